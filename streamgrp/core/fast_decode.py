"""The fast path of decoding a sample's payload: a plain schema-2 payload checked by hand, no pydantic
validation. The assembler checks every payload before it folds its slot; `fast_sample_payload` accepts
only payloads that the full decoder would accept and turns them into the very same event, its values
checked as `streamgrp.core.values.Sample` checks them, and returns None for anything else (the full
path, with its reasons and dead letters).
"""

from __future__ import annotations

import math
from typing import Any

from streamgrp.core.events import RawArray, Sample, SamplePayload
from streamgrp.core.values import DTYPES, INT64_MAX, built

_PAYLOAD_KEYS = frozenset(SamplePayload.model_fields)
_SAMPLE_KEYS = frozenset(Sample.model_fields)
#: `streamgrp.core.codec.RAW_KEY` (the codec imports this module, so it cannot be imported from there).
_RAW_KEY = "__raw__"
#: A sample's tensors in the order the encoder writes them, each with the dtypes `Sample` allows.
_SAMPLE_TENSORS = (("token_ids", ("int32", "int64")), ("loss_mask", ("bool", "uint8")),
                   ("logprobs", ("float32", "float16", "bfloat16", "float64")))

def fast_sample_payload(header: dict[str, Any], blob: bytes) -> SamplePayload | None:
    """The `SamplePayload` of a parsed header and its bytes when it is a plain, valid schema-2 one (no
    ``meta``, float rewards, values that can train); else None."""
    if header.keys() != _PAYLOAD_KEYS or header["kind"] != "sample_payload" \
            or not _is_int(header["schema_version"], 2, 2):
        return None
    task_id, producer, sample = header["task_id"], header["producer"], header["sample"]
    if not (task_id.__class__ is str and 1 <= len(task_id) <= 256 and producer.__class__ is str
            and _is_int(header["slot"]) and _is_int(header["seq"]) and sample.__class__ is dict
            and sample.keys() == _SAMPLE_KEYS):
        return None
    lengths, rewards, version, meta = sample["row_lengths"], sample["rewards"], sample["version"], sample["meta"]
    if not (lengths.__class__ is list and lengths and rewards.__class__ is list and len(rewards) == len(lengths)
            and _is_int(version) and meta.__class__ is dict and not meta):
        return None
    for length in lengths:
        if not _is_int(length, 1):
            return None
    for reward in rewards:
        if not _is_float(reward):
            return None
    total = sum(lengths)
    tensors = {}
    offset = 0
    for name, allowed in _SAMPLE_TENSORS:
        tensor = _tensor(sample[name], allowed, total, offset, blob)
        if tensor is None:
            return None
        tensors[name] = tensor
        offset += len(tensor.data)
    if offset != len(blob):
        return None
    built_sample = built(Sample, {**tensors, "row_lengths": tuple(lengths), "rewards": tuple(rewards),
                                  "version": version, "meta": meta})
    if built_sample.value_problem() is not None:
        return None  # the full path raises, naming the value
    return built(SamplePayload, {"schema_version": 2, "producer": producer, "seq": header["seq"],
                                 "kind": "sample_payload", "task_id": task_id, "slot": header["slot"],
                                 "sample": built_sample})


def _tensor(value: Any, allowed: tuple[str, ...], total: int, offset: int, blob: bytes) -> RawArray | None:
    """A 1-D tensor of ``total`` items of an ``allowed`` dtype starting at ``offset`` of ``blob``; else None."""
    if value.__class__ is not dict or len(value) != 1:
        return None
    descriptor = value.get(_RAW_KEY)
    if descriptor.__class__ is not list or len(descriptor) != 4:
        return None
    dtype, shape, start, nbytes = descriptor
    if not (dtype.__class__ is str and dtype in allowed and shape.__class__ is list and len(shape) == 1
            and shape[0].__class__ is int and shape[0] == total and start.__class__ is int and start == offset
            and nbytes.__class__ is int and nbytes == total * DTYPES[dtype][0] and start + nbytes <= len(blob)):
        return None
    return built(RawArray, {"dtype": dtype, "shape": (total,), "data": blob[start:start + nbytes]})


def _is_optional_text(value: Any) -> bool:
    return value is None or value.__class__ is str


def _is_float(value: Any) -> bool:
    return value.__class__ is float and math.isfinite(value)


def _is_optional_float(value: Any) -> bool:
    return value is None or _is_float(value)


def _is_int(value: Any, low: int = 0, high: int = INT64_MAX) -> bool:
    return value.__class__ is int and low <= value <= high

"""The fast path of decoding: a schema-2 slot result header checked by hand, no pydantic validation.

The assembler decodes every slot header of the group log; pydantic spends several microseconds
validating each one. `fast_slot_result` accepts only headers that the full decoder would accept
and turn into the very same event (every key present and no other, the exact types and bounds of
`SlotResult` and `SampleSummary`), and returns None for anything else, which then takes the full
path with its reasons and dead letters. So it changes speed, never results: a property test holds
it to the full decoder.
"""

from __future__ import annotations

import math
from typing import Any

from streamgrp.core.events import SampleSummary, SlotResult
from streamgrp.core.values import INT64_MAX

_SLOT_KEYS = frozenset({"schema_version", "producer", "seq", "kind", "task_id", "slot", "outcome", "sample", "error"})
_SUMMARY_KEYS = frozenset({"rows", "tokens", "version", "reward", "digest"})


def fast_slot_result(header: dict[str, Any]) -> SlotResult | None:
    """The `SlotResult` of a parsed header when it is a plain, valid schema-2 one; else None."""
    if header.keys() != _SLOT_KEYS or header["kind"] != "slot_result" or not _is_int(header["schema_version"], 2, 2):
        return None
    task_id, producer, error = header["task_id"], header["producer"], header["error"]
    if not (task_id.__class__ is str and 1 <= len(task_id) <= 256 and producer.__class__ is str
            and _is_int(header["slot"]) and _is_int(header["seq"]) and (error is None or error.__class__ is str)):
        return None
    outcome = header["outcome"]
    if outcome == "sample":
        summary = _summary(header["sample"])
        if summary is None:
            return None
    elif outcome in ("rejected", "failed") and header["sample"] is None:
        if outcome == "failed" and not error:
            return None
        summary = None
    else:
        return None
    return _built(SlotResult, {"schema_version": 2, "producer": producer, "seq": header["seq"], "kind": "slot_result",
                               "task_id": task_id, "slot": header["slot"], "outcome": outcome, "sample": summary,
                               "error": error})


def _summary(sample: Any) -> SampleSummary | None:
    if sample.__class__ is not dict or sample.keys() != _SUMMARY_KEYS:
        return None
    reward, digest = sample["reward"], sample["digest"]
    if not (_is_int(sample["rows"], 1) and _is_int(sample["tokens"]) and _is_int(sample["version"])
            and reward.__class__ is float and math.isfinite(reward)
            and digest.__class__ is str and 1 <= len(digest) <= 128):
        return None
    return _built(SampleSummary, {"rows": sample["rows"], "tokens": sample["tokens"], "version": sample["version"],
                                  "reward": reward, "digest": digest})


def _built(model: type[Any], values: dict[str, Any]) -> Any:
    """An instance of ``model`` holding ``values`` (every field, in declaration order), as pydantic's
    ``model_construct`` makes one, without its per-field bookkeeping (a third of this path's time)."""
    instance = model.__new__(model)
    object.__setattr__(instance, "__dict__", values)
    object.__setattr__(instance, "__pydantic_fields_set__", set(values))
    object.__setattr__(instance, "__pydantic_extra__", None)
    object.__setattr__(instance, "__pydantic_private__", None)
    return instance


def _is_int(value: Any, low: int = 0, high: int = INT64_MAX) -> bool:
    return value.__class__ is int and low <= value <= high

"""The hand-written header checks accept exactly what the full decoder turns into the same event."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from streamgrp.core import codec
from streamgrp.core.fast_decode import (
    fast_sample_payload,
)
from streamgrp.core.values import INT64_MAX
from streamgrp.errors import DecodeError

_INTS = st.one_of(st.integers(-3, 3), st.sampled_from([INT64_MAX, INT64_MAX + 1, -(2**63) - 1]), st.booleans())
_ODD = st.one_of(_INTS, st.none(), st.floats(allow_nan=False), st.text(max_size=3), st.lists(st.integers(), max_size=2),
                 st.sampled_from(["", "x" * 256, "x" * 257, "d" * 128, "d" * 129, "sample", "slot_result"]))
_COUNT = st.integers(0, INT64_MAX)
_ODD_ITEM = st.one_of(_ODD, st.just([]), st.lists(_ODD, max_size=3), st.dictionaries(st.text(max_size=2), _ODD, max_size=2))
_FLOATS = st.floats(allow_nan=False, allow_infinity=False)


def _edits(keys: list[str], values, part: str = ""):
    """One key of ``part`` of a header (the header itself when empty) set to one of ``values``, dropped, or
    another key added: ``(how, key, value)`` as `_edit` takes it, ``how`` naming the part."""
    hows = [f"{how} {part}".strip() for how in ("set", "drop", "add")]
    return st.tuples(st.sampled_from(hows), st.sampled_from(keys), values)


def _edit(target: dict, how: str, key: str, value) -> None:
    """A key of ``target`` set to ``value`` or dropped, or a key it does not know added; ``set item``:
    the first item of the list at ``key`` set (a column of members, when it has any)."""
    if how == "set item":
        if target[key]:
            target[key][0] = value
    elif how.startswith("set"):
        target[key] = value
    elif how.startswith("drop"):
        target.pop(key)
    else:
        target["more"] = value


def _full(header: dict, blob: bytes = b""):
    """The full decoder's event for ``header`` (every fast path off), or None where it refuses it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "fast_sample_payload", lambda header, blob: None)
        try:
            return codec.decode({b"h": orjson.dumps(header), **({b"b": blob} if blob else {})})
        except DecodeError:
            return None


def _check_fast_path(fast_decode, header: dict):
    """``fast_decode`` of ``header`` as it comes off the wire is None, or the full decoder's event, with the
    same bytes and the same fields set; returns (fast, full), None when the fast path left the header."""
    try:
        wire = orjson.dumps(header)
    except orjson.JSONEncodeError:
        return None  # an integer JSON cannot carry: never a header
    fast = fast_decode(orjson.loads(wire))
    if fast is None:
        return None
    full = _full(header)
    assert full is not None, f"the fast path accepted {header} which the full decoder refuses"
    assert fast == full and codec.encode(fast) == codec.encode(full)
    assert fast.model_fields_set == full.model_fields_set
    return fast, full


# -- sample payloads -------------------------------------------------------------------------------


@st.composite
def _valid_payload(draw) -> tuple[dict, bytes]:
    from streamgrp.core.events import RawArray, Sample, SamplePayload

    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    total = sum(lengths)
    ids, mask, logprobs = (draw(st.sampled_from(dtypes)) for dtypes in
                           (("int32", "int64"), ("bool", "uint8"), ("float32", "float16", "bfloat16", "float64")))
    sample = Sample(token_ids=RawArray(dtype=ids, shape=(total,), data=bytes(total * (4 if ids == "int32" else 8))),
                    loss_mask=RawArray(dtype=mask, shape=(total,), data=b"\x01" * total),
                    logprobs=RawArray(dtype=logprobs, shape=(total,), data=bytes(total * _SIZES[logprobs])),
                    row_lengths=tuple(lengths), rewards=tuple(draw(st.lists(_FLOATS, min_size=len(lengths),
                                                                            max_size=len(lengths)))),
                    version=draw(_COUNT))
    fields = codec.encode(SamplePayload(task_id=draw(st.text(min_size=1, max_size=4)), slot=draw(_COUNT),
                                        sample=sample, producer=draw(st.text(max_size=4)), seq=draw(_COUNT)))
    return orjson.loads(fields[codec.HEADER]), fields[codec.BLOB]


_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_PAYLOAD_KEYS = ["schema_version", "producer", "seq", "kind", "task_id", "slot", "sample"]
_SAMPLE_KEYS = ["token_ids", "loss_mask", "logprobs", "row_lengths", "rewards", "version", "meta"]
#: Bytes that make a value untrainable wherever they land: NaN and +inf logprobs, a negative id, a mask of 2.
_BAD_BYTES = st.sampled_from([b"\x00\x00\xc0\x7f", b"\xff\xff", b"\x02", b"\x00\x00\x80\x7f", b"\xff" * 8])
#: One change to a valid payload: a key of it or of its sample set, dropped or added; an item of a tensor
#: descriptor set; or some of its bytes overwritten, or the bytes cut short.
_PAYLOAD_CHANGE = st.one_of(
    st.none(),
    _edits(_PAYLOAD_KEYS, _ODD_ITEM),
    _edits(_SAMPLE_KEYS, _ODD_ITEM, "sample"),
    st.tuples(st.just("set descriptor"), st.sampled_from(_SAMPLE_KEYS[:3]), st.tuples(st.integers(0, 3), _ODD)),
    st.tuples(st.just("bytes"), st.integers(0, 200), _BAD_BYTES),
    st.tuples(st.just("cut"), st.integers(0, 200), st.none()))


def _changed_payload(header: dict, blob: bytes, change) -> tuple[dict, bytes]:
    if change is None:
        return header, blob
    how, key, value = change
    if how == "bytes":
        at = key % max(1, len(blob))
        return header, (blob[:at] + value + blob[at + len(value):])[:len(blob)]
    if how == "cut":
        return header, blob[:key % max(1, len(blob))]
    if how == "set descriptor":
        header["sample"][key]["__raw__"][value[0]] = value[1]
        return header, blob
    _edit(header["sample"] if how.endswith("sample") else header, how, key, value)
    return header, blob


@settings(max_examples=examples(800), deadline=None)
@given(payload=_valid_payload(), change=_PAYLOAD_CHANGE)
def test_the_fast_payload_path_gives_the_full_decoders_event_or_leaves_the_payload_to_it(payload, change):
    header, blob = _changed_payload(*payload, change)
    try:
        wire = orjson.dumps(header)
    except orjson.JSONEncodeError:
        return
    fast = fast_sample_payload(orjson.loads(wire), blob)
    if fast is None:
        return
    full = _full(header, blob)
    assert full is not None, f"the fast path accepted {header} which the full decoder refuses"
    assert fast == full and codec.encode(fast) == codec.encode(full)
    assert fast.model_fields_set == full.model_fields_set
    assert fast.sample.model_fields_set == full.sample.model_fields_set
    for name in ("token_ids", "loss_mask", "logprobs"):
        assert getattr(fast.sample, name).model_fields_set == getattr(full.sample, name).model_fields_set


def test_what_the_worker_writes_takes_the_fast_payload_path_and_bad_values_leave_it_with_a_reason():
    from streamgrp.services.synthetic import make_sample

    _, fields = codec.sample_result("t", 3, make_sample(tokens=8, rows=2, prompt_tokens=2), producer="w", seq=4)
    header, blob = orjson.loads(fields[codec.HEADER]), fields[codec.BLOB]
    assert fast_sample_payload(header, blob) == _full(header, blob) is not None
    nan = blob[:-4] + b"\x00\x00\xc0\x7f"  # the last logprob NaN
    assert fast_sample_payload(header, nan) is None
    with pytest.raises(DecodeError, match=r"logprobs\[15\] is nan") as refused:
        codec.decode({codec.HEADER: fields[codec.HEADER], codec.BLOB: nan})
    assert refused.value.reason == "invalid_value"

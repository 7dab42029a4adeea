"""Slot result headers, valid or one change away from valid: `codec.decode` gives the event they say, which
encodes back to a header that decodes to itself, or refuses them with a documented reason."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from streamgrp.core import codec
from streamgrp.core.events import SlotResult
from streamgrp.core.values import INT64_MAX
from streamgrp.errors import DecodeError

_INTS = st.one_of(st.integers(-3, 3), st.sampled_from([INT64_MAX, INT64_MAX + 1, -(2**63) - 1]), st.booleans())
_ODD = st.one_of(
    _INTS,
    st.none(),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.lists(st.integers(), max_size=2),
    st.sampled_from(["", "x" * 256, "x" * 257, "d" * 128, "d" * 129, "sample", "slot_result"]),
)
_COUNT = st.integers(0, INT64_MAX)
_KEYS = ["schema_version", "producer", "seq", "kind", "task_id", "slot", "outcome", "sample", "error", "reward_pending"]
_SUMMARY_KEYS = ["rows", "tokens", "version", "reward", "digest"]


@st.composite
def _valid_header(draw) -> dict:
    outcome = draw(st.sampled_from(["sample", "rejected", "failed"]))
    sample = (
        draw(
            st.fixed_dictionaries(
                {
                    "rows": st.integers(1, INT64_MAX),
                    "tokens": _COUNT,
                    "version": _COUNT,
                    "reward": st.floats(allow_nan=False, allow_infinity=False),
                    "digest": st.text(min_size=1, max_size=128),
                }
            )
        )
        if outcome == "sample"
        else None
    )
    error = draw(st.text(min_size=1, max_size=5)) if outcome == "failed" else draw(st.none() | st.text(max_size=3))
    return {
        "schema_version": 2,
        "producer": draw(st.text(max_size=5)),
        "seq": draw(_COUNT),
        "kind": "slot_result",
        "task_id": draw(st.text(min_size=1, max_size=256)),
        "slot": draw(_COUNT),
        "outcome": outcome,
        "sample": sample,
        "error": error,
    }


def _edits(keys: list[str], part: str):
    return st.tuples(st.just(part), st.sampled_from(["set", "drop", "add"]), st.sampled_from(keys), _ODD)


_CHANGE = st.one_of(st.none(), _edits(_KEYS, "header"), _edits(_SUMMARY_KEYS, "summary"))


def _changed(header: dict, change) -> dict:
    if change is None:
        return header
    part, how, key, value = change
    target = header if part == "header" else header["sample"]
    if not isinstance(target, dict):
        return header
    if how == "set":
        target[key] = value
    elif how == "drop":
        target.pop(key, None)
    else:
        target["more"] = value
    return header


@settings(max_examples=examples(800), deadline=None)
@given(header=_valid_header(), change=_CHANGE)
def test_a_slot_header_decodes_to_an_event_that_round_trips_or_is_refused_with_a_reason(header, change):
    header = _changed(header, change)
    try:
        wire = orjson.dumps(header)
    except orjson.JSONEncodeError:
        return  # an integer JSON cannot carry: never a header
    try:
        event = codec.decode({codec.HEADER: wire})
    except DecodeError as exc:
        assert exc.reason in codec.DECODE_REASONS
        assert change is not None, f"a valid header was refused: {exc}"
        return
    assert isinstance(event, SlotResult)
    assert codec.decode(codec.encode(event)) == event
    if change is None:
        assert orjson.loads(codec.encode(event)[codec.HEADER]) == header  # written back as it was


_GOOD = (
    '{"schema_version":2,"producer":"w","seq":1,"kind":"slot_result","task_id":"t","slot":0,"outcome":"sample",'
    '"sample":{"rows":1,"tokens":4,"version":0,"reward":0.5,"digest":"ab"},"error":null}'
)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (('"t"', '"' + "x" * 257 + '"'), "invalid_value"),
        (('"ab"', '"' + "d" * 129 + '"'), "invalid_value"),
        (('"slot":0', '"slot":true'), "wrong_type"),
        (('"seq":1', f'"seq":{INT64_MAX + 1}'), "invalid_value"),
        (('"rows":1', '"rows":0'), "invalid_value"),
        (('"error":null', '"error":null,"x":1'), "invalid_value"),
        (('"outcome":"sample"', '"outcome":"lost"'), "wrong_type"),
        (('"kind":"slot_result",', ""), "unknown_kind"),
        (('"schema_version":2', '"schema_version":3'), "unsupported_schema"),
        (('"error":null', '"error":null,"reward_pending":1'), "wrong_type"),
        (('"sample":{"rows":1,"tokens":4,"version":0,"reward":0.5,"digest":"ab"}', '"sample":null'), "invalid_value"),
    ],
)
def test_headers_past_a_bound_or_in_another_shape_are_refused_with_their_reason(edit, reason):
    with pytest.raises(DecodeError) as refused:
        codec.decode({codec.HEADER: _GOOD.replace(*edit).encode()})
    assert refused.value.reason == reason


@pytest.mark.parametrize(
    "edit",
    [
        ('"t"', '"' + "x" * 256 + '"'),
        ('"ab"', '"' + "d" * 128 + '"'),
        ('"seq":1', f'"seq":{INT64_MAX}'),
        ('"reward":0.5', '"reward":1'),
        (',"error":null', ""),
        ('"error":null', '"error":null,"reward_pending":true'),
    ],
)
def test_headers_at_the_bounds_or_with_defaults_left_out_decode(edit):
    event = codec.decode({codec.HEADER: _GOOD.replace(*edit).encode()})
    assert isinstance(event, SlotResult) and codec.decode(codec.encode(event)) == event
    assert type(event.sample.reward) is float


def test_a_schema_1_slot_result_without_a_sample_is_upcast_to_schema_2():
    event = codec.decode(
        {
            codec.HEADER: _GOOD.replace('"schema_version":2', '"schema_version":1')
            .replace(
                '"outcome":"sample","sample":{"rows":1,"tokens":4,"version":0,"reward":0.5,"digest":"ab"}',
                '"outcome":"rejected","sample":null',
            )
            .encode()
        }
    )
    assert isinstance(event, SlotResult) and event.schema_version == 2 and event.outcome == "rejected"

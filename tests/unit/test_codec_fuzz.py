"""`codec.decode` is total: any fields give an event or a `DecodeError` with a documented reason.

Three layers: (a) byte-level mutations of valid entries of every event kind, from fixed seeds;
(b) one named case per known class of malformed entry, each pinned to its exact reason; (c) a
hypothesis property over JSON-ish headers grafted onto valid ones. Everything that does decode
must encode again to the same event (what the decoder accepts, the encoder could have written).
"""

from __future__ import annotations

import math
import random
import struct

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from malformed import (
    BLOB,
    MALFORMED,
    VALID,
    header,
    mutate_entry,
    nested_prompt,
    other,
    slot_literal,
    valid_events,
)
from tiers import examples

from streamgrp.core import codec
from streamgrp.core.events import EVENT_TYPES, SampleSummary, SlotResult
from streamgrp.errors import DecodeError

SEEDS = range(4)
MUTATIONS_PER_SEED = 2_600  # 10,400 mutated entries in all


def check_total(fields, *, net: bool = False, **kwargs) -> str | None:
    """Decode ``fields``: None for an event (which must round-trip), else the DecodeError reason.

    Unless ``net``, the reason must come from an explicit check, not from decode's safety net.
    """
    try:
        event = codec.decode(fields, **kwargs)
    except DecodeError as exc:
        assert exc.reason in codec.DECODE_REASONS, exc
        assert isinstance(exc.detail, str) and len(exc.detail) < 1000
        assert net or not exc.detail.startswith("unexpected "), exc
        return exc.reason
    assert type(event) in EVENT_TYPES.values()
    assert codec.decode(codec.encode(event)) == event
    return None


# ------------------------------------------------------------------------ (a) mutated valid entries


@pytest.mark.parametrize("seed", SEEDS)
def test_mutated_entries_of_every_kind_decode_or_raise_a_documented_reason(seed):
    rng = random.Random(seed)
    reasons: dict[str | None, int] = {}
    for _ in range(MUTATIONS_PER_SEED):
        fields = mutate_entry(rng, rng.choice(VALID))
        try:
            reason = check_total(fields)
        except Exception as exc:  # a crash: name the input so the case can be pinned below
            raise AssertionError(f"seed {seed}: decode({fields!r}) raised {exc!r}") from exc
        reasons[reason] = reasons.get(reason, 0) + 1
    # The mutations reach past the JSON parser: several reasons, and some entries still decode.
    assert reasons.get(None, 0) > 0, reasons
    assert len(reasons) >= 6, reasons


# ------------------------------------------------------------------------ (b) named malformed classes


@pytest.mark.parametrize(("fields", "reason"), MALFORMED)
def test_each_malformed_class_raises_its_reason(fields, reason):
    with pytest.raises(DecodeError) as caught:
        codec.decode(fields, max_entry_bytes=200 if reason == "oversized" else codec.DEFAULT_MAX_ENTRY_BYTES)
    assert caught.value.reason == reason, caught.value
    assert caught.value.reason in codec.DECODE_REASONS
    assert len(caught.value.detail) < 1000


def test_the_classes_cover_every_reason():
    assert {param.values[1] for param in MALFORMED} == codec.DECODE_REASONS


@pytest.mark.parametrize("fields", VALID, ids=[event.kind for event in valid_events()])
def test_valid_entries_of_every_kind_decode(fields):
    assert check_total(fields) is None


def test_nesting_up_to_the_bound_decodes():
    # prompt nested 24 levels sits at header levels 2..25; a dict/list tower in the header up to 32 is
    # refused by the schema, not by the depth bound.
    assert check_total(other("task_issued", task_id="t", prompt=nested_prompt(24), issued_at=1.0)) is None
    assert check_total(slot_literal(b"[" * 31 + b"2" + b"]" * 31)) == "wrong_type"


def test_ints_are_accepted_where_floats_are_and_stay_floats():
    event = codec.decode(other("tick", now=3))
    assert event.now == 3.0 and type(event.now) is float


def test_a_safety_net_turns_unexpected_errors_into_decode_errors():
    class Hostile(dict):
        def items(self):
            raise RuntimeError("boom")

    with pytest.raises(DecodeError) as caught:
        codec.decode(Hostile({b"h": b"{}"}))
    assert caught.value.reason == "invalid_value"


# ------------------------------------------------------------------------ (c) a hypothesis property

JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["int32", "uint8", "__raw__", "sample", "slot_result"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.just("__raw__"), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(VALID), data=st.data())
def test_jsonish_values_grafted_onto_valid_headers_decode_or_raise(base, data):
    h = orjson.loads(base[codec.HEADER])
    paths = [(h, key) for key in h]
    for value in h.values():
        if isinstance(value, dict):
            paths += [(value, key) for key in value]
    for _ in range(data.draw(st.integers(1, 3))):
        target, key = data.draw(st.sampled_from(paths))
        target[key] = data.draw(JSONISH)
    fields = {codec.HEADER: orjson.dumps(h), **({codec.BLOB: base[codec.BLOB]} if codec.BLOB in base else {})}
    # The net may catch GroupPolicy's UserWarning (an error under this suite's warning filter).
    check_total(fields, net=True)


# ------------------------------------------------------------------------ the trainer's payload reader


@pytest.mark.parametrize("seed", SEEDS)
def test_the_payload_reader_agrees_with_decode_on_mutated_payloads(seed):
    """`codec.payload_view` (the trainer's reader: no values checked, no bytes cut) raises only `DecodeError`,
    and reads every payload `decode` reads to the same tensors' bytes."""
    rng = random.Random(seed)
    payloads = [fields for fields in VALID if b'"kind":"sample_payload"' in fields[codec.HEADER]]
    read = 0
    for _ in range(MUTATIONS_PER_SEED):
        fields = mutate_entry(rng, rng.choice(payloads))
        header, blob = fields.get(codec.HEADER), fields.get(codec.BLOB, b"")
        try:
            event = codec.decode(fields)
        except DecodeError:
            event = None
        try:
            view = codec.payload_view(header, blob)
        except DecodeError:
            assert not isinstance(event, codec.SamplePayload), fields
            continue
        except Exception as exc:
            raise AssertionError(f"seed {seed}: payload_view({fields!r}) raised {exc!r}") from exc
        if isinstance(event, codec.SamplePayload):
            read += 1
            for name in ("token_ids", "loss_mask", "logprobs"):
                raw = getattr(view.sample, name).raw
                tensor = getattr(event.sample, name)
                assert (raw.dtype, raw.shape) == (tensor.dtype, tensor.shape)
                assert bytes(memoryview(blob)[raw.offset : raw.offset + raw.nbytes]) == tensor.data
    assert read > 0


# ------------------------------------------------------------------------ the assembler's payload check


def _deep(levels: int) -> list:
    value: list = [1]
    for _ in range(levels):
        value = [value]
    return value


#: Payloads whose values or rows a foreign writer got wrong, beside the byte-level mutations: the rules between
#: a sample's fields and its values, each of which the check applies to the payload's view, not a `Sample`.
_VALUE_EDITS = [
    header(blob=BLOB[:20] + struct.pack("<f", math.nan) + BLOB[24:]),
    header(blob=BLOB[:24] + struct.pack("<f", 0.5) + BLOB[28:]),
    header(blob=BLOB[:28] + struct.pack("<f", -math.inf) + BLOB[32:]),
    header(blob=struct.pack("<i", -1) + BLOB[4:]),
    header(blob=BLOB[:16] + b"\x00\x02\x01\x01" + BLOB[20:]),
    header(blob=BLOB[:16] + b"\x00\x00\x00\x00" + BLOB[20:]),
    header(sample={"row_lengths": [2, 2]}),
    header(sample={"row_lengths": [2, 2], "rewards": [0.5, 1.0]}),
    header(sample={"row_lengths": [0, 4], "rewards": [0.5, 1.0]}),
    header(sample={"row_lengths": [], "rewards": []}),
    header(sample={"row_lengths": [3]}),
    header(sample={"meta": {"a": _deep(25)}}),
    header(sample={"meta": {"token_versions": [[1, 2]]}, "version": 0}),
]


def _summarised(fields, event) -> SlotResult:
    """A slot result for the payload ``fields`` (decoded as ``event``) that agrees with it in every claim."""
    summary = SampleSummary.of(event.sample, codec.entry_digest(fields))
    return SlotResult(task_id=event.task_id, slot=event.slot, outcome="sample", sample=summary)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_payload_check_refuses_exactly_what_decode_refuses(seed):
    """`codec.payload_problem` judges a payload on its compiled view, never building the `Sample`: it passes every
    payload `decode` reads (given a slot result that agrees with it) and refuses, as a payload that does not
    decode, every one `decode` refuses."""
    rng = random.Random(seed)
    payloads = [fields for fields in VALID if b'"kind":"sample_payload"' in fields[codec.HEADER]]
    base = codec.decode(payloads[0])
    cases = [mutate_entry(rng, rng.choice(payloads)) for _ in range(MUTATIONS_PER_SEED)] + _VALUE_EDITS
    passed = refused = 0
    for fields in cases:
        try:
            event = codec.decode(fields)
        except DecodeError:
            event = None
        if isinstance(event, codec.SamplePayload):
            passed += 1
            assert codec.payload_problem(fields, _summarised(fields, event)) is None, fields
            continue
        refused += 1
        # claims that match the unmutated payload: only the payload itself can be what is wrong
        problem = codec.payload_problem(fields, _summarised(payloads[0], base))
        assert problem is not None and problem.startswith(
            ("its payload does not decode", "the payloads entry at its id is a ")
        ), (fields, problem)
    assert passed > 0 and refused > 0


def test_the_payload_check_refuses_each_rule_of_a_sample_as_decode_words_it():
    """Each value or row rule, broken in a payload's bytes or header, is refused naming what broke it."""
    base = codec.decode(header())
    claims = _summarised(header(), base)
    for fields in _VALUE_EDITS:
        try:
            codec.decode(fields)
        except DecodeError as exc:
            expected = exc.detail.split(" - at ")[0]  # msgspec adds where in the header it looked
        else:  # a payload decode reads (the last edit: token versions it can only state in meta)
            assert codec.payload_problem(fields, _summarised(fields, codec.decode(fields))) is None
            continue
        problem = codec.payload_problem(fields, claims)
        assert problem is not None and expected in problem, (problem, expected)

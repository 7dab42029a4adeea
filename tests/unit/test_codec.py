import hashlib
import math

import msgspec
import orjson
import pytest
from blake3 import blake3

from streamgrp.core import codec
from streamgrp.core.entry_fields import EntryFields, entry_fields
from streamgrp.core.events import (
    DecidedMember,
    GroupDecided,
    GroupDiscarded,
    GroupStats,
    RawArray,
    Sample,
    SamplePayload,
    SampleSummary,
    SlotResult,
    SlotSegment,
    StepCommitted,
    TaskIssued,
    Tick,
)
from streamgrp.core.legacy import SlotResultV1
from streamgrp.core.manifest import make_manifest
from streamgrp.errors import DecodeError
from streamgrp.services.synthetic import make_sample


def slot_event(**overrides):
    """A sample's payload event (the one that carries tensors); ``outcome``/``error`` make a slot result."""
    if "outcome" in overrides:
        return SlotResult(task_id="task-1", slot=2, producer="worker-a", seq=17, **overrides)
    fields = dict(
        task_id="task-1", slot=2, sample=make_sample(tokens=16, rows=2, version=3), producer="worker-a", seq=17
    )
    fields.update(overrides)
    return SamplePayload(**fields)


@pytest.mark.parametrize(
    "event",
    [
        slot_event(),
        slot_event(outcome="rejected", sample=None),
        slot_event(outcome="failed", sample=None, error="ValueError: boom"),
        TaskIssued(task_id="t", prompt={"text": "2+2?", "nested": [1, {"a": None}]}, issued_at=12.5, version=4),
        Tick(now=1_700_000_000.125),
        GroupDecided(
            task_id="t",
            decision="partial",
            slots=(0, 2),
            member_entries=("1-0", "1-2"),
            member_rows=(1, 1),
            member_tokens=(5, 7),
            member_versions=(3, 2),
            slot_outcomes={"0": "sample", "1": "failed", "2": "sample"},
            stats=GroupStats.of(3, 2, 2),
            closed_by="deadline",
            issued_at=1.0,
            decided_at=2.0,
        ),
    ],
)
def test_round_trip_is_exact(event):
    decoded = codec.decode(codec.encode(event))
    assert decoded == event
    assert type(decoded) is type(event)


def test_tensor_bytes_round_trip_bit_exact_including_negative_zero_and_subnormals():
    # -0.0, the smallest negative subnormal, the most negative float32, +0.0 (NaN cannot train: refused)
    special = RawArray(dtype="float32", shape=(4,), data=bytes.fromhex("0000008001000080ffff7fff00000000"))
    sample = Sample(
        token_ids=RawArray.from_values([1, 2, 3, 4], "int32"),
        loss_mask=RawArray.from_values([0, 1, 1, 1], "uint8"),
        logprobs=special,
        row_lengths=(4,),
        rewards=(0.1,),
        version=0,
    )
    decoded = codec.decode(codec.encode(slot_event(sample=sample)))
    assert decoded.sample.logprobs.data == special.data
    assert decoded.sample.rewards == (0.1,)


def test_tensors_travel_as_raw_bytes_beside_the_header():
    fields = codec.encode(slot_event())
    header = orjson.loads(fields[codec.HEADER])
    assert header["sample"]["token_ids"] == {"__raw__": ["int32", [32], 0, 128]}
    assert len(fields[codec.BLOB]) == 32 * (4 + 1 + 4)
    assert header["schema_version"] == 2 and header["producer"] == "worker-a" and header["seq"] == 17


def test_string_keys_from_a_decode_responses_client_are_accepted():
    fields = codec.encode(Tick(now=3.0))
    assert codec.decode({"h": fields[codec.HEADER].decode()}) == Tick(now=3.0)


def _tamper(mutate):
    fields = codec.encode(slot_event())
    header = orjson.loads(fields[codec.HEADER])
    blob = fields[codec.BLOB]
    header, blob = mutate(header, blob)
    out = {codec.HEADER: orjson.dumps(header) if not isinstance(header, bytes) else header}
    if blob is not None:
        out[codec.BLOB] = blob
    return out


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda h, b: (b"{not json", b), "bad_header"),
        (lambda h, b: ([1, 2], b), "bad_header"),
        (lambda h, b: ({**h, "schema_version": 99}, b), "unsupported_schema"),
        (lambda h, b: ({**h, "kind": "mystery"}, b), "unknown_kind"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "task_id"}, b), "missing_field"),
        (lambda h, b: ({**h, "slot": "two"}, b), "wrong_type"),
        (lambda h, b: ({**h, "slot": -1}, b), "invalid_value"),
        (lambda h, b: (h, b[:-1]), "length_mismatch"),
        (lambda h, b: (h, b + b"\0"), "length_mismatch"),
        (lambda h, b: (h, None), "length_mismatch"),
        (lambda h, b: (_set_dtype(h, "complex128"), b), "unknown_dtype"),
        (lambda h, b: (_set_shape(h, [33]), b), "length_mismatch"),
    ],
)
def test_bad_entries_raise_one_typed_error_with_a_reason(mutate, reason):
    with pytest.raises(DecodeError) as caught:
        codec.decode(_tamper(mutate))
    assert caught.value.reason == reason
    assert isinstance(caught.value, ValueError)


def test_missing_header_and_oversized_entries():
    with pytest.raises(DecodeError) as caught:
        codec.decode({b"x": b"1"})
    assert caught.value.reason == "missing_field"
    with pytest.raises(DecodeError) as caught:
        codec.decode(codec.encode(slot_event()), max_entry_bytes=100)
    assert caught.value.reason == "oversized"


def test_sample_validation_catches_inconsistent_rows():
    with pytest.raises(ValueError, match="one reward per row"):
        Sample(**{**msgspec.structs.asdict(make_sample()), "rewards": (1.0, 2.0)})
    with pytest.raises(ValueError, match="sum of row_lengths"):
        Sample(
            token_ids=RawArray.from_values([1, 2], "int32"),
            loss_mask=RawArray.from_values([1, 1, 1], "uint8"),
            logprobs=RawArray.from_values([0.0, 0.0, 0.0], "float32"),
            row_lengths=(3,),
            rewards=(1.0,),
            version=0,
        )
    with pytest.raises(ValueError, match="finite"):
        make_sample(reward=math.nan)
    with pytest.raises(ValueError, match="needs a sample"):
        SlotResult(task_id="t", slot=0, outcome="sample")
    with pytest.raises(ValueError, match="error text"):
        SlotResult(task_id="t", slot=0, outcome="failed")


def test_valid_tokens_counts_the_loss_mask():
    assert make_sample(tokens=10, rows=3, prompt_tokens=4).valid_tokens == 18


def _set_dtype(header, dtype):
    header["sample"]["token_ids"]["__raw__"][0] = dtype
    return header


def _set_shape(header, shape):
    header["sample"]["token_ids"]["__raw__"][1] = shape
    return header


def test_entry_fields_gives_a_plain_dict_when_no_name_repeats():
    fields = entry_fields([b"h", b"{}", b"b", b"xy"])
    assert type(fields) is dict and fields == {b"h": b"{}", b"b": b"xy"}
    assert entry_fields([]) == {} and entry_fields(None) is None


def test_entry_fields_keeps_every_pair_when_a_name_repeats():
    good = codec.encode(Tick(now=1.0))[codec.HEADER]
    fields = entry_fields([b"h", good, b"x", b"1", b"h", b"{}", b"x", b"2", b"x", b"3"])
    assert isinstance(fields, EntryFields) and isinstance(fields, dict)
    assert fields == {b"h": b"{}", b"x": b"3"}  # the last value of each name, as redis-py's dict
    assert fields.pairs == [(b"h", good), (b"x", b"1"), (b"h", b"{}"), (b"x", b"2"), (b"x", b"3")]
    assert fields.repeated == (b"h", b"x") and fields.malformed is None
    with pytest.raises(DecodeError) as caught:
        codec.decode(fields)
    assert caught.value.reason == "repeated_field"
    assert EntryFields([(b"h", good)]).repeated == ()
    assert codec.decode(EntryFields([(b"h", good)])) == Tick(now=1.0)


def test_entry_fields_marks_an_odd_list_as_malformed():
    fields = entry_fields([b"h", b"{}", b"b"])
    assert isinstance(fields, EntryFields)
    assert fields.pairs == [(b"h", b"{}")] and "odd number" in fields.malformed
    with pytest.raises(DecodeError) as caught:
        codec.decode(fields)
    assert caught.value.reason == "bad_fields"


@pytest.mark.parametrize(
    ("model", "fields"),
    [
        (SlotResult, dict(task_id="t", slot=True, outcome="rejected")),
        (SlotResult, dict(task_id="t", slot=1.0, outcome="rejected")),
        (SlotResult, dict(task_id="t", slot=2**63, outcome="rejected")),
        (StepCommitted, dict(step=0, rank=False, world_size=1)),
        (Tick, dict(now=True)),
        (Tick, dict(now="1.0")),
        (Tick, dict(now=math.inf)),
        (TaskIssued, dict(task_id="t", issued_at=0.0, version=True)),
    ],
)
def test_event_numbers_are_strict_when_built_in_python_too(model, fields):
    # a pydantic model refuses them as it is built, a Struct as it is encoded: never on the wire
    with pytest.raises(ValueError):
        codec.encode(model(**fields))


def test_float_fields_still_take_ints():
    assert Tick(now=3) == Tick(now=3.0) and type(Tick(now=3).now) is float


def test_members_are_records_in_python_and_aligned_columns_on_the_wire():
    members = (
        DecidedMember(slot=0, entry="1-0", rows=1, tokens=5, version=3, digest="d0", reward=0.5),
        DecidedMember(slot=2, entry="1-2", rows=2, tokens=7, version=2, digest="d2", reward=-1.0),
    )
    decision = GroupDecided.of(
        task_id="t",
        decision="partial",
        members=members,
        slot_outcomes={"0": "sample"},
        stats=GroupStats.of(3, 2, 2),
        closed_by="all_slots",
    )
    header = orjson.loads(codec.encode(decision)[codec.HEADER])
    assert (
        header["members"],
        header["member_entries"],
        header["member_rows"],
        header["member_tokens"],
        header["member_versions"],
        header["member_digests"],
        header["member_rewards"],
    ) == ([0, 2], ["1-0", "1-2"], [1, 2], [5, 7], [3, 2], ["d0", "d2"], [0.5, -1.0])
    assert codec.decode(codec.encode(decision)) == decision
    # optional columns nobody recorded are written empty and read back as defaults
    bare = decision.with_members(tuple(m.replace(digest="", reward=None) for m in members))
    header = orjson.loads(codec.encode(bare)[codec.HEADER])
    assert header["member_digests"] == [] and header["member_rewards"] == []
    assert codec.decode(codec.encode(bare)) == bare


@pytest.mark.parametrize(
    "column", ["member_entries", "member_rows", "member_tokens", "member_versions", "member_digests", "member_rewards"]
)
def test_a_column_of_the_wrong_length_is_refused_naming_it(column):
    members = (
        DecidedMember(slot=0, entry="1-0", rows=1, tokens=5, version=3, digest="d0", reward=0.5),
        DecidedMember(slot=1, entry="1-1", rows=1, tokens=7, version=2, digest="d1", reward=1.0),
    )
    decision = GroupDecided.of(
        task_id="t",
        decision="complete",
        members=members,
        slot_outcomes={},
        stats=GroupStats.of(2, 2, 2),
        closed_by="all_slots",
    )
    header = orjson.loads(codec.encode(decision)[codec.HEADER])
    header[column] = header[column][:1]
    with pytest.raises(DecodeError, match=f"{column} has 1 items for 2 members"):
        codec.decode({codec.HEADER: orjson.dumps(header)})


def test_a_schema_1_slot_result_is_upcast_with_its_entry_digest_and_keeps_its_inline_sample():
    sample = make_sample(tokens=6, rows=2, version=3, reward=0.25)
    fields = codec.encode(SlotResultV1(task_id="t", slot=1, outcome="sample", sample=sample, producer="w", seq=4))
    assert orjson.loads(fields[codec.HEADER])["schema_version"] == 1
    event = codec.decode(fields)
    assert isinstance(event, SlotResult) and (event.task_id, event.slot, event.producer, event.seq) == ("t", 1, "w", 4)
    # the digest schema 1's assemblers recorded for the entry: untagged BLAKE2b
    assert event.sample == SampleSummary(
        rows=2, tokens=sample.valid_tokens, version=3, reward=0.25, digest=_digest("blake2b", fields)
    )
    assert codec.decode_v1_slot_result(fields).sample == sample
    with pytest.raises(DecodeError, match="carries no inline sample"):
        codec.decode_v1_slot_result(codec.encode(event))


def test_a_sample_result_carries_the_digest_of_its_payload():
    sample = make_sample(tokens=5, rows=3, version=2)
    event, payload = codec.sample_result("t", 0, sample, producer="w", seq=9)
    assert event.sample.digest == codec.entry_digest(payload)
    assert (event.sample.rows, event.sample.tokens, event.sample.version) == (3, sample.valid_tokens, 2)
    decoded = codec.decode(payload)
    assert (
        isinstance(decoded, SamplePayload) and decoded.sample == sample and (decoded.task_id, decoded.slot) == ("t", 0)
    )
    assert len(codec.encode(event)[codec.HEADER]) < 300 and codec.BLOB not in codec.encode(event)  # header only


def _digest(algorithm: str, fields: dict[bytes, bytes]) -> str:
    """A payload digest written out: BLAKE3 over the entry's bytes, its header and the header's length (8 bytes,
    little-endian); before it, the header, a NUL, the bytes and a NUL."""
    if algorithm == "blake3":
        header = fields[codec.HEADER]
        data = fields.get(codec.BLOB, b"") + header + len(header).to_bytes(8, "little")
        return "blake3:" + blake3(data).hexdigest()[:32]
    digest = hashlib.blake2b(digest_size=16) if algorithm == "blake2b" else hashlib.sha256()
    for part in (fields[codec.HEADER], b"\0", fields.get(codec.BLOB, b""), b"\0"):
        digest.update(part)
    return digest.hexdigest() if algorithm == "blake2b" else "sha256:" + digest.hexdigest()[:32]


def test_payload_digests_are_tagged_blake3_and_older_ones_check_the_way_they_were_made():
    sample = make_sample(tokens=7, rows=2)
    event, payload = codec.sample_result("t", 0, sample)
    assert event.sample.digest == _digest("blake3", payload) == codec.entry_digest(payload)
    assert orjson.loads(codec.encode_sample("t", 0, sample)[0])["sample"]["digest"] == event.sample.digest
    assert codec.entry_digest(payload, like=event.sample.digest) == event.sample.digest
    for older in ("sha256", "blake2b"):  # what logs written before each change recorded
        recorded = _digest(older, payload)
        assert recorded != event.sample.digest and codec.entry_digest(payload, like=recorded) == recorded


def test_a_newer_schema_is_refused_naming_what_this_build_reads():
    header = orjson.loads(codec.encode(Tick(now=1.0))[codec.HEADER])
    with pytest.raises(DecodeError, match="this build reads the integers 1, 2"):
        codec.decode({codec.HEADER: orjson.dumps({**header, "schema_version": 3})})


def _derived_events():
    members = [
        DecidedMember(slot=i, entry=f"1-{i}", rows=1, tokens=5, version=3, digest=f"d{i}", reward=0.5) for i in range(2)
    ]
    decision = GroupDecided.of(
        task_id="t",
        decision="complete",
        members=members,
        slot_outcomes={"0": "sample", "1": "sample"},
        stats=GroupStats.of(2, 2, 2),
        closed_by="all_slots",
    )
    segment = SlotSegment(
        task_id="t",
        slot=1,
        index=0,
        start=0,
        token_ids=RawArray.from_values([5, 6, 7], "int32"),
        logprobs=RawArray.from_values([-0.5, -1.0, -0.25], "float32"),
        version=2,
        cause="chunk",
    )
    return [
        decision,
        make_manifest(4, 3, [("9-0", decision)], 1, 12.5),
        segment,
        GroupDiscarded(task_id="t", reason="stale", decision_entry="9-0", group_version=1, current_version=4),
    ]


def test_events_streamgrp_derives_are_written_without_being_decoded_again(monkeypatch):
    """A decision, a step manifest, a discarded group and a segment are made from checked values: encoding one
    decodes nothing (it did, at the cost of writing it twice); a reader still checks each, and gets it back."""
    decoded = []
    for name in ("decode_entry", "decoder"):
        real = getattr(codec, name)
        monkeypatch.setattr(
            codec, name, lambda *args, real=real, **options: decoded.append(args) or real(*args, **options)
        )
    written = [codec.encode(event) for event in _derived_events()]
    assert decoded == []
    assert [codec.decode(fields) for fields in written] == _derived_events()
    codec.encode(TaskIssued(task_id="t", issued_at=0.0))  # a task carries a user's values: still checked
    assert decoded


def test_a_derived_event_built_wrong_is_refused_by_its_reader():
    """Not checked as it is written, a decision holding a value no reader takes is dead-lettered where it is read."""
    [decision, *_] = _derived_events()
    fields = codec.encode(decision.replace(task_id=7))
    with pytest.raises(DecodeError) as caught:
        codec.decode(fields)
    assert caught.value.reason == "wrong_type"


def test_a_payload_blob_read_in_place_decodes_as_its_bytes_do():
    """A payload key's blob reaches the assembler's check as a view of the reply (no copy): it decodes to the
    same event as the bytes, and a view that is not flat bytes is refused, not read."""
    fields = codec.encode(slot_event())
    arena = b"xx" + fields[codec.BLOB] + b"yy"
    viewed = {codec.HEADER: fields[codec.HEADER], codec.BLOB: memoryview(arena)[2:-2]}
    assert codec.decode(viewed) == codec.decode(fields)
    short = {codec.HEADER: fields[codec.HEADER], codec.BLOB: memoryview(arena)[2:-3]}
    with pytest.raises(DecodeError) as refused:
        codec.decode(short)
    assert refused.value.reason == "length_mismatch"
    wide = {codec.HEADER: fields[codec.HEADER], codec.BLOB: memoryview(fields[codec.BLOB]).cast("I")}
    with pytest.raises(DecodeError) as refused:
        codec.decode(wide)
    assert refused.value.reason == "bad_fields"

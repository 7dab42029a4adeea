"""Malformed stream entries for the decoder's tests: valid entries of every kind, byte-level
mutations of them, and one named case per known class of malformed entry with the reason
`codec.decode` must give. Shared by the unit fuzz test and the integration fuzz test (which puts
the storable ones onto a real server's streams).
"""

from __future__ import annotations

import random

import orjson
import pytest

from streamgrp.core import codec
from streamgrp.core.entry_fields import entry_fields
from streamgrp.core.events import (
    EVENT_TYPES,
    CheckpointSaved,
    GroupDecided,
    GroupDiscarded,
    GroupStats,
    RunFinished,
    RunStarted,
    RunTerminated,
    SamplePayload,
    SlotResult,
    SlotRewarded,
    StepCommitted,
    StepFailed,
    StepRowsTrained,
    TaskIssued,
    TrainingResumed,
    Tick,
    VersionAdvanced,
    WeightsServed,
)
from streamgrp.core.manifest import make_manifest
from streamgrp.core.policy import GroupPolicy, NormSpec
from streamgrp.services.synthetic import make_sample

TOKENS = (
    b"true",
    b"false",
    b"null",
    b"[",
    b"]",
    b"{",
    b"}",
    b'"',
    b",",
    b":",
    b"-1",
    b"0",
    b"1.5",
    b"1e400",
    b"18446744073709551616",
    b"9223372036854775808",
    b'"__raw__"',
    b'{"__raw__":',
    b"NaN",
    b"\xff",
    b"\\u0000",
    b'"slot_result"',
    b'"kind":',
    b'"schema_version":',
    b"[" * 40,
    b"{}",
    b"[]",
    b"2.0",
)


def _decision(task: int, members: int = 2) -> GroupDecided:
    slots = tuple(range(members))
    return GroupDecided(
        task_id=f"g{task}",
        decision="complete",
        slots=slots,
        member_entries=tuple(f"{task}-{m}" for m in slots),
        member_digests=tuple(f"{task:02d}{m:030d}" for m in slots),
        member_rows=(1,) * members,
        member_tokens=tuple(5 + m for m in slots),
        member_versions=(0,) * members,
        member_rewards=tuple(0.5 * m for m in slots),
        slot_outcomes={str(m): "sample" for m in slots},
        stats=GroupStats.of(members + 1, members, members),
        closed_by="all_slots",
        issued_at=1.0,
        decided_at=2.5,
    )


def valid_events() -> list:
    """At least one event of every kind, tensors included."""
    events = [
        RunStarted(
            run="r",
            policy=GroupPolicy(n_samples=4, reward_norm=NormSpec("group", "group")),
            settings={"dp_size": 2, "nested": {"a": [1, 2.5, None, True]}},
            started_at=1_700_000_000.5,
        ),
        TaskIssued(
            task_id="t1",
            prompt={"text": "2+2?", "tokens": 8, "nested": [1, {"a": None}]},
            version=3,
            issued_at=12.5,
            producer="feeder",
            seq=4,
        ),
        codec.sample_result("t1", 2, make_sample(tokens=6, rows=2, version=3, seed=1), producer="worker-a", seq=17)[0],
        SamplePayload(
            task_id="t1", slot=2, sample=make_sample(tokens=6, rows=2, version=3, seed=1), producer="worker-a", seq=17
        ),
        SamplePayload(task_id="t1", slot=0, sample=make_sample(tokens=3, version=1, reward=-0.5)),
        SlotResult(task_id="t1", slot=1, outcome="rejected"),
        SlotResult(task_id="t1", slot=3, outcome="failed", error="ValueError: boom"),
        codec.sample_result("t2", 0, make_sample(tokens=4, rows=2, version=1), reward_pending=True)[0],
        SlotRewarded(task_id="t2", slot=0, rewards=(1.0, -0.5), scorer="rewarder-a", producer="rewarder-a", seq=3),
        SlotRewarded(task_id="t2", slot=1, reason="no number in the answer", scorer="rewarder-a"),
        Tick(now=1_700_000_000.125),
        _decision(1),
        RunTerminated(reason="stall", message="run stalled", task_id="t1", step=2),
        make_manifest(0, 0, [("1-0", _decision(1)), ("2-0", _decision(2, 3))], 2, created_at=5.0),
        GroupDiscarded(task_id="t1", reason="stale", decision_entry="1-0", group_version=0, current_version=3),
        StepCommitted(step=0, rank=1, world_size=2),
        StepFailed(step=1, rank=0, error="loss is NaN"),
        StepRowsTrained(step=2, rank=0, attempt=1, rows=(0, 1, 4), total=7),
        VersionAdvanced(version=1, step=0),
        RunFinished(steps=3),
        WeightsServed(
            server="http://127.0.0.1:30000",
            version=2,
            dialect="sglang",
            ok=True,
            detail="loaded",
            seconds=1.5,
            at=1_700_000_001.0,
        ),
        TrainingResumed(attempt=2, step=5, world_size=2, base_version=7, reason="lowest_rank", retrain_through=5),
        CheckpointSaved(
            step=4,
            version=5,
            path="/ckpt/step-4",
            ranks=(0,),
            world_size=2,
            attempt=1,
            files={"model.safetensors": 1024},
        ),
        *_session_events(),
    ]
    assert {event.kind for event in events} == set(EVENT_TYPES)
    return events


def _session_events() -> list:
    """An agent session's events (streamgrp.services.gateway): opened, one turn (tensors), ended."""
    from streamgrp.core.events import RawArray, SessionEnded, SessionOpened, SlotSegment, TurnRecorded

    return [
        SessionOpened(session="p0-0123456789abcdef", task_id="t1", slot=1, deadline=1_700_000_600.5, version=2),
        TurnRecorded(
            session="p0-0123456789abcdef",
            task_id="t1",
            slot=1,
            turn=1,
            prompt_ids=RawArray.from_values([1, 4093, 198], "int32"),
            completion_ids=RawArray.from_values([33, 2], "int32"),
            logprobs=RawArray.from_values([-0.5, -0.25], "float32"),
            version=2,
            finish="stop",
            meta={"text": "1", "endpoint": "chat"},
        ),
        SessionEnded(
            session="p0-0123456789abcdef", task_id="t1", slot=1, outcome="sample", turns=1, rows=1, reward=1.0
        ),
        SlotSegment(
            task_id="t1",
            slot=0,
            index=1,
            start=64,
            token_ids=RawArray.from_values([33, 2], "int32"),
            logprobs=RawArray.from_values([-0.5, -0.25], "float32"),
            version=3,
            cause="chunk",
        ),
    ]


VALID = [codec.encode(event) for event in valid_events()]


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        pos = rng.randint(0, len(out))
        op = rng.randrange(7)
        if op == 0 and out:  # flip one bit
            pos = min(pos, len(out) - 1)
            out[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and out:  # overwrite one byte
            out[min(pos, len(out) - 1)] = rng.randrange(256)
        elif op == 2:  # insert random bytes
            out[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif op == 3:  # delete a few bytes
            del out[pos : pos + rng.randint(1, 8)]
        elif op == 4:  # insert a JSON-ish token, to get past the parser more often than noise does
            out[pos:pos] = rng.choice(TOKENS)
        elif op == 5 and out:  # duplicate a slice
            end = min(len(out), pos + rng.randint(1, 16))
            out[pos:pos] = out[pos:end]
        else:  # truncate
            del out[pos:]
    return bytes(out)


def mutate_entry(rng: random.Random, fields: dict[bytes, bytes]):
    fields = dict(fields)
    where = rng.random()
    if where < 0.7:
        fields[codec.HEADER] = mutate_bytes(rng, fields[codec.HEADER])
    elif where < 0.85:
        fields[codec.BLOB] = mutate_bytes(rng, fields.get(codec.BLOB, b""))
    elif where < 0.9:
        name = rng.choice(list(fields))
        fields[mutate_bytes(rng, name)] = fields.pop(name)
    elif where < 0.95:  # the same field given twice, as `entry_fields` sees a repeated name
        flat = [item for pair in fields.items() for item in pair]
        at = rng.randrange(0, len(flat) + 1, 2)
        name = rng.choice(list(fields))
        flat[at:at] = [name, mutate_bytes(rng, fields[name])]
        if rng.random() < 0.2:
            flat.pop()  # and sometimes an odd list
        return entry_fields(flat)
    else:  # fields dropped or added
        if codec.BLOB in fields and rng.random() < 0.5:
            del fields[codec.BLOB]
        else:
            fields[rng.choice([codec.BLOB, b"x", "h"])] = bytes(rng.randrange(256) for _ in range(rng.randint(0, 8)))
    return fields


SLOT = SamplePayload(task_id="t", slot=2, sample=make_sample(tokens=4), producer="w", seq=1)
SLOT_FIELDS = codec.encode(SLOT)  # blob: token_ids 0..16, loss_mask 16..20, logprobs 20..36
SLOT_HEADER = orjson.loads(SLOT_FIELDS[codec.HEADER])
BLOB = SLOT_FIELDS[codec.BLOB]


def header(update=None, *, sample=None, blob=BLOB, drop=()):
    """Sample-payload fields (the event with tensors) with header keys replaced (``sample``: keys of the
    sample replaced)."""
    h = {**SLOT_HEADER, **(update or {})}
    if sample is not None:
        h["sample"] = {**SLOT_HEADER["sample"], **sample}
    for key in drop:
        h.pop(key)
    fields = {codec.HEADER: orjson.dumps(h)}
    if blob is not None:
        fields[codec.BLOB] = blob
    return fields


def raw(header_bytes: bytes, blob: bytes | None = BLOB):
    return {codec.HEADER: header_bytes} | ({codec.BLOB: blob} if blob is not None else {})


def slot_literal(literal: bytes):
    """Sample-payload fields whose ``slot`` value is the JSON text ``literal`` (not something orjson writes)."""
    return raw(SLOT_FIELDS[codec.HEADER].replace(b'"slot":2', b'"slot":' + literal))


def desc(dtype="int32", shape=(4,), offset=0, nbytes=16):
    return {"__raw__": [dtype, list(shape) if isinstance(shape, tuple) else shape, offset, nbytes]}


def other(kind: str, **fields):
    return {codec.HEADER: orjson.dumps({**fields, "kind": kind})}


def nested_prompt(levels: int) -> dict:
    prompt: dict = {}
    for _ in range(levels - 1):
        prompt = {"a": prompt}
    return prompt


def inline_tensor():
    """token_ids written inline as a dict whose data is header text, the others shifted to match."""
    h = {**SLOT_HEADER, "sample": dict(SLOT_HEADER["sample"])}
    h["sample"]["token_ids"] = {"dtype": "int32", "shape": [4], "data": "abcdefghijklmnop"}
    h["sample"]["loss_mask"] = desc("uint8", (4,), 0, 4)
    h["sample"]["logprobs"] = desc("float32", (4,), 4, 16)
    return raw(orjson.dumps(h), BLOB[16:])


SUMMARY = {"rows": 1, "tokens": 4, "version": 0, "reward": 0.5, "digest": "ab" * 16}
POLICY = {"n_samples": 4, "reward_norm": {"mean_level": "group", "std_level": "group"}}
GROUP = {k: v for k, v in orjson.loads(codec.encode(_decision(1))[codec.HEADER]).items() if k != "kind"}

MALFORMED = [
    # the stream entry's fields
    pytest.param({b"x": b"1"}, "missing_field", id="missing-h"),
    pytest.param({b"b": BLOB}, "missing_field", id="only-b"),
    pytest.param(None, "bad_fields", id="fields-none"),
    pytest.param([(b"h", b"{}")], "bad_fields", id="fields-not-a-mapping"),
    pytest.param({b"h": 5}, "bad_fields", id="h-value-int"),
    pytest.param({b"h": memoryview(SLOT_FIELDS[codec.HEADER])}, "bad_fields", id="h-value-memoryview"),
    pytest.param({1: b"x", **SLOT_FIELDS}, "bad_fields", id="name-int"),
    pytest.param({"h": "\ud800"}, "bad_fields", id="h-lone-surrogate"),
    pytest.param(entry_fields([b"h", SLOT_FIELDS[codec.HEADER], b"b"]), "bad_fields", id="odd-flat-list"),
    pytest.param(entry_fields([[b"h"], b"x", b"h", b"{}"]), "bad_fields", id="unhashable-name"),
    pytest.param(entry_fields(b"h"), "bad_fields", id="flat-not-a-list"),
    pytest.param(
        entry_fields([b"h", SLOT_FIELDS[codec.HEADER], b"b", BLOB, b"h", b"{}"]),
        "repeated_field",
        id="repeated-field-names",
    ),
    pytest.param({"h": SLOT_FIELDS[codec.HEADER].decode(), **SLOT_FIELDS}, "repeated_field", id="h-as-bytes-and-str"),
    # size: checked first, before the header is parsed, over every field
    pytest.param({codec.HEADER: b"{not json" * 30}, "oversized", id="oversized-before-parsing"),
    pytest.param({**SLOT_FIELDS, b"x": b"\0" * 200}, "oversized", id="oversized-counts-every-field"),
    pytest.param({"h": "\u00e9" * 150}, "oversized", id="oversized-counts-utf8-bytes"),
    # the header as JSON
    pytest.param(raw(b"{not json"), "bad_header", id="h-not-json"),
    pytest.param(raw(b""), "bad_header", id="h-empty"),
    pytest.param(raw(b"\xff\xfe{}"), "bad_header", id="h-not-utf8"),
    pytest.param(raw(b"[1, 2]"), "bad_header", id="h-json-array"),
    pytest.param(raw(b'"slot_result"'), "bad_header", id="h-json-string"),
    pytest.param(raw(b"null"), "bad_header", id="h-json-null"),
    pytest.param(raw(b"17"), "bad_header", id="h-json-number"),
    pytest.param(slot_literal(b"[" * 1000 + b"2" + b"]" * 1000), "bad_header", id="deep-nesting-1000-arrays"),
    pytest.param(slot_literal(b'{"a":' * 1000 + b"2" + b"}" * 1000), "bad_header", id="deep-nesting-1000-objects"),
    pytest.param(slot_literal(b"[" * 5000 + b"]" * 5000), "bad_header", id="deep-nesting-past-the-parser"),
    pytest.param(slot_literal(b"[" * 32 + b"2" + b"]" * 32), "bad_header", id="nesting-33-levels"),
    pytest.param(slot_literal(b"NaN"), "bad_header", id="nan-literal"),
    pytest.param(slot_literal(b"Infinity"), "bad_header", id="infinity-literal"),
    pytest.param(slot_literal(b"1e400"), "bad_header", id="float-overflow"),
    pytest.param(slot_literal(b"9" * 5000), "bad_header", id="huge-int-5000-digits"),
    # schema version and kind
    pytest.param(header({"schema_version": 99}), "unsupported_schema", id="schema-version-99"),
    pytest.param(header({"schema_version": True}), "unsupported_schema", id="schema-version-bool"),
    pytest.param(header({"schema_version": 1.0}), "unsupported_schema", id="schema-version-float"),
    pytest.param(header({"schema_version": "1"}), "unsupported_schema", id="schema-version-str"),
    pytest.param(header({"schema_version": [1]}), "unsupported_schema", id="schema-version-list"),
    pytest.param(header({"schema_version": {"v": 1}}), "unsupported_schema", id="schema-version-dict"),
    pytest.param(header({"kind": "mystery"}), "unknown_kind", id="unknown-kind"),
    pytest.param(header(drop=("kind",)), "unknown_kind", id="kind-missing"),
    pytest.param(header({"kind": ["slot_result"]}), "unknown_kind", id="kind-list"),
    pytest.param(header({"kind": {"slot_result": 1}}), "unknown_kind", id="kind-dict"),
    pytest.param(header({"kind": None}), "unknown_kind", id="kind-null"),
    # tensor descriptors
    pytest.param(header(sample={"token_ids": desc("complex128")}), "unknown_dtype", id="unknown-dtype"),
    pytest.param(header(sample={"token_ids": desc(["int32"])}), "unknown_dtype", id="dtype-list"),
    pytest.param(header(sample={"token_ids": desc(shape="4")}), "bad_header", id="shape-str"),
    pytest.param(header(sample={"token_ids": desc(shape=[True] * 4)}), "bad_header", id="shape-bool-dims"),
    pytest.param(header(sample={"token_ids": desc(shape=[-4])}), "bad_header", id="shape-negative"),
    pytest.param(header(sample={"token_ids": desc(shape=[1] * 33)}), "bad_header", id="shape-33-dims"),
    pytest.param(header(sample={"token_ids": desc(offset=False)}), "bad_header", id="descriptor-bool-offset"),
    pytest.param(header(sample={"token_ids": desc(nbytes=16.0)}), "bad_header", id="descriptor-float-nbytes"),
    pytest.param(header(sample={"token_ids": {"__raw__": ["int32", [4], 0]}}), "bad_header", id="descriptor-3-items"),
    pytest.param(
        header(sample={"token_ids": {"__raw__": ["int32", [4], 0, 16, 0]}}), "bad_header", id="descriptor-5-items"
    ),
    pytest.param(header(sample={"token_ids": {"__raw__": "int32"}}), "bad_header", id="descriptor-str"),
    pytest.param(
        header(sample={"meta": {"x": desc("uint8", (0,), 36, 0)}}), "bad_header", id="descriptor-in-free-form-meta"
    ),
    pytest.param(header({"task_id": desc("uint8", (0,), 0, 0)}), "wrong_type", id="descriptor-as-task-id"),
    pytest.param(inline_tensor(), "wrong_type", id="tensor-inline-in-header"),
    pytest.param(header(sample={"token_ids": desc(nbytes=12)}), "length_mismatch", id="nbytes-mismatch"),
    pytest.param(header(sample={"token_ids": desc(shape=(5,), nbytes=20)}), "length_mismatch", id="shape-mismatch"),
    pytest.param(header(sample={"loss_mask": desc("uint8", (4,), 17, 4)}), "length_mismatch", id="offset-gap"),
    pytest.param(header(blob=BLOB[:-1]), "length_mismatch", id="blob-short"),
    pytest.param(header(blob=BLOB + b"\0"), "length_mismatch", id="blob-long"),
    pytest.param(header(blob=None), "length_mismatch", id="blob-missing"),
    pytest.param(
        {**codec.encode(SlotResult(task_id="t", slot=0, outcome="rejected")), codec.BLOB: b"\1\2"},
        "length_mismatch",
        id="blob-without-tensors",
    ),
    # field types: strict numbers
    pytest.param(header({"slot": True}), "wrong_type", id="bool-slot"),
    pytest.param(header({"slot": 2.0}), "wrong_type", id="float-slot"),
    pytest.param(header({"slot": "2"}), "wrong_type", id="str-slot"),
    pytest.param(header({"slot": [2]}), "wrong_type", id="list-slot"),
    pytest.param(slot_literal(b"18446744073709551616"), "wrong_type", id="huge-int-parsed-as-float"),
    pytest.param(header({"seq": False}), "wrong_type", id="bool-seq"),
    pytest.param(header(sample={"version": True}), "wrong_type", id="bool-sample-version"),
    pytest.param(header(sample={"row_lengths": "4"}), "wrong_type", id="str-row-lengths"),
    pytest.param(header(sample={"row_lengths": [True]}), "wrong_type", id="bool-row-length"),
    pytest.param(header(sample={"rewards": [True]}), "wrong_type", id="bool-reward"),
    pytest.param(header(sample={"rewards": ["1.0"]}), "wrong_type", id="str-reward"),
    pytest.param(header({"sample": [1, 2]}, blob=None), "wrong_type", id="sample-list"),
    pytest.param(header({"sample": "sample"}, blob=None), "wrong_type", id="sample-str"),
    pytest.param(other("slot_result", task_id="t", slot=0, outcome="great"), "wrong_type", id="unknown-outcome"),
    pytest.param(
        other("slot_result", task_id="t", slot=0, outcome="sample", sample={**SUMMARY, "rows": True}),
        "wrong_type",
        id="bool-summary-rows",
    ),
    pytest.param(
        other("slot_result", task_id="t", slot=0, outcome="sample", sample={**SUMMARY, "reward": "0.5"}),
        "wrong_type",
        id="str-summary-reward",
    ),
    pytest.param(other("tick", now=True), "wrong_type", id="bool-tick-now"),
    pytest.param(other("tick", now="1.5"), "wrong_type", id="str-tick-now"),
    pytest.param(other("task_issued", task_id="t", prompt=["x"], issued_at=1.0), "wrong_type", id="prompt-list"),
    pytest.param(
        other("run_started", run="r", policy={"n_samples": True}, started_at=1.0),
        "wrong_type",
        id="bool-policy-n-samples",
    ),
    pytest.param(
        other(
            "run_started",
            run="r",
            policy={**POLICY, "reward_norm": {**POLICY["reward_norm"], "eps": True}},
            started_at=1.0,
        ),
        "wrong_type",
        id="bool-policy-eps",
    ),
    pytest.param(
        other("run_started", run="r", policy={**POLICY, "drop_incomplete_group": 1}, started_at=1.0),
        "wrong_type",
        id="int-policy-bool",
    ),
    pytest.param(
        other("group_decided", **{**GROUP, "stats": {**GROUP["stats"], "fully_masked_group": 0}}),
        "wrong_type",
        id="stats-int-as-flag",
    ),
    pytest.param(
        other("group_decided", **{**GROUP, "stats": {**GROUP["stats"], "usable_slot_count": 2.0}}),
        "wrong_type",
        id="stats-float-as-count",
    ),
    pytest.param(other("group_decided", **{**GROUP, "stats": {"x": {"y": 1}}}), "missing_field", id="stats-unknown"),
    pytest.param(other("step_committed", step=0, rank=0, world_size=2.0), "wrong_type", id="float-world-size"),
    # values
    pytest.param(header({"slot": -1}), "invalid_value", id="negative-slot"),
    pytest.param(header({"slot": 2**63}), "invalid_value", id="int-past-int64"),
    pytest.param(header({"task_id": ""}), "invalid_value", id="empty-task-id"),
    pytest.param(header({"extra": 1}), "invalid_value", id="extra-header-field"),
    pytest.param(header(sample={"extra": 1}), "invalid_value", id="extra-sample-field"),
    pytest.param(
        header(sample={"logprobs": {**desc("float32", (4,), 20, 16), "x": 1}}, blob=BLOB[:20]),
        "missing_field",
        id="descriptor-with-extra-key",
    ),
    pytest.param(header(sample={"rewards": [1.0, 2.0]}), "invalid_value", id="rewards-length-vs-rows"),
    pytest.param(header(sample={"row_lengths": [2, 2]}), "invalid_value", id="row-lengths-vs-rewards"),
    pytest.param(
        other("slot_result", task_id="t", slot=0, outcome="rejected", sample=SUMMARY),
        "invalid_value",
        id="rejected-with-sample",
    ),
    pytest.param(
        other("slot_result", task_id="t", slot=0, outcome="sample", sample={**SUMMARY, "rows": 0}),
        "invalid_value",
        id="summary-zero-rows",
    ),
    pytest.param(
        other("slot_result", task_id="t", slot=0, outcome="sample", sample={**SUMMARY, "digest": ""}),
        "invalid_value",
        id="summary-empty-digest",
    ),
    pytest.param(
        other("slot_result", task_id="t", slot=0, outcome="sample", sample={**SUMMARY, "token_ids": [1, 2]}),
        "invalid_value",
        id="tensor-in-a-summary",
    ),
    pytest.param(
        other("slot_result", task_id="t", slot=0, outcome="sample", sample={**SUMMARY, "version": -1}),
        "invalid_value",
        id="summary-negative-version",
    ),
    pytest.param(
        other("group_decided", **{**GROUP, "member_tokens": [5]}), "invalid_value", id="member-lists-wrong-length"
    ),
    pytest.param(
        other("group_decided", **{**GROUP, "member_rewards": [0.5]}), "invalid_value", id="member-rewards-wrong-length"
    ),
    pytest.param(
        other("task_issued", task_id="t", prompt=nested_prompt(25), issued_at=1.0),
        "invalid_value",
        id="free-form-too-deep",
    ),
    pytest.param(
        other("run_started", run="r", policy={"n_samples": 0}, started_at=1.0),
        "invalid_value",
        id="policy-inconsistent",
    ),
    pytest.param(header(drop=("task_id",)), "missing_field", id="missing-task-id"),
    pytest.param(other("tick"), "missing_field", id="missing-tick-now"),
]

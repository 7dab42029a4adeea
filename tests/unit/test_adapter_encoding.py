"""The assembler's and the batcher's store adapters without a server: a record in, the exact function
arguments out (`encode_round`, `encode_batch`), replies decoded, and the operation names the same as the Lua's."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from streamgrp.core import codec
from streamgrp.core.batch_fold import Acked
from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    GroupStats,
    RunFinished,
    RunTerminated,
    StepManifest,
)
from streamgrp.core.group_fold import Closed
from streamgrp.store import assembler_store, batcher_store
from streamgrp.store.assembler_store import Acknowledge, Committed, DeadLetter, LateOrUnknown
from streamgrp.store.batcher_store import BatchCommitted, Settle, Step
from streamgrp.store.deadletter import MAX_DETAIL_CHARS


def _decision() -> GroupDecided:
    return GroupDecided(
        task_id="t1",
        decision="partial",
        slots=(0,),
        member_entries=("2-0",),
        member_digests=("ab" * 16,),
        member_rows=(1,),
        member_tokens=(8,),
        member_versions=(0,),
        slot_outcomes={"0": "sample", "1": "timeout"},
        stats=GroupStats.of(2, 1, 1),
        closed_by="deadline",
        producer="assembler-x",
        seq=7,
        issued_at=1.0,
        decided_at=2.0,
    )


def _header(event) -> bytes:
    return codec.encode(event)[codec.HEADER]


# -- the assembler ---------------------------------------------------------------------------------


def test_a_decision_is_written_with_its_entries_and_its_counters():
    decision = _decision()
    args = assembler_store.encode_round([Closed(decision, ("1-0", "2-0", "3-0"))])
    assert args == [
        "decide",
        "t1",
        _header(decision),
        3,
        "1-0",
        "2-0",
        "3-0",
        6,
        "slots:sample",
        1,
        "slots:timeout",
        1,
        "decisions:partial",
        1,
        "target_slots",
        2,
        "usable_slots",
        1,
        "trainable_slots",
        1,
    ]
    assert codec.decode({codec.HEADER: args[2]}) == decision  # the header is the stamped decision, whole


def test_acknowledgements_dead_letters_and_unknown_slots_in_the_order_given():
    fields = {b"h": b"{}", b"q": b"5-0"}
    long = "x" * (MAX_DETAIL_CHARS + 50)
    args = assembler_store.encode_round(
        [
            DeadLetter("bad_header", "4-0", long, fields),
            LateOrUnknown("t9", "6-0", "no task with this id is open", fields),
            Acknowledge("slots:duplicate", ("7-0", "8-0")),
            Acknowledge("", ()),
        ]
    )
    assert args == [
        "dead_letter",
        "bad_header",
        "4-0",
        "x" * MAX_DETAIL_CHARS,
        2,
        b"f:h",
        b"{}",
        b"f:q",
        b"5-0",
        "late_or_unknown",
        "t9",
        "6-0",
        "no task with this id is open",
        2,
        b"f:h",
        b"{}",
        b"f:q",
        b"5-0",
        "ack_count",
        "slots:duplicate",
        2,
        "7-0",
        "8-0",
        "ack_count",
        "",
        0,
    ]


def test_a_large_entry_is_dead_lettered_as_a_stub():
    fields = {f"x{i}".encode(): b"v" for i in range(1000)}
    args = assembler_store.encode_round([DeadLetter("missing_field", "4-0", "no header", fields)])
    assert args[:4] == ["dead_letter", "missing_field", "4-0", "no header"]
    assert args[5:9] == [b"stub", b"1", b"n_fields", b"1000"] and args[4] == (len(args) - 5) // 2


def test_the_assembler_adapter_refuses_what_it_does_not_commit():
    with pytest.raises(TypeError, match="not Acked"):
        assembler_store.encode_round([Acked(("1-0",))])  # a batcher record


def test_the_assembler_reply_is_decoded():
    assert assembler_store.decode_reply([2, 1, b"slots:sample", 4, b"redundant_decisions", 1]) == Committed(
        written=2, redundant=1, counts={"slots:sample": 4, "redundant_decisions": 1}
    )
    assert assembler_store.decode_reply([0, 0]) == Committed(0, 0, {})


# -- the batcher -----------------------------------------------------------------------------------


def _discarded() -> GroupDiscarded:
    return GroupDiscarded(
        task_id="t1",
        reason="stale",
        decision_entry="5-0@1",
        group_version=0,
        current_version=3,
        detail="too old",
        producer="batcher-x",
        seq=3,
    )


def _manifest() -> StepManifest:
    return StepManifest(step=4, version=2, shards=(), imbalance=1.0, created_at=5.0, producer="batcher-x", seq=4)


@pytest.mark.parametrize("partitioned", [False, True])
def test_steps_and_discards_settle_their_tasks_only_in_a_partitioned_run(partitioned):
    discarded, manifest = _discarded(), _manifest()
    args = batcher_store.encode_batch(
        [discarded, Step(manifest, ("1-0", "2-0@1"), ("t2", "t3"))], partitioned=partitioned
    )
    settle_discard = ["settle", 1, "t1"] if partitioned else []
    settle_step = ["settle", 2, "t2", "t3"] if partitioned else []
    assert args == [
        "discard",
        "stale",
        _header(discarded),
        "5-0@1",
        *settle_discard,
        "step",
        4,
        _header(manifest),
        2,
        2,
        "1-0",
        "2-0@1",
        *settle_step,
    ]


def test_acknowledgements_and_the_runs_end():
    terminated = RunTerminated(reason="stall", message="no trainable group", step=3, producer="b", seq=1)
    finished = RunFinished(steps=3, producer="b", seq=2)
    args = batcher_store.encode_batch([Acked(("1-0", "2-0")), terminated, finished], partitioned=False)
    assert args == ["ack", 2, "1-0", "2-0", "terminal", _header(terminated), "finished", _header(finished)]
    assert batcher_store.encode_batch([Settle(("t1", "t2"))], partitioned=True) == ["settle", 2, "t1", "t2"]


def test_a_settle_outside_a_partitioned_run_is_refused_before_any_call():
    with pytest.raises(ValueError, match="only in a partitioned run"):
        batcher_store.encode_batch([Settle(("t1",))], partitioned=False)
    with pytest.raises(TypeError, match="not Acknowledge"):
        batcher_store.encode_batch([Acknowledge("", ())], partitioned=False)  # an assembler record


def test_the_batcher_reply_is_decoded():
    assert batcher_store.decode_reply([1, b"steps", 1, b"groups:batched", 32]) == BatchCommitted(
        steps=1, counts={"steps": 1, "groups:batched": 32}
    )


# -- the names both sides use ----------------------------------------------------------------------


def _lua_operations(script: str) -> set[str]:
    body = resources.files("streamgrp.store").joinpath("lua", script).read_text()
    return set(re.findall(r"\bop == '([a-z_]+)'", body))


@pytest.mark.parametrize(("module", "script"), [(assembler_store, "commit.lua"), (batcher_store, "batch_commit.lua")])
def test_the_adapter_and_its_function_name_the_same_operations(module, script):
    names = {
        value
        for name, value in vars(module).items()
        if name.startswith("_") and name.isupper() and isinstance(value, str)
    }
    assert names == _lua_operations(script)


def test_no_operation_name_means_two_things():
    assert not _lua_operations("commit.lua") & _lua_operations("batch_commit.lua")

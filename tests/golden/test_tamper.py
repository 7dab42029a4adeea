"""`verify` and `replay_step` on the golden log with one fact altered, served from memory (no server).

Each test changes one entry of a `MemorySource` and checks that the difference is reported with
the right kind and subject, and nothing else is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from runlog import MemorySource

from streamgrp.core import codec
from streamgrp.core.events import GroupDecided
from streamgrp.errors import DigestMismatch
from streamgrp.replay import format_report, replay_step, verify
from streamgrp.store.keys import step_entry_id

LOG = Path(__file__).resolve().parent / "run_v1.jsonl"  # a schema-1 log: samples in the slot log


@pytest.fixture
def source() -> MemorySource:
    return MemorySource(LOG)


def _kinds(report) -> set[tuple[str, str, str | None]]:
    return {(d.kind, d.subject, d.field) for d in report.differences}


def _decision(source, task_id) -> tuple[str, GroupDecided]:
    return next(
        (entry_id, event)
        for entry_id, fields in source.scan("decisions")
        if (event := codec.decode(fields)).task_id == task_id
    )


def _manifest(source, step):
    return codec.decode(source.streams["steps"][step_entry_id(step)])


def test_an_altered_decision_outcome_is_reported(source):
    entry_id, decision = _decision(source, "g03")
    source.streams["decisions"][entry_id] = codec.encode(decision.replace(reason="incomplete"))
    report = verify(None, source.keys, source=source)
    assert _kinds(report) == {("decision_differs", "task g03", "reason")}
    (difference,) = report.differences
    assert (difference.recorded, difference.recomputed) == ("incomplete", "below_minimum")
    assert "recorded incomplete, recomputed below_minimum" in format_report(report)


def test_an_altered_stats_dict_is_reported(source):
    entry_id, decision = _decision(source, "g05")
    stats = decision.stats.replace(usable_slot_count=4)
    source.streams["decisions"][entry_id] = codec.encode(decision.replace(stats=stats))
    assert _kinds(verify(None, source.keys, source=source)) == {("decision_differs", "task g05", "stats")}


def test_a_missing_decision_is_reported_and_its_step_cannot_be_rebuilt(source):
    entry_id, _ = _decision(source, "g00")
    del source.streams["decisions"][entry_id]
    kinds = _kinds(verify(None, source.keys, source=source))
    assert ("decision_missing", "task g00", "decision") in kinds
    assert ("step_decision_unknown", "step 0", "task g00") in kinds


def test_a_decision_the_log_does_not_support_is_reported(source):
    entry_id, decision = _decision(source, "g12")
    source.streams["decisions"]["9999999999999-0"] = codec.encode(decision.replace(task_id="ghost"))
    assert _kinds(verify(None, source.keys, source=source)) == {("decision_extra", "task ghost", "decision")}


def test_a_duplicate_decision_is_reported(source):
    entry_id, decision = _decision(source, "g12")
    source.streams["decisions"]["9999999999999-0"] = codec.encode(decision)
    assert _kinds(verify(None, source.keys, source=source)) == {("decision_duplicate", "task g12", "entry")}


def test_groups_moved_between_ranks_are_reported(source):
    manifest = _manifest(source, 1)
    first, second = manifest.shards
    moved = (first.replace(groups=second.groups), second.replace(groups=first.groups))
    source.streams["steps"][step_entry_id(1)] = codec.encode(manifest.replace(shards=moved))
    report = verify(None, source.keys, source=source)
    assert {("shard_groups", "step 1 rank 0", "task ids"), ("shard_groups", "step 1 rank 1", "task ids")} <= _kinds(
        report
    )
    assert all(d.subject.startswith("step 1") for d in report.differences)
    # Replay checks the shard against its own groups' digests first.
    with pytest.raises(DigestMismatch, match="shard digest"):
        replay_step(None, source.keys, 1, 0, source=source)


def test_a_group_batched_twice_is_reported(source):
    step0, step1 = _manifest(source, 0), _manifest(source, 1)
    shard = step1.shards[0]
    doubled = shard.replace(groups=(step0.shards[0].groups[0], *shard.groups[1:]))
    source.streams["steps"][step_entry_id(1)] = codec.encode(step1.replace(shards=(doubled, step1.shards[1])))
    task = step0.shards[0].groups[0].task_id
    assert ("group_in_two_steps", f"task {task}", "step") in _kinds(verify(None, source.keys, source=source))


def test_the_step_range_limits_the_rank_split_check_but_not_decisions(source):
    manifest = _manifest(source, 2)
    source.streams["steps"][step_entry_id(2)] = codec.encode(manifest.replace(imbalance=9.0))
    assert _kinds(verify(None, source.keys, source=source)) == {("step_imbalance", "step 2", "imbalance")}
    report = verify(None, source.keys, 0, 1, source=source)
    assert report.ok and report.steps_checked == 2 and report.decisions_checked == 13


def test_entries_the_assembler_never_read_are_not_folded(source):
    slot_ids = list(source.streams["slots"])
    # Pretend the assembler stopped right after the issue of every task: no decision is supported.
    source.positions[("slots", "assembler")] = slot_ids[12]
    report = verify(None, source.keys, source=source)
    assert report.unread_entries == len(slot_ids) - 13 and report.entries_folded == 13
    assert ("decision_extra", "task g00", "decision") in _kinds(report)


def test_altered_slot_bytes_fail_replay_and_verify(source):
    manifest = _manifest(source, 0)
    group = manifest.shards[1].groups[0]
    fields = source.streams["slots"][group.members[0].entry]
    blob = bytearray(fields[codec.BLOB])
    blob[-1] ^= 0x01  # the last logprob's lowest bit: a valid entry with different bytes
    source.streams["slots"][group.members[0].entry] = {**fields, codec.BLOB: bytes(blob)}
    with pytest.raises(DigestMismatch, match=f"task {group.task_id}'s slot entries"):
        replay_step(None, source.keys, 0, 1, source=source)
    replay_step(None, source.keys, 0, 0, source=source)  # the other rank's shard is intact
    assert _kinds(verify(None, source.keys, source=source)) == {
        ("decision_differs", f"task {group.task_id}", "member_digests")
    }


def test_a_trimmed_slot_entry_names_the_entry(source):
    manifest = _manifest(source, 2)
    entry = manifest.shards[0].groups[0].members[1].entry
    del source.streams["slots"][entry]
    with pytest.raises(DigestMismatch, match=f"slot entry {entry} is gone"):
        replay_step(None, source.keys, 2, 0, source=source)


def test_two_steps_with_their_groups_swapped_are_caught_by_the_re_batch(source):
    """Each step alone still partitions cleanly; only batching the decisions again shows that step 0
    holds groups the batcher could only have formed after step 0's."""
    first, second = _manifest(source, 0), _manifest(source, 1)
    swapped = {
        0: second.replace(step=0, version=first.version, created_at=first.created_at),
        1: first.replace(step=1, version=second.version, created_at=second.created_at),
    }
    for step, manifest in swapped.items():
        source.streams["steps"][step_entry_id(step)] = codec.encode(manifest)
    kinds = _kinds(verify(None, source.keys, source=source))
    assert {("step_groups", "step 0", "decision entries"), ("step_groups", "step 1", "decision entries")} <= kinds
    assert not any(kind.startswith("shard_") for kind, _, _ in kinds)
    assert verify(None, source.keys, source=MemorySource(LOG)).ok  # the untouched log re-batches exactly

"""Verify a run's record: re-fold the slot log, re-batch and re-shard the steps, report every difference.

Owns the comparison, not the semantics: the fold (`streamgrp.core.group_fold.run_fold`) with the run's recorded
policy and deadline decides every group again, and `streamgrp.core.manifest.make_manifest` splits each
recorded step's groups again, in the order the batcher took them (decision stream order). Compared:
every field of a recorded decision the fold determines, decisions the log does not support or that
were never recorded, and per step the shards' groups, tokens and digests, groups trained twice,
dropped or stale groups in a step, and gaps in step numbers. Nothing is fixed; reads only.

Kinds of `Difference` (``recorded`` is the log's value, ``recomputed`` verify's):

    decision_differs        a field of a decision (``field`` names it) differs from the re-fold's
    decision_missing        the re-fold decides a group that has no recorded decision
    decision_extra          a recorded decision the re-fold does not make (the group stays open or is unknown)
    decision_duplicate      a second recorded decision for one task
    decision_undecodable    a decision entry that does not decode
    payload_digest          a member's payload no longer hashes to the digest its slot result recorded
    payload_missing         a member's payload entry is gone while its slot entry is not (deleted: retention
                            trims both together), so the steps that trained it cannot be replayed
    step_decision_unknown   a step's group points at a decision entry that is not recorded
    step_decision_task      ... or at the decision of another task
    dropped_group_batched   a step trains a dropped group
    stale_group_batched     a step trains a group older than max_staleness allows
    group_in_two_steps      one task's group is in two steps
    step_missing            step numbers have a gap
    log_not_retained        the ``decided`` hash names decisions the log does not hold (trimmed by
                            retention: verify with the run's archive, ``--archive DIR``)
    step_entry              a manifest is not at its step's entry id
    step_undecodable        an entry of the steps stream does not decode (a damaged manifest: the ranks fail there)
    step_shards             a step does not have dp_size shards
    step_groups             a step's groups differ from what the batch fold forms from the recorded decisions
    step_not_rebatched      the batch fold forms no such step from the recorded decisions
    step_unbuildable        the step's groups cannot be split into dp_size shards (fewer groups)
    shard_groups            a rank's groups (task ids, in order) differ from the re-shard's
    shard_group_differs     a group's members, entries, rows, tokens, versions or digest differ
    shard_tokens, shard_digest, step_imbalance   a shard's tokens or digest, or the step's imbalance, differ
    step_ranks_apart        a step every rank committed was last committed by its ranks in different attempts
                            of the trainer group (they did not train it together; ``recorded``: rank -> attempt)
    step_commit_missing     a rank's position is past a step it never committed (``recorded``: the position)
    segments_differ         a sample built on segments is not their concatenation (`streamgrp.replay.segment_check`)
"""

from __future__ import annotations

from typing import Any

import redis

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.events import (
    GroupDecided,
    SlotResult,
    SlotRewarded,
    TaskIssued,
    Tick,
)
from streamgrp.core.group_fold import Closed, run_fold, written_tick
from streamgrp.core.manifest import (
    decision_ref,
    split_decision_ref,
)
from streamgrp.core.refusal import INVALID_SAMPLE, NOT_FOLDED, refused
from streamgrp.errors import DecodeError
from streamgrp.replay.segment_check import check_segments
from streamgrp.replay.verify_report import Difference, VerifyReport, format_report
from streamgrp.replay.verify_steps import check_steps, check_training
from streamgrp.store.keys import RunKeys, id_key
from streamgrp.store.sources import (
    RedisSource,
    folded_through,
    partition_streams,
    recorded_config,
    server_source,
)

__all__ = ["DECISION_FIELDS", "Difference", "VerifyReport", "format_report", "verify"]

#: GroupDecided fields the fold determines, by their recorded (wire) names so that a difference names
#: what the header holds; ``decided_at`` too when the fold sets it (deadline closes). ``newest_token_version``,
#: ``whole_version`` and ``fresh_tokens`` are written only when set: absent on both sides is equal.
DECISION_FIELDS = (
    "decision",
    "reason",
    "members",
    "member_entries",
    "member_digests",
    "member_rows",
    "member_tokens",
    "member_versions",
    "member_rewards",
    "slot_outcomes",
    "stats",
    "error",
    "closed_by",
    "issued_at",
    "newest_token_version",
    "whole_version",
    "fresh_tokens",
)


def verify(
    client: redis.Redis | None,
    keys: RunKeys,
    from_step: int | None = None,
    to_step: int | None = None,
    *,
    source: RedisSource | None = None,
) -> VerifyReport:
    """Re-fold the slot log and re-shard steps ``from_step..to_step`` (inclusive); report every difference.

    The fold covers the log up to the last entry the assembler read (entries after it were never
    folded by the service either); every recorded decision is compared whatever the step range.
    Run it on a run whose assembler is stopped or idle: a decision the assembler is about to write
    would show as missing.
    """
    source = source or server_source(client, keys)
    config = recorded_config(source)
    report = VerifyReport(keys.run)
    decided = source.hash("decided")  # before the log: every decision it names is in the log by then, or trimmed
    recorded = [
        item
        for partition, name in partition_streams(source, "decisions")
        for item in _recorded_decisions(source, report, name, partition)
    ]
    _check_retained(decided, recorded, report)
    refolded = {
        task: decision
        for _, name in partition_streams(source, "slots")
        for task, decision in _refold(source, config, report, name).items()
    }
    _compare_decisions(recorded, refolded, report)
    _check_payloads(source, recorded, report)
    report.segments_checked = check_segments(source, recorded, report, Difference)
    by_entry = dict(recorded)
    check_steps(source, config, by_entry, from_step, to_step, report)
    check_training(source, config, from_step, to_step, report)
    return report


def _check_payloads(
    source: RedisSource, recorded: list[tuple[str, GroupDecided]], report: VerifyReport, chunk: int = 512
) -> None:
    """Every retained payload of a decided member hashes to the digest its slot result (and decision) recorded.

    A schema-1 log keeps samples in the slot log, whose digests the re-fold already compares."""
    by_partition: dict[int, list] = {}
    for ref, decision in recorded:
        by_partition.setdefault(split_decision_ref(ref)[0], []).extend(
            (decision.task_id, member) for member in decision.members
        )
    names = dict(partition_streams(source, "payloads"))
    slots = dict(partition_streams(source, "slots"))
    for partition, members in sorted(by_partition.items()):
        _check_partition_payloads(source, members, report, names[partition], slots[partition], chunk)


def _check_partition_payloads(
    source: RedisSource, members: list, report: VerifyReport, stream: str, slot_stream: str, chunk: int
) -> None:
    for start in range(0, len(members), chunk):
        part = members[start : start + chunk]
        for (task_id, member), fields in zip(part, source(stream, [m.entry for _, m in part])):
            if fields is None:
                _check_missing_payload(source, slot_stream, task_id, member, report)
                continue
            report.payloads_checked += 1
            digest = codec.entry_digest(fields, like=member.digest)
            if digest != member.digest:
                report.differences.append(
                    Difference(
                        "payload_digest",
                        f"task {task_id} slot {member.slot}",
                        f"payload {member.entry}",
                        member.digest,
                        digest,
                    )
                )


def _check_missing_payload(
    source: RedisSource, slot_stream: str, task_id: str, member: Any, report: VerifyReport
) -> None:
    """A member's payload is gone. Retention trims a payload only with its slot entry (the slot log's
    floor), and a schema-1 slot entry carries its sample itself; a payload missing beside a slot entry
    that needs one was deleted, and the step that trained it can no longer be replayed."""
    [slot_fields] = source(slot_stream, [member.entry])
    if slot_fields is not None and not codec.is_inline_sample(slot_fields):
        report.differences.append(
            Difference(
                "payload_missing",
                f"task {task_id} slot {member.slot}",
                f"payload {member.entry}",
                None,
                "the payload entry its slot result names (deleted, not trimmed)",
            )
        )


def _recorded_decisions(
    source: RedisSource, report: VerifyReport, stream: str = "decisions", partition: int = 0
) -> list[tuple[str, GroupDecided]]:
    """A partition's decisions, each with its reference (`streamgrp.core.manifest.decision_ref`)."""
    out = []
    for entry_id, fields in source.scan(stream):
        try:
            event = codec.decode(fields)
        except DecodeError as exc:
            report.differences.append(
                Difference("decision_undecodable", f"decision entry {entry_id}", None, exc.reason, None)
            )
            continue
        if isinstance(event, GroupDecided):
            out.append((decision_ref(partition, entry_id), event))
    return out


def _check_retained(decided: dict[str, str], recorded: list[tuple[str, GroupDecided]], report: VerifyReport) -> None:
    """One difference when decisions the run recorded are gone from the log: nothing to check them against."""
    tasks = {decision.task_id for _, decision in recorded}
    gone = sorted((entry_id, task) for task, entry_id in decided.items() if task not in tasks)
    if gone:
        entry_id, task = gone[0]
        report.differences.append(
            Difference(
                "log_not_retained",
                "decisions",
                None,
                f"{len(gone)} decisions in the decided hash (first: task {task} at {entry_id}) but not in the log",
                "none to compare: pass --archive DIR (the run's archive) to verify what retention trimmed",
            )
        )


def _refold(
    source: RedisSource, config: RunConfig, report: VerifyReport, stream: str = "slots"
) -> dict[str, GroupDecided]:
    """Fold one slot log (a partition's, in a partitioned run) up to where its assembler read."""
    through = folded_through(source, stream)
    limit = id_key(through) if through is not None else None
    refusals, unissued = _refused_entries(source)

    def events():
        for entry_id, fields in source.scan(stream):
            if limit is not None and id_key(entry_id) > limit:
                report.unread_entries += 1
                continue
            try:
                event = codec.decode(fields)
            except DecodeError:
                continue  # the assembler dead-lettered it; it was never folded
            if isinstance(event, (TaskIssued, Tick)) and entry_id in unissued:
                continue  # the assembler dead-lettered it unfolded: a task no issue wrote, a tick from the future
            if isinstance(event, SlotResult) and entry_id in refusals:
                event = refused(event, refusals[entry_id])  # as the assembler folded it
            if isinstance(event, Tick):
                event = written_tick(event, entry_id)  # as the assembler folded it
            if isinstance(event, (TaskIssued, SlotResult, SlotRewarded, Tick)):
                report.entries_folded += 1
                yield entry_id, event

    _, outputs = run_fold(config.policy(), events(), config.group_timeout_s)
    return {output.decision.task_id: output.decision for output in outputs if isinstance(output, Closed)}


def _refused_entries(source: RedisSource) -> tuple[dict[str, str], set[str]]:
    """Slot entries the assembler refused: samples (dead-lettered as `INVALID_SAMPLE`, entry id -> what was
    wrong) and entries it did not fold (`NOT_FOLDED`: tasks no issue wrote, ticks from the future)."""
    out, unissued = {}, set()
    for _, fields in source.scan("deadletter"):
        if b"entry" not in fields:
            continue
        if fields.get(b"reason") == INVALID_SAMPLE.encode():
            out[fields[b"entry"].decode(errors="replace")] = fields.get(b"detail", b"").decode(errors="replace")
        elif fields.get(b"reason", b"").decode(errors="replace") in NOT_FOLDED:
            unissued.add(fields[b"entry"].decode(errors="replace"))
    return out, unissued


def _compare_decisions(
    recorded: list[tuple[str, GroupDecided]], refolded: dict[str, GroupDecided], report: VerifyReport
) -> None:
    seen: dict[str, str] = {}
    for entry_id, decision in recorded:
        task = decision.task_id
        subject = f"task {task}"
        if task in seen:
            report.differences.append(Difference("decision_duplicate", subject, "entry", seen[task], entry_id))
            continue
        seen[task] = entry_id
        report.decisions_checked += 1
        mine = refolded.get(task)
        if mine is None:
            report.differences.append(Difference("decision_extra", subject, "decision", decision.decision, None))
            continue
        names = DECISION_FIELDS + (("decided_at",) if mine.decided_at is not None else ())
        theirs, ours = decision.wire_fields(), mine.wire_fields()
        for name in names:
            if theirs.get(name) != ours.get(name):
                report.differences.append(
                    Difference("decision_differs", subject, name, theirs.get(name), ours.get(name))
                )
    for task, mine in refolded.items():
        if task not in seen:
            report.differences.append(Difference("decision_missing", f"task {task}", "decision", None, mine.decision))

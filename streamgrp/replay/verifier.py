"""Verify a run's record: re-fold the slot log, re-batch and re-partition the steps, report every difference.

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
    step_unbuildable        the step's groups cannot be partitioned (fewer than dp_size)
    shard_groups            a rank's groups (task ids, in order) differ from the re-partition's
    shard_group_differs     a group's members, entries, rows, tokens, versions or digest differ
    shard_tokens, shard_digest, step_imbalance   a shard's tokens or digest, or the step's imbalance, differ
    step_ranks_apart        a step every rank committed was last committed by its ranks in different attempts
                            of the trainer group (they did not train it together; ``recorded``: rank -> attempt)
    step_commit_missing     a rank's position is past a step it never committed (``recorded``: the position)
    segments_differ         a sample built on segments is not their concatenation (`streamgrp.replay.segment_check`)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import redis

from streamgrp.config import RunConfig
from streamgrp.core import batch_fold, codec
from streamgrp.core.batch_fold import BatchRules, BatchState, discards_stale, is_stale
from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    SlotResult,
    SlotRewarded,
    StepCommitted,
    StepManifest,
    TaskIssued,
    Tick,
)
from streamgrp.core.group_fold import Closed, run_fold, written_tick
from streamgrp.core.manifest import (
    decision_ref,
    make_manifest,
    ref_order,
    split_decision_ref,
)
from streamgrp.core.refusal import INVALID_SAMPLE, NOT_FOLDED, refused
from streamgrp.core.shown import printable
from streamgrp.errors import DecodeError
from streamgrp.replay.segment_check import check_segments
from streamgrp.store.keys import RunKeys, id_key, step_entry_id
from streamgrp.store.sources import (
    RedisSource,
    decode_all,
    folded_through,
    partition_streams,
    recorded_config,
)

__all__ = ["DECISION_FIELDS", "Difference", "VerifyReport", "format_report", "verify"]

#: GroupDecided fields the fold determines, by their recorded (wire) names so that a difference names
#: what the header holds; ``decided_at`` too when the fold sets it (deadline closes).
DECISION_FIELDS = ("decision", "reason", "members", "member_entries", "member_digests", "member_rows", "member_tokens",
                   "member_versions", "member_rewards", "slot_outcomes", "stats", "error", "closed_by", "issued_at")


@dataclass(frozen=True)
class Difference:
    """One way the record differs from the recomputation: ``kind``, what it is about (``subject``: a
    task or a step and rank), which ``field``, and both values."""

    kind: str
    subject: str
    field: str | None = None
    recorded: Any = None
    recomputed: Any = None

    def __str__(self) -> str:
        where = f"{self.subject} {self.field}" if self.field else self.subject
        # task ids and recorded values come from the streams: one printable line whatever they hold
        return printable(f"{self.kind}: {where}: recorded {_short(self.recorded)}, "
                         f"recomputed {_short(self.recomputed)}")


@dataclass
class VerifyReport:
    run: str
    entries_folded: int = 0
    unread_entries: int = 0  # slot-log entries after the assembler's position, not folded
    decisions_checked: int = 0
    payloads_checked: int = 0
    steps_checked: int = 0
    segments_checked: int = 0  # decided samples built on segments, compared against them
    differences: list[Difference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


def verify(client: redis.Redis | None, keys: RunKeys, from_step: int | None = None, to_step: int | None = None, *,
           source: RedisSource | None = None) -> VerifyReport:
    """Re-fold the slot log and re-partition steps ``from_step..to_step`` (inclusive); report every difference.

    The fold covers the log up to the last entry the assembler read (entries after it were never
    folded by the service either); every recorded decision is compared whatever the step range.
    Run it on a run whose assembler is stopped or idle: a decision the assembler is about to write
    would show as missing.
    """
    source = source or RedisSource(client, keys)
    config = recorded_config(source)
    report = VerifyReport(keys.run)
    decided = source.hash("decided")  # before the log: every decision it names is in the log by then, or trimmed
    recorded = [item for partition, name in partition_streams(source, "decisions")
                for item in _recorded_decisions(source, report, name, partition)]
    _check_retained(decided, recorded, report)
    refolded = {task: decision for _, name in partition_streams(source, "slots")
                for task, decision in _refold(source, config, report, name).items()}
    _compare_decisions(recorded, refolded, report)
    _check_payloads(source, recorded, report)
    report.segments_checked = check_segments(source, recorded, report, Difference)
    by_entry = dict(recorded)
    _check_steps(source, config, by_entry, from_step, to_step, report)
    _check_training(source, config, from_step, to_step, report)
    return report


def _check_training(source: RedisSource, config: RunConfig, from_step: int | None, to_step: int | None,
                    report: VerifyReport) -> None:
    """Every step all ranks committed was trained by all of them in one attempt of the trainer group: the
    last commit of each rank names the same attempt (a rollback makes every rank commit the step again)."""
    positions = {int(rank): int(step) for rank, step in source.hash("committed").items()}
    through = min((positions.get(rank, -1) for rank in range(config.dp_size)), default=-1)
    last: dict[int, dict[int, int]] = {}
    for _, event in decode_all(source, "commits"):
        if isinstance(event, StepCommitted):
            last.setdefault(event.step, {})[event.rank] = event.attempt
    low = max(from_step or 0, 0)
    high = through if to_step is None else min(to_step, through)
    complete_seen = False  # before the first step with every rank's commit, the log's start may be trimmed
    for step in range(low, high + 1):
        attempts = last.get(step, {})
        missing = [rank for rank in range(config.dp_size) if rank not in attempts]
        complete_seen = complete_seen or not missing
        if not complete_seen:
            continue
        if missing:
            for rank in missing:
                report.differences.append(Difference("step_commit_missing", f"step {step} rank {rank}", "committed",
                                                     positions.get(rank), "a StepCommitted of this step"))
        elif len(set(attempts.values())) > 1:
            report.differences.append(Difference("step_ranks_apart", f"step {step}", "attempt",
                                                 dict(sorted(attempts.items())), "one attempt for every rank"))


def _check_payloads(source: RedisSource, recorded: list[tuple[str, GroupDecided]], report: VerifyReport,
                    chunk: int = 512) -> None:
    """Every retained payload of a decided member hashes to the digest its slot result (and decision) recorded.

    A schema-1 log keeps samples in the slot log, whose digests the re-fold already compares."""
    by_partition: dict[int, list] = {}
    for ref, decision in recorded:
        by_partition.setdefault(split_decision_ref(ref)[0], []).extend(
            (decision.task_id, member) for member in decision.members)
    names = dict(partition_streams(source, "payloads"))
    slots = dict(partition_streams(source, "slots"))
    for partition, members in sorted(by_partition.items()):
        _check_partition_payloads(source, members, report, names[partition], slots[partition], chunk)


def _check_partition_payloads(source: RedisSource, members: list, report: VerifyReport, stream: str,
                              slot_stream: str, chunk: int) -> None:
    for start in range(0, len(members), chunk):
        part = members[start:start + chunk]
        for (task_id, member), fields in zip(part, source(stream, [m.entry for _, m in part])):
            if fields is None:
                _check_missing_payload(source, slot_stream, task_id, member, report)
                continue
            report.payloads_checked += 1
            digest = codec.entry_digest(fields, like=member.digest)
            if digest != member.digest:
                report.differences.append(Difference("payload_digest", f"task {task_id} slot {member.slot}",
                                                     f"payload {member.entry}", member.digest, digest))


def _check_missing_payload(source: RedisSource, slot_stream: str, task_id: str, member: Any,
                           report: VerifyReport) -> None:
    """A member's payload is gone. Retention trims a payload only with its slot entry (the slot log's
    floor), and a schema-1 slot entry carries its sample itself; a payload missing beside a slot entry
    that needs one was deleted, and the step that trained it can no longer be replayed."""
    [slot_fields] = source(slot_stream, [member.entry])
    if slot_fields is not None and not codec.is_inline_sample(slot_fields):
        report.differences.append(Difference("payload_missing", f"task {task_id} slot {member.slot}",
                                             f"payload {member.entry}", None,
                                             "the payload entry its slot result names (deleted, not trimmed)"))


def _recorded_decisions(source: RedisSource, report: VerifyReport, stream: str = "decisions",
                        partition: int = 0) -> list[tuple[str, GroupDecided]]:
    """A partition's decisions, each with its reference (`streamgrp.core.manifest.decision_ref`)."""
    out = []
    for entry_id, fields in source.scan(stream):
        try:
            event = codec.decode(fields)
        except DecodeError as exc:
            report.differences.append(Difference("decision_undecodable", f"decision entry {entry_id}", None,
                                                 exc.reason, None))
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
        report.differences.append(Difference(
            "log_not_retained", "decisions", None,
            f"{len(gone)} decisions in the decided hash (first: task {task} at {entry_id}) but not in the log",
            "none to compare: pass --archive DIR (the run's archive) to verify what retention trimmed"))


def _refold(source: RedisSource, config: RunConfig, report: VerifyReport, stream: str = "slots") -> dict[str, GroupDecided]:
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


def _compare_decisions(recorded: list[tuple[str, GroupDecided]], refolded: dict[str, GroupDecided],
                       report: VerifyReport) -> None:
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
            if theirs[name] != ours[name]:
                report.differences.append(Difference("decision_differs", subject, name, theirs[name], ours[name]))
    for task, mine in refolded.items():
        if task not in seen:
            report.differences.append(Difference("decision_missing", f"task {task}", "decision", None, mine.decision))


def _check_steps(source: RedisSource, config: RunConfig, by_entry: dict[str, GroupDecided], from_step: int | None,
                 to_step: int | None, report: VerifyReport) -> None:
    trained_in: dict[str, int] = {}
    expected_step = 0
    recorded = []
    for entry_id, fields in source.scan("steps"):
        try:
            manifest = codec.decode(fields)
        except DecodeError as exc:  # a trainer rank reaching this step fails on it
            report.differences.append(Difference("step_undecodable", f"steps entry {entry_id}", None, exc.reason,
                                                 "a step manifest"))
            continue
        if isinstance(manifest, StepManifest):
            recorded.append((entry_id, manifest))
    rebatched = _rebatch(source, config, by_entry, {m.step: m for _, m in recorded})
    for entry_id, manifest in recorded:
        step = manifest.step
        subject = f"step {step}"
        if entry_id != step_entry_id(step):
            report.differences.append(Difference("step_entry", subject, "entry id", entry_id, step_entry_id(step)))
        if step != expected_step:
            report.differences.append(Difference("step_missing", subject, "previous step", expected_step - 1,
                                                 f"{expected_step}..{step - 1} absent"))
        expected_step = step + 1
        groups = []
        for shard in manifest.shards:
            for group in shard.groups:
                decision = by_entry.get(decision_ref(group.partition, group.decision_entry))
                if group.task_id in trained_in:
                    report.differences.append(Difference("group_in_two_steps", f"task {group.task_id}", "step",
                                                         trained_in[group.task_id], step))
                trained_in[group.task_id] = step
                groups.append((group, decision))
        if (from_step is not None and step < from_step) or (to_step is not None and step > to_step):
            continue
        report.steps_checked += 1
        _check_step(manifest, groups, config, report, None if rebatched is None else rebatched.get(step, False))


def _rebatch(source: RedisSource, config: RunConfig, by_entry: dict[str, GroupDecided],
             manifests: dict[int, StepManifest]) -> dict[int, batch_fold.StepDue] | None:
    """Batch the recorded decisions again with the batcher's own fold (`streamgrp.core.batch_fold`).

    The log gives the decisions in the order the batcher read them (stream order) and, through each
    recorded manifest, the policy version its step was formed at; the user's filter is replayed from
    the recorded ``filtered`` discards. Round ends are what the log cannot give: in dynamic mode a
    round is taken to end right after the last decision a recorded step holds. None when a step's
    decisions are no longer retained (nothing to batch them from), or the run is partitioned: the order
    its batcher read the partitions' decisions in is not recorded, so its steps are checked group by
    group (decisions, shards, digests) but not batched again.
    """
    if config.partitions > 1:
        return None
    filtered = {event.task_id for _, event in decode_all(source, "discarded")
                if isinstance(event, GroupDiscarded) and event.reason == batch_fold.FILTERED}
    rules = BatchRules.of(config)
    # ``wait`` only delays steps (the same groups, in the same order, formed at the versions the manifests
    # record), so they are batched again without its hold, which depends on trainers' commits the log
    # does not order against the decisions.
    rules = BatchRules(**{**{f: getattr(rules, f) for f in rules.__slots__}, "max_empty_rounds": 2**62,
                          "stall_timeout_s": float("inf"),
                          "staleness": "drop" if rules.staleness == "wait" else rules.staleness})
    state = BatchState(rules, group_filter=lambda decision: decision.task_id not in filtered)
    ends_round = {max((g.decision_entry for shard in m.shards for g in shard.groups), key=id_key): m.step
                  for m in manifests.values() if any(shard.groups for shard in m.shards)}
    due: dict[int, batch_fold.StepDue] = {}

    def feed(event: batch_fold.Event) -> None:
        nonlocal state
        if state.next_step in manifests:
            state, _ = batch_fold.fold(state, batch_fold.VersionSet(manifests[state.next_step].version))
        state, outputs = batch_fold.fold(state, event)
        due.update((o.step, o) for o in outputs if isinstance(o, batch_fold.StepDue))

    retained = all(g.decision_entry in by_entry for m in manifests.values() for shard in m.shards for g in shard.groups)
    if not retained:
        return None
    for entry_id in sorted(by_entry, key=id_key):
        feed(batch_fold.Decided(entry_id, by_entry[entry_id]))
        if rules.batch_mode == "dynamic" and entry_id in ends_round:
            feed(batch_fold.RoundEnded(float(len(due))))
    if len(due) < len(manifests):
        feed(batch_fold.DatasetEnded())  # the run's last, smaller step
    return due


def _check_step(manifest: StepManifest, groups, config: RunConfig, report: VerifyReport,
                rebatched: batch_fold.StepDue | bool | None) -> None:
    """``rebatched``: the batch fold's step of that number, False when it forms none, None when the
    decisions are not retained and the re-batch could not run."""
    step = manifest.step
    subject = f"step {step}"
    usable = _check_step_decisions(manifest, groups, config, report)
    if len(manifest.shards) != config.dp_size:
        report.differences.append(Difference("step_shards", subject, "shards", len(manifest.shards), config.dp_size))
        return
    if not usable:  # a group without its own decision cannot be partitioned again
        return
    # The batcher buffers decisions in stream order and a step takes its fresh groups in that order (a
    # partitioned run's steps: in entry id, then partition order, `streamgrp.core.manifest.ref_order`).
    ordered = sorted(((decision_ref(g.partition, g.decision_entry), d) for g, d in groups),
                     key=lambda item: ref_order(item[0]))
    _check_rebatched(subject, ordered, rebatched, report)
    try:
        rebuilt = make_manifest(step, manifest.version, ordered, config.dp_size, manifest.created_at)
    except ValueError as exc:
        report.differences.append(Difference("step_unbuildable", subject, None, len(ordered), str(exc)))
        return
    _check_shards(step, manifest, rebuilt, report)
    if not math.isclose(manifest.imbalance, rebuilt.imbalance, rel_tol=1e-12):
        report.differences.append(Difference("step_imbalance", subject, "imbalance", manifest.imbalance,
                                             rebuilt.imbalance))


def _check_step_decisions(manifest: StepManifest, groups, config: RunConfig, report: VerifyReport) -> bool:
    """Check that each of the step's groups points at its own trainable, fresh decision; False when
    some group's decision is unknown or another task's (the step cannot be re-partitioned then)."""
    subject = f"step {manifest.step}"
    usable = True
    for group, decision in groups:
        if decision is None:
            report.differences.append(Difference("step_decision_unknown", subject, f"task {group.task_id}",
                                                 group.decision_entry, None))
            usable = False
        elif decision.task_id != group.task_id:
            report.differences.append(Difference("step_decision_task", subject, f"decision {group.decision_entry}",
                                                 group.task_id, decision.task_id))
            usable = False
        elif decision.decision == "dropped":
            report.differences.append(Difference("dropped_group_batched", subject, f"task {group.task_id}",
                                                 decision.reason, "not trainable"))
        elif discards_stale(config.staleness) and is_stale(decision, manifest.version, config.max_staleness):
            report.differences.append(Difference("stale_group_batched", subject, f"task {group.task_id}",
                                                 f"group version {decision.version}",
                                                 f"stale at version {manifest.version}"))
    return usable


def _check_rebatched(subject: str, ordered: list[tuple[str, GroupDecided]],
                     rebatched: batch_fold.StepDue | bool | None, report: VerifyReport) -> None:
    """Compare the step's decision entries (in stream order) with the batch fold's step of that number."""
    if rebatched is False:
        report.differences.append(Difference("step_not_rebatched", subject, "groups", len(ordered),
                                             "the batch fold forms no such step from the recorded decisions"))
    elif rebatched is not None and [entry for entry, _ in rebatched.groups] != [entry for entry, _ in ordered]:
        report.differences.append(Difference("step_groups", subject, "decision entries",
                                             [e for e, _ in ordered], [e for e, _ in rebatched.groups]))


def _check_shards(step: int, manifest: StepManifest, rebuilt: StepManifest, report: VerifyReport) -> None:
    """Compare each recorded shard with the re-partition's shard of the same rank: groups, tokens, digest."""
    for mine, theirs in zip(rebuilt.shards, manifest.shards):
        where = f"step {step} rank {mine.rank}"
        recorded_tasks = [g.task_id for g in theirs.groups]
        rebuilt_tasks = [g.task_id for g in mine.groups]
        if recorded_tasks != rebuilt_tasks:
            report.differences.append(Difference("shard_groups", where, "task ids", recorded_tasks, rebuilt_tasks))
        else:
            for ours, recorded_group in zip(mine.groups, theirs.groups):
                rebuilt_fields, recorded_fields = ours.wire_fields(), recorded_group.wire_fields()
                for name, value in recorded_fields.items():
                    if value != rebuilt_fields[name]:
                        report.differences.append(Difference("shard_group_differs", f"{where} task {ours.task_id}",
                                                             name, value, rebuilt_fields[name]))
        if theirs.tokens != mine.tokens:
            report.differences.append(Difference("shard_tokens", where, "tokens", theirs.tokens, mine.tokens))
        if theirs.digest != mine.digest:
            report.differences.append(Difference("shard_digest", where, "digest", theirs.digest, mine.digest))


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def format_report(report: VerifyReport) -> str:
    lines = [str(difference) for difference in report.differences]
    unread = f", {report.unread_entries} entries after the assembler's position not folded" \
        if report.unread_entries else ""
    verdict = "all match" if report.ok else f"{len(report.differences)} differences"
    lines.append(f"verify run {report.run}: folded {report.entries_folded} slot-log entries{unread}; checked "
                 f"{report.decisions_checked} decisions, {report.payloads_checked} payloads"
                 f"{f' ({report.segments_checked} built on segments)' if report.segments_checked else ''} and "
                 f"{report.steps_checked} steps: {verdict}")
    return "\n".join(lines)

"""Verify's checks of the steps: each recorded step re-batched from the recorded decisions and re-sharded
(`check_steps`), and every step all ranks committed trained by them together (`check_training`).

Owns the per-step comparisons (manifest entries, shards, tokens, digests, stale or dropped groups, groups
trained twice, gaps); the differences they report are `streamgrp.replay.verify_report`'s, listed in
`streamgrp.replay.verifier`. Reads only.
"""

from __future__ import annotations

import math

from streamgrp.config import RunConfig
from streamgrp.core import batch_fold, codec
from streamgrp.core.batch_fold import BatchRules, BatchState, discards_stale, is_stale
from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    StepCommitted,
    StepManifest,
)
from streamgrp.core.manifest import (
    decision_ref,
    make_manifest,
    ref_order,
)
from streamgrp.errors import DecodeError
from streamgrp.replay.verify_report import Difference, VerifyReport
from streamgrp.store.keys import id_key, step_entry_id
from streamgrp.store.sources import (
    RedisSource,
    decode_all,
)


def check_training(
    source: RedisSource, config: RunConfig, from_step: int | None, to_step: int | None, report: VerifyReport
) -> None:
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
                report.differences.append(
                    Difference(
                        "step_commit_missing",
                        f"step {step} rank {rank}",
                        "committed",
                        positions.get(rank),
                        "a StepCommitted of this step",
                    )
                )
        elif len(set(attempts.values())) > 1:
            report.differences.append(
                Difference(
                    "step_ranks_apart",
                    f"step {step}",
                    "attempt",
                    dict(sorted(attempts.items())),
                    "one attempt for every rank",
                )
            )


def check_steps(
    source: RedisSource,
    config: RunConfig,
    by_entry: dict[str, GroupDecided],
    from_step: int | None,
    to_step: int | None,
    report: VerifyReport,
) -> None:
    trained_in: dict[str, int] = {}
    expected_step = 0
    recorded = []
    for entry_id, fields in source.scan("steps"):
        try:
            manifest = codec.decode(fields)
        except DecodeError as exc:  # a trainer rank reaching this step fails on it
            report.differences.append(
                Difference("step_undecodable", f"steps entry {entry_id}", None, exc.reason, "a step manifest")
            )
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
            report.differences.append(
                Difference(
                    "step_missing", subject, "previous step", expected_step - 1, f"{expected_step}..{step - 1} absent"
                )
            )
        expected_step = step + 1
        groups = []
        for shard in manifest.shards:
            for group in shard.groups:
                decision = by_entry.get(decision_ref(group.partition, group.decision_entry))
                if group.task_id in trained_in:
                    report.differences.append(
                        Difference(
                            "group_in_two_steps", f"task {group.task_id}", "step", trained_in[group.task_id], step
                        )
                    )
                trained_in[group.task_id] = step
                groups.append((group, decision))
        if (from_step is not None and step < from_step) or (to_step is not None and step > to_step):
            continue
        report.steps_checked += 1
        _check_step(manifest, groups, config, report, None if rebatched is None else rebatched.get(step, False))


def _rebatch(
    source: RedisSource, config: RunConfig, by_entry: dict[str, GroupDecided], manifests: dict[int, StepManifest]
) -> dict[int, batch_fold.StepDue] | None:
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
    filtered = {
        event.task_id
        for _, event in decode_all(source, "discarded")
        if isinstance(event, GroupDiscarded) and event.reason == batch_fold.FILTERED
    }
    rules = BatchRules.of(config)
    # ``wait`` only delays steps (the same groups, in the same order, formed at the versions the manifests
    # record), so they are batched again without its hold, which depends on trainers' commits the log
    # does not order against the decisions.
    rules = BatchRules(
        **{
            **{f: getattr(rules, f) for f in rules.__slots__},
            "max_empty_rounds": 2**62,
            "stall_timeout_s": float("inf"),
            "staleness": "drop" if rules.staleness == "wait" else rules.staleness,
        }
    )
    state = BatchState(rules, group_filter=lambda decision: decision.task_id not in filtered)
    ends_round = {
        max((g.decision_entry for shard in m.shards for g in shard.groups), key=id_key): m.step
        for m in manifests.values()
        if any(shard.groups for shard in m.shards)
    }
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


def _check_step(
    manifest: StepManifest, groups, config: RunConfig, report: VerifyReport, rebatched: batch_fold.StepDue | bool | None
) -> None:
    """``rebatched``: the batch fold's step of that number, False when it forms none, None when the
    decisions are not retained and the re-batch could not run."""
    step = manifest.step
    subject = f"step {step}"
    usable = _check_step_decisions(manifest, groups, config, report)
    if len(manifest.shards) != config.dp_size:
        report.differences.append(Difference("step_shards", subject, "shards", len(manifest.shards), config.dp_size))
        return
    if not usable:  # a group without its own decision cannot be sharded again
        return
    # The batcher buffers decisions in stream order and a step takes its fresh groups in that order (a
    # partitioned run's steps: in entry id, then partition order, `streamgrp.core.manifest.ref_order`).
    ordered = sorted(
        ((decision_ref(g.partition, g.decision_entry), d) for g, d in groups), key=lambda item: ref_order(item[0])
    )
    _check_rebatched(subject, ordered, rebatched, report)
    try:
        rebuilt = make_manifest(step, manifest.version, ordered, config.dp_size, manifest.created_at)
    except ValueError as exc:
        report.differences.append(Difference("step_unbuildable", subject, None, len(ordered), str(exc)))
        return
    _check_shards(step, manifest, rebuilt, report)
    if not math.isclose(manifest.imbalance, rebuilt.imbalance, rel_tol=1e-12):
        report.differences.append(
            Difference("step_imbalance", subject, "imbalance", manifest.imbalance, rebuilt.imbalance)
        )


def _check_step_decisions(manifest: StepManifest, groups, config: RunConfig, report: VerifyReport) -> bool:
    """Check that each of the step's groups points at its own trainable, fresh decision; False when
    some group's decision is unknown or another task's (the step cannot be re-sharded then)."""
    subject = f"step {manifest.step}"
    usable = True
    for group, decision in groups:
        if decision is None:
            report.differences.append(
                Difference("step_decision_unknown", subject, f"task {group.task_id}", group.decision_entry, None)
            )
            usable = False
        elif decision.task_id != group.task_id:
            report.differences.append(
                Difference(
                    "step_decision_task", subject, f"decision {group.decision_entry}", group.task_id, decision.task_id
                )
            )
            usable = False
        elif decision.decision == "dropped":
            report.differences.append(
                Difference("dropped_group_batched", subject, f"task {group.task_id}", decision.reason, "not trainable")
            )
        elif discards_stale(config.staleness) and is_stale(decision, manifest.version, config.max_staleness):
            report.differences.append(
                Difference(
                    "stale_group_batched",
                    subject,
                    f"task {group.task_id}",
                    f"group version {decision.version}",
                    f"stale at version {manifest.version}",
                )
            )
    return usable


def _check_rebatched(
    subject: str,
    ordered: list[tuple[str, GroupDecided]],
    rebatched: batch_fold.StepDue | bool | None,
    report: VerifyReport,
) -> None:
    """Compare the step's decision entries (in stream order) with the batch fold's step of that number."""
    if rebatched is False:
        report.differences.append(
            Difference(
                "step_not_rebatched",
                subject,
                "groups",
                len(ordered),
                "the batch fold forms no such step from the recorded decisions",
            )
        )
    elif isinstance(rebatched, batch_fold.StepDue) and [entry for entry, _ in rebatched.groups] != [
        entry for entry, _ in ordered
    ]:
        report.differences.append(
            Difference(
                "step_groups", subject, "decision entries", [e for e, _ in ordered], [e for e, _ in rebatched.groups]
            )
        )


def _check_shards(step: int, manifest: StepManifest, rebuilt: StepManifest, report: VerifyReport) -> None:
    """Compare each recorded shard with the re-shard's shard of the same rank: groups, tokens, digest."""
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
                        report.differences.append(
                            Difference(
                                "shard_group_differs", f"{where} task {ours.task_id}", name, value, rebuilt_fields[name]
                            )
                        )
        if theirs.tokens != mine.tokens:
            report.differences.append(Difference("shard_tokens", where, "tokens", theirs.tokens, mine.tokens))
        if theirs.digest != mine.digest:
            report.differences.append(Difference("shard_digest", where, "digest", theirs.digest, mine.digest))

"""A run's accounting, computed from its streams and counters: what the demo prints and tests check.

Owns the definitions users read: tasks issued, decisions by kind, drop reasons (assembler and
batcher), slot outcomes, usable and trainable slot yields, steps and per-rank commits, and the
mean reward of the first and last step (`streamgrp.replay.report_series.step_reward`, the report's
reward per step). Reads only; changes nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import redis

from streamgrp.core import codec, counters
from streamgrp.core.events import GroupDecided, GroupDiscarded, StepManifest
from streamgrp.replay.report_series import step_reward, trainer_metrics
from streamgrp.store.keys import RunKeys, id_key
from streamgrp.store.sources import RedisSource, folded_through, partition_streams, server_source

SLOT_OUTCOMES = ("sample", "rejected", "failed", "timeout", "duplicate", "late", "invalid")


def run_summary(client: redis.Redis | None, keys: RunKeys, *, source: RedisSource | None = None) -> dict[str, Any]:
    """The run's accounting; ``source`` (default: the server) may be an archive-backed one
    (`streamgrp.store.sources`), so the figures stay whole after retention trimmed the streams."""
    source = source or server_source(client, keys)
    counts = {k: int(float(v)) for k, v in source.hash("counts").items()}
    tasks = slots_published = unread = 0
    for _, slot_log in partition_streams(source, "slots"):  # each log, against how far its own assembler read
        through = folded_through(source, slot_log)
        horizon = id_key(through) if through else (-1, -1)
        for entry_id, fields in source.scan(slot_log):
            kind = _kind(fields)
            tasks += kind == "task_issued"
            if kind == "slot_result":
                slots_published += 1
                unread += id_key(entry_id) > horizon
    decisions: list[GroupDecided] = [
        codec.decode(f) for _, name in partition_streams(source, "decisions") for _, f in source.scan(name)
    ]
    discarded: list[GroupDiscarded] = [codec.decode(f) for _, f in source.scan("discarded")]
    manifests: list[StepManifest] = [codec.decode(f) for _, f in source.scan("steps")]
    by_task = {d.task_id: d for d in decisions}
    groups = Counter(d.decision for d in decisions)
    dropped = Counter(d.reason for d in decisions if d.decision == "dropped")
    dropped.update(d.reason for d in discarded)
    slots = {outcome: counts.get(counters.slots(outcome), 0) for outcome in SLOT_OUTCOMES}
    # Results the assembler never read (published after it stopped), and results of groups still
    # open when it stopped: neither folded nor ignored, so they are named rather than lost.
    slots["unread"] = unread
    slots["open"] = slots_published - unread - sum(slots[o] for o in SLOT_OUTCOMES if o != "timeout")
    usable_yield, trainable_yield = counters.slot_yields(counts) or (0.0, 0.0)
    committed = {int(rank): int(step) for rank, step in source.hash("committed").items()}
    rewards = [step_reward(m, by_task) for m in manifests]
    metrics = trainer_metrics(source.hash("trainer_metrics"))  # skips what does not parse, as the report does
    waits = [m["wait_s"] for _, m in sorted(metrics.items()) if "wait_s" in m]
    return {
        "run": keys.run,
        "steps": len(manifests),
        "tasks": tasks,
        "tasks_decided": len(decisions),
        "groups": {kind: groups.get(kind, 0) for kind in ("complete", "partial", "dropped")},
        "dropped_reasons": dict(sorted(dropped.items())),
        "discarded_by_batcher": len(discarded),
        "slots": slots,
        "slots_published": slots_published,
        "usable_slot_yield": usable_yield,
        "trainable_slot_yield": trainable_yield,
        "committed_steps": {str(rank): step + 1 for rank, step in sorted(committed.items())},
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "trainer_wait_s_mean": sum(waits) / len(waits) if waits else None,
        "imbalance_mean": sum(m.imbalance for m in manifests) / len(manifests) if manifests else None,
        "dead_letters": sum(counters.family(counts, counters.DEADLETTER).values()),
    }


def _kind(fields: dict[bytes, bytes]) -> str | None:
    header = fields.get(codec.HEADER)
    if header is None:
        return None
    start = header.find(b'"kind":"')
    if start < 0:
        return None
    start += 8
    return header[start : header.index(b'"', start)].decode()


def format_summary(summary: dict[str, Any], seconds: float) -> str:
    groups, slots = summary["groups"], summary["slots"]
    reward = lambda value: "n/a" if value is None else f"{value:.3f}"  # noqa: E731
    lines = [
        f"run {summary['run']}: {summary['steps']} steps in {seconds:.1f}s",
        f"  tasks        {summary['tasks']} issued, {summary['tasks_decided']} decided",
        f"  groups       complete {groups['complete']}, partial {groups['partial']}, dropped {groups['dropped']}",
        f"  drop reasons {', '.join(f'{k} {v}' for k, v in summary['dropped_reasons'].items()) or 'none'}",
        "  slots        "
        + ", ".join(f"{k} {v}" for k, v in slots.items())
        + f" (published {summary['slots_published']})",
        (
            f"  yields       usable {summary['usable_slot_yield']:.3f}, "
            f"trainable {summary['trainable_slot_yield']:.3f} (slots that could train / slots asked for)"
        ),
        f"  reward       first step {reward(summary['reward_first'])}, last step {reward(summary['reward_last'])}",
        f"  ranks        committed steps {summary['committed_steps']}"
        + (
            f", mean wait for a batch {summary['trainer_wait_s_mean']:.3f}s"
            if summary["trainer_wait_s_mean"] is not None
            else ""
        ),
    ]
    return "\n".join(lines)

"""A run's accounting, computed from its streams and counters: what the demo prints and tests check.

Owns the definitions users read: tasks issued, decisions by kind, drop reasons (assembler and
batcher), slot outcomes, usable and trainable slot yields, steps and per-rank commits, and the
mean reward of the first and last step. Reads only; changes nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import redis

from streamgrp import codec
from streamgrp.events import GroupDecided, GroupDiscarded, SlotResult, StepManifest, TaskIssued
from streamgrp.keys import RunKeys

SLOT_OUTCOMES = ("sample", "rejected", "failed", "timeout", "duplicate", "late", "invalid")


def run_summary(client: redis.Redis, keys: RunKeys) -> dict[str, Any]:
    counts = {k.decode(): int(float(v)) for k, v in client.hgetall(keys.counts).items()}
    tasks = slots_published = 0
    for _, fields in _scan(client, keys.slots):
        kind = _kind(fields)
        tasks += kind == "task_issued"
        slots_published += kind == "slot_result"
    decisions: list[GroupDecided] = [codec.decode(f) for _, f in _scan(client, keys.decisions)]
    discarded: list[GroupDiscarded] = [codec.decode(f) for _, f in _scan(client, keys.discarded)]
    manifests: list[StepManifest] = [codec.decode(f) for _, f in _scan(client, keys.steps)]
    by_task = {d.task_id: d for d in decisions}
    groups = Counter(d.decision for d in decisions)
    dropped = Counter(d.reason for d in decisions if d.decision == "dropped")
    dropped.update(d.reason for d in discarded)
    slots = {outcome: counts.get(f"slots:{outcome}", 0) for outcome in SLOT_OUTCOMES}
    target = counts.get("target_slots", 0)
    committed = {int(rank): int(step) for rank, step in client.hgetall(keys.committed).items()}
    rewards = [_step_reward(m, by_task) for m in manifests]
    metrics = {int(k): orjson.loads(v) for k, v in client.hgetall(keys.trainer_metrics).items()}
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
        "usable_slot_yield": counts.get("usable_slots", 0) / target if target else 0.0,
        "trainable_slot_yield": counts.get("trainable_slots", 0) / target if target else 0.0,
        "committed_steps": {str(rank): step + 1 for rank, step in sorted(committed.items())},
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "trainer_wait_s_mean": sum(waits) / len(waits) if waits else None,
        "imbalance_mean": sum(m.imbalance for m in manifests) / len(manifests) if manifests else None,
        "dead_letters": sum(v for k, v in counts.items() if k.startswith("deadletter:")),
    }


def _step_reward(manifest: StepManifest, by_task: dict[str, GroupDecided]) -> float | None:
    rewards = [r for shard in manifest.shards for g in shard.groups for r in by_task[g.task_id].member_rewards
               if g.task_id in by_task]
    return sum(rewards) / len(rewards) if rewards else None


def _scan(client: redis.Redis, stream: str, page: int = 2000):
    last = "-"
    while True:
        entries = client.xrange(stream, last, "+", count=page)
        if last != "-":
            entries = entries[1:]
        if not entries:
            return
        yield from entries
        last = entries[-1][0].decode()


def _kind(fields: dict[bytes, bytes]) -> str | None:
    header = fields.get(codec.HEADER)
    if header is None:
        return None
    start = header.find(b'"kind":"')
    if start < 0:
        return None
    start += 8
    return header[start:header.index(b'"', start)].decode()


def format_summary(summary: dict[str, Any], seconds: float) -> str:
    groups, slots = summary["groups"], summary["slots"]
    reward = lambda value: "n/a" if value is None else f"{value:.3f}"  # noqa: E731
    lines = [
        f"run {summary['run']}: {summary['steps']} steps in {seconds:.1f}s",
        f"  tasks        {summary['tasks']} issued, {summary['tasks_decided']} decided",
        f"  groups       complete {groups['complete']}, partial {groups['partial']}, dropped {groups['dropped']}",
        f"  drop reasons {', '.join(f'{k} {v}' for k, v in summary['dropped_reasons'].items()) or 'none'}",
        f"  slots        " + ", ".join(f"{k} {v}" for k, v in slots.items()) + f" (published {summary['slots_published']})",
        f"  yields       usable {summary['usable_slot_yield']:.3f}, trainable {summary['trainable_slot_yield']:.3f} "
        "(slots that could train / slots asked for)",
        f"  reward       first step {reward(summary['reward_first'])}, last step {reward(summary['reward_last'])}",
        f"  ranks        committed steps {summary['committed_steps']}"
        + (f", mean wait for a batch {summary['trainer_wait_s_mean']:.3f}s" if summary['trainer_wait_s_mean'] is not None else ""),
    ]
    return "\n".join(lines)

"""A run's per-step series, computed from timestamped events: what `streamgrp report` shows. Pure.

Owns the series and their definitions; reading the run's streams and drawing the page is
`streamgrp.replay.report`. The run totals are not computed here but taken from
`streamgrp.replay.summary.run_summary` unchanged, so the page and the demo's summary never disagree.

**Step windows.** Step ``k``'s window is ``(end of k-1, created_at of manifest k]``; step 0's
starts when the run started (its `RunStarted` record). Every time is the server's clock: manifests
carry ``created_at`` (server TIME), and a decision or discard is placed by its stream entry id
(the server's clock when it was written; millisecond resolution). An event after the last manifest
falls in no step; it is reported as "after the last step", so per-step counts plus that remainder
equal the run totals.

Per step, over its window:

- *yields*: the groups the assembler decided in the window: usable slots / target slots and
  trainable slots / target slots (the run-level definitions of `run_summary`, restricted to the
  window). None when no group was decided in the window, e.g. a step cut at once from groups already
  buffered; the cumulative yields (all windows up to and including the step) are always defined.
- *decisions by kind*: complete / partial / dropped decisions written in the window.
- *drop reasons*: the reasons of dropped decisions written in the window, plus the batcher's
  discards (stale / filtered / leftover) written in it. A group the batcher discards as stale while
  cutting step ``k`` is written in the same commit as manifest ``k``, just after its ``created_at``,
  so it usually counts in step ``k+1``'s window.
- *stall seconds*: the window's length (time since the previous manifest), and the longest
  stretch of the window without a trainable (complete or partial) decision.
- *imbalance*: the manifest's largest shard tokens over the mean (1.0 is perfect).

- *bias by length*: of the generations (members of trainable decisions) decided in all windows up to
  and including the step, by length bucket (`streamgrp.core.lengths`, of each member's loss tokens):
  the share trained by the steps so far, and the share in groups the batcher discarded as stale. A
  bucket with no generation decided yet is None. Long buckets training less than short ones: the
  run learns from the easy prompts (``--staleness wait`` or ``mask`` keep them).

Per step, of the step itself (not its window):

- *reward*: the mean reward of the samples the step trains, over every shard: each member of each
  of its groups counts once with the reward its decision recorded (the mean over the sample's
  rows, as the worker published it); `step_reward`, the same figure as the run summary's
  ``reward_first`` / ``reward_last``. None when none of its members carries a reward.
- *loss* and *logprob mismatch*: what the trainer recorded for the step in the run's
  trainer-metrics hash (`TRAINER_METRICS` names the keys; `streamgrp.consumers.grpo_trainer` and
  `streamgrp.consumers.lm_trainer` write them). None when the trainer recorded no such number for the step.

Deliberately ignored: slot-level timing (when workers published), trainer-side timing, and anything
the counters know but the streams do not (slot outcomes per step).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import orjson

from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    RunFinished,
    RunTerminated,
    StepFailed,
    StepManifest,
    TrainingResumed,
)
from streamgrp.core.lengths import LENGTH_LABELS, length_bucket

__all__ = [
    "DECISION_KINDS",
    "LENGTH_LABELS",
    "TRAINER_METRICS",
    "ReportData",
    "StepRow",
    "Tally",
    "longest_gap",
    "run_status",
    "step_reward",
    "step_rows",
    "trainer_metrics",
]

DECISION_KINDS = ("complete", "partial", "dropped")

#: Per-step figures read from the trainer-metrics hash: StepRow field -> the key trainers write.
TRAINER_METRICS = {"loss": "loss", "logprob_mismatch": "logprob_abs_diff_mean"}


@dataclass(frozen=True)
class Tally:
    """What the assembler and batcher recorded in one window."""

    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DECISION_KINDS, 0))
    drop_reasons: dict[str, int] = field(default_factory=dict)
    target_slots: int = 0
    usable_slots: int = 0
    trainable_slots: int = 0

    @property
    def groups_decided(self) -> int:
        return sum(self.decisions.values())


@dataclass(frozen=True)
class StepRow:
    """One step's numbers; see the module docstring for each definition."""

    step: int
    version: int
    groups: int  # groups the step trains
    tokens: int  # valid loss tokens over all shards
    window_start: float
    created_at: float
    tally: Tally
    usable_yield: float | None
    trainable_yield: float | None
    cumulative_usable_yield: float | None
    cumulative_trainable_yield: float | None
    step_seconds: float
    longest_gap_s: float
    imbalance: float
    reward: float | None = None
    loss: float | None = None
    logprob_mismatch: float | None = None
    #: Cumulative, by length bucket: the share of the generations decided so far that were trained, and
    #: that were discarded as stale (None: none decided yet in the bucket).
    trained_share: dict[str, float | None] = field(default_factory=dict)
    stale_share: dict[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class ReportData:
    """Everything the page shows: one row per step, the tally after the last step, the run's totals and status."""

    run: str
    started_at: float | None
    steps: tuple[StepRow, ...]
    after_last_step: Tally
    totals: dict[str, Any]
    status: str
    failures: tuple[StepFailed, ...] = ()
    #: Each start of the trainer group after the first (`TrainingResumed`): where it resumed, what it trained again.
    resumes: tuple[TrainingResumed, ...] = ()
    #: The bias monitor by prompt (`streamgrp.replay.report_prompts.PromptRow`), trained least first.
    prompts: tuple[Any, ...] = ()

    @property
    def steps_trained_again(self) -> int:
        return sum(max(0, r.retrain_through - r.step + 1) for r in self.resumes)

    def series(self) -> dict[str, list[Any]]:
        """Every per-step series by name, one value per step (what the charts draw)."""
        reasons = sorted({reason for row in self.steps for reason in row.tally.drop_reasons})
        out: dict[str, list[Any]] = {
            "step": [r.step for r in self.steps],
            "usable_yield": [r.usable_yield for r in self.steps],
            "trainable_yield": [r.trainable_yield for r in self.steps],
            "cumulative_usable_yield": [r.cumulative_usable_yield for r in self.steps],
            "cumulative_trainable_yield": [r.cumulative_trainable_yield for r in self.steps],
            "step_seconds": [r.step_seconds for r in self.steps],
            "longest_gap_s": [r.longest_gap_s for r in self.steps],
            "imbalance": [r.imbalance for r in self.steps],
            "reward": [r.reward for r in self.steps],
            "loss": [r.loss for r in self.steps],
            "logprob_mismatch": [r.logprob_mismatch for r in self.steps],
        }
        for kind in DECISION_KINDS:
            out[f"decisions:{kind}"] = [r.tally.decisions.get(kind, 0) for r in self.steps]
        for reason in reasons:
            out[f"dropped:{reason}"] = [r.tally.drop_reasons.get(reason, 0) for r in self.steps]
        for label in LENGTH_LABELS:
            if any(r.trained_share.get(label) is not None for r in self.steps):
                out[f"trained_share:{label}"] = [r.trained_share.get(label) for r in self.steps]
                out[f"stale_share:{label}"] = [r.stale_share.get(label) for r in self.steps]
        return out


def step_rows(
    *,
    started_at: float | None,
    manifests: Sequence[StepManifest],
    decisions: Sequence[tuple[float, GroupDecided]],
    discards: Sequence[tuple[float, GroupDiscarded]],
    metrics: Mapping[int, Mapping[str, Any]] | None = None,
) -> tuple[list[StepRow], Tally]:
    """Per-step rows from timestamped events, and the tally of what came after the last step.

    Every decision and discard is counted exactly once: in the first window whose end is at or after
    its time (an event before the run's start counts in step 0), or else in the returned remainder.
    ``metrics`` are the trainer's per-step records (`trainer_metrics`), by step.
    """
    by_task = {decision.task_id: decision for _, decision in decisions}
    metrics = metrics or {}
    manifests = sorted(manifests, key=lambda m: m.step)
    ends: list[float] = []
    for manifest in manifests:  # a clock stepping back must not make windows overlap
        ends.append(max(manifest.created_at, ends[-1]) if ends else manifest.created_at)
    buckets: list[list[tuple[float, Any]]] = [[] for _ in range(len(manifests) + 1)]
    for when, event in sorted([*decisions, *discards], key=lambda item: item[0]):
        buckets[_window_of(ends, when)].append((when, event))
    first_event = min([when for when, _ in [*decisions, *discards]], default=None)
    start = started_at if started_at is not None else first_event
    rows: list[StepRow] = []
    running: Counter[str] = Counter()
    lengths: dict[str, Counter[str]] = {"decided": Counter(), "trained": Counter(), "stale": Counter()}
    for index, manifest in enumerate(manifests):
        end = ends[index]
        window_start = min(start, end) if start is not None else end
        tally = _tally(buckets[index])
        running.update(target=tally.target_slots, usable=tally.usable_slots, trainable=tally.trainable_slots)
        trainable_times = [
            when for when, event in buckets[index] if isinstance(event, GroupDecided) and event.decision != "dropped"
        ]
        _count_lengths(lengths, buckets[index], manifest, by_task)
        rows.append(
            StepRow(
                step=manifest.step,
                version=manifest.version,
                groups=sum(len(shard.groups) for shard in manifest.shards),
                tokens=sum(shard.tokens for shard in manifest.shards),
                window_start=window_start,
                created_at=manifest.created_at,
                tally=tally,
                usable_yield=_ratio(tally.usable_slots, tally.target_slots),
                trainable_yield=_ratio(tally.trainable_slots, tally.target_slots),
                cumulative_usable_yield=_ratio(running["usable"], running["target"]),
                cumulative_trainable_yield=_ratio(running["trainable"], running["target"]),
                step_seconds=end - window_start,
                longest_gap_s=longest_gap(window_start, end, trainable_times),
                imbalance=manifest.imbalance,
                reward=step_reward(manifest, by_task),
                trained_share=_shares(lengths, "trained"),
                stale_share=_shares(lengths, "stale"),
                **{name: _number(metrics.get(manifest.step, {}).get(key)) for name, key in TRAINER_METRICS.items()},
            )
        )
        start = end
    return rows, _tally(buckets[-1])


def _count_lengths(
    lengths: dict[str, Counter[str]],
    window: Sequence[tuple[float, Any]],
    manifest: StepManifest,
    by_task: Mapping[str, GroupDecided],
) -> None:
    """Add a window's decided generations and stale discards, and the step's trained ones, by length bucket."""
    for _, event in window:
        if isinstance(event, GroupDecided) and event.decision != "dropped":
            lengths["decided"].update(length_bucket(member.tokens) for member in event.members)
        elif isinstance(event, GroupDiscarded) and event.reason == "stale" and event.task_id in by_task:
            lengths["stale"].update(length_bucket(member.tokens) for member in by_task[event.task_id].members)
    for shard in manifest.shards:
        for group in shard.groups:
            if group.task_id in by_task:
                lengths["trained"].update(length_bucket(member.tokens) for member in by_task[group.task_id].members)


def _shares(lengths: dict[str, Counter[str]], outcome: str) -> dict[str, float | None]:
    decided = lengths["decided"]
    return {label: _ratio(lengths[outcome][label], decided[label]) for label in LENGTH_LABELS}


def step_reward(manifest: StepManifest, by_task: Mapping[str, GroupDecided]) -> float | None:
    """The mean reward of the step's samples: each member of each of its groups once, with the reward its
    decision recorded; None when none carries one (or its decisions are not given)."""
    rewards = [
        member.reward
        for shard in manifest.shards
        for group in shard.groups
        if group.task_id in by_task
        for member in by_task[group.task_id].members
        if member.reward is not None
    ]
    return sum(rewards) / len(rewards) if rewards else None


def trainer_metrics(raw: Mapping[str, str | bytes]) -> dict[int, dict[str, Any]]:
    """The trainer-metrics hash (step -> JSON object) by step; an entry that is not a step number
    and a JSON object is skipped, as the report skips an event that does not decode."""
    out: dict[int, dict[str, Any]] = {}
    for key, value in raw.items():
        try:
            step, record = int(key), orjson.loads(value)
        except (ValueError, orjson.JSONDecodeError):
            continue
        if isinstance(record, dict):
            out[step] = record
    return out


def _number(value: Any) -> float | None:
    """A recorded figure as a finite float, or None (missing, not a number, NaN or infinite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def longest_gap(start: float, end: float, times: Sequence[float]) -> float:
    """The longest stretch of [start, end] containing none of ``times`` (clipped to the interval)."""
    points = [start, *sorted(min(max(t, start), end) for t in times), end]
    return max((b - a for a, b in pairwise(points)), default=0.0)


def run_status(control: Sequence[Any], steps: int) -> str:
    """One line: finished, failed (with the terminal reason and message), or still running."""
    for event in control:
        if isinstance(event, RunTerminated):
            where = f" at step {event.step}" if event.step is not None else ""
            return f"failed{where} ({event.reason}): {event.message}"
    for event in control:
        if isinstance(event, RunFinished):
            return f"finished after {event.steps} steps"
    return f"running ({steps} steps so far)"


def _window_of(ends: Sequence[float], when: float) -> int:
    low, high = 0, len(ends)
    while low < high:  # the first window whose end is >= when
        middle = (low + high) // 2
        if ends[middle] < when:
            low = middle + 1
        else:
            high = middle
    return low


def _tally(events: Sequence[tuple[float, Any]]) -> Tally:
    decisions = dict.fromkeys(DECISION_KINDS, 0)
    reasons: Counter[str] = Counter()
    target = usable = trainable = 0
    for _, event in events:
        if isinstance(event, GroupDecided):
            decisions[event.decision] += 1
            if event.decision == "dropped" and event.reason:
                reasons[event.reason] += 1
            target += event.stats.target_slot_count
            usable += event.stats.usable_slot_count
            trainable += event.stats.trainable_slot_count
        else:
            reasons[event.reason] += 1
    return Tally(decisions, dict(sorted(reasons.items())), target, usable, trainable)


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None

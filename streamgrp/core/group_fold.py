"""The assembler fold: ``(state, event) -> (state, outputs)`` over task, slot, reward and tick events.

Owns open groups, their deadlines, first-result-wins per ``(task, slot)``, rewards that come after
their results (a result published with ``reward_pending`` waits for its `SlotRewarded`; the first
reward wins), and the moment a group closes: when every slot has a result with its reward, or when a
`Tick` reaches its deadline (``issued_at + group_timeout_s``), the missing slots, and those still
waiting for a reward, counting as ``timeout``. It reads no clock and does no I/O:
time arrives only as `Tick.now`, so the same events in the same order give the same outputs in
any process (replay and the crash test rely on this). The driver (`streamgrp.services.assembler`) owns
acknowledgements, dead letters and persistence; this module deliberately ignores them and only
says, per output, which stream entries a decision or an ignored entry accounts for.

State is mutated in place and returned, to keep the fold signature without copying every group.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

from msgspec import UNSET

from streamgrp.core.decision import decide_group
from streamgrp.core.events import (
    GroupDecided,
    SlotResult,
    SlotRewarded,
    TaskIssued,
    Tick,
)
from streamgrp.core.fresh_tokens import Freshness, group_freshness
from streamgrp.core.policy import GroupPolicy

# Why a slot entry was acknowledged without being folded.
DUPLICATE = "duplicate"
LATE = "late"
UNKNOWN_TASK = "unknown_task"
SLOT_OUT_OF_RANGE = "slot_out_of_range"
DUPLICATE_TASK = "duplicate_task"
OPEN_GROUPS_FULL = "open_groups_full"
# Why a reward entry was acknowledged without being folded.
REWARD_DUPLICATE = "reward_duplicate"
REWARD_LATE = "reward_late"
REWARD_ROWS = "reward_rows"


@dataclass(frozen=True, slots=True)
class SlotRecord:
    outcome: str
    rows: int
    tokens: int
    version: int
    entry_id: str
    digest: str = ""
    reward: float = 0.0
    #: Per-row rewards and the entry of the `SlotRewarded` that brought them, for a result published
    #: with ``reward_pending`` (a rejection by its scorer keeps just the entry).
    rewards: tuple[float, ...] | None = None
    reward_entry: str = ""
    #: The newest version among the sample's tokens, past ``version`` (`SampleSummary.newest`), else None.
    newest: int | None = None
    #: What the sample trains under ``staleness="mask"``, when its summary recorded it (its tokens span versions).
    fresh: Freshness | None = None


@dataclass(slots=True)
class OpenGroup:
    task_id: str
    issued_at: float
    deadline: float | None
    task_entry: str
    results: dict[int, SlotRecord] = field(default_factory=dict)
    #: Samples whose results came with ``reward_pending``, until their reward arrives.
    pending: dict[int, SlotRecord] = field(default_factory=dict)
    #: Entries already acknowledged as duplicates while open; kept only for accounting.
    duplicates: int = 0


@dataclass(frozen=True, slots=True)
class Closed:
    """A group decision and every stream entry it accounts for (task entry and its slot entries)."""

    decision: GroupDecided
    entries: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Ignored:
    """An entry acknowledged without folding: a duplicate, a late result, or one that fits no task."""

    entry_id: str
    reason: str
    task_id: str
    slot: int | None
    detail: str = ""


Output = Closed | Ignored


@dataclass(slots=True)
class FoldState:
    """Open groups and what the fold must know of decided ones.

    ``decided`` holds the tasks known to be decided that the next events may name; a driver that
    keeps the decisions elsewhere (the assembler: the run's ``decided`` hash) fills it per round with
    just those and clears it, so memory stays at the open groups. ``max_open`` bounds the open
    groups: a task issued beyond it is refused (``open_groups_full``), so a flood of fake task
    entries cannot grow the state without limit.
    """

    policy: GroupPolicy
    group_timeout_s: float | None = None
    open: dict[str, OpenGroup] = field(default_factory=dict)
    decided: set[str] = field(default_factory=set)
    max_open: int | None = None
    now: float | None = None
    _deadlines: list[tuple[float, str]] = field(default_factory=list)


FoldedEvent = TaskIssued | SlotResult | SlotRewarded | Tick


def fold(state: FoldState, event: FoldedEvent, entry_id: str = "") -> tuple[FoldState, list[Output]]:
    """Apply one event; ``entry_id`` identifies its stream entry (recorded in decisions)."""
    if isinstance(event, SlotResult):
        return state, _on_slot(state, event, entry_id)
    if isinstance(event, SlotRewarded):
        return state, _on_reward(state, event, entry_id)
    if isinstance(event, TaskIssued):
        return state, _on_task(state, event, entry_id)
    if isinstance(event, Tick):
        return state, _on_tick(state, event.now)
    raise TypeError(
        f"the assembler fold takes TaskIssued, SlotResult, SlotRewarded or Tick, not {type(event).__name__}"
    )


def _on_task(state: FoldState, event: TaskIssued, entry_id: str) -> list[Output]:
    task_id = event.task_id
    if task_id in state.open or task_id in state.decided:
        return [Ignored(entry_id, DUPLICATE_TASK, task_id, None, "task issued twice; the first issue stands")]
    if state.max_open is not None and len(state.open) >= state.max_open:
        return [
            Ignored(
                entry_id,
                OPEN_GROUPS_FULL,
                task_id,
                None,
                f"{len(state.open)} groups are open, the most max_open_groups allows; the task is refused",
            )
        ]
    deadline = None if state.group_timeout_s is None else event.issued_at + state.group_timeout_s
    state.open[task_id] = OpenGroup(task_id, event.issued_at, deadline, entry_id)
    if deadline is not None:
        heapq.heappush(state._deadlines, (deadline, task_id))
    return []


def _on_slot(state: FoldState, event: SlotResult, entry_id: str) -> list[Output]:
    task_id, slot = event.task_id, event.slot
    n_samples = state.policy.n_samples
    if slot >= n_samples:
        return [Ignored(entry_id, SLOT_OUT_OF_RANGE, task_id, slot, f"slot {slot} is outside 0..{n_samples - 1}")]
    group = state.open.get(task_id)
    if group is None:
        if task_id in state.decided:
            return [Ignored(entry_id, LATE, task_id, slot, "the group was already decided")]
        return [Ignored(entry_id, UNKNOWN_TASK, task_id, slot, "no task with this id is open in this run")]
    if slot in group.results or slot in group.pending:
        group.duplicates += 1
        return [Ignored(entry_id, DUPLICATE, task_id, slot, "a result for this slot was already folded")]
    sample = event.sample
    if sample is None:
        group.results[slot] = SlotRecord(event.outcome, 0, 0, 0, entry_id)
    elif event.reward_pending:
        group.pending[slot] = SlotRecord(
            "sample",
            sample.rows,
            sample.tokens,
            sample.version,
            entry_id,
            sample.digest,
            newest=None if sample.newest is UNSET else sample.newest,
            fresh=None if sample.fresh_tokens is UNSET else sample.freshness,
        )
        return []
    else:
        group.results[slot] = SlotRecord(
            "sample",
            sample.rows,
            sample.tokens,
            sample.version,
            entry_id,
            sample.digest,
            sample.reward,
            newest=None if sample.newest is UNSET else sample.newest,
            fresh=None if sample.fresh_tokens is UNSET else sample.freshness,
        )
    if len(group.results) == n_samples:
        return [_close(state, group, "all_slots", None)]
    return []


def _on_reward(state: FoldState, event: SlotRewarded, entry_id: str) -> list[Output]:
    task_id, slot = event.task_id, event.slot
    group = state.open.get(task_id)
    if group is None:
        why = (
            "the group was already decided" if task_id in state.decided else "no task with this id is open in this run"
        )
        return [Ignored(entry_id, REWARD_LATE, task_id, slot, why)]
    waiting = group.pending.get(slot)
    if waiting is None:
        done = group.results.get(slot)
        if done is not None and done.reward_entry:
            return [
                Ignored(
                    entry_id,
                    REWARD_DUPLICATE,
                    task_id,
                    slot,
                    f"slot {slot} was rewarded already (entry {done.reward_entry}); the first reward stands",
                )
            ]
        why = "its result carried its reward" if done is not None else "no result of it waits for a reward"
        return [Ignored(entry_id, REWARD_LATE, task_id, slot, f"slot {slot} is not waiting for a reward: {why}")]
    rewards = event.rewards
    if rewards is None:  # rejected or failed by its scorer
        group.results[slot] = SlotRecord(event.outcome, 0, 0, 0, waiting.entry_id, reward_entry=entry_id)
    elif len(rewards) != waiting.rows and len(rewards) != 1:
        return [
            Ignored(
                entry_id,
                REWARD_ROWS,
                task_id,
                slot,
                f"{len(rewards)} rewards for a sample of {waiting.rows} rows; give one reward per row, "
                "or one for them all",
            )
        ]
    else:
        if len(rewards) != waiting.rows:
            rewards = rewards * waiting.rows  # one reward for every row
        group.results[slot] = SlotRecord(
            "sample",
            waiting.rows,
            waiting.tokens,
            waiting.version,
            waiting.entry_id,
            waiting.digest,
            sum(rewards) / len(rewards),
            tuple(rewards),
            entry_id,
            waiting.newest,
        )
    del group.pending[slot]
    if len(group.results) == state.policy.n_samples:
        return [_close(state, group, "all_slots", None)]
    return []


def written_tick(event: Tick, entry_id: str) -> Tick:
    """``event`` with its time no later than its entry id says it was written (the server's clock, in ms).

    Anyone who may write the group log could add a tick with a time in the future, which would close
    every open group at once as timed out; the drivers that fold a stored log (the assembler, verify)
    fold each tick through this. The assembler's own ticks say the server's time when they are
    written, so it changes none of them. An id that is not a stream id leaves the tick as it is."""
    ms, sep, _ = entry_id.partition("-")
    if not (sep and ms.isdigit()):
        return event
    written = int(ms) / 1000.0 + 0.001  # the id's millisecond holds the whole of it
    return event if event.now <= written else Tick(now=written, producer=event.producer, seq=event.seq)


def _on_tick(state: FoldState, now: float) -> list[Output]:
    if state.now is not None and now < state.now:
        now = state.now  # time never runs backwards, even if a clock did
    state.now = now
    outputs: list[Output] = []
    deadlines = state._deadlines
    while deadlines and deadlines[0][0] <= now:
        _, task_id = heapq.heappop(deadlines)
        group = state.open.get(task_id)
        if group is not None:
            outputs.append(_close(state, group, "deadline", now))
    return outputs


def _close(
    state: FoldState, group: OpenGroup, closed_by: Literal["all_slots", "deadline"], now: float | None
) -> Closed:
    policy = state.policy
    results = group.results
    row_counts = [
        results[i].rows if i in results and results[i].outcome == "sample" else None for i in range(policy.n_samples)
    ]
    decided = decide_group(policy, row_counts)
    usable = [results[i] for i in decided.members]
    digests = tuple(result.digest for result in usable)
    rewards = tuple(result.reward for result in usable)
    row_rewards = tuple(result.rewards for result in usable)
    newest = max((result.newest for result in usable if result.newest is not None), default=None)
    fresh = (
        group_freshness([result.fresh or Freshness.flat(result.version, result.tokens) for result in usable])
        if any(result.fresh for result in usable)
        else None
    )
    # The member columns straight from the slot results, validated when they were decoded (an optional column
    # no member recorded is empty, as `streamgrp.core.members.columns_of` writes it).
    decision = GroupDecided(
        task_id=group.task_id,
        decision=decided.decision,
        reason=decided.reason,
        slots=tuple(decided.members),
        member_entries=tuple(result.entry_id for result in usable),
        member_digests=digests if any(digests) else (),
        member_rows=tuple(result.rows for result in usable),
        member_tokens=tuple(result.tokens for result in usable),
        member_versions=tuple(result.version for result in usable),
        member_rewards=rewards if any(reward is not None for reward in rewards) else (),
        member_row_rewards=row_rewards if any(value is not None for value in row_rewards) else UNSET,
        slot_outcomes={str(i): results[i].outcome if i in results else "timeout" for i in range(policy.n_samples)},
        stats=decided.stats,
        error=decided.error,
        closed_by=closed_by,
        issued_at=group.issued_at,
        decided_at=now,
        newest_token_version=newest if newest is not None and newest > max(r.version for r in usable) else UNSET,
        whole_version=fresh.whole if fresh else UNSET,
        fresh_tokens=fresh.tokens if fresh else UNSET,
    )
    del state.open[group.task_id]
    state.decided.add(group.task_id)
    # Every entry the decision accounts for: the task's, each result's and each reward's, and those
    # of results still waiting for a reward (their slots timed out).
    entries = (
        group.task_entry,
        *(results[i].entry_id for i in sorted(results)),
        *(results[i].reward_entry for i in sorted(results) if results[i].reward_entry),
        *(group.pending[i].entry_id for i in sorted(group.pending)),
    )
    return Closed(decision, entries)


def next_deadline(state: FoldState) -> float | None:
    """The earliest deadline among open groups, or None (the driver ticks once it has passed)."""
    deadlines = state._deadlines
    while deadlines and deadlines[0][1] not in state.open:
        heapq.heappop(deadlines)
    return deadlines[0][0] if deadlines else None


def run_fold(policy: GroupPolicy, events, group_timeout_s: float | None = None) -> tuple[FoldState, list[Output]]:
    """Fold ``(entry_id, event)`` items from an empty state (replay, tests)."""
    state = FoldState(policy, group_timeout_s)
    outputs: list[Output] = []
    for entry_id, event in events:
        state, produced = fold(state, event, entry_id)
        outputs.extend(produced)
    return state, outputs

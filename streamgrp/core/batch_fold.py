"""The batch fold: ``(state, event) -> (state, outputs)`` over decisions, version changes, round ends
and the end of the dataset (SPEC section 4).

Owns, for one run: which decided groups train (a dropped decision is only acknowledged; the user's
group filter and the staleness bound discard others, each with its reason), when a step is due
(fixed mode: exactly ``batch_size`` fresh groups, or a smaller final step once the dataset has
ended; dynamic mode: every fresh group buffered when a round ends, at least ``dp_size``), the
``max_batch_size`` bound, step numbering, ``max_steps``, leftovers, the end of the run, the run's
failure (a contract violation the assembler recorded, at the next step), and the stall bound (through
`streamgrp.core.stall`). It reads no clock and does no I/O: time arrives as
`RoundEnded.now`, the policy version as `VersionSet`. The driver (`streamgrp.services.batcher`)
owns reading, the commit script, acknowledgements, manifests' timestamps and metrics; `verify`
runs this same fold over the recorded decisions to check the steps.

Invariants, for any order of the same decisions: every trainable group is in at most one step or
discarded once, never both; a step holds between ``dp_size`` and ``max_batch_size`` groups (fixed
mode: exactly ``batch_size`` except the final step); no group in a step is more than
``max_staleness`` versions behind the step's version, except under ``staleness="mask"``, which keeps
such groups (the loader masks their old tokens) unless the mask would leave it no loss (`masked_out`: every
token older than the window, or every row cut below ``mask_min_tokens``; it is discarded as stale instead
of taking a step's place); steps are numbered 0, 1, 2, ... without gaps.

The staleness policy (`BatchRules.staleness`, the run's recorded setting): ``drop`` discards a stale
group; ``mask`` keeps it while some of its rows still train; ``wait`` holds tasks and
steps so that no pending work can turn stale. The feeder issues only while at most ``max_staleness`` written steps
are uncommitted (`may_issue`), and
a step is held (`window_allows`) while it could make pending work stale:
writing steps lets the trainers raise the version, one per step, to at most ``version + (steps written
and not committed by every rank)``; a step is written only while that bound, counted with the step,
stays within ``max_staleness`` of every pending item, an in-flight task (by the version it was issued
at, `WindowSet`) or a group left in the buffer after the step. The steps themselves are the same
groups in the same order as without the hold, only later, so `verify` batches them again unchanged.

State is mutated in place and returned, like the group fold's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from streamgrp.core.batch_records import (  # noqa: F401 - the fold's records, importable from here as before
    FILTERED,
    LEFTOVER,
    STALE,
    Acked,
    Buffered,
    DatasetEnded,
    Decided,
    Discarded,
    DiscardReason,
    Event,
    Failed,
    Finished,
    Output,
    RoundEnded,
    Stalling,
    StepDue,
    VersionSet,
    WindowSet,
)
from streamgrp.core.decision import CONTRACT_VIOLATION
from streamgrp.core.events import GroupDecided
from streamgrp.core.stall import StallTracker

GroupFilter = Callable[[GroupDecided], bool]


Staleness = Literal["drop", "wait", "mask"]


def is_stale(decision: GroupDecided, current_version: int, max_staleness: int) -> bool:
    """A group is stale when its oldest member is more than ``max_staleness`` versions behind."""
    version = decision.version
    return version is not None and current_version - version > max_staleness


def masked_out(decision: GroupDecided, current_version: int, max_staleness: int, min_tokens: int = 1) -> bool:
    """Under ``mask`` the loader would clear all of the group's loss: no row keeps a loss token inside the
    window, or ``min_tokens`` of them once the mask cut it (`streamgrp.core.fresh_tokens`), so the group would
    take a step's place and train nothing."""
    return bool(decision.slots) and not decision.freshness.trains_at(current_version - max_staleness, min_tokens)


def discards_stale(staleness: str) -> bool:
    """Whether a stale group is discarded (``drop``, and ``wait`` for what turned stale anyway: a worker
    that sampled weights older than the task's issue version) or kept with its old tokens masked."""
    return staleness != "mask"


def feeder_capacity(current_version: int, max_staleness: int, batch_size: int) -> int:
    """How many tasks may be issued or accepted: ``(max_staleness + version + 1) * batch_size``."""
    return (max_staleness + current_version + 1) * batch_size


@dataclass(frozen=True, slots=True)
class BatchRules:
    """The run's batching settings (its recorded `RunConfig`) and the batcher's ``max_steps``."""

    batch_mode: Literal["fixed", "dynamic"] = "fixed"
    batch_size: int = 8
    max_batch_size: int = 4096
    dp_size: int = 1
    max_staleness: int = 1
    max_steps: int | None = None
    max_empty_rounds: int = 8
    stall_timeout_s: float = 1800.0
    staleness: Staleness = "drop"
    mask_min_tokens: int = 1

    @classmethod
    def of(cls, run_config, max_steps: int | None = None) -> BatchRules:
        """From a `streamgrp.config.RunConfig` (duck-typed: core does not import config)."""
        return cls(
            batch_mode=run_config.batch_mode,
            batch_size=run_config.batch_size,
            max_batch_size=run_config.max_batch_size,
            dp_size=run_config.dp_size,
            max_staleness=run_config.max_staleness,
            max_steps=max_steps,
            max_empty_rounds=run_config.max_empty_rounds,
            stall_timeout_s=run_config.stall_timeout_s,
            staleness=getattr(run_config, "staleness", "drop"),
            mask_min_tokens=getattr(run_config, "mask_min_tokens", 1),
        )


@dataclass(slots=True)
class BatchState:
    """The buffer of trainable groups not yet in a step, the next step number, the policy version,
    the stall streak and how the run stands (``running``, ``finished``, ``failed``)."""

    rules: BatchRules
    group_filter: GroupFilter | None = None
    next_step: int = 0
    version: int = 0
    buffer: list[Buffered] = field(default_factory=list)
    stall: StallTracker = field(default_factory=StallTracker)
    outcome: str = "running"
    #: Trainable groups buffered since the last round ended (what the stall bound counts).
    added: int = 0
    #: The last `WindowSet` (``staleness="wait"`` only).
    oldest_in_flight: int | None = None
    lowest_committed: int = -1

    def __post_init__(self) -> None:
        if (
            self.stall.max_empty_rounds != self.rules.max_empty_rounds
            or self.stall.stall_timeout_s != self.rules.stall_timeout_s
        ):
            self.stall = StallTracker(self.rules.max_empty_rounds, self.rules.stall_timeout_s)

    @property
    def max_steps_reached(self) -> bool:
        return self.rules.max_steps is not None and self.next_step >= self.rules.max_steps


def fold(state: BatchState, event: Event) -> tuple[BatchState, list[Output]]:
    """Apply one event; a run that has finished or failed ignores everything after."""
    if state.outcome != "running":
        return state, []
    if isinstance(event, Decided):
        return state, _on_decided(state, event)
    if isinstance(event, VersionSet):
        state.version = event.version
        return state, []
    if isinstance(event, RoundEnded):
        return state, _on_round_end(state, event)
    if isinstance(event, DatasetEnded):
        return state, _on_dataset_end(state)
    if isinstance(event, WindowSet):
        state.oldest_in_flight, state.lowest_committed = event.oldest_in_flight, event.lowest_committed
        return state, (_fixed_steps(state) + _finish_if_done(state) if state.rules.batch_mode == "fixed" else [])
    raise TypeError(
        f"the batch fold takes Decided, VersionSet, RoundEnded, DatasetEnded or WindowSet, not {type(event).__name__}"
    )


def _on_decided(state: BatchState, event: Decided) -> list[Output]:
    decision = event.decision
    if decision is not None and decision.reason == CONTRACT_VIOLATION:
        # The assembler records the violation as a dropped decision; the run's one terminal event
        # is written from here, with the step at which every trainer rank stops.
        return [Acked((event.entry_id,)), _fail(state, CONTRACT_VIOLATION, decision.error or "")]
    if decision is None or decision.decision == "dropped":
        return [Acked((event.entry_id,))]
    verdict = _filter_verdict(state.group_filter, decision)
    if verdict is not None:
        return [Discarded(event.entry_id, decision, FILTERED, verdict)]
    state.buffer.append((event.entry_id, decision))
    state.added += 1
    outputs = _fixed_steps(state) if state.rules.batch_mode == "fixed" else []
    return outputs + _finish_if_done(state)


def _fixed_steps(state: BatchState) -> list[Output]:
    """Fixed mode: every step of ``batch_size`` buffered groups due now (none while ``wait`` holds)."""
    size = state.rules.batch_size
    outputs: list[Output] = []
    while len(state.buffer) >= size and not state.max_steps_reached:
        if not window_allows(state, len(state.buffer) // size, state.buffer[len(state.buffer) // size * size :]):
            break
        outputs += _emit(state, state.buffer[:size])
    return outputs


def may_issue(state: BatchState) -> bool:
    """Whether ``staleness="wait"`` lets the feeder issue a task now: only while the steps written and not
    committed by every rank are at most ``max_staleness`` (once they are trained, a task issued now is
    that many versions behind already; `window_allows` then holds every further step while it is in
    flight). Other policies: the feeder's count window alone (`feeder_capacity`)."""
    if state.rules.staleness != "wait":
        return True
    return state.next_step - (state.lowest_committed + 1) <= state.rules.max_staleness


def window_allows(state: BatchState, steps: int, left: list[Buffered]) -> bool:
    """Whether ``staleness="wait"`` lets ``steps`` more steps be written now, ``left`` staying buffered:
    the version those steps and the uncommitted ones before them may raise the run to must stay within
    ``max_staleness`` of the oldest in-flight task's issue version and of every group ``left``. Other
    policies: always."""
    if state.rules.staleness != "wait":
        return True
    pending = [decision.version for _, decision in left if decision.version is not None]
    if state.oldest_in_flight is not None:
        pending.append(state.oldest_in_flight)
    if not pending:
        return True
    uncommitted = state.next_step - (state.lowest_committed + 1)
    reachable = state.version + max(0, uncommitted) + steps
    return reachable - min(pending) <= state.rules.max_staleness


def _filter_verdict(group_filter: GroupFilter | None, decision: GroupDecided) -> str | None:
    """None to keep the group, else why the user's filter dropped it."""
    if group_filter is None:
        return None
    try:
        keep = group_filter(decision)
    except Exception as exc:  # a user bug must not stop the batcher: the group is dropped and says why
        return f"the group filter raised {type(exc).__name__}: {exc}"
    return None if keep else "the group filter returned False"


def _emit(state: BatchState, candidates: list[Buffered], *, final: bool = False) -> list[Output]:
    """One step from ``candidates`` if enough fresh ones remain; stale ones are discarded either way.

    Fixed mode needs exactly ``batch_size`` fresh groups, except for the ``final`` step of a run; no
    step takes more than ``max_batch_size`` (the rest wait for the next one).
    """
    rules, version = state.rules, state.version
    outputs: list[Output] = []
    fresh: list[Buffered] = []
    used: set[str] = set()
    for entry_id, decision in candidates:
        if discards_stale(rules.staleness) and is_stale(decision, version, rules.max_staleness):
            detail = f"group version {decision.version}, policy version {version}, max_staleness {rules.max_staleness}"
            outputs.append(Discarded(entry_id, decision, STALE, detail, version))
            used.add(entry_id)
        elif rules.staleness == "mask" and masked_out(decision, version, rules.max_staleness, rules.mask_min_tokens):
            oldest = version - rules.max_staleness
            detail = (
                f"no row trains under mask: newest token version {decision.newest_version}, at most "
                f"{decision.freshness.tokens_at(oldest)} loss tokens of one row at version {oldest} or newer "
                f"(mask_min_tokens {rules.mask_min_tokens}), policy version {version}, max_staleness "
                f"{rules.max_staleness}"
            )
            outputs.append(Discarded(entry_id, decision, STALE, detail, version))
            used.add(entry_id)
        else:
            fresh.append((entry_id, decision))
    fresh = fresh[: rules.max_batch_size]
    due = len(fresh) >= rules.dp_size and (rules.batch_mode == "dynamic" or final or len(fresh) == rules.batch_size)
    if due:
        outputs.append(StepDue(state.next_step, version, tuple(fresh)))
        state.next_step += 1
        used.update(entry for entry, _ in fresh)
    state.buffer = [item for item in state.buffer if item[0] not in used]
    return outputs


def _on_round_end(state: BatchState, event: RoundEnded) -> list[Output]:
    outputs: list[Output] = []
    if state.rules.batch_mode == "dynamic" and window_allows(
        state, -(-len(state.buffer) // state.rules.max_batch_size), []
    ):
        while state.buffer and not state.max_steps_reached:
            step = _emit(state, list(state.buffer))
            outputs += step
            if not any(isinstance(o, StepDue) for o in step):
                break  # fewer than dp_size fresh groups: they wait for the next round
    outputs += _finish_if_done(state)
    if state.outcome != "running":
        return outputs
    added, state.added = state.added, 0
    if event.server_away:  # a round without the server says nothing about rollouts
        state.stall.shift(event.duration)
        return outputs
    waiting = _waiting_for_trainers(state, event)
    if state.stall.round(added, event.now, waiting_for_trainers=waiting, held=_holding(state)):
        return [*outputs, _fail(state, "stall", "")]
    if state.stall.should_warn(event.now):
        outputs.append(Stalling(state.stall.empty_rounds, state.stall.stall_seconds(event.now)))
    return outputs


def _waiting_for_trainers(state: BatchState, event: RoundEnded) -> bool:
    """The feeder's window is full and a written step is not committed by every rank yet: the round
    waits for trainers, not for rollouts. Without a feeder there is no window to fill."""
    return event.window_full and state.next_step > 0 and event.lowest_committed < state.next_step - 1


def _holding(state: BatchState) -> bool:
    """``staleness="wait"`` holds a step that could be formed now, for work still in flight."""
    if state.rules.staleness != "wait" or state.oldest_in_flight is None:
        return False
    buffer = state.buffer
    if state.rules.batch_mode == "fixed":
        steps = len(buffer) // state.rules.batch_size
        return steps > 0 and not window_allows(state, steps, buffer[steps * state.rules.batch_size :])
    steps = -(-len(buffer) // state.rules.max_batch_size)
    return len(buffer) >= state.rules.dp_size and not window_allows(state, steps, [])


def _on_dataset_end(state: BatchState) -> list[Output]:
    outputs: list[Output] = []
    size = state.rules.batch_size if state.rules.batch_mode == "fixed" else state.rules.max_batch_size
    # Nothing is in flight any more: every step the buffer holds (``wait`` may have held several), the
    # last one possibly smaller, all formed now, at the version now.
    while state.buffer and not state.max_steps_reached:
        before = len(state.buffer)
        if state.rules.batch_mode == "fixed" and before > size:
            outputs += _emit(state, state.buffer[:size])
        else:
            outputs += _emit(state, list(state.buffer), final=True)
        if len(state.buffer) == before:
            break  # fewer than dp_size fresh groups: no step
    for entry_id, decision in state.buffer:  # fewer than dp_size groups remain: nothing can train them
        outputs.append(Discarded(entry_id, decision, LEFTOVER, "dataset ended"))
    state.buffer = []
    state.outcome = "finished"
    return [*outputs, Finished(state.next_step)]


def _finish_if_done(state: BatchState) -> list[Output]:
    if not state.max_steps_reached:
        return []
    state.outcome = "finished"
    return [Finished(state.next_step)]


def _fail(state: BatchState, reason: str, message: str) -> Failed:
    """The run fails at the next step; an empty ``message`` is the driver's to fill (the stall text
    needs the run's counters, which only the driver reads)."""
    state.outcome = "failed"
    return Failed(reason, message, state.next_step)


def run_batch_fold(state: BatchState, events) -> tuple[BatchState, list[Output]]:
    """Fold a whole sequence (verify and the tests); returns every output in order."""
    outputs: list[Output] = []
    for event in events:
        state, produced = fold(state, event)
        outputs += produced
    return state, outputs

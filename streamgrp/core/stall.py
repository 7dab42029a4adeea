"""The stall bound (SPEC section 4): when a run that cannot make progress must fail, and the warnings
before it. Pure: the batcher hands it each round's outcome and the time; it keeps the streak.

A *round* is one collection attempt. The run fails when at least ``max_empty_rounds`` consecutive
rounds added no trainable group AND at least ``stall_timeout_s`` passed since the last progress.
Requiring both keeps fast all-reject bursts alive (many empty rounds in little time) and keeps a
single slow round from failing a run that is merely slow.

A round spent waiting for trainers (the feeder's staleness window is full and a written step is
not committed yet) is not an empty round: rollouts are not what holds the run up, so it is
counted apart (``trainer_wait_rounds``) and the stall timer starts again after it. Nor is a round in
which ``--staleness wait`` holds a step for a generation still in flight (``held_rounds``): the run
waits for that generation on purpose (its group's deadline bounds the wait). Time the batcher spent
unable to reach the server is not stall time either (`shift`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamgrp.core import counters

WARNING_INTERVAL_S = 60.0


@dataclass
class StallTracker:
    max_empty_rounds: int = 8
    stall_timeout_s: float = 1800.0
    empty_rounds: int = 0
    trainer_wait_rounds: int = 0
    held_rounds: int = 0
    last_progress: float | None = None
    _last_warning: float | None = field(default=None, repr=False)

    def round(
        self, trainable_added: int, now: float, *, waiting_for_trainers: bool = False, held: bool = False
    ) -> bool:
        """Record a round; True when the run has stalled for good."""
        if self.last_progress is None:
            self.last_progress = now
        if waiting_for_trainers and trainable_added == 0:
            self.trainer_wait_rounds += 1
            self.last_progress = now
            return False
        if held and trainable_added == 0:
            self.held_rounds += 1
            self.last_progress = now
            return False
        if trainable_added > 0:
            self.empty_rounds = 0
            self.last_progress = now
            return False
        self.empty_rounds += 1
        return self.empty_rounds >= self.max_empty_rounds and self.stall_seconds(now) >= self.stall_timeout_s

    def shift(self, seconds: float) -> None:
        """Leave ``seconds`` out of the stall timer (the batcher could not reach the server)."""
        if self.last_progress is not None and seconds > 0:
            self.last_progress += seconds

    def stall_seconds(self, now: float) -> float:
        return 0.0 if self.last_progress is None or self.empty_rounds == 0 else max(0.0, now - self.last_progress)

    def should_warn(self, now: float) -> bool:
        """At most one progress warning a minute, and only while rounds are empty."""
        if self.empty_rounds == 0:
            return False
        if self._last_warning is not None and now - self._last_warning < WARNING_INTERVAL_S:
            return False
        self._last_warning = now
        return True


def stall_message(tracker: StallTracker, now: float, counts: dict[str, int], server_note: str = "") -> str:
    """The terminal message: what stalled, the likely causes, and the figures to check."""
    yields = counters.slot_yields(counts)
    drops = counters.family(counts, counters.DROPPED)
    outcomes = counters.family(counts, counters.SLOTS)
    usable_yield = f"{yields[0]:.3f}" if yields else "n/a (no group decided)"
    trainable_yield = f"{yields[1]:.3f}" if yields else "n/a"
    return (
        f"run stalled: {tracker.empty_rounds} consecutive batcher rounds added no trainable group and "
        f"{tracker.stall_seconds(now):.0f}s passed without progress "
        f"(bounds: max_empty_rounds={tracker.max_empty_rounds}, stall_timeout_s={tracker.stall_timeout_s:g}). "
        "Likely causes: the reward function or rollout rejects or fails every sample; min_usable_group_size is "
        "more than the workers can reach; no worker is running (or all died); the assembler is down. "
        f"Check: usable_slot_yield={usable_yield}, trainable_slot_yield={trainable_yield}, "
        f"drop reasons {drops or '{}'}, slot outcomes {outcomes or '{}'} "
        "(streamgrp_groups_dropped_total, streamgrp_groups_discarded_total and streamgrp_slots_total on the "
        "dashboards)." + (f" {server_note}" if server_note else "")
    )

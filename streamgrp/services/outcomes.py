"""The bias monitor's counts: what became of the generations the run decided, by length.

Long generations are the ones that go stale or time out; a run that trains mostly short ones is
biased toward easy prompts. The batcher counts every generation (a decided slot) once, by what
became of it (``trained``: in a step; ``stale``, ``filtered``, ``leftover``: its group discarded by the
batcher; ``dropped``: its group dropped by the assembler; ``timeout``: the slot never returned) and by
the length bucket of its loss tokens (`streamgrp.core.lengths`; a timed-out slot has no length: ``none``). A
group's members share its outcome. Rejected and failed slots are not generations that could train,
and are left to ``streamgrp_slots_total``. Pure but for the metrics object it is handed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from streamgrp.core.events import GroupDecided
from streamgrp.core.lengths import length_bucket

OUTCOMES = ("trained", "stale", "filtered", "leftover", "dropped", "timeout")
NO_LENGTH = "none"


def _members(metrics: Any, decision: GroupDecided, outcome: str) -> None:
    for member in decision.members:
        metrics.generations.labels(outcome, length_bucket(member.tokens)).inc()


def decided(metrics: Any, decisions: Iterable[GroupDecided]) -> None:
    """Decisions read: their timed-out slots, and the members of the groups the assembler dropped
    (``metrics`` None: nothing to count, as for each function here)."""
    if metrics is None:
        return
    for decision in decisions:
        timeouts = sum(1 for outcome in decision.slot_outcomes.values() if outcome == "timeout")
        if timeouts:
            metrics.generations.labels("timeout", NO_LENGTH).inc(timeouts)
        if decision.decision == "dropped":
            _members(metrics, decision, "dropped")


def discarded(metrics: Any, decision: GroupDecided, reason: str) -> None:
    """A trainable group the batcher discarded (``reason``: stale, filtered, leftover)."""
    if metrics is None:
        return
    _members(metrics, decision, reason if reason in OUTCOMES else "filtered")


def batched(metrics: Any, version: int, decisions: Iterable[GroupDecided]) -> None:
    """A step written at ``version`` with these groups: trained generations, and each group's staleness."""
    for decision in decisions:
        metrics.staleness.observe(max(0, version - (decision.version or 0)))
        _members(metrics, decision, "trained")

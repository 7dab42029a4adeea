"""The run's durable counters: every field name of the ``counts`` hash, what a decision adds to
them, and reading the increments the commit scripts report.

Names are ``kind`` or ``kind:label``. The commit scripts spell the few they write themselves
(``steps``, ``groups:batched``, ``dropped:<reason>``, ...; tests/unit/test_counters.py checks every
name the Lua writes against this module), and return the (field, amount) pairs they applied
(`store/lua/counters.lua`), so a process mirrors exactly what reached the server, never what it
meant to write.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamgrp.core.events import GroupDecided

# Totals (one name each).
STEPS = "steps"  # steps written by the batcher
TARGET_SLOTS = "target_slots"  # n_samples per decided group
USABLE_SLOTS = "usable_slots"  # usable slots of decided groups
TRAINABLE_SLOTS = "trainable_slots"  # usable slots of groups that were kept
GROUPS_BATCHED = "groups:batched"  # groups placed in a step
GROUPS_DISCARDED = "groups:discarded"  # decided groups the batcher did not train
REDUNDANT_DECISIONS = "redundant_decisions"  # decisions another assembler had already written
TASKS_DUPLICATE = "tasks:duplicate"  # a task id issued twice
INVALID_TASKS = "invalid:tasks"  # task-queue entries dead-lettered
INVALID_CONTROL = "invalid:control"  # control-stream entries dead-lettered
INVALID_DECISIONS = "invalid:decisions"  # decision entries the batcher dead-lettered

# Families (``prefix:label``).
SLOTS = "slots"  # slot outcomes: sample, rejected, failed, timeout, duplicate, late, invalid, trimmed
DECISIONS = "decisions"  # complete, partial, dropped
DROPPED = "dropped"  # drop and discard reasons
DEADLETTER = "deadletter"  # dead-letter reasons of the slot log
REWARDS = "rewards"  # reward entries not folded: duplicate, late

FAMILIES = (SLOTS, DECISIONS, DROPPED, DEADLETTER, REWARDS)
TOTALS = (
    STEPS,
    TARGET_SLOTS,
    USABLE_SLOTS,
    TRAINABLE_SLOTS,
    GROUPS_BATCHED,
    GROUPS_DISCARDED,
    REDUNDANT_DECISIONS,
    TASKS_DUPLICATE,
    INVALID_TASKS,
    INVALID_CONTROL,
    INVALID_DECISIONS,
)


def slots(outcome: str) -> str:
    return f"{SLOTS}:{outcome}"


def rewards(label: str) -> str:
    return f"{REWARDS}:{label}"


def decisions(kind: str) -> str:
    return f"{DECISIONS}:{kind}"


def dropped(reason: str) -> str:
    return f"{DROPPED}:{reason}"


def deadletter(reason: str) -> str:
    return f"{DEADLETTER}:{reason}"


def is_known(field: str) -> bool:
    """A name this module defines (a total, or a family with any label)."""
    family, sep, label = field.partition(":")
    return field in TOTALS or (bool(sep) and bool(label) and family in FAMILIES)


def family(counts: Mapping[str, int], prefix: str) -> dict[str, int]:
    """The non-zero members of one family by label: ``family(counts, DROPPED) -> {"stale": 3}``."""
    head = prefix + ":"
    return {name[len(head) :]: value for name, value in counts.items() if name.startswith(head) and value}


def decision_increments(decision: GroupDecided) -> dict[str, int]:
    """What one decision adds to the counters (the assembler commits them with it)."""
    counts: Counter[str] = Counter(slots(outcome) for outcome in decision.slot_outcomes.values())
    counts[decisions(decision.decision)] += 1
    if decision.reason:
        counts[dropped(decision.reason)] += 1
    counts[TARGET_SLOTS] += decision.stats.target_slot_count
    counts[USABLE_SLOTS] += decision.stats.usable_slot_count
    counts[TRAINABLE_SLOTS] += decision.stats.trainable_slot_count
    return dict(counts)


def slot_yields(counts: Mapping[str, float]) -> tuple[float, float] | None:
    """(usable, trainable) slot yields so far, or None before any group was decided."""
    target = counts.get(TARGET_SLOTS, 0)
    if not target:
        return None
    return counts.get(USABLE_SLOTS, 0) / target, counts.get(TRAINABLE_SLOTS, 0) / target


def pairs_to_counts(flat: list) -> dict[str, int]:
    """``[field, amount, field, amount, ...]`` from a commit script into a dict."""
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in zip(flat[::2], flat[1::2])}

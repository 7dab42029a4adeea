"""The decision rule for one group (SPEC section 2): complete, partial or dropped, and why.

`decide_group` is a pure function of the policy and each slot's row count; it knows nothing of
streams, deadlines or time. Deadlines, duplicates and late results belong to `streamgrp.core.group_fold`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from streamgrp.core.events import GroupStats
from streamgrp.core.policy import GroupPolicy

DecisionKind = Literal["complete", "partial", "dropped"]

#: Drop reasons the assembler records (SPEC section 2). The batcher adds `stale` and `filtered`.
ALL_UNUSABLE = "all_unusable"
INCOMPLETE = "incomplete"
BELOW_MINIMUM = "below_minimum"
CONTRACT_VIOLATION = "contract_violation"
ASSEMBLER_DROP_REASONS = (ALL_UNUSABLE, INCOMPLETE, BELOW_MINIMUM, CONTRACT_VIOLATION)


@dataclass(frozen=True, slots=True)
class Decision:
    """What `decide_group` concluded.

    ``members`` are the usable slot indices in order, also for a dropped group (whose members are
    not trained); ``error`` is set only for a contract violation.
    """

    decision: DecisionKind
    reason: str | None
    members: tuple[int, ...]
    stats: GroupStats
    error: str | None = None


def decide_group(policy: GroupPolicy, row_counts: Sequence[int | None]) -> Decision:
    """Decide a closed group. ``row_counts[i]`` is None for an unusable slot, else slot i's rows.

    The rules apply in SPEC order: all unusable, incomplete under ``drop_incomplete_group``, below
    the resolved minimum, one-sample-per-slot contract, else complete or partial.
    """
    target = policy.n_samples
    if len(row_counts) != target:
        raise ValueError(f"expected {target} slot row counts (n_samples), got {len(row_counts)}")
    for index, rows in enumerate(row_counts):
        if rows is not None and rows < 1:
            raise ValueError(f"slot {index} is usable but carries {rows} rows; a sample has at least one row")
    members = tuple(index for index, rows in enumerate(row_counts) if rows is not None)
    usable = len(members)

    reason: str | None = None
    error: str | None = None
    if usable == 0:
        reason = ALL_UNUSABLE
    elif usable < target and policy.drop_incomplete_group:
        reason = INCOMPLETE
    elif usable < policy.minimum_usable_group_size:
        reason = BELOW_MINIMUM
    elif policy.one_sample_per_slot and any(row_counts[index] != 1 for index in members):
        reason = CONTRACT_VIOLATION
        error = contract_violation_message(policy, [row_counts[index] for index in members])

    if reason is None:
        kind: DecisionKind = "complete" if usable == target else "partial"
        trainable = usable
    else:
        kind = "dropped"
        trainable = 0
    return Decision(kind, reason, members, GroupStats.of(target, usable, trainable), error)


def contract_violation_message(policy: GroupPolicy, slot_sizes: Sequence[int | None]) -> str:
    """The terminal error for a multi-row usable slot, naming the sizes seen and the remedies."""
    return (
        f"one-sample-per-slot contract violated: slot sizes {list(slot_sizes)} (rows per usable slot) "
        f"with n_samples={policy.n_samples} and resolved min_usable_group_size="
        f"{policy.minimum_usable_group_size}; group statistics would count each row as a group member. "
        "Remedies: return exactly one sample (one row) per slot from the rollout function, or use "
        "batch-level mean_level/std_level and leave min_usable_group_size unset (an explicit minimum "
        ">= 2 arms this contract even under batch statistics)."
    )

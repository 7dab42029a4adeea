"""Turning decided groups into one step's manifest: shards per rank, digests, imbalance. Pure.

Owns which rank trains which group (the rank split, `balanced_partition`, over valid tokens) and what each shard's
digest is; ignores staleness, filtering and when a batch is due (the batcher decides those).
"""

from __future__ import annotations

from collections.abc import Sequence

from streamgrp.core.codec import combine_digests
from streamgrp.core.events import GroupDecided, Shard, ShardGroup, StepManifest
from streamgrp.core.rank_split import balanced_partition


def decision_ref(partition: int, entry_id: str) -> str:
    """How the batcher names a decision entry: its id, with ``@partition`` after it beyond partition 0
    (entry ids of different partitions' streams can be equal)."""
    return f"{entry_id}@{partition}" if partition else entry_id


def split_decision_ref(ref: str) -> tuple[int, str]:
    """(partition, entry id) of a `decision_ref`."""
    entry_id, _, partition = ref.partition("@")
    return (int(partition) if partition else 0), entry_id


def ref_order(ref: str) -> tuple[int, int, int]:
    """A `decision_ref`'s place in the one order of a partitioned run's steps: entry id, then partition
    (the batcher forms each step's groups in it, so `verify` can form them again)."""
    partition, entry_id = split_decision_ref(ref)
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0), partition


def shard_group(ref: str, decision: GroupDecided) -> ShardGroup:
    partition, entry_id = split_decision_ref(ref)
    if partition < 0:
        raise ValueError(f"decision reference {ref!r} names partition {partition}")
    # The member columns of the validated decision, as they are (a 32-group manifest is 256 members, made
    # once per step on the batcher's hot path).
    return ShardGroup(
        task_id=decision.task_id,
        decision_entry=entry_id,
        slots=decision.slots,
        member_entries=decision.member_entries,
        member_rows=decision.member_rows,
        member_tokens=decision.member_tokens,
        member_versions=decision.member_versions,
        member_row_rewards=decision.member_row_rewards,
        digest=combine_digests(member.digest for member in decision.members),
        written_partition=partition,
    )


def make_manifest(
    step: int, version: int, groups: Sequence[tuple[str, GroupDecided]], dp_size: int, created_at: float
) -> StepManifest:
    """A step of ``groups`` split over ``dp_size`` ranks; raises ValueError with fewer groups than ranks."""
    if len(groups) < dp_size:
        raise ValueError(f"a step needs at least dp_size={dp_size} groups, got {len(groups)}")
    items = [shard_group(entry, decision) for entry, decision in groups]
    weights = [max(item.valid_tokens, 0) for item in items]
    shards = []
    for rank, indices in enumerate(balanced_partition(weights, dp_size)):
        members = tuple(items[i] for i in indices)
        shards.append(
            Shard(
                rank=rank,
                groups=members,
                tokens=sum(weights[i] for i in indices),
                digest=combine_digests(g.digest for g in members),
            )
        )
    return StepManifest(
        step=step, version=version, shards=tuple(shards), imbalance=imbalance(shards), created_at=created_at
    )


def imbalance(shards: Sequence[Shard]) -> float:
    """Largest shard's tokens over the mean (1.0 is perfect)."""
    total = sum(s.tokens for s in shards)
    return max(s.tokens for s in shards) * len(shards) / total if total else 1.0

"""The batcher's events: a step's manifest (`StepManifest`: one `Shard` per data-parallel rank, each of whole
groups, `ShardGroup`) and a trainable group it did not train (`GroupDiscarded`).

Owns their schema, as `streamgrp.core.events` owns the others' (registered there, importable from there); what
goes in a step is `streamgrp.core.batch_fold`'s and `streamgrp.core.manifest`'s. Pure: no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from streamgrp.core import wire
from streamgrp.core.members import Member, RowRewards, check_columns, columns_of, records_of
from streamgrp.core.wire import Record, WireEvent, as_tuples


class ShardGroup(Record, frozen=True, kw_only=True, dict=True):
    """One group as a step uses it: where its members are (`Member` records, written as columns:
    `streamgrp.core.members`) and what their bytes hash to. Build one from records with `of`."""

    task_id: str
    decision_entry: str
    slots: tuple[wire.NonNegInt, ...] = msgspec.field(name="members")
    member_entries: tuple[str, ...]
    member_rows: tuple[wire.Int, ...]
    member_tokens: tuple[wire.Int, ...]
    member_versions: tuple[wire.Int, ...]
    member_row_rewards: RowRewards = UNSET
    digest: str
    #: The run partition whose streams hold the decision and the members' entries: written only when not 0,
    #: so an unpartitioned run's manifests are what they always were (`partition` reads it).
    written_partition: wire.NonNegInt | UnsetType = msgspec.field(name="partition", default=UNSET)

    def __post_init__(self) -> None:
        check_columns(self)
        if self.written_partition == 0:
            msgspec.structs.force_setattr(self, "written_partition", UNSET)

    @classmethod
    def of(
        cls, *, task_id: str, decision_entry: str, members: Sequence[Member], digest: str, partition: int = 0
    ) -> ShardGroup:
        columns = columns_of(members, Member)
        return cls(
            task_id=task_id,
            decision_entry=decision_entry,
            **columns,
            digest=digest,
            written_partition=partition or UNSET,
        )

    def with_members(self, members: Sequence[Member]) -> ShardGroup:
        """A copy whose members are ``members``."""
        return self.replace(**columns_of(members, Member))

    @property
    def partition(self) -> int:
        """The run partition of the group's streams (0 unpartitioned)."""
        return 0 if self.written_partition is UNSET else self.written_partition

    @functools.cached_property
    def members(self) -> tuple[Member, ...]:
        return records_of(self, Member)

    @property
    def valid_tokens(self) -> int:
        return sum(self.member_tokens)

    @property
    def rows(self) -> int:
        return sum(self.member_rows)


class Shard(Record, frozen=True, kw_only=True):
    """What one DP rank trains at a step: whole groups, and a digest over their members' bytes."""

    rank: wire.Int
    groups: tuple[ShardGroup, ...]
    tokens: wire.Int
    digest: str

    def __post_init__(self) -> None:
        as_tuples(self, "groups")


class StepManifest(WireEvent, frozen=True, kw_only=True):
    """One optimizer step: its number, the policy version it was batched at, one shard per rank."""

    kind: Literal["step"] = "step"

    step: wire.NonNegInt
    version: wire.Int
    shards: tuple[Shard, ...]
    imbalance: wire.Float
    created_at: wire.Float

    def __post_init__(self) -> None:
        as_tuples(self, "shards")


class GroupDiscarded(WireEvent, frozen=True, kw_only=True):
    """A decided, trainable group the batcher did not train: ``stale``, ``filtered``, or ``leftover``
    (fewer than dp_size groups remained when the dataset ran out)."""

    kind: Literal["group_discarded"] = "group_discarded"

    task_id: str
    reason: Literal["stale", "filtered", "leftover"]
    #: The decision's entry id; in a partitioned run `streamgrp.core.manifest.decision_ref`'s ``ID@P``.
    decision_entry: str
    group_version: wire.Int | None = None
    current_version: wire.Int | None = None
    detail: str = ""

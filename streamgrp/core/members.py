"""A decided group's members and statistics: typed records in Python, columns on the wire.

A group's members are `Member` records (where a slot's entry is and what it weighs) and, in a
decision, `DecidedMember` records (also its digest and mean reward). The wire writes them as one
list per field (``members`` for slot indices, ``member_entries``, ``member_rows``, ...), the most
compact form, and the events that hold members (`streamgrp.core.events.GroupDecided`,
`streamgrp.core.events.ShardGroup`) define exactly those columns, so msgspec decodes and checks them;
`check_columns` checks that every column has one item per member, `records_of` gives the records
(the events' ``members``) and `columns_of` is the other way. Nothing else aligns lists by position. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from streamgrp.core import wire
from streamgrp.core.wire import Record, as_tuples


class Member(Record, frozen=True, kw_only=True):
    """One usable slot of a group as a step trains it: where its entry is and what it weighs.

    ``entry`` is the slot stream entry id replay reads; ``rows`` the sample's rows; ``tokens`` its
    valid loss tokens (the partition weight); ``version`` the policy version that generated it.
    """

    slot: wire.NonNegInt
    entry: str
    rows: wire.Int
    tokens: wire.Int
    version: wire.Int
    #: The sample's rewards, one per row, when they came in a `SlotRewarded` event after the result
    #: (they replace the payload's placeholders); None when the payload carries them.
    rewards: tuple[wire.Float, ...] | None = None


class DecidedMember(Member, frozen=True, kw_only=True):
    """A member as the decision records it: also the ``digest`` of its entry's bytes
    (`streamgrp.core.codec.entry_digest`, empty when not recorded) and its mean ``reward`` over its
    rows (what group filters look at; None when not recorded)."""

    digest: str = ""
    reward: wire.Float | None = None

    def placed(self) -> Member:
        """The member as a step's shard records it (without digest and reward)."""
        return Member(
            slot=self.slot,
            entry=self.entry,
            rows=self.rows,
            tokens=self.tokens,
            version=self.version,
            rewards=self.rewards,
        )


#: Wire column -> member field, in the order the columns are written; the first, ``members``, holds the
#: slots (the events' ``slots`` field).
WIRE_COLUMNS = {
    "members": "slot",
    "member_entries": "entry",
    "member_digests": "digest",
    "member_rows": "rows",
    "member_tokens": "tokens",
    "member_versions": "version",
    "member_rewards": "reward",
}
#: Columns written after those, and only when some member has a value: a log whose rewards all came
#: with their results is written as it was before they existed.
SPARSE_COLUMNS = {"member_row_rewards": "rewards"}
#: Columns that may be written empty when no member recorded a value (schema 1 allows it).
OPTIONAL_COLUMNS = ("member_digests", "member_rewards")
_DEFAULTS = {"digest": "", "reward": None, "rewards": None}


def check_columns(event: Any) -> None:
    """Each member column of ``event`` (lists from Python become tuples) has one item per member, an
    optional one may be empty; raises ValueError naming the column that does not."""
    names = _column_names(type(event))
    as_tuples(event, "slots", *names)
    if getattr(event, "member_row_rewards", UNSET) is not UNSET:
        as_tuples(event, "member_row_rewards")
    count = len(event.slots)
    for name in (*names, "member_row_rewards"):
        column = getattr(event, name, UNSET)
        if column is UNSET or (not column and name in OPTIONAL_COLUMNS):
            continue
        if len(column) != count:
            raise ValueError(f"{name} has {len(column)} items for {count} members; give one per member")


def _column_names(event_type: Any) -> tuple[str, ...]:
    return tuple(name for name in WIRE_COLUMNS if name != "members" and name in event_type.__struct_fields__)


def records_of(event: Any, record: type[Member]) -> tuple[Any, ...]:
    """The ``record`` of each member of ``event``'s columns, in slot order."""
    slots = event.slots
    count = len(slots)
    columns: dict[str, Sequence[Any]] = {"slot": slots}
    for name in _column_names(type(event)):
        field = WIRE_COLUMNS[name]
        column = getattr(event, name)
        columns[field] = column if column or not count else (_DEFAULTS[field],) * count  # an optional one empty
    row_rewards = getattr(event, "member_row_rewards", UNSET)
    columns["rewards"] = (None,) * count if row_rewards is UNSET else row_rewards
    names = tuple(columns)
    return tuple(record(**dict(zip(names, values))) for values in zip(*columns.values()))


def columns_of(members: Sequence[Member], record: type[Member]) -> dict[str, Any]:
    """The column fields of ``members`` (the events' field names: ``slots`` first): an optional column
    that no member recorded is empty, as schema 1 allows; the sparse per-row rewards UNSET."""
    columns: dict[str, Any] = {"slots": tuple(member.slot for member in members)}
    fields = msgspec.structs.fields(record)
    names = {info.name for info in fields}
    for name, field in WIRE_COLUMNS.items():
        if name == "members" or field not in names:
            continue
        values = tuple(getattr(member, field) for member in members)
        if name in OPTIONAL_COLUMNS and all(value == _DEFAULTS[field] for value in values):
            values = ()
        columns[name] = values
    rewards = tuple(member.rewards for member in members)
    columns["member_row_rewards"] = rewards if any(value is not None for value in rewards) else UNSET
    return columns


RowRewards = tuple[tuple[wire.Float, ...] | None, ...] | UnsetType


class GroupStats(Record, frozen=True, kw_only=True):
    """The per-group statistics SPEC section 3 names, all derived from three slot counts (`of`)."""

    target_slot_count: wire.NonNegInt
    usable_slot_count: wire.NonNegInt
    trainable_slot_count: wire.NonNegInt
    fully_masked_group: bool
    singleton_slot_group: bool
    pre_filter_usable_slot_yield: wire.Float
    pre_filter_trainable_slot_yield: wire.Float

    @classmethod
    def of(cls, target: int, usable: int, trainable: int) -> GroupStats:
        return cls(
            target_slot_count=target,
            usable_slot_count=usable,
            trainable_slot_count=trainable,
            fully_masked_group=usable == 0,
            singleton_slot_group=usable == 1,
            pre_filter_usable_slot_yield=usable / target if target else 0.0,
            pre_filter_trainable_slot_yield=trainable / target if target else 0.0,
        )

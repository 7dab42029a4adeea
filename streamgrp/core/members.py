"""A decided group's members and statistics: typed records in Python, columns on the wire.

A group's members are `Member` records (where a slot's entry is and what it weighs) and, in a
decision, `DecidedMember` records (also its digest and mean reward). Schema 1 writes them as one
list per field (``members`` for slot indices, ``member_entries``, ``member_rows``, ...), the most
compact form; `from_columns` and `member_columns` are the only code that converts, so nothing else
aligns lists by position. Pure: no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from pydantic import StrictBool
from pydantic_core import PydanticUndefined

from streamgrp.core.values import Float, Frozen, Int, NonNegInt, built


class Member(Frozen):
    """One usable slot of a group as a step trains it: where its entry is and what it weighs.

    ``entry`` is the slot stream entry id replay reads; ``rows`` the sample's rows; ``tokens`` its
    valid loss tokens (the partition weight); ``version`` the policy version that generated it.
    """

    slot: NonNegInt
    entry: str
    rows: Int
    tokens: Int
    version: Int
    #: The sample's rewards, one per row, when they came in a `SlotRewarded` event after the result
    #: (they replace the payload's placeholders); None when the payload carries them.
    rewards: tuple[Float, ...] | None = None


class DecidedMember(Member):
    """A member as the decision records it: also the ``digest`` of its entry's bytes
    (`streamgrp.core.codec.entry_digest`, empty when not recorded) and its mean ``reward`` over its
    rows (what group filters look at; None when not recorded)."""

    digest: str = ""
    reward: Float | None = None

    def placed(self) -> Member:
        """The member as a step's shard records it (without digest and reward)."""
        # Every field was validated when this record was; constructing again would only repeat it.
        return built(Member, {"slot": self.slot, "entry": self.entry, "rows": self.rows, "tokens": self.tokens,
                              "version": self.version, "rewards": self.rewards})


#: Wire column -> member field, in the order the columns are written.
WIRE_COLUMNS = {"members": "slot", "member_entries": "entry", "member_digests": "digest", "member_rows": "rows",
            "member_tokens": "tokens", "member_versions": "version", "member_rewards": "reward"}
#: Columns written after those, and only when some member has a value: a log whose rewards all came
#: with their results is written as it was before they existed.
SPARSE_COLUMNS = {"member_row_rewards": "rewards"}


def from_columns(data: Any, record: type[Member]) -> Any:
    """Turn a header's member columns into records, checking that every column has one item per member.

    Data already given as records (a model built in Python) passes through unchanged."""
    if not isinstance(data, dict) or "member_entries" not in data:
        return data
    data = dict(data)
    columns = []
    for name, field, optional in _record_columns(record):
        column = data.pop(name, ())
        if not isinstance(column, (list, tuple)):
            raise ValueError(f"{name} is a {type(column).__name__}, not a list")
        columns.append((name, field, optional, column))
    count = len(columns[0][3])
    for name, _, optional, column in columns:
        if len(column) != count and not (optional and not column):
            raise ValueError(f"{name} has {len(column)} items for {count} members; give one per member")
    present = [(field, column) for _, field, _, column in columns if column]
    names = [field for field, _ in present]
    data["members"] = [dict(zip(names, values)) for values in zip(*(column for _, column in present))]
    return data


@functools.cache
def _record_columns(record: type[Member]) -> tuple[tuple[str, str, bool], ...]:
    """(wire column, field, optional) of each column ``record`` has, "members" (the slots) first."""
    return tuple((name, field, record.model_fields[field].default is not PydanticUndefined)
                 for name, field in (*WIRE_COLUMNS.items(), *SPARSE_COLUMNS.items()) if field in record.model_fields)


def member_columns(members: Sequence[Member], record: type[Member]) -> dict[str, list[Any]]:
    """The wire columns of ``members`` (the inverse of ``_from_columns``); an optional field that no
    member recorded is written as an empty column, as schema 1 allows."""
    columns: dict[str, list[Any]] = {}
    for name, field, optional, default in _column_defaults(record):
        values = [member.__dict__[field] for member in members]
        if optional:
            for value in values:  # a loop, not all(...): a generator costs more than the comparisons
                if value != default:
                    break
            else:
                if name in SPARSE_COLUMNS:
                    continue
                values = []
        columns[name] = values
    return columns


@functools.cache
def _column_defaults(record: type[Member]) -> tuple[tuple[str, str, bool, Any], ...]:
    """(wire column, field, optional, default) of each column ``record`` has, in wire order."""
    return tuple((name, field, optional, record.model_fields[field].default)
                 for name, field, optional in _record_columns(record))


class GroupStats(Frozen):
    """The per-group statistics SPEC section 3 names, all derived from three slot counts (`of`)."""

    target_slot_count: NonNegInt
    usable_slot_count: NonNegInt
    trainable_slot_count: NonNegInt
    fully_masked_group: StrictBool
    singleton_slot_group: StrictBool
    pre_filter_usable_slot_yield: Float
    pre_filter_trainable_slot_yield: Float

    @classmethod
    def of(cls, target: int, usable: int, trainable: int) -> GroupStats:
        return cls(target_slot_count=target, usable_slot_count=usable, trainable_slot_count=trainable,
                   fully_masked_group=usable == 0, singleton_slot_group=usable == 1,
                   pre_filter_usable_slot_yield=usable / target if target else 0.0,
                   pre_filter_trainable_slot_yield=trainable / target if target else 0.0)

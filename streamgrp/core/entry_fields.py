"""A stream entry's fields from its raw RESP field list, keeping what a plain dict would lose.

Redis lets one entry repeat a field name, and a damaged reply may not be a field list at all;
`entry_fields` keeps such entries whole (`EntryFields`) so that the codec can refuse them with a
reason and a dead letter can record them exactly. Pure, never raises.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from streamgrp.core.shown import show


class EntryFields(dict[Any, Any]):  # names and values as the server sent them (malformed ones too)
    """A stream entry's fields when its RESP field list was not a plain set of distinct names.

    As a dict it maps each name to its **last** value, which is what redis-py's own
    ``dict(zip(it, it))`` has always given; ``pairs`` keeps every ``(name, value)`` in entry
    order, so a dead letter can record the entry exactly as it was. ``repeated`` names the fields
    given more than once; ``malformed`` says why the list was not a field list at all (odd length,
    unhashable name), else None. `decode` refuses both (``bad_fields``, ``repeated_field``).
    """

    __slots__ = ("malformed", "pairs")

    def __init__(self, pairs: Iterable[tuple[Any, Any]] = (), *, malformed: str | None = None) -> None:
        super().__init__()
        self.pairs: list[tuple[Any, Any]] = list(pairs)
        for name, value in self.pairs:
            try:
                self[name] = value
            except TypeError:
                malformed = malformed or f"field name {show(name)} is not hashable"
        self.malformed = malformed

    @property
    def repeated(self) -> tuple[Any, ...]:
        """Names that occur more than once, in order of first occurrence; empty when none do."""
        seen: set[Any] = set()
        repeated: list[Any] = []
        for name, _ in self.pairs:
            try:
                if name not in seen:
                    seen.add(name)
                elif name not in repeated:
                    repeated.append(name)
            except TypeError:
                continue  # unhashable: already reported by ``malformed``
        return tuple(repeated)

    def __repr__(self) -> str:
        extra = f", malformed={self.malformed!r}" if self.malformed else ""
        return f"EntryFields({self.pairs!r}{extra})"


def entry_fields(flat: list[bytes] | None) -> dict[bytes, bytes] | EntryFields | None:
    """The fields of one entry from its flat RESP list ``[k1, v1, k2, v2, ...]``. Pure, never raises.

    A plain dict when every name is distinct (nearly every entry); an `EntryFields` when a name
    repeats or the list is not a field list (odd length, unhashable name, not a list), which
    `decode` then refuses with a reason. None (an entry deleted while pending) stays None.
    """
    if flat is None:
        return None
    if flat.__class__ is list or flat.__class__ is tuple:
        count = len(flat)
        if not count & 1:
            items = iter(flat)
            try:
                fields = dict(zip(items, items))
            except TypeError:
                pass  # an unhashable name: the slow path says which
            else:
                if len(fields) * 2 == count:
                    return fields
        pairs = list(zip(flat[0::2], flat[1::2]))
        if count & 1:
            return EntryFields(pairs, malformed=f"the field list has an odd number of items ({count}): "
                                                f"name {show(flat[-1])} has no value")
        return EntryFields(pairs)
    return EntryFields(malformed=f"the field list is a {type(flat).__name__}, not a list of names and values")

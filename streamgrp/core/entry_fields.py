"""A stream entry's fields from its raw RESP field list, keeping what a plain dict would lose.

Redis lets one entry repeat a field name, and a damaged reply may not be a field list at all;
`entry_fields` keeps such entries whole (`EntryFields`) so that the codec can refuse them with a
reason and a dead letter can record them exactly (it never raises). The codec's first checks of an
entry are here too: the fields' types, the entry's size, and its ``h`` and ``b`` fields (`field_items`,
`check_size`, `header_and_blob`, raising `DecodeError` with the codec's reasons). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from streamgrp.core.shown import clip, field_names, show, show_names
from streamgrp.errors import DecodeError

HEADER = b"h"
BLOB = b"b"


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
            return EntryFields(
                pairs,
                malformed=f"the field list has an odd number of items ({count}): name {show(flat[-1])} has no value",
            )
        return EntryFields(pairs)
    return EntryFields(malformed=f"the field list is a {type(flat).__name__}, not a list of names and values")


def field_items(fields: Any) -> Iterable[tuple[Any, Any]]:
    """Every (name, value) pair of the entry, repeats included; refuses what is not a field mapping."""
    if fields.__class__ is dict:  # the fast path: what redis-py and `entry_fields` return
        return fields.items()
    if not isinstance(fields, Mapping):
        raise DecodeError(
            "bad_fields",
            f"entry fields are a {type(fields).__name__}, not a mapping of names "
            "to values" + (" (the entry was deleted?)" if fields is None else ""),
        )
    malformed = getattr(fields, "malformed", None)
    if malformed:
        raise DecodeError("bad_fields", clip(str(malformed)))
    pairs = getattr(fields, "pairs", None)
    return pairs if isinstance(pairs, list) else fields.items()


def check_size(items: Iterable[tuple[Any, Any]], max_entry_bytes: int) -> bool:
    """Refuse an entry over ``max_entry_bytes`` before anything is parsed (every name and value counts).
    Returns whether any name or value is a str (a decode_responses client)."""
    size = 0
    text = False
    for key, value in items:
        if key.__class__ is not bytes or value.__class__ is not bytes:
            if value.__class__ is memoryview and key == BLOB:
                # the tensors' bytes as a view of a reply (a payload key's, `streamgrp.store.payloads`): read in
                # place; a header is parsed as text, so it stays bytes
                value = _byte_view(value)
            else:
                _check_field_types(key, value)
                text = True
        size += len(key) + len(value)
    if size <= max_entry_bytes and text:
        # A str counted its characters, a lower bound; count the UTF-8 bytes the server holds.
        size = sum(len(_as_bytes(key)) + len(_as_bytes(value)) for key, value in items)
    if size > max_entry_bytes:
        raise DecodeError(
            "oversized",
            f"entry is {'at least ' if text else ''}{size} bytes, over the "
            f"{max_entry_bytes}-byte limit (max_entry_bytes); write smaller events or raise the limit",
        )
    return text


def header_and_blob(fields: Any, text: bool) -> tuple[bytes, bytes]:
    """The ``h`` and ``b`` values as bytes (``b`` empty when absent); refuses repeated or missing ones."""
    if fields.__class__ is not dict:
        repeated = getattr(fields, "repeated", ())
        if repeated:
            raise DecodeError(
                "repeated_field",
                f"field names repeated in one entry: {show_names(repeated)}; "
                "each field must appear once (was the entry written by streamgrp.core.codec?)",
            )
    raw_header = fields.get(HEADER)
    blob = fields.get(BLOB)
    if text:
        raw_header, blob = _text_fields(fields, raw_header, blob)
    if raw_header is None:
        raise DecodeError(
            "missing_field", f"entry has no {HEADER.decode()!r} header field (fields: {field_names(fields)})"
        )
    return raw_header, b"" if blob is None else blob


def _byte_view(value: memoryview) -> memoryview:
    """``value`` if it is a flat view of bytes (what `len` counts as bytes); refuses any other view."""
    if value.ndim != 1 or value.itemsize != 1 or not value.c_contiguous:
        raise DecodeError(
            "bad_fields",
            f"a field value is a {value.ndim}-dimensional memoryview of {value.format!r} items, expected bytes",
        )
    return value


def _check_field_types(key: Any, value: Any) -> None:
    for what, item in (("name", key), ("value", value)):
        if item.__class__ is not bytes and item.__class__ is not str:
            raise DecodeError(
                "bad_fields",
                f"a field {what} is of type {type(item).__name__} ({show(item)}), "
                "expected bytes (or str from a decode_responses client)",
            )


def _as_bytes(value: bytes | str) -> bytes:
    if value.__class__ is bytes:
        return value
    try:
        # surrogateescape gives back the server's bytes when the client decoded them that way
        return value.encode("utf-8", "surrogateescape")  # type: ignore[union-attr]
    except UnicodeEncodeError as exc:
        raise DecodeError("bad_fields", f"a str field holds text that has no UTF-8 bytes: {exc.reason}") from None


def _text_fields(fields: Mapping[Any, Any], raw_header: Any, blob: Any) -> tuple[bytes | None, bytes | None]:
    """The header and blob from a mapping with str names or values (a decode_responses client)."""
    for key, value in ((HEADER, raw_header), (BLOB, blob)):
        if value is not None and key.decode() in fields:
            raise DecodeError("repeated_field", f"field {key.decode()!r} is given both as bytes and as str")
    if raw_header is None:
        raw_header = fields.get(HEADER.decode())
    if blob is None:
        blob = fields.get(BLOB.decode())
    return (None if raw_header is None else _as_bytes(raw_header), None if blob is None else _as_bytes(blob))


def field(fields: Mapping[Any, bytes | str], key: bytes) -> bytes | str | None:
    value = fields.get(key)
    if value is None:
        value = fields.get(key.decode())
    return value

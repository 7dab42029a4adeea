"""The bytes of one archive segment and of its index file: encoding, decoding, checking. No files, no server.

A segment file is an 8-byte magic, then records, each::

    "SGR1"  u32 header length  u32 body length  u32 crc32(header + body)        (little-endian)
    header  orjson {"s": stream name, "i": entry id, "f": [[name length, value length], ...]}
    body    each field's name then its value, raw bytes, back to back

so every field name and value round-trips byte for byte (dead-letter entries carry whatever names the
bad input had). No pickle. A record whose checksum matches but whose header is not one this format
writes (a stream name that is no string, an id that is no stream id, field sizes that do not add up)
is `Undecodable` with ``whole`` set: a crash never leaves one (a torn write fails its lengths or its
checksum), so readers refuse it wherever it is instead of taking it for a torn tail.

A sealed segment's index file (``NNNNNNNN.idx``) is orjson: each stream's first and last id and
every record's id, offset and size. `SegmentIndex.from_json` checks it before it is used: every
offset and size it holds lies inside the segment it names, and each stream's ids strictly increase,
so a damaged or hostile index raises `ArchiveError` instead of making a reader seek or allocate
wildly.

Owns the wire format of records and indexes and the stream order of entry ids; reading and writing
segment files is `streamgrp.store.segment_file`.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from streamgrp.errors import ArchiveError
from streamgrp.store.keys import IdKey, id_key

__all__ = [
    "INDEX_FORMAT",
    "PREFIX_SIZE",
    "RECORD_MAGIC",
    "SEGMENT_MAGIC",
    "Fields",
    "IdKey",
    "Record",
    "SegmentIndex",
    "Undecodable",
    "damaged_index_error",
    "decode_at",
    "decode_record",
    "decode_record_or_problem",
    "encode_record",
    "id_key",
    "record_size",
]

INDEX_FORMAT = "streamgrp.segment-index/1"
SEGMENT_MAGIC = b"SGSEG01\n"
RECORD_MAGIC = b"SGR1"
_PREFIX = struct.Struct("<4sIII")
PREFIX_SIZE = _PREFIX.size
_MAX_HEADER = 64 * 1024 * 1024
_ENTRY_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")  # a stream entry id: two u64s

Fields = dict[bytes, bytes]


# -- records ----------------------------------------------------------------------------------------


def encode_record(stream: str, entry_id: str, fields: Mapping[bytes, bytes]) -> bytes:
    """One record: prefix, orjson header naming the stream, id and field sizes, then the raw fields."""
    names = [k if isinstance(k, bytes) else str(k).encode() for k in fields]
    values = [v if isinstance(v, bytes) else str(v).encode() for v in fields.values()]
    header = orjson.dumps({"s": stream, "i": entry_id, "f": [[len(k), len(v)] for k, v in zip(names, values)]})
    body = b"".join(part for pair in zip(names, values) for part in pair)
    crc = zlib.crc32(body, zlib.crc32(header))
    return _PREFIX.pack(RECORD_MAGIC, len(header), len(body), crc) + header + body


@dataclass(frozen=True, slots=True)
class Record:
    stream: str
    entry_id: str
    fields: Fields


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What is wrong with the bytes at an offset. ``whole``: they are a complete record whose checksum
    matches but whose header this format never writes, so they are no torn write but damage or forgery."""

    problem: str
    whole: bool = False


def decode_record(buffer: bytes | memoryview, offset: int = 0) -> tuple[Record, int] | None:
    """The record at ``offset`` and the offset after it; None when it is incomplete or damaged."""
    decoded = decode_at(buffer, offset)
    return None if isinstance(decoded, Undecodable) else decoded


def decode_record_or_problem(buffer: bytes | memoryview, offset: int) -> tuple[Record, int] | str:
    """The record at ``offset`` and the offset after it, or what is wrong with it (for error messages)."""
    decoded = decode_at(buffer, offset)
    return decoded.problem if isinstance(decoded, Undecodable) else decoded


def record_size(prefix: bytes | memoryview) -> int | Undecodable:
    """A record's whole size from its first `PREFIX_SIZE` bytes, before reading the rest of it."""
    if len(prefix) < _PREFIX.size:
        return Undecodable("the file ends inside the record's prefix")
    magic, header_len, body_len, _crc = _PREFIX.unpack_from(prefix, 0)
    if magic != RECORD_MAGIC:
        return Undecodable(f"no record starts there (bytes {bytes(magic)!r})")
    if header_len > _MAX_HEADER:
        return Undecodable(f"a record header of {header_len} bytes")
    return _PREFIX.size + header_len + body_len


def decode_at(buffer: bytes | memoryview, offset: int) -> tuple[Record, int] | Undecodable:
    """The record at ``offset`` and the offset after it, or what is wrong with the bytes there."""
    size = record_size(buffer[offset : offset + _PREFIX.size])
    if isinstance(size, Undecodable):
        return size
    end = offset + size
    if end > len(buffer):
        return Undecodable(f"the record's {size - _PREFIX.size} bytes run past the end of the file")
    _magic, header_len, _body_len, crc = _PREFIX.unpack_from(buffer, offset)
    start = offset + _PREFIX.size
    header = bytes(buffer[start : start + header_len])
    body = bytes(buffer[start + header_len : end])
    if zlib.crc32(body, zlib.crc32(header)) != crc:
        return Undecodable("the record fails its checksum")
    if not header:  # zeroed lengths and checksum "match" (the CRC of nothing is 0): a zeroed block, not a forgery
        return Undecodable("the record's header is empty")
    record = _parse_header(header, body)
    if isinstance(record, str):
        return Undecodable(f"its checksum matches but {record}", whole=True)
    return record, end


def _parse_header(header: bytes, body: bytes) -> Record | str:
    """The record a checksummed header and body describe, or what in the header is not what `encode_record` writes.

    Checked in full so that no reader later meets a stream name that is no string, an id it cannot
    order, or a field that slices past the body.
    """
    try:
        meta = orjson.loads(header)
    except orjson.JSONDecodeError:
        return "its header is not JSON"
    if not isinstance(meta, dict):
        return f"its header is a JSON {type(meta).__name__}, not an object"
    stream, entry_id, sizes = meta.get("s"), meta.get("i"), meta.get("f")
    if not isinstance(stream, str) or not stream:
        return f"its stream name is {stream!r:.80}"
    if not isinstance(entry_id, str) or not _ENTRY_ID.fullmatch(entry_id):
        return f"its entry id is {entry_id!r:.80}, not MS-SEQ"
    if not isinstance(sizes, list):
        return f"its field sizes are {sizes!r:.80}, not a list"
    fields: Fields = {}
    at = 0
    for pair in sizes:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in pair)
        ):
            return f"a field size is {pair!r:.80}, not [name length, value length]"
        name_end = at + pair[0]
        value_end = name_end + pair[1]
        if value_end > len(body):
            return f"its field sizes run past its {len(body)}-byte body"
        fields[body[at:name_end]] = body[name_end:value_end]
        at = value_end
    if at != len(body):
        return f"its field sizes add up to {at} bytes, not its {len(body)}-byte body"
    return Record(stream, entry_id, fields)


# -- the index of one segment -----------------------------------------------------------------------


@dataclass
class SegmentIndex:
    """Where each record of one segment is: per stream, (id order key, id, offset, size), in id order."""

    number: int
    length: int  # bytes of the segment that hold whole, valid records
    streams: dict[str, list[tuple[IdKey, str, int, int]]] = field(default_factory=dict)
    sealed: bool = False
    torn: bool = False  # bytes after ``length`` that are not a valid record (a crash mid-append)

    def first_last(self, stream: str) -> tuple[IdKey, IdKey] | None:
        records = self.streams.get(stream)
        return (records[0][0], records[-1][0]) if records else None

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "format": INDEX_FORMAT,
                "segment": self.number,
                "length": self.length,
                "streams": {
                    name: {"first": recs[0][1], "last": recs[-1][1], "count": len(recs)}
                    for name, recs in self.streams.items()
                    if recs
                },
                "records": {
                    name: [[entry_id, offset, size] for _, entry_id, offset, size in recs]
                    for name, recs in self.streams.items()
                },
            }
        )

    @classmethod
    def from_json(
        cls, raw: bytes, where: Path, *, number: int | None = None, segment_size: int | None = None
    ) -> SegmentIndex:
        """Parse and check a sealed segment's index file; any problem raises `ArchiveError`.

        ``number`` and ``segment_size`` (the segment file's bytes), when given, are checked too: the
        index must name that segment and hold no record past its end.
        """
        try:
            return _parse_index(orjson.loads(raw), number, segment_size)
        except ValueError as exc:  # orjson.JSONDecodeError is one
            raise damaged_index_error(where, str(exc)) from None


def damaged_index_error(where: Path, problem: str) -> ArchiveError:
    """The error for an index file that cannot be used; the archiver rebuilds a deleted one."""
    return ArchiveError(
        f"segment index {where} is damaged ({problem}); delete it and the archiver rebuilds it "
        "from its segment on the next start"
    )


def _parse_index(data: Any, number: int | None, segment_size: int | None) -> SegmentIndex:
    """The index that decoded JSON describes; ValueError saying what is wrong when it is not a valid one.

    Checks everything a reader later trusts without looking again: the types, that offsets and sizes
    are non-negative and each record lies within the segment's readable bytes, and that each stream's
    ids strictly increase (lookups bisect them).
    """
    if not isinstance(data, dict):
        raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
    if data.get("format") != INDEX_FORMAT:
        raise ValueError(f"format {data.get('format')!r:.80}, expected {INDEX_FORMAT!r}")
    segment = _count(data.get("segment"), "segment")
    if number is not None and segment != number:
        raise ValueError(f"it indexes segment {segment}, not {number}")
    length = _count(data.get("length"), "length")
    if segment_size is not None and length > segment_size:
        raise ValueError(f"length {length} is past the end of the {segment_size}-byte segment")
    records = data.get("records")
    if not isinstance(records, dict):
        raise ValueError("'records' is not an object")
    streams = {name: _stream_records(name, recs, length) for name, recs in records.items()}
    return SegmentIndex(segment, length, streams, sealed=True)


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} is {value!r:.80}, not a non-negative integer")
    return value


def _stream_records(name: str, recs: Any, length: int) -> list[tuple[IdKey, str, int, int]]:
    """One stream's ``[[entry id, offset, size], ...]`` from an index, checked against the segment's length."""
    if not isinstance(recs, list):
        raise ValueError(f"the records of {name!r:.80} are not a list")
    out: list[tuple[IdKey, str, int, int]] = []
    for item in recs:
        if not (
            isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and _ENTRY_ID.fullmatch(item[0])
        ):
            raise ValueError(f"a record of {name!r:.80} is {item!r:.80}, not [entry id, offset, size]")
        entry_id, offset, size = item[0], _count(item[1], "an offset"), _count(item[2], "a size")
        if offset < len(SEGMENT_MAGIC) or size < _PREFIX.size or offset + size > length:
            raise ValueError(
                f"{name!r:.80} entry {entry_id} spans bytes [{offset}, {offset + size}), outside the "
                f"segment's records [{len(SEGMENT_MAGIC)}, {length})"
            )
        key = id_key(entry_id)
        if out and key <= out[-1][0]:
            raise ValueError(f"{name!r:.80} entry {entry_id} is not after {out[-1][1]}")
        out.append((key, entry_id, offset, size))
    return out

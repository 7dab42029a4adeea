"""The archive on disk: append-only segment files, their index, and the run's snapshot. No server.

One directory per run (``<data_dir>/archive/<run>`` by default)::

    meta.json               {"format": "streamgrp.archive/1", "run": RUN, "archive_id": HEX}
    LOCK                    flock'ed by the one archiver writing here
    segments/00000001.seg   records, appended in the order the archiver read them
    segments/00000001.idx   written when the segment is sealed: each stream's first and last id, record offsets
    snapshot.json           the run's hashes and consumer-group positions when the archiver last caught up

A segment file is an 8-byte magic, then records, each::

    "SGR1"  u32 header length  u32 body length  u32 crc32(header + body)        (little-endian)
    header  orjson {"s": stream name, "i": entry id, "f": [[name length, value length], ...]}
    body    each field's name then its value, raw bytes, back to back

so every field name and value round-trips byte for byte (dead-letter entries carry whatever names the
bad input had). No pickle.

Invariants the reader relies on, and that `SegmentWriter` and `ArchiveWriter` keep:

- within one segment one stream's ids strictly increase: a segment is written by one archiver process
  in stream order, and every start of an archiver opens a new segment;
- a record that is incomplete or fails its checksum ends what is readable of a segment: the torn
  write of an archiver killed mid-append, only ever at the end of the segment it was writing. A
  damaged record that a whole record follows is therefore not a torn write but damage (a bad disk,
  an edit, a copy gone wrong): reading or sealing past it would lose every record after it for good,
  so it raises `ArchiveError` and the file is left as it is;
- an index file is checked before it is used: every offset and size it holds lies inside the
  segment it names, so a damaged or hostile index raises `ArchiveError` instead of making a reader
  seek or allocate wildly;
- an id can be in several segments after a crash (the archiver copies again what it had written but
  not yet recorded as progress); the bytes are the same, and the copy in the later segment wins.

Owns bytes on disk and finding entries by stream and id range; knows nothing of Redis or of what
the entries mean.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import heapq
import os
import re
import struct
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from streamgrp.errors import ArchiveError, ConfigError

__all__ = ["ARCHIVE_FORMAT", "ArchiveError", "ArchiveReader", "ArchiveWriter", "SegmentIndex", "SegmentWriter",
           "decode_record", "default_archive_dir", "encode_record", "id_key", "scan_segment"]

ARCHIVE_FORMAT = "streamgrp.archive/1"
INDEX_FORMAT = "streamgrp.segment-index/1"
SEGMENT_MAGIC = b"SGSEG01\n"
RECORD_MAGIC = b"SGR1"
_PREFIX = struct.Struct("<4sIII")
_MAX_HEADER = 64 * 1024 * 1024
_ENTRY_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")  # a stream entry id: two u64s
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024

Fields = dict[bytes, bytes]
IdKey = tuple[int, int]



def default_archive_dir(data_dir: str | os.PathLike[str], run: str) -> Path:
    """Where an archiver writes a run's archive by default, and where readers look for it."""
    return Path(data_dir) / "archive" / run


def id_key(entry_id: str) -> IdKey:
    """Stream order of an entry id (``ms-seq``)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


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


def decode_record(buffer: bytes | memoryview, offset: int = 0) -> tuple[Record, int] | None:
    """The record at ``offset`` and the offset after it; None when it is incomplete or damaged."""
    decoded = _decode(buffer, offset)
    return None if isinstance(decoded, str) else decoded


def _decode(buffer: bytes | memoryview, offset: int) -> tuple[Record, int] | str:
    """The record at ``offset`` and the offset after it, or what is wrong with it (for error messages)."""
    end = offset + _PREFIX.size
    if end > len(buffer):
        return "the file ends inside the record's prefix"
    magic, header_len, body_len, crc = _PREFIX.unpack_from(buffer, offset)
    if magic != RECORD_MAGIC:
        return f"no record starts there (bytes {magic!r})"
    if header_len > _MAX_HEADER:
        return f"a record header of {header_len} bytes"
    if end + header_len + body_len > len(buffer):
        return f"the record's {header_len + body_len} bytes run past the end of the file"
    header = bytes(buffer[end:end + header_len])
    body = bytes(buffer[end + header_len:end + header_len + body_len])
    if zlib.crc32(body, zlib.crc32(header)) != crc:
        return "the record fails its checksum"
    try:
        meta = orjson.loads(header)
        fields, at = {}, 0
        for name_len, value_len in meta["f"]:
            fields[body[at:at + name_len]] = body[at + name_len:at + name_len + value_len]
            at += name_len + value_len
        record = Record(meta["s"], meta["i"], fields)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return "the record's header is not a record header"
    if at != body_len:
        return "the record's field sizes do not add up to its body"
    return record, end + header_len + body_len


def _next_record(buffer: bytes, start: int) -> int | None:
    """The offset of the first whole, checksummed record at or after ``start``, if any.

    Only used after a record failed to decode, to tell a torn tail (nothing whole after it) from
    damage in the middle. Candidates are found by their magic; a false one is cheap to reject
    because its lengths must fit the buffer and its checksum must match.
    """
    at = buffer.find(RECORD_MAGIC, start)
    while at != -1:
        if not isinstance(_decode(buffer, at), str):
            return at
        at = buffer.find(RECORD_MAGIC, at + 1)
    return None


# -- one segment ------------------------------------------------------------------------------------


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
        return orjson.dumps({
            "format": INDEX_FORMAT, "segment": self.number, "length": self.length,
            "streams": {name: {"first": recs[0][1], "last": recs[-1][1], "count": len(recs)}
                        for name, recs in self.streams.items() if recs},
            "records": {name: [[entry_id, offset, size] for _, entry_id, offset, size in recs]
                        for name, recs in self.streams.items()},
        })

    @classmethod
    def from_json(cls, raw: bytes, where: Path, *, number: int | None = None,
                  segment_size: int | None = None) -> SegmentIndex:
        """Parse and check a sealed segment's index file; any problem raises `ArchiveError`.

        ``number`` and ``segment_size`` (the segment file's bytes), when given, are checked too: the
        index must name that segment and hold no record past its end.
        """
        try:
            return _parse_index(orjson.loads(raw), number, segment_size)
        except ValueError as exc:  # orjson.JSONDecodeError is one
            raise _damaged_index(where, str(exc)) from None


def _damaged_index(where: Path, problem: str) -> ArchiveError:
    """The error for an index file that cannot be used; the archiver rebuilds a deleted one."""
    return ArchiveError(f"segment index {where} is damaged ({problem}); delete it and the archiver rebuilds it "
                        "from its segment on the next start")


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
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and _ENTRY_ID.fullmatch(item[0])):
            raise ValueError(f"a record of {name!r:.80} is {item!r:.80}, not [entry id, offset, size]")
        entry_id, offset, size = item[0], _count(item[1], "an offset"), _count(item[2], "a size")
        if offset < len(SEGMENT_MAGIC) or size < _PREFIX.size or offset + size > length:
            raise ValueError(f"{name!r:.80} entry {entry_id} spans bytes [{offset}, {offset + size}), outside the "
                             f"segment's records [{len(SEGMENT_MAGIC)}, {length})")
        key = id_key(entry_id)
        if out and key <= out[-1][0]:
            raise ValueError(f"{name!r:.80} entry {entry_id} is not after {out[-1][1]}")
        out.append((key, entry_id, offset, size))
    return out


def scan_segment(path: Path, number: int, *, resume: SegmentIndex | None = None) -> SegmentIndex:
    """Index a segment by reading it; stops at a torn tail, raises `ArchiveError` at damage before the end.

    A record that does not decode is a torn tail when nothing whole follows it (a crash mid-append);
    when a whole record does follow, it is damage, and nothing is returned that a caller could seal.

    ``resume``: an index of the same segment taken earlier; only the bytes after its readable part
    are read (a segment being written only grows, and its torn tail may since have been completed).
    """
    index = SegmentIndex(number, 0)
    base = 0
    with open(path, "rb") as handle:
        if resume is not None and resume.length >= len(SEGMENT_MAGIC):
            index.length = base = resume.length
            index.streams = {name: list(recs) for name, recs in resume.streams.items()}
            handle.seek(base)
        data = handle.read()
    if base == 0:
        if not data.startswith(SEGMENT_MAGIC):
            # killed before the magic reached the disk, or not a segment; a damaged magic has records after it
            _refuse_damage(path, data, 0, 0, "its magic bytes are wrong")
            index.torn = bool(data)
            return index
        offset = len(SEGMENT_MAGIC)
    else:
        offset = 0
    unordered = False
    while offset < len(data):
        decoded = _decode(data, offset)
        if isinstance(decoded, str):
            _refuse_damage(path, data, offset, base, decoded)
            index.torn = True
            break
        record, after = decoded
        recs = index.streams.setdefault(record.stream, [])
        key = id_key(record.entry_id)
        unordered |= bool(recs) and key <= recs[-1][0]  # never with our writer; stay right for other files
        recs.append((key, record.entry_id, base + offset, after - offset))
        offset = after
    index.length = base + offset
    if unordered:
        for recs in index.streams.values():
            recs.sort()
    return index


def _refuse_damage(path: Path, data: bytes, offset: int, base: int, problem: str) -> None:
    """Raise `ArchiveError` when a whole record follows the undecodable bytes at ``offset`` of ``data``.

    ``data`` holds the segment from byte ``base`` on. A torn tail has nothing whole after it; anything
    else is damage that neither the reader nor the archiver may skip or seal over.
    """
    following = _next_record(data, offset + 1)
    if following is None:
        return
    raise ArchiveError(
        f"segment {path} is damaged at offset {base + offset} ({problem}), yet a whole record follows at offset "
        f"{base + following}: this is not the torn tail a crash leaves. Nothing was sealed or truncated. Restore "
        f"{path.name} from a copy, or move it out of {path.parent} to go on without the entries it holds")


class SegmentWriter:
    """Appends records to one new segment file and keeps its index; `seal` writes the index file."""

    def __init__(self, path: Path, number: int) -> None:
        self.path = path
        self.number = number
        self._file = open(path, "xb")  # never reopen an existing segment: its tail may be torn
        self._file.write(SEGMENT_MAGIC)
        self.index = SegmentIndex(number, len(SEGMENT_MAGIC))
        self.closed = False

    @property
    def size(self) -> int:
        return self.index.length

    def append(self, stream: str, entry_id: str, fields: Mapping[bytes, bytes]) -> None:
        key = id_key(entry_id)
        recs = self.index.streams.setdefault(stream, [])
        if recs and key <= recs[-1][0]:
            raise ValueError(f"{stream} entry {entry_id} is not after {recs[-1][1]} in segment {self.number}")
        record = encode_record(stream, entry_id, fields)
        self._file.write(record)
        recs.append((key, entry_id, self.index.length, len(record)))
        self.index.length += len(record)

    def sync(self) -> None:
        """Everything appended so far is on disk when this returns."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def seal(self) -> None:
        """Sync, write the index file next to the segment (atomically), close."""
        if self.closed:
            return
        self.sync()
        self._file.close()
        self.closed = True
        self.index.sealed = True
        write_atomic(self.path.with_suffix(".idx"), self.index.to_json())

    def abandon(self) -> None:
        """Close without sealing (the next archiver start seals it from its bytes)."""
        if not self.closed:
            self._file.close()
            self.closed = True


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a reader or a crash sees the old or the new file whole."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _segment_number(path: Path) -> int | None:
    try:
        return int(path.stem)
    except ValueError:
        return None


def _segment_paths(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for path in (directory / "segments").glob("*.seg"):
        number = _segment_number(path)
        if number is not None:
            found.append((number, path))
    return sorted(found)


def read_meta(directory: Path) -> dict[str, Any] | None:
    try:
        meta = orjson.loads((directory / "meta.json").read_bytes())
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as exc:
        raise ArchiveError(f"{directory / 'meta.json'} is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != ARCHIVE_FORMAT:
        raise ArchiveError(f"{directory} is not a streamgrp archive (meta.json format "
                           f"{meta.get('format') if isinstance(meta, dict) else meta!r}, expected {ARCHIVE_FORMAT})")
    return meta


# -- the archive directory: writing ------------------------------------------------------------------


class ArchiveWriter:
    """The one writer of an archive directory: creates it, locks it, seals what a crashed writer left,
    appends to a new segment, rotates by size, and replaces the snapshot.

    ``append`` buffers in the OS; nothing is durable until `sync` returns. Call `close` to seal the
    last segment; a writer that is killed instead leaves it for the next one to seal.
    """

    def __init__(self, directory: str | os.PathLike[str], *, run: str,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        (self.directory / "segments").mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.directory / "LOCK")
        try:
            meta = read_meta(self.directory)
            if meta is None:
                meta = {"format": ARCHIVE_FORMAT, "run": run, "archive_id": uuid.uuid4().hex}
                write_atomic(self.directory / "meta.json", orjson.dumps(meta))
            elif meta.get("run") != run:
                raise ArchiveError(f"{self.directory} archives run {meta.get('run')!r}, not {run!r}; give each run its "
                                   "own --archive-dir")
            self.meta = meta
            self.sealed_on_start = self._seal_stale()
            numbers = [number for number, _ in _segment_paths(self.directory)]
            self._next_number = (numbers[-1] + 1) if numbers else 1
            self.segment: SegmentWriter | None = None
            self._dirty = False
            self._new_file = False
        except BaseException:
            self._lock.close()
            raise

    @property
    def archive_id(self) -> str:
        return str(self.meta["archive_id"])

    def _seal_stale(self) -> int:
        """Index every segment a killed writer left without one (its torn tail, if any, stays unread).

        A segment damaged before its end raises `ArchiveError` from `scan_segment` and stays unsealed:
        an index would make everything after the damage unreadable for good.
        """
        sealed = 0
        for number, path in _segment_paths(self.directory):
            if not path.with_suffix(".idx").exists():
                index = scan_segment(path, number)
                index.sealed = True
                write_atomic(path.with_suffix(".idx"), index.to_json())
                sealed += 1
        return sealed

    def append(self, stream: str, entry_id: str, fields: Mapping[bytes, bytes]) -> None:
        if self.segment is None:
            path = self.directory / "segments" / f"{self._next_number:08d}.seg"
            self.segment = SegmentWriter(path, self._next_number)
            self._next_number += 1
            self._new_file = True
        self.segment.append(stream, entry_id, fields)
        self._dirty = True

    def sync(self) -> None:
        """Make every appended record durable, then rotate to a new segment when this one is full."""
        if self.segment is None or not self._dirty:
            return
        self.segment.sync()
        if self._new_file:  # the file's directory entry must be durable too
            fsync_dir(self.directory / "segments")
            self._new_file = False
        self._dirty = False
        if self.segment.size >= self.segment_bytes:
            self.segment.seal()
            self.segment = None

    def write_snapshot(self, snapshot: Mapping[str, Any]) -> None:
        write_atomic(self.directory / "snapshot.json", orjson.dumps(snapshot))

    def close(self) -> None:
        """Seal the current segment and release the directory."""
        try:
            if self.segment is not None:
                self.sync()
                if self.segment is not None:
                    self.segment.seal()
                    self.segment = None
        finally:
            self._lock.close()


def _lock(path: Path):
    handle = open(path, "a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"another archiver is writing to {path.parent}; stop it first, or give this one its "
                              "own --archive-dir") from None
        raise
    return handle


# -- the archive directory: reading ------------------------------------------------------------------


class ArchiveReader:
    """Reads an archive directory while an archiver may be appending to it.

    Sealed segments are read through their index files; an unsealed one (being written, or left by a
    killed archiver) is indexed by reading it, up to its last whole record. Each id is served once,
    from the last segment holding it.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_open: int = 32) -> None:
        self.directory = Path(directory)
        meta = read_meta(self.directory)
        if meta is None:
            raise ConfigError(f"{self.directory} is not a streamgrp archive (no meta.json); pass the directory the "
                              "archiver wrote (default <data_dir>/archive/<run>)")
        self.meta = meta
        self._indexes: dict[int, tuple[tuple[bool, int], SegmentIndex]] = {}
        self._open: OrderedDict[int, int] = OrderedDict()
        self._paths: dict[int, Path] = {}
        self._max_open = max_open

    @property
    def run(self) -> str:
        return str(self.meta["run"])

    def close(self) -> None:
        while self._open:
            _, fd = self._open.popitem()
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- indexes --------------------------------------------------------------------------------------

    def segments(self) -> list[SegmentIndex]:
        """Every segment's index, oldest first (unsealed ones re-read when they grew)."""
        out = []
        for number, path in _segment_paths(self.directory):
            self._paths[number] = path
            idx = path.with_suffix(".idx")
            sealed = idx.exists()
            stamp = (sealed, 0 if sealed else path.stat().st_size)
            cached = self._indexes.get(number)
            if cached is None or cached[0] != stamp:
                if sealed:
                    index = _load_index(path, number)
                else:  # being written (or left by a killed archiver): read only what was added since
                    index = scan_segment(path, number, resume=cached[1] if cached is not None else None)
                cached = self._indexes[number] = (stamp, index)
            out.append(cached[1])
        return out

    def streams(self) -> dict[str, int]:
        """Stream name -> distinct ids archived."""
        return {name: sum(1 for _ in self._merged(name, None, None)) for name in
                sorted({name for index in self.segments() for name in index.streams})}

    # -- reading entries ------------------------------------------------------------------------------

    def _read(self, number: int, offset: int, size: int, stream: str, entry_id: str) -> Record:
        """The record the index puts at ``offset``, checked to be whole and to be ``stream``'s ``entry_id``."""
        path = self._paths[number]
        try:
            raw = os.pread(self._fd(number), size, offset)
        except OSError as exc:  # the segment went away or is unreadable since it was indexed
            raise ArchiveError(f"segment {path} cannot be read ({exc}); restore it from a copy") from None
        decoded = _decode(raw, 0)
        if isinstance(decoded, str):
            raise ArchiveError(f"segment {path} is damaged at offset {offset} ({decoded}): the record its index "
                               "points at does not decode; restore the segment from a copy (or, when only its "
                               ".idx file is wrong, delete that and the archiver rebuilds it on its next start)")
        record, end = decoded
        if (record.stream, record.entry_id, end) != (stream, entry_id, size):
            raise _damaged_index(path.with_suffix(".idx"),
                                f"it puts {stream} entry {entry_id} at offset {offset}, where {record.stream} entry "
                                f"{record.entry_id} is")
        return record

    def _fd(self, number: int) -> int:
        """An open descriptor of segment ``number``; at most ``max_open`` stay open, the least recently used close."""
        fd = self._open.get(number)
        if fd is None:
            fd = os.open(self._paths[number], os.O_RDONLY)
            self._open[number] = fd
            if len(self._open) > self._max_open:
                _, old = self._open.popitem(last=False)
                os.close(old)
        else:
            self._open.move_to_end(number)
        return fd

    def get(self, stream: str, ids: Sequence[str]) -> list[Fields | None]:
        """The fields of each id of ``stream``, None where the archive does not hold it."""
        segments = self.segments()
        out: list[Fields | None] = []
        for entry_id in ids:
            key = id_key(entry_id)
            found = None
            for index in reversed(segments):  # the last copy wins
                recs = index.streams.get(stream)
                if not recs or not recs[0][0] <= key <= recs[-1][0]:
                    continue
                at = bisect.bisect_left(recs, (key,))
                if at < len(recs) and recs[at][0] == key:
                    found = self._read(index.number, recs[at][2], recs[at][3], stream, entry_id).fields
                    break
            out.append(found)
        return out

    def _merged(self, stream: str, after: str | None, before: str | None) -> Iterator[tuple[IdKey, str, int, int, int]]:
        """(key, id, segment, offset, size) of each distinct id in (after, before), in id order."""
        low = id_key(after) if after is not None else None
        high = id_key(before) if before is not None else None
        runs = []
        for index in self.segments():
            recs = index.streams.get(stream)
            if not recs:
                continue
            if (low is not None and recs[-1][0] <= low) or (high is not None and recs[0][0] >= high):
                continue
            start = bisect.bisect_right(recs, (low, "\uffff")) if low is not None else 0
            stop = bisect.bisect_left(recs, (high,)) if high is not None else len(recs)
            runs.append(_run(recs[start:stop], index.number))
        previous = None
        for key, negative, entry_id, offset, size in heapq.merge(*runs):
            if key == previous:
                continue
            previous = key
            yield key, entry_id, -negative, offset, size

    def scan(self, stream: str, *, after: str | None = None, before: str | None = None) -> Iterator[tuple[str, Fields]]:
        """Every entry of ``stream`` with an id strictly between ``after`` and ``before``, in id order, once."""
        for _, entry_id, number, offset, size in self._merged(stream, after, before):
            yield entry_id, self._read(number, offset, size, stream, entry_id).fields

    def copies(self, stream: str) -> Iterator[tuple[str, int, Fields]]:
        """Every stored copy of every entry (duplicates included), segment by segment: for checking an archive."""
        for index in self.segments():
            for _, entry_id, offset, size in index.streams.get(stream, ()):
                yield entry_id, index.number, self._read(index.number, offset, size, stream, entry_id).fields

    # -- the snapshot ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any] | None:
        try:
            return orjson.loads((self.directory / "snapshot.json").read_bytes())
        except FileNotFoundError:
            return None
        except orjson.JSONDecodeError as exc:
            raise ArchiveError(f"{self.directory / 'snapshot.json'} is damaged ({exc}); the archiver rewrites it "
                               "when it next catches up") from None


def _load_index(path: Path, number: int) -> SegmentIndex:
    """The checked index of sealed segment ``number`` at ``path``; an unreadable one raises `ArchiveError`."""
    idx = path.with_suffix(".idx")
    try:
        segment_size = path.stat().st_size
        index_size = idx.stat().st_size
        if index_size > _max_index_bytes(segment_size):  # refuse before reading a huge file into memory
            raise _damaged_index(idx, f"{index_size} bytes, too large for a {segment_size}-byte segment")
        raw = idx.read_bytes()
    except OSError as exc:
        raise ArchiveError(f"segment index {idx} cannot be read ({exc}); delete it and the archiver rebuilds it from "
                           "its segment on the next start") from None
    return SegmentIndex.from_json(raw, idx, number=number, segment_size=segment_size)


def _max_index_bytes(segment_size: int) -> int:
    # Each indexed record costs the index its id and two numbers, and each stream its name twice and a
    # summary; the record itself holds a 16-byte prefix, its stream name and id. Four times the segment
    # is room to spare for any index the writer makes, and still bounds what a reader loads.
    return 4 * segment_size + 1024 * 1024


def _run(recs: list[tuple[IdKey, str, int, int]], number: int) -> Iterator[tuple[IdKey, int, str, int, int]]:
    # -number: for equal keys the later segment sorts first, and the first copy of a key wins
    for key, entry_id, offset, size in recs:
        yield key, -number, entry_id, offset, size


def last_ids(indexes: Iterable[SegmentIndex]) -> dict[str, str]:
    """Each stream's highest archived id over ``indexes``."""
    out: dict[str, tuple[IdKey, str]] = {}
    for index in indexes:
        for name, recs in index.streams.items():
            if recs and (name not in out or recs[-1][0] > out[name][0]):
                out[name] = (recs[-1][0], recs[-1][1])
    return {name: entry_id for name, (_, entry_id) in out.items()}

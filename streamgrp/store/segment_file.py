"""One archive segment file on disk: appending to it, sealing it, and indexing it by reading it. No server.

The format of its bytes is `streamgrp.store.segment_format`. Invariants the reader relies on, and
that `SegmentWriter` (with `streamgrp.store.archive_writer.ArchiveWriter`) keeps:

- within one segment one stream's ids strictly increase: a segment is written by one archiver process
  in stream order, and every start of an archiver opens a new segment;
- a record that is incomplete or fails its checksum ends what is readable of a segment: the torn
  write of an archiver killed mid-append, only ever at the end of the segment it was writing. A
  damaged record that a whole record follows is therefore not a torn write but damage (a bad disk,
  an edit, a copy gone wrong): reading or sealing past it would lose every record after it for good,
  so it raises `ArchiveError` and the file is left as it is;
- a sealed segment's index file is loaded only when its size is plausible for its segment, then
  checked in full (`SegmentIndex.from_json`).

Also owns the durable-write helpers every archive file uses (`write_atomic`, `fsync_dir`). Knows
nothing of the archive directory around the segment, of Redis, or of what the entries mean.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from streamgrp.errors import ArchiveError
from streamgrp.store.private import open_private
from streamgrp.store.segment_format import (
    RECORD_MAGIC,
    SEGMENT_MAGIC,
    SegmentIndex,
    damaged_index_error,
    decode_record_or_problem,
    encode_record,
    id_key,
)

__all__ = ["SegmentWriter", "fsync_dir", "load_index", "scan_segment", "write_atomic"]


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
        decoded = decode_record_or_problem(data, offset)
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


def _next_record(buffer: bytes, start: int) -> int | None:
    """The offset of the first whole, checksummed record at or after ``start``, if any.

    Only used after a record failed to decode, to tell a torn tail (nothing whole after it) from
    damage in the middle. Candidates are found by their magic; a false one is cheap to reject
    because its lengths must fit the buffer and its checksum must match.
    """
    at = buffer.find(RECORD_MAGIC, start)
    while at != -1:
        if not isinstance(decode_record_or_problem(buffer, at), str):
            return at
        at = buffer.find(RECORD_MAGIC, at + 1)
    return None


def load_index(path: Path, number: int) -> SegmentIndex:
    """The checked index of sealed segment ``number`` at ``path``; an unreadable one raises `ArchiveError`."""
    idx = path.with_suffix(".idx")
    try:
        segment_size = path.stat().st_size
        index_size = idx.stat().st_size
        if index_size > _max_index_bytes(segment_size):  # refuse before reading a huge file into memory
            raise damaged_index_error(idx, f"{index_size} bytes, too large for a {segment_size}-byte segment")
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


class SegmentWriter:
    """Appends records to one new segment file and keeps its index; `seal` writes the index file."""

    def __init__(self, path: Path, number: int) -> None:
        self.path = path
        self.number = number
        self._file = open_private(path, "xb")  # never reopen an existing segment: its tail may be torn
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
    with open_private(partial, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make ``directory``'s entries durable: a file created or renamed in it survives a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

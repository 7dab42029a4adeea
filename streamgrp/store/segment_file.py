"""One archive segment file on disk: appending to it, sealing it, and indexing it by reading it. No server.

The format of its bytes is `streamgrp.store.segment_format`. Invariants the reader relies on, and
that `SegmentWriter` (with `streamgrp.store.archive_writer.ArchiveWriter`) keeps:

- within one segment one stream's ids strictly increase: a segment is written by one archiver process
  in stream order, and every start of an archiver opens a new segment;
- a record that is incomplete or fails its checksum ends what is readable of a segment: the torn
  write of an archiver killed mid-append, only ever at the end of the segment it was writing. A
  damaged record that a whole record follows is therefore not a torn write but damage (a bad disk,
  an edit, a copy gone wrong): reading or sealing past it would lose every record after it for good,
  so it raises `ArchiveError` and the file is left as it is. So does a record that passes its
  checksum but does not decode, wherever it is: no crash writes one;
- a sealed segment's index file is loaded only when its size is plausible for its segment, then
  checked in full (`SegmentIndex.from_json`);
- segments and indexes are read only as regular files, never through a link, never past their size
  at open (`streamgrp.store.archive_files`): a link to ``/dev/zero``, a FIFO or a sparse file of
  gigabytes raises `ArchiveError` or costs only its written bytes, never ``MemoryError`` or a hang.

Also owns the durable-write helpers every archive file uses (`write_atomic`, `fsync_dir`). Knows
nothing of the archive directory around the segment, of Redis, or of what the entries mean.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from streamgrp.errors import ArchiveError
from streamgrp.store.archive_files import RegularFile, regular_size
from streamgrp.store.private import open_private
from streamgrp.store.segment_format import (
    PREFIX_SIZE,
    RECORD_MAGIC,
    SEGMENT_MAGIC,
    Record,
    SegmentIndex,
    Undecodable,
    damaged_index_error,
    decode_at,
    encode_record,
    id_key,
    record_size,
)

__all__ = ["SegmentWriter", "fsync_dir", "load_index", "scan_segment", "write_atomic"]

#: Bytes read at a time while indexing a segment or searching it for a record: what a scan holds in
#: memory besides the record it decodes, whatever the segment's size.
_WINDOW = 8 * 1024 * 1024


def scan_segment(path: Path, number: int, *, resume: SegmentIndex | None = None) -> SegmentIndex:
    """Index a segment by reading it; stops at a torn tail, raises `ArchiveError` at damage before the end.

    A record that does not decode is a torn tail when nothing whole follows it (a crash mid-append);
    when a whole record does follow, it is damage, and nothing is returned that a caller could seal.
    A record that passes its checksum but does not decode is damage wherever it is.

    ``resume``: an index of the same segment taken earlier; only the bytes after its readable part
    are read (a segment being written only grows, and its torn tail may since have been completed).

    Reads the file a window at a time, never past the size it had when opened, so a huge (or
    sparse) file costs time in proportion to its written bytes and memory in proportion to its
    largest record; a link or special file is refused (`streamgrp.store.archive_files`).
    """
    index = SegmentIndex(number, 0)
    with RegularFile(path, "segment") as file:
        source = _Window(file)
        if resume is not None and resume.length >= len(SEGMENT_MAGIC):
            if file.size < resume.length:
                raise ArchiveError(
                    f"segment {path} shrank to {file.size} bytes after {resume.length} were read from "
                    "it: it was replaced or truncated under the reader. Restore it from a copy"
                )
            index.length = offset = resume.length
            index.streams = {name: list(recs) for name, recs in resume.streams.items()}
        elif file.read(0, len(SEGMENT_MAGIC)) != SEGMENT_MAGIC:
            # killed before the magic reached the disk, or not a segment; a damaged magic has records after it
            _refuse_damage(source, path, 0, Undecodable("its magic bytes are wrong"))
            index.torn = file.size > 0
            return index
        else:
            offset = len(SEGMENT_MAGIC)
        unordered = False
        while offset < file.size:
            decoded = source.record(offset)
            if isinstance(decoded, Undecodable):
                _refuse_damage(source, path, offset, decoded)
                index.torn = True
                break
            record, after = decoded
            recs = index.streams.setdefault(record.stream, [])
            key = id_key(record.entry_id)
            unordered |= bool(recs) and key <= recs[-1][0]  # never with our writer; stay right for other files
            recs.append((key, record.entry_id, offset, after - offset))
            offset = after
    index.length = offset
    if unordered:
        for recs in index.streams.values():
            recs.sort()
    return index


class _Window:
    """A segment's bytes, read a window at a time from its `RegularFile`: what `scan_segment` decodes."""

    def __init__(self, file: RegularFile) -> None:
        self.file = file
        self._start = 0
        self._data = b""

    def _view(self, offset: int, length: int) -> memoryview:
        end = min(offset + length, self.file.size)
        if not (self._start <= offset and end <= self._start + len(self._data)):
            self._data = self.file.read(offset, max(end - offset, _WINDOW))
            self._start = offset
        at = offset - self._start
        return memoryview(self._data)[at : at + end - offset]

    def record(self, offset: int) -> tuple[Record, int] | Undecodable:
        """The record at ``offset`` and the offset after it, or what is wrong there; reads only what it declares."""
        size = record_size(self._view(offset, PREFIX_SIZE))
        if isinstance(size, Undecodable):
            return size
        if offset + size > self.file.size:
            return Undecodable(f"the record's {size - PREFIX_SIZE} bytes run past the end of the file")
        decoded = decode_at(self._view(offset, size), 0)
        if isinstance(decoded, Undecodable):
            return decoded
        return decoded[0], offset + decoded[1]


def _refuse_damage(source: _Window, path: Path, offset: int, problem: Undecodable) -> None:
    """Raise `ArchiveError` unless the undecodable bytes at ``offset`` are a torn tail.

    A torn tail is incomplete or fails its checksum, and has nothing whole after it; anything else
    is damage that neither the reader nor the archiver may skip or seal over.
    """
    restore = (
        f"Nothing was sealed or truncated. Restore {path.name} from a copy, or move it out of {path.parent} to "
        "go on without the entries it holds"
    )
    if problem.whole:
        raise ArchiveError(
            f"segment {path} is damaged at offset {offset} ({problem.problem}): no crash writes such a "
            f"record, so it was altered. {restore}"
        )
    following = _next_record(source, offset + 1)
    if following is None:
        return
    raise ArchiveError(
        f"segment {path} is damaged at offset {offset} ({problem.problem}), yet a whole record follows at offset "
        f"{following}: this is not the torn tail a crash leaves. {restore}"
    )


def _next_record(source: _Window, start: int) -> int | None:
    """The offset of the first whole, checksummed record at or after ``start``, if any.

    Only used after a record failed to decode, to tell a torn tail (nothing whole after it) from
    damage in the middle. Candidates are found by their magic, a window at a time, skipping the
    holes of a sparse file; a false one is cheap to reject because its lengths must fit the file
    and its checksum must match.
    """
    file = source.file
    at: int | None = start
    while at is not None:
        at = file.data_from(at)
        if at is None:
            return None
        chunk = file.read(at, _WINDOW)
        hit = chunk.find(RECORD_MAGIC)
        while hit != -1:
            if not isinstance(source.record(at + hit), Undecodable):
                return at + hit
            hit = chunk.find(RECORD_MAGIC, hit + 1)
        if at + len(chunk) >= file.size:
            return None
        at += len(chunk) - (len(RECORD_MAGIC) - 1)  # a magic across the window's end is found in the next one
    return None


def load_index(path: Path, number: int) -> SegmentIndex:
    """The checked index of sealed segment ``number`` at ``path``; an unreadable one raises `ArchiveError`."""
    idx = path.with_suffix(".idx")
    try:
        segment_size = regular_size(path, "segment")
        with RegularFile(idx, "segment index") as file:
            if file.size > _max_index_bytes(segment_size):  # refuse before reading a huge file into memory
                raise damaged_index_error(idx, f"{file.size} bytes, too large for a {segment_size}-byte segment")
            raw = file.read_all()
    except OSError as exc:
        raise ArchiveError(
            f"segment index {idx} cannot be read ({exc}); delete it and the archiver rebuilds it from "
            "its segment on the next start"
        ) from None
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
    # Created afresh (O_EXCL): a link left at the partial name is removed, never written through.
    partial.unlink(missing_ok=True)
    with open_private(partial, "xb") as handle:
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

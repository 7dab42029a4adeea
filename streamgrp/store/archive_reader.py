"""Reading a run's archive directory (`streamgrp.store.archive_layout`), also while an archiver appends to it.

Finds entries by stream and id range over all segments. An id can be in several segments after a
crash (the archiver copies again what it had written but not yet recorded as progress); the bytes
are the same, and the copy in the later segment wins. Every record read is checked to be whole and
to be the entry its index names, and every file is read as `streamgrp.store.archive_files` says: a
regular file, never through a link, never past its size. Whatever is wrong raises `ArchiveError`
naming the file (and, in a segment, the offset).

Owns finding and reading entries and the snapshot; knows nothing of Redis or of what the entries
mean (`streamgrp.store.sources.ArchiveSource` serves them to replay).
"""

from __future__ import annotations

import bisect
import heapq
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from streamgrp.errors import ArchiveError, ConfigError
from streamgrp.store.archive_files import RegularFile
from streamgrp.store.archive_layout import read_meta, segment_paths
from streamgrp.store.segment_file import load_index, scan_segment
from streamgrp.store.segment_format import (
    Fields,
    IdKey,
    Record,
    SegmentIndex,
    damaged_index_error,
    decode_record_or_problem,
    id_key,
)

__all__ = ["ArchiveReader", "last_ids"]


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
            raise ConfigError(
                f"{self.directory} is not a streamgrp archive (no meta.json); pass the directory the "
                "archiver wrote (default <data_dir>/archive/<run>)"
            )
        self.meta = meta
        self._indexes: dict[int, tuple[tuple[bool, int], SegmentIndex]] = {}
        self._open: OrderedDict[int, RegularFile] = OrderedDict()
        self._paths: dict[int, Path] = {}
        self._max_open = max_open

    @property
    def run(self) -> str:
        return str(self.meta["run"])

    def close(self) -> None:
        while self._open:
            _, file = self._open.popitem()
            file.close()

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
        for number, path in segment_paths(self.directory):
            self._paths[number] = path
            # lexists and lstat: a link is not followed here; opening it is refused (archive_files)
            sealed = os.path.lexists(path.with_suffix(".idx"))
            stamp = (sealed, 0 if sealed else _size(path))
            cached = self._indexes.get(number)
            if cached is None or cached[0] != stamp:
                if sealed:
                    index = load_index(path, number)
                else:  # being written (or left by a killed archiver): read only what was added since
                    index = scan_segment(path, number, resume=cached[1] if cached is not None else None)
                cached = self._indexes[number] = (stamp, index)
            out.append(cached[1])
        return out

    def streams(self) -> dict[str, int]:
        """Stream name -> distinct ids archived."""
        return {
            name: sum(1 for _ in self._merged(name, None, None))
            for name in sorted({name for index in self.segments() for name in index.streams})
        }

    # -- reading entries ------------------------------------------------------------------------------

    def _read(self, number: int, offset: int, size: int, stream: str, entry_id: str) -> Record:
        """The record the index puts at ``offset``, checked to be whole and to be ``stream``'s ``entry_id``."""
        path = self._paths[number]
        # Never past the indexed record (which lies inside the segment's sealed or scanned length),
        # nor past the file's size when it was opened.
        file = self._file(number)
        if offset + size > file.size:  # a segment being written grew since it was opened: look at it again
            self._open.pop(number).close()
            file = self._file(number)
        raw = file.read(offset, size)
        decoded = decode_record_or_problem(raw, 0)
        if isinstance(decoded, str):
            raise ArchiveError(
                f"segment {path} is damaged at offset {offset} ({decoded}): the record its index "
                "points at does not decode; restore the segment from a copy (or, when only its "
                ".idx file is wrong, delete that and the archiver rebuilds it on its next start)"
            )
        record, end = decoded
        if (record.stream, record.entry_id, end) != (stream, entry_id, size):
            raise damaged_index_error(
                path.with_suffix(".idx"),
                f"it puts {stream} entry {entry_id} at offset {offset}, where {record.stream} "
                f"entry {record.entry_id} is",
            )
        return record

    def _file(self, number: int) -> RegularFile:
        """Segment ``number``, open; at most ``max_open`` stay open, the least recently used close."""
        file = self._open.get(number)
        if file is None:
            path = self._paths[number]
            try:
                file = RegularFile(path, "segment")
            except FileNotFoundError:  # gone since it was indexed
                raise ArchiveError(f"segment {path} is gone since it was indexed; restore it from a copy") from None
            self._open[number] = file
            if len(self._open) > self._max_open:
                _, old = self._open.popitem(last=False)
                old.close()
        else:
            self._open.move_to_end(number)
        return file

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
        """The snapshot the archiver took when it last caught up, checked to have the shape readers use."""
        path = self.directory / "snapshot.json"
        try:
            with RegularFile(path, "snapshot") as file:
                snapshot = orjson.loads(file.read_all())
        except FileNotFoundError:
            return None
        except orjson.JSONDecodeError as exc:
            raise _damaged_snapshot(path, str(exc)) from None
        problem = _snapshot_problem(snapshot)
        if problem is not None:
            raise _damaged_snapshot(path, problem)
        return snapshot


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0  # gone since it was listed: opening it says so


def _damaged_snapshot(path: Path, problem: str) -> ArchiveError:
    return ArchiveError(
        f"{path} is damaged ({problem}); delete it and the archiver rewrites it when it next catches up"
    )


def _strings(values: Any) -> bool:
    return isinstance(values, dict) and all(isinstance(value, str) for value in values.values())


def _consumer_groups(infos: Any) -> bool:
    return isinstance(infos, list) and all(
        isinstance(info, dict) and isinstance(info.get("last_delivered", ""), str) for info in infos
    )


def _snapshot_problem(snapshot: Any) -> str | None:
    """What in a snapshot is not the shape `streamgrp.services.archiver` writes, as far as readers rely on it."""
    if not isinstance(snapshot, dict):
        return f"it holds a JSON {type(snapshot).__name__}, not an object"
    hashes = snapshot.get("hashes", {})
    if not (isinstance(hashes, dict) and all(_strings(values) for values in hashes.values())):
        return "its 'hashes' are not objects of strings"
    groups = snapshot.get("groups", {})
    if not (isinstance(groups, dict) and all(_consumer_groups(infos) for infos in groups.values())):
        return "its 'groups' are not lists of consumer groups"
    return None


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

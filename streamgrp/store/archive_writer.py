"""Writing a run's archive directory (`streamgrp.store.archive_layout`): the one archiver that may, at a time.

Creates the directory and its ``meta.json``, holds its ``LOCK``, seals the segments a killed writer
left, appends to a new segment on every start (so one stream's ids strictly increase within a
segment), rotates segments by size, and replaces the snapshot. Knows nothing of Redis or of what the
entries mean: `streamgrp.services.archiver` decides what to append and when to sync.
"""

from __future__ import annotations

import errno
import fcntl
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from streamgrp.errors import ArchiveError, ConfigError
from streamgrp.store.archive_files import open_lock
from streamgrp.store.archive_layout import ARCHIVE_FORMAT, read_meta, segment_paths
from streamgrp.store.private import private_dir
from streamgrp.store.segment_file import (
    SegmentWriter,
    fsync_dir,
    scan_segment,
    write_atomic,
)

__all__ = ["DEFAULT_SEGMENT_BYTES", "ArchiveWriter"]

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024


class ArchiveWriter:
    """The one writer of an archive directory: creates it, locks it, seals what a crashed writer left,
    appends to a new segment, rotates by size, and replaces the snapshot.

    ``append`` buffers in the OS; nothing is durable until `sync` returns. Call `close` to seal the
    last segment; a writer that is killed instead leaves it for the next one to seal.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, run: str, segment_bytes: int = DEFAULT_SEGMENT_BYTES
    ) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        private_dir(self.directory / "segments")  # 0700: an archive holds every prompt and sample
        self._lock = _lock(self.directory / "LOCK")
        try:
            meta = read_meta(self.directory)
            if meta is None:
                meta = {"format": ARCHIVE_FORMAT, "run": run, "archive_id": uuid.uuid4().hex}
                write_atomic(self.directory / "meta.json", orjson.dumps(meta))
            elif meta.get("run") != run:
                raise ArchiveError(
                    f"{self.directory} archives run {meta.get('run')!r}, not {run!r}; give each run its "
                    "own --archive-dir"
                )
            self.meta = meta
            self.sealed_on_start = self._seal_stale()
            numbers = [number for number, _ in segment_paths(self.directory)]
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
        for number, path in segment_paths(self.directory):
            if not os.path.lexists(path.with_suffix(".idx")):  # a link there is refused by readers, not replaced
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
    """Hold ``path`` locked for as long as the returned file is open; a second writer is refused at once."""
    handle = os.fdopen(open_lock(path, os.O_RDWR | os.O_CREAT), "r+b")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise ConfigError(
                f"another archiver is writing to {path.parent}; stop it first, or give this one its own --archive-dir"
            ) from None
        raise
    return handle

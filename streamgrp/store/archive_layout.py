"""Where a run's archive lives and what its directory holds; the writer and the reader both follow it. No server.

One directory per run (``<data_dir>/archive/<run>`` by default)::

    meta.json               {"format": "streamgrp.archive/1", "run": RUN, "archive_id": HEX}
    LOCK                    flock'ed by the one archiver writing here
    segments/00000001.seg   records, appended in the order the archiver read them
    segments/00000001.idx   written when the segment is sealed: each stream's first and last id, record offsets
    snapshot.json           the run's hashes and consumer-group positions when the archiver last caught up

Owns the names of those files and reading ``meta.json``; what a segment holds is
`streamgrp.store.segment_format`, writing the directory `streamgrp.store.archive_writer`, reading it
`streamgrp.store.archive_reader`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from streamgrp.errors import ArchiveError
from streamgrp.store.archive_files import RegularFile

__all__ = ["ARCHIVE_FORMAT", "default_archive_dir", "read_meta", "segment_paths"]

ARCHIVE_FORMAT = "streamgrp.archive/1"
#: ``meta.json`` holds a format, a run name and an id: far below this.
_MAX_META_BYTES = 64 * 1024


def default_archive_dir(data_dir: str | os.PathLike[str], run: str) -> Path:
    """Where an archiver writes a run's archive by default, and where readers look for it."""
    return Path(data_dir) / "archive" / run


def segment_paths(directory: Path) -> list[tuple[int, Path]]:
    """(number, path) of every segment file of the archive at ``directory``, oldest first."""
    found = []
    for path in (directory / "segments").glob("*.seg"):
        number = _segment_number(path)
        if number is not None:
            found.append((number, path))
    return sorted(found)


def _segment_number(path: Path) -> int | None:
    try:
        return int(path.stem)
    except ValueError:
        return None


def read_meta(directory: Path) -> dict[str, Any] | None:
    """The archive's ``meta.json``; None when there is none (not an archive, or not one yet)."""
    try:
        with RegularFile(directory / "meta.json", "archive record") as file:
            meta = orjson.loads(file.read_all(limit=_MAX_META_BYTES))
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as exc:
        raise ArchiveError(f"{directory / 'meta.json'} is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != ARCHIVE_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise ArchiveError(
            f"{directory} is not a streamgrp archive (meta.json format {found!r:.80}, expected {ARCHIVE_FORMAT})"
        )
    if not isinstance(meta.get("run"), str) or not isinstance(meta.get("archive_id"), str):
        raise ArchiveError(f"{directory / 'meta.json'} is damaged (no run name or archive id); restore it from a copy")
    return meta

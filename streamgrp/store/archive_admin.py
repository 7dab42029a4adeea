"""A run's archive directory as a whole: its size on disk, whether an archiver is writing it, removing it.

Owns what `streamgrp runs --sizes` and `streamgrp delete --delete-archive` do to archives
(`streamgrp.store.archive_layout` says what a directory holds): summing its files, probing its
``LOCK`` without taking it from a live archiver, and removing a directory only after its
``meta.json`` names the run it is asked to remove, while holding that lock so no archiver starts
writing into it meanwhile. Deliberately ignores what the segments hold and the server.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

from streamgrp.errors import ArchiveError, ConfigError
from streamgrp.store.archive_files import open_lock
from streamgrp.store.archive_layout import read_meta
from streamgrp.store.keys import check_run_name

__all__ = ["archive_bytes", "archive_in_use", "archived_runs", "remove_archive"]


def archive_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes of every file under ``directory`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue  # a segment an archiver replaced meanwhile
    return total


def archive_in_use(directory: str | os.PathLike[str]) -> bool:
    """True while an archiver holds the directory's ``LOCK`` (`streamgrp.store.archive_writer`)."""
    try:
        # No O_CREAT: probing must not leave a LOCK file in a directory that has none.
        fd = open_lock(Path(directory) / "LOCK", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    finally:
        os.close(fd)  # closing drops the probe's shared lock too
    return False


def archived_runs(data_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Run name -> archive directory, for every archive at the default place under ``data_dir``."""
    found = {}
    root = Path(data_dir) / "archive"
    for directory in sorted(root.iterdir()) if root.is_dir() else ():
        try:
            meta = read_meta(directory)
        except (ArchiveError, OSError):
            continue  # not an archive (or a damaged one): listed by nothing, removed by nobody
        if meta is not None and isinstance(meta.get("run"), str):
            found[meta["run"]] = directory
    return found


def remove_archive(directory: str | os.PathLike[str], run: str, *, force: bool = False) -> int:
    """Remove the archive of ``run`` at ``directory``; the bytes it held.

    Refuses (`ConfigError`) a directory that is not an archive, or is another run's, and one an
    archiver is writing unless ``force``: removing files under a live writer would leave it appending
    to segments nobody can find."""
    check_run_name(run)
    directory = Path(directory)
    meta = read_meta(directory)
    if meta is None:
        raise ConfigError(f"{directory} is not a streamgrp archive (no meta.json); nothing removed")
    if meta.get("run") != run:
        raise ConfigError(f"{directory} is the archive of run {meta.get('run')!r}, not {run!r}; nothing removed")
    size = archive_bytes(directory)
    fd = open_lock(directory / "LOCK", os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            if not force:
                raise ConfigError(f"an archiver is writing {directory}; stop it first (or pass --force)") from None
        shutil.rmtree(directory)
    finally:
        os.close(fd)
    return size

"""Opening an archive's files for reading: regular files only, never through a symbolic link, never
blocking, and never reading past what the file held when it was opened. No server.

An archive directory is copied, restored and moved around by hand, so what sits at a segment's,
an index's or ``meta.json``'s name is not necessarily what the archiver wrote there. A symbolic
link to ``/dev/zero`` would make a whole-file read allocate until ``MemoryError``; a FIFO would
block the first ``open`` forever; a device or a directory is no archive file either. Every file is
therefore opened with ``O_NOFOLLOW`` (a link is refused, whatever it points at) and ``O_NONBLOCK``
(a FIFO opens at once, and is then refused by ``fstat``), and only a regular file is read, never
past the size ``fstat`` gave at open: a file that grows meanwhile is read up to that size, one that
shrinks comes back short, which the record checks then report as damage.

Owns that rule and the `ArchiveError` for a file that breaks it; what the bytes mean is
`streamgrp.store.segment_format`'s. Directories given by the user (``--archive DIR``) may be links:
only the files inside are checked.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from streamgrp.errors import ArchiveError

__all__ = ["RegularFile", "open_lock", "regular_size"]

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: One pread(2) moves at most this much on Linux; larger reads are split.
_MAX_PREAD = 1 << 30


class RegularFile:
    """A regular file opened for reading; ``size`` is its size when opened, and no read goes past it.

    ``what`` names the file in errors (``segment``, ``segment index``...). A symbolic link, a FIFO,
    a device, a socket or a directory raises `ArchiveError` saying what to put there instead; a
    missing file raises `FileNotFoundError` (callers decide whether that is normal); any other
    ``OSError`` (permissions) raises `ArchiveError` naming the file.
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        try:
            self.fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _refused(path, what, exc) from None
        try:
            info = os.fstat(self.fd)
            if not stat.S_ISREG(info.st_mode):
                raise _not_regular(path, what, _kind(info.st_mode))
        except BaseException:
            os.close(self.fd)
            raise
        self.size = info.st_size

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)``, cut at ``size``; shorter when the file shrank since it was opened."""
        length = max(0, min(length, self.size - offset))
        parts, done = [], 0
        try:
            while done < length:
                part = os.pread(self.fd, min(length - done, _MAX_PREAD), offset + done)
                if not part:
                    break
                parts.append(part)
                done += len(part)
        except OSError as exc:
            raise ArchiveError(
                f"{self.what} {self.path} cannot be read ({exc.strerror}); restore it from a copy"
            ) from None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_all(self, *, limit: int | None = None) -> bytes:
        """The whole file as it was at open; `ArchiveError` when it is over ``limit`` bytes."""
        if limit is not None and self.size > limit:
            raise ArchiveError(
                f"{self.what} {self.path} is {self.size} bytes, more than the {limit} such a file can "
                "hold; it is not one streamgrp wrote: restore it from a copy or remove it"
            )
        return self.read(0, self.size)

    def data_from(self, offset: int) -> int | None:
        """The first offset at or after ``offset`` that is not in a hole of a sparse file; None when only holes follow.

        A hole reads as zeros, which hold no record: searching a sparse file for records skips its holes
        instead of reading gigabytes of zeros. Where the file system cannot tell, every offset is data.
        """
        if offset >= self.size:
            return None
        try:
            found = os.lseek(self.fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return None
            return offset
        return found if found < self.size else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> RegularFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def regular_size(path: Path, what: str) -> int:
    """The size of the regular file at ``path`` (a link is refused, not followed); `FileNotFoundError` when absent."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, what, _kind(info.st_mode))
    return info.st_size


def open_lock(path: Path, flags: int) -> int:
    """A descriptor of the archive's ``LOCK`` file opened with ``flags``, which must be a regular file.

    A FIFO there would block a read-only open; a link would make a writer create or lock whatever it
    points at. ``FileNotFoundError`` passes through (a probe without ``O_CREAT`` finds no lock).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _refused(path, "lock file", exc) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _not_regular(path, "lock file", _kind(info.st_mode))
    return fd


def _refused(path: Path, what: str, exc: OSError) -> ArchiveError:
    if exc.errno == errno.ELOOP:
        return _not_regular(path, what, "a symbolic link")
    if exc.errno == errno.ENXIO:
        return _not_regular(path, what, "a socket")
    return ArchiveError(
        f"{what} {path} cannot be opened ({exc.strerror}); fix its permissions or restore it from a copy"
    )


def _not_regular(path: Path, what: str, kind: str) -> ArchiveError:
    fix = (
        "replace the link with a copy of the file it points at"
        if kind == "a symbolic link"
        else "remove it, or restore the file from a copy"
    )
    return ArchiveError(
        f"{what} {path} is {kind}, not a regular file: streamgrp reads only regular files in an "
        f"archive (a link or special file could be endless or block forever); {fix}"
    )


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"

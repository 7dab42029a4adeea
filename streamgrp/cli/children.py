"""Child processes the CLI starts and stops: the embedded server, Prometheus, the demo's roles.

Owns how a child is started (its own session, stdout and stderr appended to a private log file,
stdin closed or a pipe, an environment of its own when given, a umask that keeps what it writes
private, and on Linux ``PR_SET_PDEATHSIG`` so that it ends when its owner dies, even by SIGKILL),
how it is stopped (SIGTERM, then SIGKILL after a timeout; several at once), and reading the tail of
its log for error messages. Nothing here knows what the child is.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from streamgrp.services.parent_death import pdeathsig_preexec
from streamgrp.store.private import open_private


def spawn(
    command: Sequence[str],
    log_path: Path,
    *,
    stdin: int = subprocess.DEVNULL,
    cwd: Path | None = None,
    new_session: bool = True,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``command`` with stdout and stderr appended to ``log_path`` (created ``0600``); raises OSError
    if it cannot run.

    ``new_session``: a Ctrl-C typed in the owner's terminal reaches only the owner, which then stops
    the child cleanly. ``env`` replaces the environment: how a secret reaches a child, since its
    argument list is readable by every user of the machine (``/proc/PID/cmdline``)."""
    with open_private(log_path, "ab") as log:
        return subprocess.Popen(
            list(command),
            stdin=stdin,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=new_session,
            preexec_fn=pdeathsig_preexec(),
        )


def stop(process: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    """SIGTERM, wait ``timeout`` seconds, then SIGKILL. True if it ended on SIGTERM (or had already ended)."""
    if process is None or process.poll() is not None:
        return True
    process.terminate()
    try:
        process.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False


def stop_all(processes: Sequence[subprocess.Popen[bytes] | None], timeout: float) -> list[bool]:
    """`stop` for several processes at once: SIGTERM to every one, then ``timeout`` seconds in all for them to
    end, then SIGKILL to the rest. One True per process that ended on SIGTERM (or had already ended).

    Together, not one by one: stopping N processes costs one timeout, not N, and data-parallel peers
    stop on the same step instead of one waiting in a collective for another that is already gone."""
    for process in processes:
        if process is not None and process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout
    clean = []
    for process in processes:
        if process is None:
            clean.append(True)
            continue
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
            clean.append(True)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            clean.append(False)
    return clean


def log_tail(path: Path, lines: int, *, offset: int = 0, empty: str = "") -> str:
    """The last ``lines`` lines of ``path`` after byte ``offset``; ``empty`` if there are none."""
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    kept = text.strip().splitlines()[-lines:]
    return "\n".join(kept) if kept else empty


def free_port(host: str) -> int:
    """A TCP port nothing listens on now, for a child to listen on soon (a race is reported as such).

    Chosen below the kernel's ephemeral range: a port from ``bind(0)`` is free again once this returns,
    and the kernel hands ephemeral ports to every other socket that binds 0 meanwhile (gloo's
    connections, clients), which then took the child's port now and then on a busy machine. A port
    below the range is only ever taken by someone who chose it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(_CHOSEN_FROM, low) if low > _CHOSEN_FROM + 1000 else 0
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue  # someone listens there: another one
            return int(sock.getsockname()[1])
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


#: The lowest port `free_port` chooses (above the well-known and most registered services' ports).
_CHOSEN_FROM = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:  # a zombie is dead, just not reaped yet
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True

"""Children that end with their owner: a preexec_fn asking Linux to signal a child when the process (the
thread) that started it dies, even by SIGKILL, so no child outlives the role that owns it (the CLI's
children, weight-sync's llama-server)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
#: Children create what they write for their owner only (a server's append-only file, a TSDB).
CHILD_UMASK = 0o077


def pdeathsig_preexec(signum: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn giving the child the private umask (`CHILD_UMASK`) and, on Linux, asking the kernel to
    send it ``signum`` (SIGTERM: it ends cleanly) when its parent dies.

    The kernel sends it when the *thread* that started the child exits, so start long-lived children
    from a thread that lives as long as they should (normally the main thread)."""
    prctl = None
    if sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork, not in the child
        except (OSError, AttributeError):
            prctl = None
    parent = os.getpid()

    def preexec() -> None:
        os.umask(CHILD_UMASK)
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:  # the owner died before prctl took effect
            os._exit(1)

    return preexec

"""Stopping child processes together: one timeout for all, SIGKILL only for the ones that ignore SIGTERM."""

from __future__ import annotations

import subprocess
import time

from streamgrp.cli.children import stop_all


def _start(script: str) -> subprocess.Popen:
    # `exec sleep` leaves no shell behind; the trap keeps a shell that ignores SIGTERM alive until SIGKILL.
    return subprocess.Popen(["bash", "-c", script], stdin=subprocess.DEVNULL)


def test_stop_all_terminates_together_and_kills_only_what_ignores_sigterm():
    polite = [_start("exec sleep 60") for _ in range(3)]
    stubborn = _start("trap '' TERM; while :; do sleep 0.05; done")
    time.sleep(0.3)  # let the trap be installed
    began = time.monotonic()
    clean = stop_all([*polite, None, stubborn], timeout=1.0)
    took = time.monotonic() - began
    assert clean == [True, True, True, True, False]
    assert 1.0 <= took < 3.0, took  # one timeout for all of them, not one each
    assert all(p.returncode is not None for p in [*polite, stubborn])
    assert stubborn.returncode == -9


def test_stop_all_leaves_finished_processes_alone():
    done = _start("exit 3")
    done.wait()
    assert stop_all([done], timeout=1.0) == [True] and done.returncode == 3

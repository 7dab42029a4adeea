"""Real OS processes of streamgrp roles for crash tests: start, SIGKILL, restart, reap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class RoleProcess:
    """One `python -m streamgrp ROLE ...` child with its output in a log file."""

    def __init__(self, role: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.role = role
        self.args = args
        self.log_dir = log_dir
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> RoleProcess:
        self.starts += 1
        log_path = self.log_dir / f"{self.role}-{self.starts}.log"
        with open(log_path, "wb") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "streamgrp", "--log-level", "INFO", self.role, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: no cleanup runs, nothing is released."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{self.role}-*.log")))


def wait_until(condition, *, timeout: float, interval: float = 0.05, message: str = "condition"):
    """The condition's first true value, polled every ``interval`` seconds; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")

"""Stop signals, as a script delivers them: `streamgrp demo` and every long-running role, started in the
background by a non-interactive shell (``bash -c 'streamgrp demo & wait'``), which starts them with SIGINT
ignored.

- the demo exits 130 on SIGINT and 143 on SIGTERM, and no process it started survives it: its roles, the
  embedded server it started and its Prometheus (checked by pid and start time in ``/proc``, and by the
  shell's session);
- each role (server, worker, assembler, batcher, trainer, archiver) stops on SIGINT and on SIGTERM, in
  its loop, and exits 0: a requested stop of a service is not a failure (``streamgrp.cli.roles``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from processes import wait_until

from streamgrp.cli.children import free_port
from streamgrp.config import RunConfig
from streamgrp.store.runs import join_run

on_valkey = pytest.mark.parametrize("server_kind", ["valkey"], indirect=True)
STOPS = pytest.mark.parametrize(
    "signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)


@dataclass(frozen=True)
class Proc:
    """A process as /proc shows it; pid and start time together name it even if the pid is reused."""

    pid: int
    start: int
    sid: int
    command: str

    def alive(self) -> bool:
        now = _proc(self.pid)
        return now is not None and now.start == self.start and _state(self.pid) not in ("Z", "X")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _state(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def _proc(pid: int) -> Proc | None:
    fields = _stat_fields(pid)
    if fields is None:
        return None
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        command = ""
    # fields[0] is the state (field 3 of stat): ppid is field 4, session 6, starttime 22
    return Proc(pid, int(fields[19]), int(fields[3]), command.strip())


def _all() -> list[Proc]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (proc := _proc(int(entry.name))) is not None:
            found.append(proc)
    return found


def _descendants(root: int) -> list[Proc]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        for child in parents.get(frontier.pop(), []):
            if (proc := _proc(child)) is not None:
                found.append(proc)
                frontier.append(child)
    return found


def _assert_background_jobs_ignore_sigint() -> None:
    """The premise: a Python started as a script's background job finds SIGINT ignored (and so installs no
    KeyboardInterrupt handler of its own)."""
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    shown = subprocess.run(
        ["bash", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)} & wait"],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert shown.stdout.strip() == "True", shown


class Backgrounded:
    """``bash -c 'python -m streamgrp ARGS & echo $!; wait $!'`` in a session of its own: the shell runs
    streamgrp as a background job (SIGINT ignored), prints its pid, and exits with its exit code."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        command = shlex.join([sys.executable, "-m", "streamgrp", *args])
        with open(log_path, "wb") as log:
            script = f"{command} >>{shlex.quote(str(log_path))} 2>&1 & echo $!; wait $!"
            self.shell = subprocess.Popen(
                ["bash", "-c", script],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                text=True,
            )
        with self.shell.stdout:  # the shell prints nothing after the pid
            self.pid = int(self.shell.stdout.readline())

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout: float) -> int:
        return self.shell.wait(timeout=timeout)

    def kill(self) -> None:
        """Teardown after a failure: everything in the shell's session (roles included)."""
        if self.shell.poll() is None:
            try:
                os.killpg(self.shell.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.shell.wait()


# -- the demo --------------------------------------------------------------------------------------------


@pytest.mark.slow
@STOPS
def test_the_demo_started_by_a_script_stops_everything_and_exits_128_plus_the_signal(tmp_path, signum, code):
    _assert_background_jobs_ignore_sigint()
    prometheus = ["--prometheus"] if shutil.which("prometheus") else []
    demo = Backgrounded(
        [
            "--log-level",
            "INFO",
            "demo",
            "--data-dir",
            str(tmp_path),
            "--steps",
            "500",
            "--workers",
            "2",
            "--ranks",
            "2",
            "--timeout-s",
            "300",
            *prometheus,
        ],
        tmp_path / "demo.log",
    )
    try:
        # every role in its loop: both ranks have trained a step
        wait_until(
            lambda: (
                all("step 0:" in p.read_text(errors="replace") for p in tmp_path.glob("logs/*/trainer-*.log"))
                and len(list(tmp_path.glob("logs/*/trainer-*.log"))) == 2
                or demo.shell.poll() is not None
            ),
            timeout=180,
            message="both trainer ranks to train a step",
            interval=0.2,
        )
        assert demo.shell.poll() is None, demo.output()
        started = _descendants(demo.pid)
        commands = " ".join(p.command for p in started)
        for role in ("batcher", "assembler", "worker", "trainer", "valkey-server", *["prometheus"][: len(prometheus)]):
            assert role in commands, f"no {role} among the demo's processes: {commands}"
        assert len(started) == 6 + 1 + len(prometheus)  # 6 roles, the server, Prometheus

        demo.signal(signum)
        assert demo.wait(timeout=60) == code, demo.output()
    finally:
        demo.kill()
    assert "interrupted; every process it started was stopped" in demo.output()  # its own exit, not the signal's
    survivors = [p for p in started if p.alive()]
    survivors += [p for p in _all() if p.sid == demo.shell.pid and p.alive()]  # its roles' session
    assert survivors == [], survivors
    # the ranks stopped between steps: each logged its last commit on the way out (a rank SIGKILLed after the
    # stop timeout logs nothing more), and no step was failed by it. (No bound on the seconds: a busy
    # machine stretches a clean stop too.)
    for log in tmp_path.glob("logs/*/trainer-*.log"):
        text = log.read_text(errors="replace")
        assert "committed" in text.splitlines()[-1] and "failed" not in text, text[-2000:]


# -- the roles -------------------------------------------------------------------------------------------

#: The line each role logs once it is in its loop, and the one it logs after a clean stop.
ROLES = {
    "server": ("serving", "stopping server pid"),
    "worker": ("joined run", "finished 0 tasks"),
    "assembler": ("joined run", "wrote 0 decisions"),
    "batcher": ("joined run", "is running after 0 steps"),
    "trainer": ("joined run", "committed 0 steps"),
    "archiver": ("writing to", "entries archived"),
}


@on_valkey
@STOPS
def test_every_role_started_by_a_script_stops_on_the_signal_and_exits_0(
    client, redis_url, run_name, tmp_path, signum, code
):
    _assert_background_jobs_ignore_sigint()
    join_run(client, run_name, RunConfig(n_samples=2))
    common = ["--redis-url", redis_url, "--run", run_name]
    args = {
        "server": ["--data-dir", str(tmp_path / "server"), "--port", str(free_port("127.0.0.1"))],
        "worker": [*common, "--rollout", "streamgrp.consumers.toy_task:rollout"],
        "assembler": common,
        "batcher": common,
        "trainer": common,
        "archiver": [*common, "--archive-dir", str(tmp_path / "archive")],
    }
    roles = {role: Backgrounded(["--log-level", "INFO", role, *args[role]], tmp_path / f"{role}.log") for role in ROLES}
    try:
        for role, process in roles.items():
            wait_until(
                lambda p=process, r=role: ROLES[r][0] in p.output() or p.shell.poll() is not None,
                timeout=120,
                message=f"the {role} to start",
                interval=0.2,
            )
            assert process.shell.poll() is None, f"{role} exited:\n{process.output()}"
        time.sleep(0.5)  # in the loop, past the line that said so
        for process in roles.values():
            process.signal(signum)
        codes = {role: process.wait(timeout=30) for role, process in roles.items()}
    finally:
        for process in roles.values():
            process.kill()
    assert codes == dict.fromkeys(ROLES, 0), {r: roles[r].output()[-1500:] for r, c in codes.items() if c}
    for role, process in roles.items():
        assert ROLES[role][1] in process.output(), f"{role} did not stop cleanly:\n{process.output()[-1500:]}"

"""`streamgrp demo` end to end: real processes, a real server, and a summary whose accounting adds up."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamgrp.core import codec

pytestmark = pytest.mark.slow

DEMO = ["--steps", "6", "--workers", "2", "--ranks", "2", "--json", "--timeout-s", "240"]


def _demo(redis_url, tmp_path, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamgrp",
            "demo",
            "--redis-url",
            redis_url,
            "--data-dir",
            str(tmp_path),
            *DEMO,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check_accounting(summary, steps=6, ranks=2):
    assert summary["steps"] == steps
    assert sum(summary["groups"].values()) == summary["tasks_decided"] <= summary["tasks"]
    accounted = sum(summary["slots"][k] for k in ("sample", "rejected", "failed", "duplicate", "late", "invalid"))
    # the demo stops the assembler once the last step is trained: results published after that are
    # unread or belong to groups still open, and never more than the undecided tasks could hold
    assert accounted + summary["slots"]["unread"] + summary["slots"]["open"] == summary["slots_published"]
    assert 0 <= summary["slots"]["open"] <= (summary["tasks"] - summary["tasks_decided"]) * 6
    assert summary["groups"]["dropped"] == sum(
        v for k, v in summary["dropped_reasons"].items() if k not in ("stale", "filtered", "leftover")
    )
    folded = summary["slots"]["sample"] + summary["slots"]["rejected"] + summary["slots"]["failed"]
    target = folded + summary["slots"]["timeout"]
    assert summary["usable_slot_yield"] == pytest.approx(summary["slots"]["sample"] / target)
    assert 0 < summary["trainable_slot_yield"] <= summary["usable_slot_yield"] <= 1
    assert summary["committed_steps"] == {str(rank): steps for rank in range(ranks)}
    assert summary["reward_first"] is not None and summary["reward_last"] is not None


def test_demo_runs_every_role_and_its_summary_adds_up(redis_url, tmp_path):
    demo = _demo(redis_url, tmp_path)
    out, err = demo.communicate(timeout=300)
    assert demo.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    _check_accounting(summary)
    assert "reward" in out and "streamgrp replay" in out
    assert "step 6/6" in err
    assert summary["slots"]["rejected"] + summary["slots"]["failed"] > 0  # injected failures happened
    assert summary["groups"]["partial"] > 0
    # The README's sample output is what the demo prints, figures aside.
    printed = [_shape(line) for line in out.splitlines()[:-1]]
    assert printed == _readme_sample(), "update the sample output at the top of README.md"


def _shape(line: str) -> str:
    """A summary line with its figures and the run's name replaced, and padding collapsed."""
    line = re.sub(r"demo-\d{8}-\d{6}", "RUN", line)
    line = re.sub(r"\d+(\.\d+)?", "N", line)
    line = line.split(" --run RUN", 1)[0]  # where the data is (--redis-url, --data-dir) depends on the run
    line = " ".join(line.split())
    return "drop reasons ..." if line.startswith("drop reasons") else line  # which reasons occurred varies


def _readme_sample() -> list[str]:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("at the end it prints:\n\n```\n", 1)[1].split("```", 1)[0]
    return [_shape(line) for line in block.splitlines()]


@pytest.mark.one_server_kind
def test_demo_survives_a_killed_worker_with_correct_accounting(redis_url, tmp_path):
    demo = _demo(redis_url, tmp_path, "--steps", "8")
    try:
        worker = _wait_for_child(demo.pid, "worker", timeout=60)
        time.sleep(3.0)  # let it take work
        os.kill(worker, signal.SIGKILL)
        out, err = demo.communicate(timeout=300)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, err
    assert "worker" in err and "take over" in err
    _check_accounting(json.loads(out.strip().splitlines()[-1]), steps=8)


@pytest.mark.one_server_kind
def test_a_failing_trainer_stops_everything_and_names_the_role(redis_url, tmp_path):
    demo = _demo(redis_url, tmp_path, "--trainer-fail-at-step", "2")
    out, err = demo.communicate(timeout=300)
    assert demo.returncode == 2
    assert "trainer" in err and "failed with exit code" in err
    assert "injected fault" in err
    children = [pid for pid in _children(demo.pid)]
    assert children == []


def _children(parent: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.append(int(stat.parent.name))
    return pids


def _wait_for_child(parent: int, role: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in _children(parent):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if role.encode() in cmdline:
                return pid
        time.sleep(0.1)
    raise AssertionError(f"no {role} child of {parent} within {timeout}s")


def test_no_password_in_any_log_printed_line_argv_record_or_metric(tmp_path):
    """A demo on its own embedded server with a password: the password must show up nowhere but where it is
    needed (the children's environment)."""
    import shutil
    import urllib.request

    from streamgrp.store.runs import connect, latest_run, open_run

    password = "pw-" + os.urandom(8).hex()
    data = tmp_path / "data"
    prometheus = ["--prometheus"] if shutil.which("prometheus") else []
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamgrp",
            "demo",
            "--data-dir",
            str(data),
            "--steps",
            "4",
            "--workers",
            "1",
            "--ranks",
            "2",
            "--timeout-s",
            "240",
            *prometheus,
        ],
        env={**os.environ, "STREAMGRP_PASSWORD": password},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    argvs, metrics = [], []
    try:
        while demo.poll() is None:
            for pid in _descendants(demo.pid):
                try:
                    argvs.append(Path(f"/proc/{pid}/cmdline").read_bytes())
                except OSError:
                    pass
            for target in data.glob("logs/*/prometheus/targets.json"):
                metrics += _scrape(target, urllib.request)
            time.sleep(0.5)
        out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, err
    assert argvs and (metrics or not prometheus)
    files = {path: path.read_bytes() for path in data.rglob("*") if path.is_file()}
    assert any(path.name == "server.log" for path in files) and any(path.suffix == ".log" for path in files)
    from streamgrp.cli.server_reuse import (
        ensure_server,  # the record: the same data again, with the password
    )

    with ensure_server(None, data, password=password) as handle:
        client = connect(handle.url)
        record = open_run(client, latest_run(client)).record
        client.close()
    secret = password.encode()
    leaks = [f"argv {argv!r}" for argv in argvs if secret in argv]
    leaks += [f"file {path}" for path, content in files.items() if secret in content]
    leaks += [f"metrics {text[:80]!r}" for text in metrics if password in text]
    leaks += [f"printed {name}" for name, text in (("stdout", out), ("stderr", err)) if password in text]
    leaks += ["the recorded configuration"] if secret in codec.encode(record)[codec.HEADER] else []
    assert leaks == []
    assert oct(data.stat().st_mode & 0o777) == "0o700"
    assert all(path.stat().st_mode & 0o077 == 0 for path in files if path.suffix in (".log", ".json", ".jsonl"))


def _descendants(parent: int) -> list[int]:
    found, frontier = [], [parent]
    while frontier:
        children = _children(frontier.pop())
        found += children
        frontier += children
    return found


def _scrape(targets_file: Path, request) -> list[str]:
    try:
        targets = json.loads(targets_file.read_text())
    except (OSError, ValueError):
        return []
    texts = []
    for group in targets:
        for address in group["targets"]:
            try:
                with request.urlopen(f"http://{address}/metrics", timeout=1) as response:
                    texts.append(response.read().decode())
            except OSError:
                pass
    return texts

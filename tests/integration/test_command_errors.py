"""A command someone typed fails within seconds, in one line, when the server is not there or the URL is not
one (issue: errors that say what to do); services keep riding outages for --outage-budget-s."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from streamgrp.cli.children import free_port


def _streamgrp(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "streamgrp", *args], capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


@pytest.mark.parametrize("command", [["runs"], ["steps"], ["verify"], ["report", "--out", "/dev/null"]])
def test_a_one_shot_command_gives_up_on_an_absent_server_within_its_command_budget(command):
    url = f"redis://127.0.0.1:{free_port('127.0.0.1')}/0"  # nothing listens there
    done, seconds = _streamgrp(*command, "--redis-url", url, "--command-budget-s", "2")
    assert done.returncode == 2, done.stderr
    assert seconds < 20, f"took {seconds:.1f}s"  # the budget, the interpreter's start and a margin for a busy machine
    last = done.stderr.strip().splitlines()[-1]
    assert url in last and "raise --command-budget-s" in last and "Traceback" not in done.stderr


def test_the_default_command_budget_is_seconds_not_the_services_five_minutes():
    from streamgrp.config import ConnectionConfig

    assert ConnectionConfig().command_budget_s <= 10 < ConnectionConfig().outage_budget_s


def test_a_url_that_is_not_a_redis_url_is_one_line_naming_the_schemes():
    done, _ = _streamgrp("steps", "--redis-url", "http://127.0.0.1:6379/0")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "streamgrp steps: invalid [connection] settings: redis_url: Value error, 'http://127.0.0.1:6379/0' is not a "
        "Redis URL: give redis://HOST:PORT/DB, rediss://HOST:PORT/DB (TLS) or unix:///PATH"
    ]


def test_a_trainer_for_a_run_that_does_not_exist_says_so_lists_the_runs_and_stops_with_0(redis_url, make_run, tmp_path):
    import signal

    from processes import RoleProcess, wait_until

    existing = make_run(n_samples=2)  # the run that does exist: listed, so a typo in the name shows
    trainer = RoleProcess("trainer", ["--redis-url", redis_url, "--run", "no-such-run"], tmp_path)
    trainer.start()
    try:
        wait_until(
            lambda: "waits for run no-such-run to be created by its batcher" in trainer.output(),
            timeout=60,
            message="the trainer to say what it waits for",
        )
        line = next(line for line in trainer.output().splitlines() if "waits for run no-such-run" in line)
        assert "runs on this server: " in line and existing.name in line.split("runs on this server: ")[1]
    finally:
        trainer.proc.send_signal(signal.SIGTERM)
        code = trainer.proc.wait(timeout=30)
    assert code == 0, trainer.output()[-2000:]

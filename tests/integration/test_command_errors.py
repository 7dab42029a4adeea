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
        "Redis URL: give redis://HOST:PORT/DB, rediss://HOST:PORT/DB (TLS) or unix:///PATH"]

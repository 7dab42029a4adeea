"""Every role rides out a server that stops answering and one that dies and comes back on its data.

(a) Outage: the server is SIGSTOPped for 15 s mid-run (longer than the 10 s socket timeout, so
    every role's reads time out), then SIGKILLed and restarted on the same port
    and AOF. No role exits; the run finishes; every SPEC section 5 check holds; `verify` passes.
(b) Chaos: at least 20 SIGKILLs spread over every role, and two server SIGKILL-restarts with
    appendfsync always. Only killed processes exit; the same checks hold afterwards.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from pipeline import CHILD_ENV, Pipeline, check_run, events, write_dataset
from processes import wait_until

from streamgrp.cli.children import free_port
from streamgrp.config import RunConfig
from streamgrp.core.events import RunFinished
from streamgrp.store.keys import WORKERS_GROUP
from streamgrp.store.runs import connect, join_run

pytestmark = pytest.mark.slow

RUN = dict(n_samples=4, dp_size=2, batch_size=4, max_staleness=2)
RUN_FLAGS = ["--n-samples", "4", "--dp-size", "2", "--batch-size", "4", "--max-staleness", "2"]


def _finished(client, run) -> bool:
    return bool(events(client, run.keys.control, RunFinished))


def _verify(url: str, run_name: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamgrp", "verify", "--redis-url", url, "--run", run_name],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **CHILD_ENV},
    )


def _finish_and_check(client, run, pipeline: Pipeline, url: str, *, prompts: int) -> int:
    """Wait for the run to end with every live role still up, stop them, and check SPEC section 5."""

    def done() -> bool:
        assert not [e for e in pipeline.exited() if not e.startswith(("batcher", "trainer"))], pipeline.exited()
        return _finished(client, run) and pipeline.trainers_done()

    wait_until(done, timeout=180, interval=0.5, message="the run to finish")
    assert pipeline.batcher.proc.wait(timeout=30) == 0, pipeline.batcher.output()[-3000:]
    wait_until(
        lambda: client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0,
        timeout=30,
        message="every task acknowledged",
    )
    codes = pipeline.stop()
    assert set(codes.values()) == {0}, codes  # SIGTERM is a clean stop for every role
    n_steps = check_run(client, run, prompts=prompts)
    report = _verify(url, run.name)
    assert report.returncode == 0, report.stdout + report.stderr
    return n_steps


def _outage_warnings(output: str) -> int:
    return output.count("is unavailable")


@pytest.mark.one_server_kind
def test_every_role_rides_out_a_paused_then_killed_and_restarted_server(server_factory, run_name, tmp_path):
    port = free_port("127.0.0.1")
    server = server_factory(tmp_path / "data", port=port)
    url = server.url
    client = connect(url)
    run = join_run(client, run_name, RunConfig(**RUN))
    prompts = 160
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts, tokens=16, reject_rate=0.1, sleep_s=0.01)
    pipeline = Pipeline(url, run_name, tmp_path, dataset, RUN_FLAGS, dp_size=2)
    pipeline.start()
    try:
        wait_until(lambda: client.xlen(run.keys.steps) >= 4, timeout=60, message="the run to be under way")
        assert not _finished(client, run)
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(15)
        assert not pipeline.exited(), pipeline.exited()
        server.kill()  # SIGKILL delivered to a stopped process ends it; no SIGCONT first
        time.sleep(2)
        assert not pipeline.exited(), pipeline.exited()
        server = server_factory(tmp_path / "data", port=port)
        client = connect(url)
        n_steps = _finish_and_check(client, run, pipeline, url, prompts=prompts)
    finally:
        pipeline.stop()
    assert n_steps >= prompts // 4 - 5
    for role in pipeline.roles:
        out = role.output()
        # one warning per outage, not one per attempt; every role saw the outage and said it was over
        assert 1 <= _outage_warnings(out) <= 3, (role.role, out[-3000:])
        assert "answers again" in out, (role.role, out[-3000:])
        assert "Traceback" not in out, (role.role, out[-3000:])


def test_chaos_twenty_role_kills_and_two_server_restarts_lose_and_double_nothing(server_factory, run_name, tmp_path):
    port = free_port("127.0.0.1")
    server = server_factory(tmp_path / "data", port=port, appendfsync="always")
    url = server.url
    client = connect(url)
    run = join_run(client, run_name, RunConfig(**RUN))
    prompts = 240
    dataset = write_dataset(
        tmp_path / "prompts.jsonl", prompts, tokens=16, reject_rate=0.1, fail_rate=0.05, sleep_s=0.02
    )
    pipeline = Pipeline(url, run_name, tmp_path, dataset, RUN_FLAGS, dp_size=2)
    rng = random.Random(31)
    kills: dict[str, int] = {}
    pipeline.start()
    try:
        wait_until(lambda: client.xlen(run.keys.steps) >= 2, timeout=60, message="the run to be under way")
        # each role twice, then random roles; the server restarts after the 7th and 14th kill
        schedule = [role for role in pipeline.roles for _ in range(2)]
        rng.shuffle(schedule)
        schedule += [rng.choice(pipeline.roles) for _ in range(20 - len(schedule) + 2)]
        for number, role in enumerate(schedule, 1):
            time.sleep(rng.uniform(0.3, 1.2))
            assert not pipeline.exited(), pipeline.exited()
            assert not _finished(client, run), f"the run finished after {number - 1} kills; make it longer"
            role.kill()
            kills[role.role] = kills.get(role.role, 0) + 1
            role.start()
            if number in (7, 14):
                server.kill()
                time.sleep(rng.uniform(0.5, 2.0))
                server = server_factory(tmp_path / "data", port=port, appendfsync="always")
                client = connect(url)
        assert sum(kills.values()) >= 20
        assert {r.role for r in pipeline.roles} <= kills.keys()
        _finish_and_check(client, run, pipeline, url, prompts=prompts)
    finally:
        pipeline.stop()

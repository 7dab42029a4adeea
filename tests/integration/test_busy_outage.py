"""A server answering BUSY (a script looping past the time limit, as any credential allowed to run one
can cause) is ridden like an outage on real servers: commands wait with backoff within the outage
budget and go on once the script is killed; roles do not exit. Also what the embedded server sets
against it (a script time limit, a memory cap under noeviction), and a server that comes back
configured to evict keys, refused on reconnect.

The busy script runs from its own connection in a thread; SCRIPT KILL from another one ends it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import redis
from pipeline import CHILD_ENV, Pipeline, check_run, events, write_dataset
from processes import wait_until

from streamgrp.cli.children import free_port
from streamgrp.cli.server_config import SCRIPT_TIME_LIMIT_MS
from streamgrp.config import RunConfig
from streamgrp.core.events import RunFinished
from streamgrp.errors import ConfigError, OutageBudgetExceeded
from streamgrp.store.connection import SOCKET_TIMEOUT_S, connect, is_outage, outage_of
from streamgrp.store.keys import WORKERS_GROUP
from streamgrp.store.runs import join_run

LOOP = "while true do end"


class BusyServer:
    """Makes the server at ``url`` answer BUSY: a looping script from a connection of its own, until `kill`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ended: list[str] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        runner = redis.Redis.from_url(self.url, socket_timeout=None)
        try:
            runner.eval(LOOP, 0)
        except redis.ResponseError as exc:  # "Script killed by user with SCRIPT KILL"
            self.ended.append(str(exc))
        finally:
            runner.close()

    def __enter__(self) -> BusyServer:
        self._thread.start()
        probe = redis.Redis.from_url(self.url)

        def busy() -> bool:
            try:
                probe.ping()
            except redis.ResponseError as exc:
                return str(exc).startswith("BUSY")
            return False

        wait_until(busy, timeout=20, interval=0.05, message="the server to answer BUSY")
        probe.close()
        return self

    def kill(self) -> None:
        admin = redis.Redis.from_url(self.url)
        admin.script_kill()
        admin.close()
        self._thread.join(timeout=20)
        assert not self._thread.is_alive() and self.ended, "SCRIPT KILL did not end the busy script"

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self.kill()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_embedded_server_caps_memory_under_noeviction_and_limits_script_time(server_factory):
    server = server_factory(maxmemory="256mb")
    config = redis.Redis.from_url(server.url, decode_responses=True).config_get("*")
    assert config["maxmemory"] == str(256 * 1024**2)
    assert config["maxmemory-policy"] == "noeviction"
    assert config["busy-reply-threshold"] == str(SCRIPT_TIME_LIMIT_MS)
    default = server_factory()  # 50% of the machine by default: a cap, never none
    assert int(redis.Redis.from_url(default.url, decode_responses=True).config_get("maxmemory")["maxmemory"]) > 0


def test_commands_wait_through_busy_and_run_once_the_script_is_killed(server_factory, caplog):
    server = server_factory()
    plain = redis.Redis.from_url(server.url)
    client = connect(server.url, outage_budget_s=60)
    done: list[float] = []

    def write() -> None:
        client.xadd("s", {"k": "v"})  # a plain command
        pipe = client.pipeline(transaction=True)  # a transaction: BUSY comes back annotated per command
        pipe.xadd("s", {"k": "w"})
        pipe.hset("h", "f", "1")
        pipe.execute()
        client.eval("return redis.call('XADD', KEYS[1], '*', 'k', 'x')", 1, "s")  # a script
        done.append(time.monotonic())

    with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"), BusyServer(server.url) as busy:
        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        time.sleep(2.0)
        assert writer.is_alive() and not done, "a command returned (or raised) while the server was busy"
        killed_at = time.monotonic()
        busy.kill()
        writer.join(timeout=15)
    assert done and done[0] - killed_at < 5
    assert plain.xlen("s") == 3 and plain.hget("h", "f") == b"1"  # each write once
    messages = _warnings(caplog)
    assert sum("is unavailable (" in m and "BUSY" in m for m in messages) == 1, messages
    assert sum("answers again" in m for m in messages) == 1, messages


def test_a_role_read_that_meets_busy_is_an_outage_it_rides_out(server_factory):
    server = server_factory()
    client = connect(server.url, outage_budget_s=60)
    client.xgroup_create("s", "g", id="0", mkstream=True)
    client.xadd("s", {"k": "v"})
    with BusyServer(server.url) as busy:
        # XREADGROUP is never sent again by the client (a lost reply would strand entries): the role
        # gets the error, which must count as an outage, and waits for the server (its role loop).
        with pytest.raises(redis.ResponseError) as raised:
            client.xreadgroup("g", "c", {"s": ">"}, count=10)
        assert is_outage(raised.value)
        rode_out = threading.Event()
        waiter = threading.Thread(
            target=lambda: (outage_of(client).ride_out(raised.value, client), rode_out.set()), daemon=True
        )
        waiter.start()
        assert not rode_out.wait(1.5), "the wait ended while the server was still busy"
        busy.kill()
        assert rode_out.wait(15)
    reply = client.xreadgroup("g", "c", {"s": ">"}, count=10)
    assert len(reply[0][1]) == 1  # resumes: the entry is delivered once, now


def test_busy_longer_than_the_outage_budget_ends_with_the_budget_error(server_factory):
    server = server_factory()
    client = connect(server.url, outage_budget_s=1.5)
    with BusyServer(server.url):
        started = time.monotonic()
        with pytest.raises(OutageBudgetExceeded, match=r"outage budget of 1.5s \(last error ResponseError: BUSY"):
            client.set("k", "v")
        assert 1.5 <= time.monotonic() - started < 6


def test_a_server_that_comes_back_evicting_keys_is_refused_on_reconnect(server_factory, kind_binary, tmp_path):
    port = free_port("127.0.0.1")
    server = server_factory(port=port)
    client = connect(server.url)
    client.set("k", "v")
    server.stop()
    # The same address comes back as a server configured to evict (restarted by hand, say).
    evicting = subprocess.Popen(
        [
            kind_binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            "64mb",
            "--maxmemory-policy",
            "allkeys-lru",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        probe = redis.Redis(port=port)
        wait_until(lambda: _answers(probe), timeout=20, message="the evicting server to answer")
        with pytest.raises(ConfigError, match=r"evicts keys \(maxmemory-policy allkeys-lru\)"):
            client.get("k")
        with pytest.raises(ConfigError, match="evicts keys"):
            client.get("k")  # every new connection checks, not only the first after the outage
    finally:
        evicting.terminate()
        evicting.wait(timeout=10)


def _answers(probe: redis.Redis) -> bool:
    try:
        return bool(probe.ping())
    except redis.ConnectionError:
        return False


@pytest.mark.slow
@pytest.mark.one_server_kind
def test_every_role_waits_while_a_script_holds_the_server_and_the_run_finishes_after_script_kill(
    server_factory, run_name, tmp_path
):
    server = server_factory(tmp_path / "data")
    client = connect(server.url)
    run = join_run(client, run_name, RunConfig(n_samples=4, dp_size=2, batch_size=4, max_staleness=2))
    prompts = 120
    dataset = write_dataset(tmp_path / "prompts.jsonl", prompts, tokens=16, reject_rate=0.1, sleep_s=0.01)
    pipeline = Pipeline(
        server.url,
        run_name,
        tmp_path,
        dataset,
        ["--n-samples", "4", "--dp-size", "2", "--batch-size", "4", "--max-staleness", "2"],
        dp_size=2,
    )
    pipeline.start()
    try:
        wait_until(lambda: client.xlen(run.keys.steps) >= 3, timeout=60, message="the run to be under way")
        with BusyServer(server.url) as busy:
            # Longer than the clients' 10 s socket timeout: a role blocked in a read when the script began
            # times out too, and then meets BUSY like the roles that sent a command meanwhile.
            time.sleep(SOCKET_TIMEOUT_S + 3)
            assert not pipeline.exited(), pipeline.exited()
            busy.kill()

        def done() -> bool:
            assert not [e for e in pipeline.exited() if not e.startswith(("batcher", "trainer"))], pipeline.exited()
            return bool(events(client, run.keys.control, RunFinished)) and pipeline.trainers_done()

        wait_until(done, timeout=180, interval=0.5, message="the run to finish")
        assert pipeline.batcher.proc.wait(timeout=30) == 0, pipeline.batcher.output()[-3000:]
        wait_until(
            lambda: client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0,
            timeout=30,
            message="every task acknowledged",
        )
        codes = pipeline.stop()
        assert set(codes.values()) == {0}, codes
        check_run(client, run, prompts=prompts)
        report = subprocess.run(
            [sys.executable, "-m", "streamgrp", "verify", "--redis-url", server.url, "--run", run_name],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **CHILD_ENV},
        )
        assert report.returncode == 0, report.stdout + report.stderr
    finally:
        pipeline.stop()
    for role in pipeline.roles:  # each waited: one warning when it met the busy server, one when it answered
        out = role.output()
        assert "Traceback" not in out, (role.role, out[-3000:])
        assert "is unavailable" in out and "answers again" in out, (role.role, out[-3000:])
    assert sum("BUSY" in role.output() for role in pipeline.roles) >= 2, "no role met the BUSY reply itself"

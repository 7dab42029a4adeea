"""`streamgrp.store.connection` against real servers: settings that lose data are refused or warned
about at connect, a full noeviction server is waited out, replicas are waited for, a lease is
taken again by its own holder, and a process stopped while the server is gone exits quietly."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import redis
from processes import RoleProcess, wait_until

from streamgrp.config import RunConfig
from streamgrp.errors import ConfigError, OutageBudgetExceeded
from streamgrp.store.connection import connect
from streamgrp.store.lease import Lease
from streamgrp.store.runs import join_run


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_server_that_evicts_keys_is_refused_naming_the_setting(server_factory):
    server = server_factory()
    redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(ConfigError, match=r"evicts keys \(maxmemory-policy allkeys-lru\).*noeviction"):
        connect(server.url)
    redis.Redis.from_url(server.url).config_set("maxmemory-policy", "noeviction")
    connect(server.url).ping()


def test_a_server_that_does_not_persist_is_warned_about(server_factory, caplog):
    server = server_factory(appendonly=False)
    with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"):
        connect(server.url)
    [warning] = _warnings(caplog)
    assert "does not keep an append-only file (appendonly no)" in warning and "CONFIG SET appendonly yes" in warning
    caplog.clear()
    persisted = server_factory(appendfsync="no")
    with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"):
        connect(persisted.url)
    [warning] = _warnings(caplog)
    assert "appendfsync no" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"):
        connect(server_factory(appendfsync="always").url)
    assert _warnings(caplog) == []


def test_a_full_noeviction_server_is_waited_out_and_nothing_is_written_twice(server_factory, caplog):
    server = server_factory()
    plain = redis.Redis.from_url(server.url)
    used = int(plain.info("memory")["used_memory"])
    plain.config_set("maxmemory", used // 2)  # full already: every write is refused until it is raised
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        plain.set("k", "v")
    client = connect(server.url)
    assert any("uses" in w and "maxmemory" in w for w in _warnings(caplog))
    done: list = []

    def write() -> None:
        client.xadd("s", {"k": "v"})  # a plain command
        client.eval("return redis.call('XADD', KEYS[1], '*', 'k', 'v')", 1, "s")  # a script's OOM reply
        done.append(True)

    with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"):
        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        time.sleep(1.5)
        assert writer.is_alive() and not done, "a write to a full server returned instead of waiting"
        assert plain.xlen("s") == 0
        plain.config_set("maxmemory", 0)
        writer.join(timeout=10)
    assert done and plain.xlen("s") == 2
    messages = _warnings(caplog)
    assert any("is unavailable (OutOfMemoryError: command not allowed" in m for m in messages), messages
    assert sum("answers again" in m for m in messages) == 1


def test_wait_replicas_waits_for_a_replica_and_warns_when_too_few_confirm(server_factory, caplog):
    # WAITAOF (Valkey, Redis >= 7.2) waits for the replica's fsync: with appendfsync always that is at once
    primary, replica = server_factory(), server_factory(appendfsync="always")
    # the full sync starts at once, not after the default 5 s wait for more replicas to sync together
    redis.Redis.from_url(primary.url).config_set("repl-diskless-sync-delay", 0)
    replica_client = redis.Redis.from_url(replica.url)
    replica_client.replicaof(primary.host, primary.port)
    wait_until(
        lambda: replica_client.info("replication").get("master_link_status") == "up",
        timeout=20,
        message="the replica to sync",
    )
    client = connect(primary.url, wait_replicas=1, wait_timeout_ms=5000)
    with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"):
        for i in range(20):
            client.set(f"k{i}", i)
            client.wait_for_replicas()
            assert replica_client.get(f"k{i}") == str(i).encode()  # on the replica once wait_for_replicas returns
    assert _warnings(caplog) == []
    too_many = connect(primary.url, wait_replicas=2, wait_timeout_ms=2000)  # room for a loaded machine
    with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"):
        too_many.set("k", 1)
        too_many.wait_for_replicas()
    assert "only 1 of 2 replicas confirmed a write within 2000 ms" in _warnings(caplog)


def test_an_outage_longer_than_the_budget_raises_one_clear_error(server_factory, caplog):
    server = server_factory()
    client = connect(server.url, outage_budget_s=1.0)
    server.kill()
    with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"):
        with pytest.raises(OutageBudgetExceeded, match="over the outage budget of 1s"):
            client.get("k")
    assert sum("is unavailable" in m for m in _warnings(caplog)) == 1


def test_the_lease_holder_takes_its_own_lease_again(client, run_name):
    key = f"{run_name}:lease"
    holder, other = Lease(client, key, "a", ttl_s=5), Lease(client, key, "b", ttl_s=5)
    assert holder.acquire()
    client.pexpire(key, 300)
    assert holder.acquire(), "the holder (whose SET reply was lost, say) could not take its own lease again"
    assert client.pttl(key) > 1000  # and taking it again renewed it
    assert not other.acquire()


def test_a_role_stopped_while_the_server_is_gone_exits_quietly(server_factory, run_name, tmp_path):
    server = server_factory()
    join_run(redis.Redis.from_url(server.url), run_name, RunConfig(n_samples=2))
    (tmp_path / "worker").mkdir()
    worker = RoleProcess("worker", ["--redis-url", server.url, "--run", run_name], tmp_path / "worker").start()
    try:
        wait_until(
            lambda: "waiting for tasks" in worker.output() or "worker" in worker.output(),
            timeout=30,
            message="the worker to start",
        )
        time.sleep(1)
        server.kill()
        wait_until(lambda: "is unavailable" in worker.output(), timeout=30, message="the worker to see the outage")
        assert worker.proc.poll() is None
        started = time.monotonic()
        assert worker.stop(timeout=15) == 0
        assert time.monotonic() - started < 10
    finally:
        if worker.proc.poll() is None:
            worker.kill()
    assert "Traceback" not in worker.output()
    assert worker.output().count("is unavailable") == 1

"""The embedded server against real valkey-server / redis-server processes (no mocks).

Covers the persistence table in ``streamgrp.cli.server``'s docstring: what survives a stop, a SIGKILL
of the server with ``appendfsync always``, and what ``appendonly=False`` loses.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from streamgrp.cli.server import EmbeddedServer, ensure_server
from streamgrp.cli.server_binary import server_binary
from streamgrp.cli.server_state import STATE_FILE
from streamgrp.errors import ConfigError, ServerError


def pid_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (a zombie nobody reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_gone(pid):
            return True
        time.sleep(0.05)
    return pid_gone(pid)


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=False)


def test_start_ping_stop(server_factory, server_kind):
    server = server_factory()
    assert server.running and server.pid is not None
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    state = json.loads((server.data_dir / STATE_FILE).read_text())
    assert state["pid"] == server.pid and state["port"] == server.port
    assert state["password_set"] is False
    with connect(server.url) as r:
        assert r.ping() is True
        info = r.info("server")
        assert ("valkey_version" in info) == (server_kind == "valkey")
    pid = server.pid
    server.stop()
    assert not server.running
    assert pid_gone(pid)
    assert not (server.data_dir / STATE_FILE).exists()
    server.stop()  # idempotent


def test_the_server_keeps_an_aof_whose_rewrites_are_not_compressed(server_factory):
    """AOF on, no RDB snapshots, and the AOF's rewritten base uncompressed (LZF doubled the rewrite's
    CPU on rollout payloads for 12% less disk)."""
    server = server_factory()
    with connect(server.url) as r:
        settings = {**r.config_get("appendonly"), **r.config_get("save"), **r.config_get("rdbcompression")}
    assert settings == {"appendonly": "yes", "save": "", "rdbcompression": "no"}


def test_context_manager_stops(server_factory):
    server = server_factory(start=False)
    with server:
        pid = server.pid
        with connect(server.url) as r:
            assert r.ping()
    assert pid_gone(pid)


def test_data_survives_stop_and_restart(server_factory, tmp_path):
    data_dir = tmp_path / "aof"
    first = server_factory(data_dir)
    with connect(first.url) as r:
        r.set(b"k", b"v")
        r.xadd(b"s", {b"n": b"1"})
    first.stop()

    second = server_factory(data_dir)
    with connect(second.url) as r:
        assert r.get(b"k") == b"v"
        assert r.xlen(b"s") == 1


def test_appendfsync_always_keeps_every_acknowledged_entry_across_sigkill(server_factory, tmp_path):
    data_dir = tmp_path / "always"
    server = server_factory(data_dir, appendfsync="always")
    with connect(server.url) as r:
        ids = [r.xadd(b"events", {b"seq": str(i).encode()}) for i in range(1000)]
    server.kill()  # right after the last XADD returned

    restarted = server_factory(data_dir, appendfsync="always")
    with connect(restarted.url) as r:
        entries = r.xrange(b"events")
    assert [entry_id for entry_id, _ in entries] == ids
    assert [fields[b"seq"] for _, fields in entries] == [str(i).encode() for i in range(1000)]


def test_appendonly_off_loses_everything_on_a_server_crash(server_factory, tmp_path):
    """Documents the ``appendonly=False`` row: nothing is persisted (``--save ""`` too)."""
    data_dir = tmp_path / "volatile"
    server = server_factory(data_dir, appendonly=False)
    with connect(server.url) as r:
        for i in range(100):
            r.xadd(b"events", {b"seq": str(i).encode()})
    server.kill()

    restarted = server_factory(data_dir, appendonly=False)
    with connect(restarted.url) as r:
        assert r.xlen(b"events") == 0


def test_password_is_required_and_never_recorded(server_factory):
    password = "p@ss:w/rd #1"
    server = server_factory(password=password)
    anonymous = f"redis://127.0.0.1:{server.port}/0"
    with connect(anonymous) as r, pytest.raises(redis.AuthenticationError):
        r.ping()
    with connect(server.url) as r:
        assert r.ping()
    state_text = (server.data_dir / STATE_FILE).read_text()
    assert password not in state_text
    assert json.loads(state_text)["password_set"] is True
    assert password not in server.display_url
    # Given via stdin, not argv: it must not show in the process list.
    cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
    assert password.encode() not in cmdline


def test_second_server_in_the_same_data_dir_is_refused(server_factory, tmp_path):
    data_dir = tmp_path / "shared"
    first = server_factory(data_dir)
    with pytest.raises(ServerError, match="already running"):
        server_factory(data_dir)
    assert first.running


def test_taken_port_is_reported(server_factory):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ServerError, match="(?i)in use"):
            server_factory(port=port)


def test_ensure_server_reuses_a_live_server(tmp_path):
    data_dir = tmp_path / ".streamgrp"
    with ensure_server(None, data_dir) as owner:
        assert owner.owned
        assert (data_dir / STATE_FILE).exists()
        second = ensure_server(None, data_dir)
        assert second.url == owner.url and not second.owned
        second.close()
        with connect(owner.url) as r:
            assert r.ping()
        pid = owner.server.pid
    assert pid_gone(pid)
    assert not (data_dir / STATE_FILE).exists()


def test_ensure_server_replaces_a_crashed_server(tmp_path):
    data_dir = tmp_path / ".streamgrp"
    crashed = ensure_server(None, data_dir)
    crashed.server.kill()
    assert (data_dir / STATE_FILE).exists()  # stale record, as after a real crash
    with ensure_server(None, data_dir) as fresh:
        assert fresh.owned
        with connect(fresh.url) as r:
            assert r.ping()


def test_ensure_server_with_url_owns_nothing(tmp_path):
    data_dir = tmp_path / "unused"
    handle = ensure_server("redis://example.invalid:6379/0", data_dir)
    assert handle.url == "redis://example.invalid:6379/0" and not handle.owned
    handle.close()
    assert not data_dir.exists()


def test_bogus_binary_raises_a_readable_server_error(tmp_path, monkeypatch):
    bogus = tmp_path / "no" / "valkey-server"
    with pytest.raises(ServerError, match="cannot run server binary") as raised:
        EmbeddedServer(tmp_path / "data", binary=bogus).start()
    assert str(bogus) in str(raised.value) and "--redis-url" in str(raised.value)

    monkeypatch.setenv("STREAMGRP_SERVER_BINARY", str(bogus))
    with pytest.raises(ServerError, match="STREAMGRP_SERVER_BINARY"):
        server_binary()


def test_server_dying_during_start_reports_its_log(tmp_path):
    fake = tmp_path / "fake-server"
    fake.write_text("#!/bin/sh\necho 'fatal: cannot open the frobnicator' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(ServerError, match="exited with code 3") as raised:
        EmbeddedServer(tmp_path / "data", binary=fake).start()
    assert "cannot open the frobnicator" in str(raised.value)


def test_invalid_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="appendfsync"):
        EmbeddedServer(tmp_path, appendfsync="sometimes")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_server_dies_with_its_sigkilled_owner(kind_binary, tmp_path):
    binary = kind_binary
    owner_code = textwrap.dedent(
        """
        import sys, time
        from streamgrp.cli.server import EmbeddedServer
        server = EmbeddedServer(sys.argv[1], binary=sys.argv[2])
        server.start()
        print(server.pid, flush=True)
        time.sleep(120)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_code, str(tmp_path / "data"), binary],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    server_pid = None
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        assert not pid_gone(server_pid)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert wait_gone(server_pid, 5.0), "the server outlived its SIGKILLed owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
        if server_pid is not None and not pid_gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def test_concurrent_ensure_server_calls_share_one_server(tmp_path):
    """Four processes race ``ensure_server`` on one data dir: the flock lets exactly one start it."""
    data_dir = tmp_path / ".streamgrp"
    code = textwrap.dedent(
        """
        import json, sys
        from streamgrp.cli.server import ensure_server
        handle = ensure_server(None, sys.argv[1])
        print(json.dumps({"url": handle.url, "owned": handle.owned}), flush=True)
        sys.stdin.read()  # hold the handle until the test closes stdin
        handle.close()
        """
    )
    repo = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(data_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=repo,
        )
        for _ in range(4)
    ]
    try:
        results = [json.loads(p.stdout.readline()) for p in procs]
        assert len({r["url"] for r in results}) == 1
        assert sorted(r["owned"] for r in results) == [False, False, False, True]
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait(15)
            p.stdout.close()
    assert not (data_dir / STATE_FILE).exists()

"""Who may connect to the embedded server: the loopback rule, passwords, ACL files and TLS, on real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from certs import make_certs

from streamgrp.cli.children import free_port
from streamgrp.cli.server import EmbeddedServer
from streamgrp.cli.server_state import STATE_FILE
from streamgrp.errors import ConfigError, ServerError
from streamgrp.store.acl import render_run
from streamgrp.store.connection import connect

PASSWORD = "s3cret pass:w/rd"


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamgrp", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _redis_cli(port: int, *command: str, password: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"REDISCLI_AUTH": password} if password else {})}  # never -a: argv is public
    return subprocess.run(["redis-cli", "-p", str(port), *command], capture_output=True, text=True, env=env, timeout=10)


def test_a_bind_other_machines_reach_without_a_password_is_refused_naming_the_fix(tmp_path):
    result = _cli(
        "server", "--bind", "0.0.0.0", "--port", str(free_port("127.0.0.1")), "--data-dir", str(tmp_path / "data")
    )
    assert result.returncode == 2, result.stderr
    for fix in ("--password-file", "STREAMGRP_PASSWORD", "--acl-file", "bind 127.0.0.1"):
        assert fix in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists()  # refused before anything started
    with pytest.raises(ConfigError, match="other machines can reach"):
        EmbeddedServer(tmp_path / "lib", bind="127.0.0.1 0.0.0.0")
    EmbeddedServer(tmp_path / "lib", bind="127.0.0.1 ::1 -::1")  # loopback only: fine without a password


def test_with_a_password_redis_cli_without_it_is_refused_and_config_is_not_for_the_roles(kind_binary, tmp_path):
    if not _has_redis_cli():
        pytest.skip("redis-cli is not installed")
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    port = free_port("127.0.0.1")
    data = tmp_path / "data"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamgrp",
            "server",
            "--bind",
            "0.0.0.0",
            "--port",
            str(port),
            "--data-dir",
            str(data),
            "--password-file",
            str(secret),
        ],
        env={**os.environ, "STREAMGRP_SERVER_BINARY": kind_binary},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_state(data, server)
        refused = _redis_cli(port, "PING")
        assert "NOAUTH" in refused.stdout + refused.stderr
        assert _redis_cli(port, "PING", password=PASSWORD).stdout.strip() == "PONG"
        config = _redis_cli(port, "CONFIG", "SET", "appendonly", "no", password=PASSWORD)
        assert "NOPERM" in config.stdout + config.stderr
        assert "NOPERM" in _redis_cli(port, "FLUSHALL", password=PASSWORD).stdout
        state = json.loads((data / STATE_FILE).read_text())
        assert _redis_cli(port, "CONFIG", "GET", "protected-mode", password=PASSWORD).stdout.split() == [
            "protected-mode",
            "yes",
        ]
        assert PASSWORD.encode() not in Path(f"/proc/{state['pid']}/cmdline").read_bytes()
        assert PASSWORD not in (data / STATE_FILE).read_text() and state["password_set"] is True
        assert oct((data).stat().st_mode & 0o777) == "0o700"
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=20)
    assert server.returncode == 0, output
    assert PASSWORD not in output


def test_an_acl_file_must_say_what_the_default_user_may_do(tmp_path):
    lines = render_run("r1", ["inspector"])
    open_file = tmp_path / "open.acl"
    open_file.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="no line for the default user"):
        EmbeddedServer(tmp_path / "a", acl_file=open_file)
    nopass = tmp_path / "nopass.acl"
    nopass.write_text("user default on nopass ~* +@all\n")
    with pytest.raises(ConfigError, match="nopass"):
        EmbeddedServer(tmp_path / "b", acl_file=nopass)
    closed = tmp_path / "closed.acl"
    closed.write_text("user default on nopass resetpass >x ~* +@all\n")
    EmbeddedServer(tmp_path / "c", acl_file=closed, bind="0.0.0.0")  # a password, then: allowed


def test_an_acl_server_lets_no_anonymous_client_in(server_factory, tmp_path):
    users = tmp_path / "users.acl"
    users.write_text(
        "user default off\n" + "\n".join(render_run("r1", ["inspector"], passwords={"inspector": "pw"})) + "\n"
    )
    server = server_factory(acl_file=users)
    anonymous = redis.Redis(port=server.port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    inspector = connect(f"redis://sg-r1-inspector@127.0.0.1:{server.port}/0", password="pw")
    assert inspector.ping()
    with pytest.raises(redis.exceptions.NoPermissionError):
        inspector.set("sg:{r1}:version", 1)
    inspector.close()


def test_tls_only_with_a_client_certificate_signed_by_the_ca(kind_binary, server_kind, tmp_path):
    if server_kind == "valkey":
        pytest.skip("the bundled valkey-server is built without TLS; the redis7 kind runs this test")
    certs = make_certs(tmp_path / "certs")
    server = EmbeddedServer(tmp_path / "data", binary=kind_binary, tls=certs.server, password=PASSWORD)
    url = server.start()
    try:
        assert url.startswith("rediss://") and server.display_url.startswith("rediss://:***@")
        client = connect(url, tls=certs.client)
        assert client.ping()
        client.close()
        with pytest.raises((redis.ConnectionError, ServerError)):  # plain TCP on the TLS port
            redis.Redis(port=server.port, password=PASSWORD, socket_timeout=2).ping()
        without_cert = redis.Redis.from_url(url, ssl_ca_certs=str(certs.ca), socket_timeout=2)
        with pytest.raises(redis.ConnectionError):
            without_cert.ping()
        with pytest.raises(ConfigError, match="rediss://"):
            connect(url.replace("rediss://", "redis://"), tls=certs.client)
    finally:
        server.stop()


def test_a_server_built_without_tls_says_which_binary_to_use(tmp_path):
    from streamgrp.cli.server_binary import bundled_binary

    binary = bundled_binary()
    if binary is None:
        pytest.skip("no bundled valkey-server")
    certs = make_certs(tmp_path / "certs")
    with pytest.raises(ServerError) as raised:
        EmbeddedServer(tmp_path / "data", binary=binary, tls=certs.server).start()
    if "TLS" not in str(raised.value):
        pytest.skip("this valkey-server has TLS")
    assert "built without TLS" in str(raised.value) and "STREAMGRP_SERVER_BINARY" in str(raised.value)


def _has_redis_cli() -> bool:
    from shutil import which

    return which("redis-cli") is not None


def _wait_for_state(data: Path, process: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (data / STATE_FILE).exists():
            return
        if process.poll() is not None:
            raise AssertionError(f"streamgrp server exited: {process.stdout.read()}")
        time.sleep(0.05)
    raise AssertionError("streamgrp server did not start")

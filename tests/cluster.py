"""A local 3-node Redis Cluster for the ``cluster`` server kind: Debian's redis-server in cluster mode.

`LocalCluster.start` starts three primaries (no replicas), each in a tmp dir of its own with
``--cluster-enabled yes``, an AOF (``appendfsync everysec``) and no RDB snapshots, joins them with
``redis-cli --cluster create``, and waits until every node reports ``cluster_state:ok``. Ports are
picked free below 55536, since a node's cluster bus listens on its port + 10000. `stop` ends the
processes it started (by pid) and nothing else.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DEBIAN_REDIS = "/usr/bin/redis-server"
DEBIAN_CLI = "/usr/bin/redis-cli"
#: Below Linux's ephemeral ports (32768 and up), so an outgoing connection does not take a node's port
#: while the cluster starts; port + 10000 (the cluster bus) stays below 65536.
PORT_RANGE = (20000, 32000)
NODES = 3


def cluster_binaries() -> tuple[str, str] | None:
    """``(redis-server, redis-cli)`` when both exist, else None."""
    server = DEBIAN_REDIS if os.path.exists(DEBIAN_REDIS) else shutil.which("redis-server")
    cli = DEBIAN_CLI if os.path.exists(DEBIAN_CLI) else shutil.which("redis-cli")
    return (server, cli) if server and cli else None


def _free(port: int) -> bool:
    for candidate in (port, port + 10000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                return False
    return True


def free_ports(count: int, *, rng: random.Random | None = None) -> list[int]:
    """``count`` distinct ports below 55536 whose port + 10000 is free too."""
    rng = rng or random.Random()
    ports: list[int] = []
    for _ in range(2000):
        port = rng.randrange(*PORT_RANGE)
        if port not in ports and all(abs(port - p) != 10000 for p in ports) and _free(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"no {count} free port pairs (port, port + 10000) in {PORT_RANGE}")


@dataclass
class LocalCluster:
    root: Path
    server: str
    cli: str
    #: ``always`` for a crash test that kills a node: its AOF then holds every write it answered.
    appendfsync: str = "everysec"
    ports: list[int] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout: float = 30.0) -> str:
        self.ports = free_ports(NODES)
        for port in self.ports:
            (self.root / f"node-{port}").mkdir(parents=True)
            self.processes.append(self._spawn(port))
        deadline = time.monotonic() + timeout
        for port in self.ports:
            self._wait(lambda: self._cli(port, "ping") == "PONG", deadline, f"node {port} to answer PING")
        created = subprocess.run(
            [
                self.cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout}{created.stderr}")
        for port in self.ports:
            self._wait(
                lambda: "cluster_state:ok" in self._cli(port, "cluster", "info"),
                deadline,
                f"node {port} to report cluster_state:ok",
            )
        return self.url

    def _spawn(self, port: int) -> subprocess.Popen:
        directory = self.root / f"node-{port}"
        return subprocess.Popen(
            [
                self.server,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(directory),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                "5000",
                "--appendonly",
                "yes",
                "--appendfsync",
                self.appendfsync,
                "--save",
                "",
                "--logfile",
                str(directory / "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port``."""
        proc = self.processes[self.ports.index(port)]
        proc.kill()
        proc.wait()

    def restart(self, port: int, timeout: float = 30.0) -> None:
        """Start the node on ``port`` again from its directory (its cluster config and AOF) and wait
        until every node reports ``cluster_state:ok``."""
        self.processes[self.ports.index(port)] = self._spawn(port)
        deadline = time.monotonic() + timeout
        for each in self.ports:
            self._wait(
                lambda each=each: "cluster_state:ok" in self._cli(each, "cluster", "info"),
                deadline,
                f"node {each} to report cluster_state:ok after the restart",
            )

    def _cli(self, port: int, *args: str) -> str:
        done = subprocess.run([self.cli, "-p", str(port), *args], capture_output=True, text=True, timeout=5)
        return done.stdout.strip()

    def _wait(self, ready, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            if any(proc.poll() is not None for proc in self.processes):
                raise RuntimeError(f"a cluster node exited while waiting for {what}: {self.logs()}")
            if ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {what}: {self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- node {port}:\n" + _tail(self.root / f"node-{port}" / "redis.log") for port in self.ports)

    def stop(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def client_for(url: str):
    """A new client of the server at ``url``, of this test's kind: a cluster client when the ``redis_url``
    fixture set ``STREAMGRP_CLUSTER=1`` (the ``cluster`` kind), a plain redis-py client otherwise."""
    import redis

    if os.environ.get("STREAMGRP_CLUSTER") == "1":
        from streamgrp.store.connection import connect

        return connect(url, cluster=True)
    return redis.Redis.from_url(url)

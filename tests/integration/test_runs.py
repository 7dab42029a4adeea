import pytest

from streamgrp.config import RunConfig
from streamgrp.core.events import RunStarted
from streamgrp.errors import ConfigError
from streamgrp.store.runs import (
    join_run,
    latest_run,
    list_runs,
    open_run,
    resolve_run_name,
)


def test_first_join_records_the_configuration_as_the_first_event(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=8))
    first = client.xrange(run.keys.control, count=1)
    assert len(first) == 1
    assert isinstance(run.record, RunStarted)
    assert run.config.n_samples == 8
    assert run.record.policy.n_samples == 8
    assert latest_run(client) == run_name
    assert run_name in dict(list_runs(client))


def test_unset_fields_adopt_the_record_and_matching_fields_join(client, run_name):
    join_run(client, run_name, RunConfig(n_samples=8, group_timeout_s=5.0))
    adopted = join_run(client, run_name, RunConfig())
    assert adopted.config.n_samples == 8 and adopted.config.group_timeout_s == 5.0
    assert join_run(client, run_name, RunConfig(n_samples=8)).config.n_samples == 8
    assert client.xlen(adopted.keys.control) == 1


def test_a_differing_policy_refuses_and_names_the_fields(client, run_name):
    join_run(client, run_name, RunConfig(n_samples=8, drop_incomplete_group=False))
    with pytest.raises(ConfigError) as caught:
        join_run(client, run_name, RunConfig(n_samples=4, drop_incomplete_group=True))
    message = str(caught.value)
    assert "n_samples: recorded 8, this process 4" in message
    assert "drop_incomplete_group: recorded False, this process True" in message
    assert "--n-samples" in message and "STREAMGRP_N_SAMPLES" in message


def test_inspection_defaults_to_the_latest_run_and_missing_runs_say_so(client, run_name):
    join_run(client, run_name, RunConfig())
    assert resolve_run_name(client, None, create=False) == latest_run(client)
    assert open_run(client, run_name).config == RunConfig()
    with pytest.raises(ConfigError, match="does not exist"):
        open_run(client, run_name + "-missing")
    with pytest.raises(ValueError, match="not allowed"):
        join_run(client, "bad name!", RunConfig())

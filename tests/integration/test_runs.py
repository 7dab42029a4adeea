import pytest

from streamgrp.config import RunConfig
from streamgrp.core.events import RunStarted
from streamgrp.errors import ConfigError, StopRequested
from streamgrp.store.runs import (
    await_run,
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


def test_opening_a_run_writes_nothing_and_still_refuses_a_differing_setting(client, run_name):
    keys = join_run(client, run_name, RunConfig(n_samples=3)).keys
    length = client.xlen(keys.control)
    assert open_run(client, run_name, RunConfig()).config.n_samples == 3  # unset fields adopt the record
    with pytest.raises(ConfigError, match="n_samples: recorded 3, this process 5"):
        open_run(client, run_name, RunConfig(n_samples=5))
    assert client.xlen(keys.control) == length


def test_await_run_waits_for_the_batcher_and_gives_up_when_stopped(client, run_name):
    import threading

    stop = threading.Event()
    with pytest.raises(ConfigError, match="does not exist"):
        await_run(client, run_name, stop=stop, wait=False)
    found = []
    waiter = threading.Thread(target=lambda: found.append(await_run(client, run_name, stop=stop, poll_s=0.05)))
    waiter.start()
    join_run(client, run_name, RunConfig(n_samples=2))
    waiter.join(timeout=10)
    assert found and found[0].config.n_samples == 2
    with pytest.raises(StopRequested, match="stopped while waiting"):
        await_run(client, run_name + "-never", stop=_set_soon(), poll_s=0.05)


def _set_soon():
    import threading

    event = threading.Event()
    threading.Timer(0.2, event.set).start()
    return event

"""The one path tasks take to the queue and the group log: fenced for the feeder, unfenced for others."""

from __future__ import annotations

import pytest

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.events import TaskIssued
from streamgrp.errors import LeaseLost
from streamgrp.store.runs import join_run
from streamgrp.store.tasks import MAX_TASKS_PER_CALL, TaskIssuer, TaskWriter


def _ids(client, stream) -> list[str]:
    return [codec.decode(fields).task_id for _, fields in client.xrange(stream)]


def test_unfenced_issue_writes_both_streams_in_bounded_calls_and_leaves_the_cursor(client, run_name):
    keys = join_run(client, run_name, RunConfig(n_samples=2)).keys
    events = TaskIssuer(client, keys).issue([{"n": i} for i in range(MAX_TASKS_PER_CALL + 5)])
    assert len(events) == MAX_TASKS_PER_CALL + 5
    assert _ids(client, keys.tasks) == _ids(client, keys.slots) == [e.task_id for e in events]
    assert client.hget(keys.batcher_state, "feeder_cursor") is None
    server_now = float(client.time()[0])
    assert all(abs(e.issued_at - server_now) < 5 for e in events)


def test_a_fenced_write_checks_lease_and_cursor_before_writing(client, run_name):
    keys = join_run(client, run_name, RunConfig(n_samples=2)).keys
    writer = TaskWriter(client, keys)
    client.set(keys.batcher_lease, "mine")
    task = [TaskIssued(task_id="t00000000", issued_at=writer.now())]
    assert writer.write(task, lease_token="mine", cursor=0) == 1
    with pytest.raises(LeaseLost, match="CURSOR moved: expected 0 found 1"):
        writer.write(task, lease_token="mine", cursor=0)  # a zombie re-issuing what was issued
    with pytest.raises(LeaseLost, match="LEASE lost"):
        writer.write(task, lease_token="someone-else", cursor=1)
    assert _ids(client, keys.tasks) == _ids(client, keys.slots) == ["t00000000"]
    assert client.hget(keys.batcher_state, "feeder_cursor") == b"1"
    with pytest.raises(ValueError, match="at most 256"):
        writer.write(task * (MAX_TASKS_PER_CALL + 1))

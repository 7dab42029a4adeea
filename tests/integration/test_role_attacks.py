"""What a role's own credential can still do to a run, on a real server with that role's ACL user.

Forged task entries in the group log (any role that publishes results may append there) open no group
and are dead-lettered, so they cannot fill ``max_open_groups`` until issued tasks are refused. Writes a
role's functions need but its own calls do not are confined by ACL selectors to the keys that need them:
each attack below is refused with NOPERM.
"""

from __future__ import annotations

import logging

import pytest
from role_users import RoleUsers, refused, role_users  # noqa: F401  (a fixture)

from streamgrp.config import AssemblerConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, TaskIssued
from streamgrp.core.refusal import TASK_NOT_ISSUED
from streamgrp.replay.verifier import format_report, verify
from streamgrp.services.assembler import Assembler
from streamgrp.services.retention import trim
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient
from streamgrp.store.keys import RUNS, WORKERS_GROUP, RunKeys
from streamgrp.store.runs import server_time


def _forged(task_id: str, seq: int, issued_at: float) -> dict:
    return codec.encode(
        TaskIssued(task_id=task_id, prompt={"tokens": 8}, version=0, issued_at=issued_at, producer="forger", seq=seq)
    )


def test_forged_task_entries_open_no_group_and_issued_tasks_are_not_refused(client, make_run, issuer, role_users):
    run = make_run(n_samples=2, group_timeout_s=600.0)
    worker = role_users.client("worker")
    [first] = issuer(run).issue([{"tokens": 8}])
    queued = client.xrange(run.keys.tasks)[-1][0].decode()
    now = server_time(client)
    forged = []
    for i in range(6):  # no queue entry named; one that does not exist; an issued task's (another header)
        fields = _forged(f"forged-{i}", i, now)
        if i % 3 == 1:
            fields["q"] = "99999999999999-0"
        elif i % 3 == 2:
            fields["q"] = queued
        forged.append(worker.xadd(run.keys.slots, fields).decode())
    # a copy of the issued task's entry, its queue entry and all: the first issue stands
    copy = dict(client.xrange(run.keys.slots, "-", "+", count=1)[0][1])
    worker.xadd(run.keys.slots, copy)
    # and the worker cannot put tasks of its own in the queue to point at
    refused(lambda: worker.xadd(run.keys.tasks, _forged("forged-q", 9, now)))

    tasks = [first, *issuer(run).issue([{"tokens": 8}, {"tokens": 8}])]
    publisher = WorkerClient(worker, run.keys)
    for task in tasks:
        for slot in (0, 1):
            publisher.publish(task.task_id, slot, make_sample(tokens=8))
    config = AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05, max_open_groups=3)
    Assembler(role_users.client("assembler"), run, config).run(burst=True)

    decisions = [codec.decode(fields) for _, fields in client.xrange(run.keys.decisions)]
    assert all(isinstance(d, GroupDecided) for d in decisions)
    assert sorted((d.task_id, d.decision) for d in decisions) == sorted((t.task_id, "complete") for t in tasks)
    letters = [fields for _, fields in client.xrange(run.keys.deadletter)]
    assert sorted(f[b"entry"].decode() for f in letters if f[b"reason"] == TASK_NOT_ISSUED.encode()) == sorted(forged)
    assert all(b"no issue wrote it" in f[b"detail"] for f in letters)
    assert int(client.hget(run.keys.counts, f"deadletter:{TASK_NOT_ISSUED}")) == 6
    assert int(client.hget(run.keys.counts, "tasks:duplicate")) == 1
    report = verify(client, run.keys)
    assert report.ok, format_report(report)


def test_consumer_groups_a_worker_makes_on_its_task_queue_are_reported(client, make_run, issuer, role_users, caplog):
    # Redis ACLs cannot name consumer groups: a worker that may read the task queue through its group may
    # create others there. Retention names them (they hold nothing back from trimming).
    run = make_run(n_samples=2)
    issuer(run).issue([{"tokens": 8}])
    worker = role_users.client("worker")
    for i in range(3):
        worker.xgroup_create(run.keys.tasks, f"forged-{i}", id="0")
    with caplog.at_level(logging.WARNING, logger="streamgrp.services.retention"):
        trim(client, run.keys, {})
    [line] = [r.getMessage() for r in caplog.records if "consumer groups streamgrp did not make" in r.getMessage()]
    assert "3 consumer groups" in line and "'forged-0'" in line and run.keys.tasks in line


def test_each_roles_writes_reach_only_the_keys_that_need_them(client, make_run, issuer, role_users):
    run = make_run(n_samples=2)
    keys = run.keys
    [task] = issuer(run).issue([{"tokens": 8}])
    worker, trainer = role_users.client("worker"), role_users.client("trainer")
    batcher, assembler = role_users.client("batcher"), role_users.client("assembler")
    gateway = role_users.client("gateway")
    WorkerClient(worker, keys).publish(task.task_id, 0, make_sample(tokens=8))
    Assembler(assembler, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)  # its group

    # A worker cannot read or acknowledge the assembler's slot entries, nor create groups on them.
    from streamgrp.store.keys import ASSEMBLER_GROUP

    for role_client in (worker, gateway):
        refused(lambda: role_client.xreadgroup(ASSEMBLER_GROUP, "w", {keys.slots: "0"}))
        refused(lambda: role_client.xack(keys.slots, ASSEMBLER_GROUP, "1-1"))
        refused(lambda: role_client.xautoclaim(keys.slots, ASSEMBLER_GROUP, "w", 0))
        refused(lambda: role_client.xgroup_create(keys.slots, "mine", id="0"))
        refused(lambda: role_client.xdel(keys.payloads, "1-1"))  # payloads are never deleted by them
        refused(lambda: role_client.xadd(keys.tasks, {"h": b"{}"}))
    # nor delete or overwrite what it writes through functions
    for key in (keys.slots, keys.payloads, keys.tasks, keys.deadletter):
        refused(lambda: worker.delete(key))
        refused(lambda: worker.set(key, "x"))
    # The trainer: no DEL of control, commits or dead letters, no SET but its version and weights.
    for key in (keys.control, keys.commits, keys.deadletter, keys.committed, keys.attempt):
        refused(lambda: trainer.delete(key))
        refused(lambda: trainer.set(key, "x"))
    # One run's batcher cannot delete or overwrite the registry of runs, nor another run's lease.
    refused(lambda: batcher.delete(RUNS))
    refused(lambda: batcher.set(RUNS, "x"))
    refused(lambda: batcher.xadd(RUNS, {"h": b"{}"}))
    refused(lambda: batcher.xgroup_create(RUNS, "g", id="0", mkstream=True))
    for key in (keys.control, keys.steps, keys.counts, keys.batcher_state, keys.decisions):
        refused(lambda: batcher.delete(key))
    refused(lambda: batcher.delete(RunKeys("another-run").batcher_lease))
    # The assembler: its lease only.
    for key in (keys.decisions, keys.decided, keys.counts, keys.slots):
        refused(lambda: assembler.delete(key))
        refused(lambda: assembler.set(key, "x"))

    # What they need still works: the worker takes from its own group, the trainer sets its version.
    assert worker.xreadgroup(WORKERS_GROUP, "w", {keys.tasks: "0"}) is not None
    trainer.set(keys.version, 0)
    assert client.xlen(keys.control) >= 1 and client.exists(RUNS)


def test_a_run_record_the_trainer_appends_before_the_batcher_is_not_adopted(client, run_name, role_users):
    # The trainer appends its version events to control, so before the batcher created the run its
    # credential could append a record of its own; the batcher notes the record it writes in its state
    # hash, which only its user may write, and refuses a first entry nobody vouches for.
    from streamgrp.config import RunConfig
    from streamgrp.core.events import RunStarted
    from streamgrp.errors import ConfigError
    from streamgrp.store.runs import join_run

    keys = RunKeys(run_name)
    trainer = role_users.client("trainer")
    forged = RunStarted(
        run=run_name,
        policy=RunConfig(n_samples=2).policy(),
        settings={"n_samples": 2},
        started_at=1.0,
        producer="forger",
    )
    trainer.xadd(keys.control, codec.encode(forged))
    refused(lambda: trainer.delete(keys.control))
    with pytest.raises(ConfigError, match="was not written by a batcher"):
        join_run(role_users.client("batcher"), run_name, RunConfig(n_samples=4))
    # a run the batcher created is joined again as before, and the trainer's later entries change nothing
    other = RunKeys(run_name + "-b")
    run = join_run(client, other.run, RunConfig(n_samples=4))
    trainer_b = RoleUsers(client, other.run)
    try:
        trainer_b.client("trainer").xadd(other.control, codec.encode(forged.replace(run=other.run)))
        assert join_run(client, other.run, RunConfig()).config.n_samples == run.config.n_samples == 4
    finally:
        trainer_b.close()

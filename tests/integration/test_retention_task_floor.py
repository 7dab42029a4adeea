"""The task queue's floor when a task's queue entry and its log entry got different milliseconds (Redis 7.0
takes the clock at each XADD of a function call): retention keeps the queue entry of the task logged at the
slot log's assembler bound, which the assembler checks the task against (`queued_task_bounds`)."""

from __future__ import annotations

from streamgrp.services.retention import floors
from streamgrp.services.worker import WorkerClient
from streamgrp.store.keys import ASSEMBLER_GROUP, WORKERS_GROUP


def test_the_queue_keeps_a_task_whose_log_entry_is_a_millisecond_newer_than_its_queue_entry(client, make_run):
    run = make_run(n_samples=1)
    keys = run.keys
    WorkerClient(client, keys)  # the workers' group
    client.xgroup_create(keys.slots, ASSEMBLER_GROUP, "0", mkstream=True)
    seconds, micros = client.time()
    now = seconds * 1000 + micros // 1000
    # One issue as Redis 7.0 may write it: the queue entry in one millisecond, its log entry in the next.
    client.xadd(keys.tasks, {"h": b"task"}, id=f"{now}-0")
    client.xadd(keys.slots, {"h": b"task", "q": f"{now}-0"}, id=f"{now + 1}-0")
    client.xreadgroup(WORKERS_GROUP, "w", {keys.tasks: ">"}, count=1)  # generated and acknowledged: the workers
    client.xack(keys.tasks, WORKERS_GROUP, f"{now}-0")  # no longer need it
    client.xreadgroup(ASSEMBLER_GROUP, "a", {keys.slots: ">"}, count=1)  # its group open: pending, the bound
    archived = dict.fromkeys(keys.all_streams(), f"{now + 1000}-0")
    floor, why = floors(client, keys, archived)["tasks"]
    assert floor == (now, 0) and why == "tasks the assembler checks", (floor, why, now)

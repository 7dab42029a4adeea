import asyncio
import threading
import time

import pytest
import redis

from streamgrp.config import WorkerConfig
from streamgrp.core import codec
from streamgrp.core.events import SlotResult
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient, WorkerProcess
from streamgrp.store.keys import WORKERS_GROUP

pytestmark = pytest.mark.cluster  # core: runs on the Redis Cluster kind too


def slot_results(client, run):
    events = [codec.decode(fields) for _, fields in client.xrange(run.keys.slots)]
    return [e for e in events if isinstance(e, SlotResult)]


def rollout(request):
    if request.slot == 1:
        return None
    if request.slot == 2:
        raise ValueError(f"bad prompt {request.prompt['q']}")
    return make_sample(tokens=4, version=request.version)


async def async_rollout(request):
    await asyncio.sleep(0.001)
    return make_sample(tokens=3)


def test_worker_publishes_sample_rejected_and_failed_then_acks(client, make_run, issuer):
    run = make_run(n_samples=3)
    issuer(run).issue([{"q": "x"}, {"q": "y"}])
    worker = WorkerClient(client, run.keys)
    done = WorkerProcess(worker, rollout, WorkerConfig(burst=True), n_samples=3).run()
    assert done == 2
    results = slot_results(client, run)
    assert sorted((r.slot, r.outcome) for r in results) == [
        (0, "sample"),
        (0, "sample"),
        (1, "rejected"),
        (1, "rejected"),
        (2, "failed"),
        (2, "failed"),
    ]
    assert {r.error for r in results if r.outcome == "failed"} == {
        "ValueError: bad prompt x",
        "ValueError: bad prompt y",
    }
    assert all(r.producer == worker.name for r in results)
    assert sorted(r.seq for r in results) == list(range(6))
    assert client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0


def test_a_burst_worker_ends_on_an_empty_read_without_waiting_for_a_task(client, make_run, issuer):
    """`--burst` drains what is queued and exits: the read that finds the queue empty does not block."""

    blocking: list[bool] = []

    class Watched(WorkerProcess):
        def _take(self, room, *, block):
            blocking.append(block)
            return super()._take(room, block=block)

    run = make_run(n_samples=2)
    issuer(run).issue([{"q": "x"}])
    done = Watched(WorkerClient(client, run.keys), rollout, WorkerConfig(burst=True), n_samples=2).run()
    assert done == 1
    assert blocking and not any(blocking)


def test_async_rollout_functions_are_awaited(client, make_run, issuer):
    run = make_run(n_samples=2)
    issuer(run).issue([{}] * 3)
    assert (
        WorkerProcess(WorkerClient(client, run.keys), async_rollout, WorkerConfig(burst=True), n_samples=2).run() == 3
    )
    assert [r.outcome for r in slot_results(client, run)] == ["sample"] * 6


def test_wrong_return_type_becomes_a_failed_slot(client, make_run, issuer):
    run = make_run(n_samples=1)
    issuer(run).issue([{}])
    WorkerProcess(
        WorkerClient(client, run.keys), lambda request: {"tokens": [1]}, WorkerConfig(burst=True), n_samples=1
    ).run()
    [result] = slot_results(client, run)
    assert result.outcome == "failed" and "return a streamgrp.Sample, a RewardLater or None" in result.error


def test_a_dead_workers_task_is_reclaimed_after_the_idle_timeout(client, make_run, issuer):
    run = make_run(n_samples=2)
    [task_event] = issuer(run).issue([{}])
    dead = WorkerClient(client, run.keys, name="dead", claim_idle_s=0.2)
    [task] = dead.take(1, block_ms=None)
    dead.publish(task.event.task_id, 0, make_sample())  # then it dies without acknowledging
    alive = WorkerClient(client, run.keys, name="alive", claim_idle_s=0.2)
    assert alive.take(1, block_ms=None) == []  # not idle long enough yet
    time.sleep(0.3)
    [reclaimed] = alive.take(1, block_ms=None)
    assert reclaimed.event == task_event and reclaimed.entry_id == task.entry_id
    alive.done(reclaimed)
    assert client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0


def test_a_task_running_longer_than_the_claim_time_stays_with_its_worker(client, make_run, issuer):
    """A rollout three times longer than ``claim_idle_s``: its worker claims the task again while it runs, so
    another worker scanning for idle tasks never takes it over, and each slot is published once. Without
    that, the other worker would reclaim it after ``claim_idle_s`` and run the group a second time."""
    run = make_run(n_samples=2)
    issuer(run).issue([{}])
    claim_idle_s = 0.6

    def slow(request):
        time.sleep(3 * claim_idle_s)
        return make_sample(tokens=3)

    running = WorkerClient(client, run.keys, name="running", claim_idle_s=claim_idle_s)
    worker = threading.Thread(target=WorkerProcess(running, slow, WorkerConfig(burst=True), n_samples=2).run)
    worker.start()
    while client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0:  # the task is running's first
        time.sleep(0.01)
    other = WorkerClient(client, run.keys, name="other", claim_idle_s=claim_idle_s)
    taken = []
    while worker.is_alive():
        taken += other.take(1, block_ms=None)
        time.sleep(0.05)
    worker.join()
    assert taken == []
    assert sorted((r.slot, r.producer) for r in slot_results(client, run)) == [(0, "running"), (1, "running")]
    assert client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0


def test_a_worker_scans_for_idle_tasks_once_a_tenth_of_claim_idle_s_while_none_are(client, make_run, issuer):
    """A take scans the pending list for a dead worker's tasks first; while a whole scan finds none,
    the next scan waits a tenth of ``claim_idle_s`` (at most 1 s) instead of costing every take a round
    trip. A reclaim is at most that much later than the idle timeout alone."""
    run = make_run(n_samples=1)
    issuer(run).issue([{}] * 20)
    worker = WorkerClient(client, run.keys, claim_idle_s=30.0)
    scans = []
    scan = worker.client.xautoclaim
    worker.client.xautoclaim = lambda *args, **kwargs: scans.append(args) or scan(*args, **kwargs)
    try:
        taken = [task for _ in range(20) for task in worker.take(1, block_ms=None)]
    finally:
        del worker.client.xautoclaim
    assert len(taken) == 20 and len(scans) == 1


def test_publish_many_acknowledges_the_done_tasks_in_the_same_call_and_none_when_it_fails(client, make_run, issuer):
    run = make_run(n_samples=2, payload_layout="stream")  # a run an older version made: payloads in a stream
    issuer(run).issue([{}] * 3)
    worker = WorkerClient(client, run.keys)
    first, second, third = worker.take(3, block_ms=None)
    slots = [(task.event.task_id, slot, make_sample()) for task in (first, second) for slot in range(2)]
    apart = []  # acknowledgements sent apart from the publish (none: they ride in its script call)
    xack = worker.client.xack
    worker.client.xack = lambda *args: apart.append(args) or xack(*args)
    try:
        assert len(worker.publish_many(slots, done=[first, second])) == 4
    finally:
        del worker.client.xack
    assert apart == []
    pending = client.xpending_range(run.keys.tasks, WORKERS_GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [third.entry_id]
    assert client.xlen(run.keys.slots) == 3 + 4 and client.xlen(run.keys.payloads) == 4  # 3 issued + 4 results
    # A payload stream at the largest id takes no payload: the publish call fails, acknowledging nothing...
    client.xadd(run.keys.payloads, {"h": "not ours"}, id="18446744073709551615-18446744073709551615")
    header, payload, blob = codec.encode_sample(third.event.task_id, 0, make_sample(), producer="p", seq=1)
    with pytest.raises(redis.ResponseError, match="PAYLOAD cannot be written"):
        worker._publish(
            keys=[run.keys.slots, run.keys.payloads, run.keys.tasks],
            args=[WORKERS_GROUP, 1, third.entry_id, header, payload, blob],
        )
    assert client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 1
    # ...and publish_many then publishes the results as failed slots saying why, acknowledging the task.
    worker.publish_many([(third.event.task_id, slot, make_sample()) for slot in range(2)], done=[third])
    assert client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0


def test_done_acknowledges_several_tasks_in_one_call_and_nothing_when_given_none(client, make_run, issuer):
    run = make_run(n_samples=1)
    issuer(run).issue([{}] * 3)
    worker = WorkerClient(client, run.keys)
    tasks = worker.take(3, block_ms=None)
    worker.done()
    assert client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 3
    worker.done(*tasks[:2])
    pending = client.xpending_range(run.keys.tasks, WORKERS_GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [tasks[2].entry_id]


def test_a_rollout_that_raises_is_logged_with_its_text_once_a_minute_at_most(client, make_run, issuer, caplog):
    """48 of 64 slots failing must show in the worker's log, not only in inspect/export: one warning with
    the count and the latest exception's type and text (a rollout bug fails every slot: no flood)."""
    import logging

    run = make_run(n_samples=4)
    issuer(run).issue([{"i": i} for i in range(16)])

    def rollout(request):
        if request.slot:
            raise KeyError(f"no field 'answer' in prompt {request.prompt['i']}")
        return make_sample(tokens=4)

    with caplog.at_level(logging.WARNING, logger="streamgrp.services.worker"):
        WorkerProcess(
            WorkerClient(client, run.keys), rollout, WorkerConfig(concurrency=4, burst=True), n_samples=4
        ).run()
    warnings = [r.getMessage() for r in caplog.records if "rollout(s) raised" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert (
        warnings[0].startswith("1 rollout(s) raised since the last warning")
        and "KeyError: \"no field 'answer'" in warnings[0]
        and " slot " in warnings[0]
    )


def test_a_worker_and_the_assembler_exit_once_the_run_has_ended(client, make_run, issuer, caplog, monkeypatch):
    import functools
    import logging
    import threading

    from streamgrp.config import AssemblerConfig
    from streamgrp.core.events import RunFinished
    from streamgrp.services import assembler as assembler_module
    from streamgrp.services.assembler import Assembler
    from streamgrp.store.run_end import RunEndWatch

    caplog.set_level(logging.INFO)
    run = make_run(n_samples=2)
    issuer(run).issue([{}])
    worker = WorkerProcess(WorkerClient(client, run.keys), lambda request: make_sample(), WorkerConfig(), n_samples=2)
    worker.run_end.interval_s = 0.1
    # the assembler's watch reads the control stream every 5 s by default; as often as the worker's here
    monkeypatch.setattr(assembler_module, "RunEndWatch", functools.partial(RunEndWatch, interval_s=0.1))
    assembler = Assembler(client, run, AssemblerConfig(lease_ttl_s=1, tick_interval_s=0.05))
    exited = {}
    threads = [
        threading.Thread(target=lambda: exited.setdefault("worker", worker.run()), daemon=True),
        threading.Thread(target=lambda: exited.setdefault("assembler", assembler.run()), daemon=True),
    ]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    assert exited == {}  # not burst: idle, they wait for more work while the run goes on
    client.xadd(run.keys.control, codec.encode(RunFinished(steps=1, producer="batcher-test")))
    for thread in threads:
        thread.join(timeout=15)
    assert exited == {"worker": 1, "assembler": 1}
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"run {run.keys.run} finished: no task will come; worker" in said
    assert f"run {run.keys.run} finished: no slot result will be needed; assembler" in said

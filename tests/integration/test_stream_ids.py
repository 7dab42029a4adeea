"""Foreign stream ids make no publish fail forever and stop no role, with the worker's own ACL user.

A payload sits at its slot result's id, so an entry a worker's credential appends to the payloads stream at a
later id (a plain ``XADD *`` in the same millisecond as a publish, or an explicit id in the future, deleted
or not) would make that publish fail: the payload and its header move after it instead. At the largest id
there is no payload can ever be written: the worker publishes those results as failed slots saying why and
goes on. Only the batcher may append to the task queue, so no other role can exhaust its ids.

Runs keep payloads in a stream only when recorded so (``payload_layout = "stream"``, what older versions
wrote), so the payload tests here make such runs; a keys run's payload ids cannot collide (its payload
keys are named by their slot entry's id, test_payload_keys.py).
"""

from __future__ import annotations

import threading

from role_users import refused, role_users  # noqa: F401  (a fixture)

from streamgrp.config import AssemblerConfig, WorkerConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided
from streamgrp.replay.verifier import format_report, verify
from streamgrp.services.assembler import Assembler
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient, WorkerProcess
from streamgrp.store.streams import read_entries

LARGEST_ID = "18446744073709551615-18446744073709551615"


def _rollout(request):
    return make_sample(tokens=8)


def _decisions(client, run) -> list[GroupDecided]:
    return [codec.decode(fields) for _, fields in client.xrange(run.keys.decisions)]


def _run_through(client, run, role_users, n_tasks: int, issuer) -> list[GroupDecided]:
    issuer(run).issue([{"tokens": 8}] * n_tasks)
    worker = WorkerProcess(
        WorkerClient(role_users.client("worker"), run.keys),
        _rollout,
        WorkerConfig(burst=True, concurrency=4),
        n_samples=run.config.n_samples,
    )
    worker.run()  # returns: it did not exit on a publish error
    Assembler(role_users.client("assembler"), run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
    return _decisions(client, run)


def test_a_future_payload_id_written_and_deleted_fails_no_publish(client, make_run, issuer, role_users):
    run = make_run(n_samples=2, payload_layout="stream")
    worker = role_users.client("worker")
    future = worker.xadd(run.keys.payloads, {"h": b"{}"}, id="99999999999999-0")
    refused(lambda: worker.xdel(run.keys.payloads, future))  # it may not delete payloads...
    client.xdel(run.keys.payloads, future)  # ...but the stream's last id stays in the future once deleted anyway
    decisions = _run_through(client, run, role_users, 4, issuer)
    assert sorted(d.decision for d in decisions) == ["complete"] * 4
    members = [m.entry for d in decisions for m in d.members]
    payloads = read_entries(client, run.keys.payloads, members)
    assert all(p is not None for p in payloads) and all(m > "99999999999999-0" for m in members)
    report = verify(client, run.keys)
    assert report.ok, format_report(report)


def test_plain_payload_appends_in_the_same_millisecond_fail_no_publish(client, make_run, issuer, role_users):
    run = make_run(n_samples=2, payload_layout="stream")
    flooder = role_users.client("worker")
    stop = threading.Event()

    def flood():
        while not stop.is_set():
            pipe = flooder.pipeline(transaction=False)
            for _ in range(20):
                pipe.xadd(run.keys.payloads, {"h": b"{}"})
            pipe.execute()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        [task] = issuer(run).issue([{"tokens": 8}])
        publisher = WorkerClient(role_users.client("worker"), run.keys)
        ids = [publisher.publish(task.task_id, slot % 2, make_sample(tokens=8)) for slot in range(200)]
    finally:
        stop.set()
        thread.join()
    payloads = read_entries(client, run.keys.payloads, ids)
    assert all(p is not None and p[b"h"] != b"{}" for p in payloads)  # each at its own header's id


def test_at_the_largest_payload_id_results_fail_saying_why_and_the_run_goes_on(client, make_run, issuer, role_users):
    run = make_run(n_samples=2, payload_layout="stream")
    role_users.client("worker").xadd(run.keys.payloads, {"h": b"{}"}, id=LARGEST_ID)
    decisions = _run_through(client, run, role_users, 3, issuer)
    assert len(decisions) == 3 and all(d.decision == "dropped" for d in decisions)
    failed = [codec.decode(f) for _, f in client.xrange(run.keys.slots) if b"slot_result" in f[b"h"]]
    assert failed and all(r.outcome == "failed" and "payloads stream holds an entry" in r.error for r in failed)
    report = verify(client, run.keys)
    assert report.ok, format_report(report)


def test_no_role_but_the_batcher_may_append_to_the_task_queue(client, make_run, role_users):
    run = make_run(n_samples=2)
    for role in ("worker", "gateway", "rewarder", "assembler", "trainer", "archiver", "inspector"):
        user = role_users.client(role)
        refused(lambda: user.xadd(run.keys.tasks, {"h": b"{}"}, id=LARGEST_ID))
    assert role_users.client("batcher").xadd(run.keys.tasks, {"h": b"{}"})  # the issuer's own


def test_a_group_log_at_the_largest_id_stops_no_role(client, make_run, issuer, role_users, monkeypatch):
    # Nothing can be appended to the group log again, and no ACL can stop a writer of it choosing that id.
    # The batcher's issue takes its task back (in neither stream) and the batcher goes on (its stall bound
    # ends the run); a worker's results wait for it, the worker not exiting.
    from streamgrp.services import worker as worker_module
    from streamgrp.services.feeder import Feeder
    from streamgrp.store.lease import Lease

    monkeypatch.setattr(worker_module, "LOG_FULL_WAIT_S", 0.1)
    run = make_run(n_samples=2)
    issuer(run).issue([{"tokens": 8}])
    role_users.client("worker").xadd(run.keys.slots, {"h": b"{}"}, id=LARGEST_ID)
    tasks_before = client.xlen(run.keys.tasks)
    batcher = role_users.client("batcher")
    lease = Lease(batcher, run.keys.batcher_lease, "b", 10)
    assert lease.acquire()
    feeder = Feeder(batcher, run.keys, iter([{"tokens": 8}] * 8), batch_size=4, max_staleness=1, producer="b")
    assert feeder.feed(0, lease.token) == 0 and feeder.window_full
    assert client.xlen(run.keys.tasks) == tasks_before and feeder.cursor == 0  # nothing half-issued

    process = WorkerProcess(
        WorkerClient(role_users.client("worker"), run.keys), _rollout, WorkerConfig(concurrency=2), n_samples=2
    )
    stop, failed = threading.Event(), []
    thread = threading.Thread(target=lambda: _capture(failed, process.run, stop), daemon=True)
    thread.start()
    thread.join(timeout=1.5)
    assert thread.is_alive() and not failed  # still there, waiting
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive() and not failed


def _capture(failed: list, call, stop) -> None:
    try:
        call(stop)
    except Exception as exc:  # noqa: BLE001 - the test reports it
        failed.append(exc)

import logging
import time

import orjson
import pytest

from streamgrp.config import AssemblerConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, RunTerminated
from streamgrp.core.group_fold import Closed, run_fold
from streamgrp.core.legacy import SlotResultV1
from streamgrp.services.assembler import Assembler
from streamgrp.services.synthetic import make_sample, synthetic_rollout
from streamgrp.services.worker import WorkerClient
from streamgrp.store.keys import ASSEMBLER_GROUP
from streamgrp.store.lease import LeaseLost

pytestmark = pytest.mark.cluster  # core: runs on the Redis Cluster kind too

FAST = AssemblerConfig(lease_ttl_s=1.0, tick_interval_s=0.05)


def decisions(client, run):
    return [codec.decode(fields) for _, fields in client.xrange(run.keys.decisions)]


def counts(client, run):
    return {k.decode(): int(v) for k, v in client.hgetall(run.keys.counts).items()}


def pending(client, run):
    return client.xpending(run.keys.slots, ASSEMBLER_GROUP)["pending"]


def test_every_task_gets_exactly_one_decision_matching_the_pure_fold(client, make_run, issuer, drain):
    run = make_run(n_samples=4)
    issuer(run).issue([{"tokens": 16, "reject_rate": 0.2, "fail_rate": 0.1, "seed": 3}] * 60)
    assert drain(client, run, synthetic_rollout) == 60
    recorded = decisions(client, run)
    assert len({d.task_id for d in recorded}) == 60 == len(recorded)
    log = [(eid.decode(), codec.decode(fields)) for eid, fields in client.xrange(run.keys.slots)]
    _, outputs = run_fold(run.config.policy(), log, run.config.group_timeout_s)
    expected = [o.decision for o in outputs if isinstance(o, Closed)]
    assert [_key(d) for d in recorded] == [_key(d) for d in expected]
    assert pending(client, run) == 0
    c = counts(client, run)
    assert c["target_slots"] == 240
    assert c["slots:sample"] + c["slots:rejected"] + c["slots:failed"] == 240
    assert c["decisions:complete"] + c.get("decisions:partial", 0) + c.get("decisions:dropped", 0) == 60


def test_restart_rebuilds_open_groups_from_pending_entries(client, make_run, issuer):
    run = make_run(n_samples=3)
    [task] = issuer(run).issue([{}])
    worker = WorkerClient(client, run.keys)
    worker.publish(task.task_id, 0, make_sample(tokens=5))
    worker.publish(task.task_id, 1, None)
    first = Assembler(client, run, FAST)
    first.run(burst=True)  # folds and leaves the open group's entries pending
    assert pending(client, run) == 3 and decisions(client, run) == []
    # The first assembler dies holding its fold in memory; a new one must rebuild from the server.
    client.delete(run.keys.assembler_lease)
    worker.publish(task.task_id, 2, make_sample(tokens=7))
    second = Assembler(client, run, FAST)
    assert second.run(burst=True) == 1
    [decision] = decisions(client, run)
    assert (decision.decision, decision.slots, [m.tokens for m in decision.members]) == ("partial", (0, 2), [5, 7])
    assert pending(client, run) == 0


def test_a_standby_waits_for_the_lease_then_takes_over(client, make_run, issuer, background, caplog):
    caplog.set_level(logging.INFO, logger="streamgrp.store.lease")
    run = make_run(n_samples=2)
    config = AssemblerConfig(lease_ttl_s=0.6, tick_interval_s=0.05)
    active = Assembler(client, run, config, name="active")
    assert active.lease.acquire()  # then it "dies": it never renews and never releases
    [task] = issuer(run).issue([{}])
    worker = WorkerClient(client, run.keys)
    worker.publish(task.task_id, 0, make_sample())
    worker.publish(task.task_id, 1, make_sample())
    standby = Assembler(client, run, config, name="standby")
    started = time.monotonic()
    background(standby.run)
    _wait_for(lambda: len(decisions(client, run)) == 1, timeout=5)
    assert time.monotonic() - started >= 0.3  # it could not act before the old lease expired
    assert decisions(client, run)[0].producer == "standby"
    # It said it was standing by, and for whom, once (not at every poll).
    said = [r.getMessage() for r in caplog.records if "stands by" in r.getMessage()]
    assert (
        len(said) == 1
        and said[0].startswith("assembler standby stands by: active holds the lease ")
        and run.keys.assembler_lease in said[0]
    ), said


def test_a_fenced_assembler_cannot_commit(client, make_run, issuer):
    run = make_run(n_samples=1)
    [task] = issuer(run).issue([{}])
    WorkerClient(client, run.keys).publish(task.task_id, 0, make_sample())
    zombie = Assembler(client, run, FAST)
    assert zombie.lease.acquire()
    client.set(run.keys.assembler_lease, "someone-else")
    zombie._rebuild()
    with pytest.raises(LeaseLost):
        zombie._round(">", block_ms=None)
    assert decisions(client, run) == []


def test_deadline_closes_groups_with_missing_slots(client, make_run, issuer, background):
    run = make_run(n_samples=3, group_timeout_s=0.3)
    [task] = issuer(run).issue([{}])
    worker = WorkerClient(client, run.keys)
    worker.publish(task.task_id, 0, make_sample())
    worker.publish(task.task_id, 1, make_sample())
    background(Assembler(client, run, FAST).run)
    _wait_for(lambda: len(decisions(client, run)) == 1, timeout=5)
    [decision] = decisions(client, run)
    assert (decision.decision, decision.closed_by) == ("partial", "deadline")
    assert decision.slot_outcomes == {"0": "sample", "1": "sample", "2": "timeout"}
    assert decision.decided_at >= decision.issued_at + 0.3
    worker.publish(task.task_id, 2, make_sample())  # arrives after the decision: late, acknowledged
    _wait_for(lambda: counts(client, run).get("slots:late") == 1, timeout=5)
    _wait_for(lambda: pending(client, run) == 0, timeout=5)
    assert counts(client, run)["slots:timeout"] == 1


def test_duplicates_and_late_results_are_counted_and_acknowledged_never_folded(client, make_run, issuer):
    run = make_run(n_samples=2)
    [task] = issuer(run).issue([{}])
    worker = WorkerClient(client, run.keys)
    worker.publish(task.task_id, 0, make_sample(tokens=3))
    worker.publish(task.task_id, 0, make_sample(tokens=9))  # duplicate: the first result wins
    Assembler(client, run, FAST).run(burst=True)
    worker.publish(task.task_id, 1, make_sample(tokens=4))
    worker.publish(task.task_id, 1, None)  # late

    Assembler(client, run, FAST).run(burst=True)
    [decision] = decisions(client, run)
    assert [m.tokens for m in decision.members] == [3, 4]
    c = counts(client, run)
    assert (c["slots:duplicate"], c["slots:late"], c["slots:sample"]) == (1, 1, 2)
    assert pending(client, run) == 0


def test_a_contract_violation_is_recorded_as_a_dropped_decision_and_nothing_else(client, make_run, issuer):
    """The batcher writes the run's one terminal event (with its step) when it reads this decision."""
    run = make_run(n_samples=2, min_usable_group_size=2)
    [task] = issuer(run).issue([{}])
    worker = WorkerClient(client, run.keys)
    worker.publish(task.task_id, 0, make_sample(rows=2))
    worker.publish(task.task_id, 1, make_sample())
    Assembler(client, run, FAST).run(burst=True)
    [decision] = decisions(client, run)
    assert (decision.decision, decision.reason) == ("dropped", "contract_violation")
    assert "slot sizes [2, 1]" in decision.error
    assert not [
        e for e in (codec.decode(f) for _, f in client.xrange(run.keys.control)) if isinstance(e, RunTerminated)
    ]


BAD_ENTRIES = {
    "missing_field": lambda good: {b"x": b"1"},
    "bad_header": lambda good: {b"h": b"{oops"},
    "wrong_type": lambda good: {b"h": _patch(good, slot="zero"), b"b": good[b"b"]},
    "length_mismatch": lambda good: {b"h": good[b"h"], b"b": good[b"b"][:-3]},
    "unknown_dtype": lambda good: {b"h": _patch_dtype(good, "complex64"), b"b": good[b"b"]},
    "oversized": lambda good: {b"h": good[b"h"], b"b": good[b"b"], b"pad": b"x" * 5000},
    "slot_out_of_range": lambda good: {b"h": _patch(good, slot=9), b"b": good[b"b"]},
    "unknown_task": lambda good: {b"h": _patch(good, task_id="never-issued"), b"b": good[b"b"]},
}


def test_bad_entries_are_dead_lettered_with_distinct_reasons_while_valid_traffic_flows(client, make_run, issuer):
    run = make_run(n_samples=2)
    tasks = issuer(run).issue([{}] * 4)
    worker = WorkerClient(client, run.keys)
    # A schema-1 slot result (sample inline) is still folded, so its tensor fields are broken here too.
    good = codec.encode(SlotResultV1(task_id=tasks[0].task_id, slot=0, outcome="sample", sample=make_sample(tokens=64)))
    for index, task in enumerate(tasks):
        worker.publish(task.task_id, 0, make_sample())
        reason = list(BAD_ENTRIES)[index * 2 : index * 2 + 2]
        for name in reason:
            client.xadd(run.keys.slots, BAD_ENTRIES[name](good))
        worker.publish(task.task_id, 1, make_sample())
    config = AssemblerConfig(lease_ttl_s=1.0, max_entry_bytes=4096 + 1024)
    assert Assembler(client, run, config).run(burst=True) == 4
    letters = client.xrange(run.keys.deadletter)
    reasons = sorted(fields[b"reason"].decode() for _, fields in letters)
    assert reasons == sorted(BAD_ENTRIES)
    for _, fields in letters:
        assert fields[b"stream"] == run.keys.slots.encode()
        assert fields[b"detail"]
        assert any(key.startswith(b"f:") for key in fields)
    c = counts(client, run)
    assert c["slots:invalid"] == len(BAD_ENTRIES)
    assert all(c[f"deadletter:{name}"] == 1 for name in BAD_ENTRIES)
    assert pending(client, run) == 0
    assert all(d.decision == "complete" for d in decisions(client, run))


def _patch(good, **changes):
    header = orjson.loads(good[b"h"])
    header.update(changes)
    return orjson.dumps(header)


def _patch_dtype(good, dtype):
    header = orjson.loads(good[b"h"])
    header["sample"]["token_ids"]["__raw__"][0] = dtype
    return orjson.dumps(header)


def _key(decision: GroupDecided):
    return decision.task_id, decision.decision, decision.reason, decision.slots, [m.entry for m in decision.members]


def _wait_for(condition, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_metrics_mirror_exactly_the_counters_the_commit_applied(client, make_run, issuer):
    from prometheus_client import CollectorRegistry

    from streamgrp.cli.metrics import Metrics

    run = make_run(n_samples=3)
    tasks = issuer(run).issue([{}] * 4)
    worker = WorkerClient(client, run.keys)
    for task in tasks:
        worker.publish(task.task_id, 0, make_sample())
        worker.publish(task.task_id, 0, make_sample())  # duplicate
        worker.publish(task.task_id, 1, None)
        worker.publish(task.task_id, 2, make_sample())
    client.xadd(run.keys.slots, {b"junk": b"1"})
    metrics = Metrics(CollectorRegistry())
    Assembler(client, run, FAST, metrics=metrics).run(burst=True)
    c = counts(client, run)
    sample = lambda name, **labels: metrics.registry.get_sample_value(name, labels) or 0  # noqa: E731
    for outcome in ("sample", "rejected", "duplicate", "invalid"):
        assert sample("streamgrp_slots_total", outcome=outcome) == c.get(f"slots:{outcome}", 0) > 0
    assert sample("streamgrp_groups_total", decision="partial") == c["decisions:partial"] == 4
    assert sample("streamgrp_target_slots_total") == c["target_slots"] == 12
    assert sample("streamgrp_dead_letters_total", reason="missing_field") == 1
    assert metrics.registry.get_sample_value("streamgrp_group_assembly_seconds_count") == 4


def test_decided_at_is_in_the_servers_clock_for_every_close(client, make_run, issuer, background, monkeypatch):
    """A group closed by its last slot is stamped with the server's TIME, like deadline closes and
    issued_at: here the assembler's host clock runs an hour ahead and no decision shows it."""
    run = make_run(n_samples=2, group_timeout_s=0.3)
    complete, timed_out = issuer(run).issue([{}, {}])
    worker = WorkerClient(client, run.keys)
    worker.publish(complete.task_id, 0, make_sample())
    worker.publish(complete.task_id, 1, make_sample())
    worker.publish(timed_out.task_id, 0, make_sample())
    before = float(client.time()[0])
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600.0)
    background(Assembler(client, run, FAST).run)
    _wait_for(lambda: len(decisions(client, run)) == 2, timeout=5)
    after = float(client.time()[0]) + 1
    by_task = {d.task_id: d for d in decisions(client, run)}
    assert by_task[complete.task_id].closed_by == "all_slots" and by_task[timed_out.task_id].closed_by == "deadline"
    for decision in by_task.values():
        assert before <= decision.decided_at <= after, (decision.closed_by, decision.decided_at, before)
        assert decision.decided_at >= decision.issued_at

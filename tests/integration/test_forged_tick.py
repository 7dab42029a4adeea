"""A tick entry in the group log that says a time in the future (what any credential that may write the
log could add) no longer closes every open group as timed out: the assembler and verify fold each tick
no later than its entry was written, so the groups stay open and the run's decisions verify."""

from role_users import role_users  # noqa: F401  (a fixture)

from streamgrp.config import AssemblerConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, Tick
from streamgrp.core.refusal import TICK_FROM_FUTURE
from streamgrp.replay.verifier import format_report, verify
from streamgrp.services.assembler import Assembler
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient


def _decisions(client, run) -> list[GroupDecided]:
    return [codec.decode(fields) for _, fields in client.xrange(run.keys.decisions)]


def test_a_tick_from_the_future_times_nothing_out(client, make_run, issuer):
    run = make_run(n_samples=2, group_timeout_s=600.0)
    [task] = issuer(run).issue([{"tokens": 8}])
    worker = WorkerClient(client, run.keys)
    worker.publish(task.task_id, 0, make_sample(tokens=8))
    client.xadd(run.keys.slots, codec.encode(Tick(now=4_000_000_000.0, producer="forger", seq=1)))
    config = AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)
    Assembler(client, run, config).run(burst=True)
    assert _decisions(client, run) == []  # the forged tick closed nothing

    worker.publish(task.task_id, 1, make_sample(tokens=8))
    Assembler(client, run, config).run(burst=True)
    [decision] = _decisions(client, run)
    assert (decision.decision, decision.closed_by) == ("complete", "all_slots")
    report = verify(client, run.keys)
    assert report.ok, format_report(report)


def test_a_tick_at_a_future_entry_id_is_dead_lettered_with_the_workers_own_user(client, make_run, issuer, role_users):
    # Any writer of the group log chooses its entry ids: a tick at an id in the future says a time its id
    # allows. The assembler refuses a tick after the server's clock when it reads it (tick_from_future),
    # and verify skips it as the assembler did.
    run = make_run(n_samples=2, group_timeout_s=600.0)
    [task] = issuer(run).issue([{"tokens": 8}])
    worker = role_users.client("worker")
    publisher = WorkerClient(worker, run.keys)
    publisher.publish(task.task_id, 0, make_sample(tokens=8))
    forged = worker.xadd(
        run.keys.slots, codec.encode(Tick(now=4_000_000_000.0, producer="forger", seq=1)), id="4000000000000-0"
    ).decode()
    config = AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)
    Assembler(role_users.client("assembler"), run, config).run(burst=True)
    assert _decisions(client, run) == []  # the forged tick closed nothing
    [letter] = [fields for _, fields in client.xrange(run.keys.deadletter)]
    assert (letter[b"reason"], letter[b"entry"].decode()) == (TICK_FROM_FUTURE.encode(), forged)

    publisher.publish(task.task_id, 1, make_sample(tokens=8))
    Assembler(role_users.client("assembler"), run, config).run(burst=True)
    [decision] = _decisions(client, run)
    assert (decision.decision, decision.closed_by) == ("complete", "all_slots")
    report = verify(client, run.keys)
    assert report.ok, format_report(report)

"""SIGKILL the assembler (several times) and a worker mid-group while 2,000 groups flow.

Afterwards every task has exactly one decision, no slot entry was folded twice, every published
slot is accounted for, and the decisions equal the pure fold over the recorded slot log.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest
from processes import RoleProcess, wait_until
from stored_payloads import payload_entries

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, SlotResult, TaskIssued, Tick
from streamgrp.core.group_fold import Closed, Ignored, run_fold
from streamgrp.store.keys import ASSEMBLER_GROUP, WORKERS_GROUP
from streamgrp.store.runs import join_run
from streamgrp.store.tasks import TaskIssuer

pytestmark = [pytest.mark.slow, pytest.mark.cluster]  # cluster: the core crash test runs on a cluster too

GROUPS = 2000
N_SAMPLES = 4
PROMPT = {"tokens": 32, "reject_rate": 0.1, "fail_rate": 0.1, "seed": 11, "sleep_s": 0.004}


def test_sigkill_assembler_and_worker_mid_group_loses_and_doubles_nothing(client, redis_url, run_name, tmp_path):
    rng = random.Random(1234)
    run = join_run(client, run_name, RunConfig(n_samples=N_SAMPLES, group_timeout_s=3600.0))
    issued = TaskIssuer(client, run.keys).issue([PROMPT] * GROUPS)
    common = ["--redis-url", redis_url, "--run", run_name]

    # A worker that runs one slot at a time and hangs in slot 2, so its SIGKILL lands mid-group.
    here = str(Path(__file__).parent)
    victim = RoleProcess(
        "worker",
        [*common, "--concurrency", "1", "--claim-idle-s", "1", "--rollout", "rollouts:stalls_at_slot_two"],
        tmp_path / "victim",
        env={"PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    (tmp_path / "victim").mkdir()
    victim.start()
    workers = [
        RoleProcess("worker", [*common, "--concurrency", "4", "--claim-idle-s", "1"], tmp_path / f"w{i}")
        for i in range(2)
    ]
    assembler = RoleProcess("assembler", [*common, "--lease-ttl-s", "1", "--tick-interval-s", "0.1"], tmp_path / "asm")
    for process in (*workers, assembler):
        process.log_dir.mkdir()

    try:
        wait_until(
            lambda: _victim_partial_tasks(client, run, victim.pid),
            timeout=30,
            message="the victim worker to be in the middle of a group",
        )
        victim.kill()
        half_done = _victim_partial_tasks(client, run, victim.pid)
        assert half_done, "the victim was killed with no partially published task"
        for process in (*workers, assembler):
            process.start()

        kills = 0
        while kills < 3 or _decided(client, run) < GROUPS // 2:
            wait_until(
                lambda: _holds_lease(client, run, assembler.pid),
                timeout=30,
                message=f"assembler start {assembler.starts} to take the lease",
            )
            before = _decided(client, run)
            wait_until(lambda: _decided(client, run) > before, timeout=30, message="the assembler to decide something")
            if _decided(client, run) >= GROUPS - 50 and kills >= 3:
                break
            time.sleep(rng.uniform(0.05, 0.6))  # a random moment while it folds
            assembler.kill()
            kills += 1
            assembler.start()
            if kills >= 6:
                break
        assert kills >= 3

        wait_until(lambda: _decided(client, run) == GROUPS, timeout=180, interval=0.2, message="every task decided")
        wait_until(
            lambda: client.xpending(run.keys.slots, ASSEMBLER_GROUP)["pending"] == 0,
            timeout=30,
            message="the slot log fully acknowledged",
        )
    finally:
        for process in (*workers, assembler):
            if process.proc is not None and process.proc.poll() is None:
                process.stop()

    # each restart rebuilt its open groups from entries its killed predecessor left pending
    # (a life killed before it logged that it is active, on a loaded machine, has no line)
    replays = [int(n) for n in re.findall(r"replayed (\d+) pending entries", assembler.output())]
    assert 3 <= len(replays) <= assembler.starts
    assert sum(1 for n in replays[1:] if n > 0) >= 2
    _check_log(client, run, issued, half_done)


def _check_log(client, run, issued, half_done):
    raw = client.xrange(run.keys.slots)
    log = [(eid.decode(), codec.decode(fields)) for eid, fields in raw]
    decisions = [codec.decode(fields) for _, fields in client.xrange(run.keys.decisions)]

    # every task has exactly one decision
    assert sorted(d.task_id for d in decisions) == sorted(t.task_id for t in issued)

    # no slot entry folded twice, and members are the right task's slots
    by_entry = {eid: event for eid, event in log}
    member_entries = [m.entry for d in decisions for m in d.members]
    assert len(member_entries) == len(set(member_entries))
    payloads = {eid.decode(): fields for eid, fields in payload_entries(client, run.keys)}
    for decision in decisions:
        for member in decision.members:
            event = by_entry[member.entry]
            assert (event.task_id, event.slot, event.outcome) == (decision.task_id, member.slot, "sample")
            # its payload sits at the same id and hashes to the digest the decision recorded
            assert codec.entry_digest(payloads[member.entry]) == member.digest == event.sample.digest

    # decisions equal the pure fold over the same recorded log (ticks included)
    _, outputs = run_fold(run.config.policy(), log, run.config.group_timeout_s)
    expected = {o.decision.task_id: o.decision for o in outputs if isinstance(o, Closed)}
    assert {d.task_id: _key(d) for d in decisions} == {t: _key(d) for t, d in expected.items()}

    # every published slot is accounted for as folded, duplicate, late or dead-lettered
    published = sum(1 for _, event in log if isinstance(event, SlotResult))
    counts = {k.decode(): int(v) for k, v in client.hgetall(run.keys.counts).items()}
    folded = counts["slots:sample"] + counts.get("slots:rejected", 0) + counts.get("slots:failed", 0)
    accounted = folded + counts.get("slots:duplicate", 0) + counts.get("slots:late", 0) + counts.get("slots:invalid", 0)
    assert accounted == published
    ignored = Counter(o.reason for o in outputs if isinstance(o, Ignored))
    assert counts.get("slots:duplicate", 0) == ignored["duplicate"]
    assert counts.get("slots:late", 0) == ignored["late"]
    assert counts.get("slots:timeout", 0) == 0  # deadlines were long enough not to fire
    # the killed worker's half-published tasks were reclaimed and republished: the repeats count as
    # duplicates (group still open) or late (the reclaiming worker's other slots closed it first)
    assert counts.get("slots:duplicate", 0) + counts.get("slots:late", 0) >= 1
    for task_id in half_done:
        assert sum(1 for _, e in log if isinstance(e, SlotResult) and e.task_id == task_id) > N_SAMPLES - 1
    outcomes = Counter(o for d in decisions for o in d.slot_outcomes.values())
    assert 0.1 < (outcomes["rejected"] + outcomes["failed"]) / (GROUPS * N_SAMPLES) < 0.3
    assert client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0
    assert sum(1 for _, e in log if isinstance(e, TaskIssued)) == GROUPS
    assert all(isinstance(e, (TaskIssued, SlotResult, Tick)) for _, e in log)


def _key(decision: GroupDecided):
    return decision.decision, decision.reason, decision.members


def _decided(client, run) -> int:
    return client.hlen(run.keys.decided)


def _holds_lease(client, run, pid: int) -> bool:
    token = client.get(run.keys.assembler_lease)
    return token is not None and f"-{pid}-" in token.decode()


def _victim_slots(client, run, pid: int) -> Counter:
    counts: Counter = Counter()
    for _, fields in client.xrange(run.keys.slots):
        event = codec.decode(fields)
        if isinstance(event, SlotResult) and f"-{pid}-" in event.producer:
            counts[event.task_id] += 1
    return counts


def _victim_partial_tasks(client, run, pid: int) -> list[str]:
    return [task for task, n in _victim_slots(client, run, pid).items() if n < N_SAMPLES]

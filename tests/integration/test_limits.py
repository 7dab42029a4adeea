"""Limits that hostile or large input used to break (issue: never stops, never doubles).

- Lua's unpack fails past about 8,000 values, after a script had written: a step of 9,000 groups was
  written twice. Now acknowledgements go in bounded chunks and every script checks its whole input
  before it writes.
- An entry with thousands of fields, or of 100 MB, is dead-lettered as a bounded stub.
- Open groups are capped; decided tasks are looked up on the server, not kept in memory.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import redis

from streamgrp.config import AssemblerConfig, BatcherConfig, RunConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, GroupStats, SlotResult, StepManifest
from streamgrp.errors import LeaseLost
from streamgrp.services.assembler import Assembler
from streamgrp.services.batcher import Batcher
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient
from streamgrp.store import scripts
from streamgrp.store.keys import ASSEMBLER_GROUP, BATCHER_GROUP, WORKERS_GROUP
from streamgrp.store.runs import join_run

FAST = AssemblerConfig(lease_ttl_s=1.0, tick_interval_s=0.05)


def counts(client, run) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(run.keys.counts).items()}


def decision(task: int) -> GroupDecided:
    digest = hashlib.blake2b(str(task).encode(), digest_size=16).hexdigest()
    return GroupDecided(
        task_id=f"t{task:06d}",
        decision="complete",
        slots=(0, 1),
        member_entries=(f"{task + 1}-0", f"{task + 1}-1"),
        member_digests=(digest, digest),
        member_rows=(1, 1),
        member_tokens=(8 + task % 5, 8),
        member_versions=(0, 0),
        slot_outcomes={"0": "sample", "1": "sample"},
        stats=GroupStats.of(2, 2, 2),
        closed_by="all_slots",
    )


def write_decisions(client, run, n: int) -> None:
    pipe = client.pipeline(transaction=False)
    for task in range(n):
        pipe.xadd(run.keys.decisions, codec.encode(decision(task)))
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()


def manifests(client, run) -> list[StepManifest]:
    return [codec.decode(fields) for _, fields in client.xrange(run.keys.steps)]


def batcher_for(client, run) -> Batcher:
    batcher = Batcher(client, run, BatcherConfig(round_s=3, lease_ttl_s=5))
    assert batcher.lease.acquire()
    batcher._activate()
    return batcher


@pytest.mark.one_server_kind
@pytest.mark.parametrize("max_batch_size, sizes", [(10_000, [9000]), (4096, [4096, 4096, 808])])
def test_a_dynamic_batch_of_9000_groups_puts_each_group_in_exactly_one_step(client, run_name, max_batch_size, sizes):
    run = join_run(
        client,
        run_name,
        RunConfig(n_samples=2, dp_size=2, batch_mode="dynamic", max_batch_size=max_batch_size, max_staleness=100),
    )
    batcher = batcher_for(client, run)
    write_decisions(client, run, 9000)
    batcher.round()  # one round reads all 9,000 (512 per read) and writes the steps
    batcher.round()
    steps = manifests(client, run)
    assert [sum(len(shard.groups) for shard in step.shards) for step in steps] == sizes
    tasks = [group.task_id for step in steps for shard in step.shards for group in shard.groups]
    assert len(tasks) == len(set(tasks)) == 9000
    assert counts(client, run)["groups:batched"] == 9000
    assert client.xpending(run.keys.decisions, BATCHER_GROUP)["pending"] == 0
    assert batcher.outcome == "running"


def test_a_fixed_batch_size_over_the_bound_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="max_batch_size"):
        RunConfig(batch_size=5000)


def test_a_round_acknowledging_9000_duplicates_commits_once(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    worker = WorkerClient(client, run.keys)
    from streamgrp.store.tasks import TaskIssuer

    [task] = TaskIssuer(client, run.keys).issue([{}])
    worker.publish(task.task_id, 0, make_sample())
    event = SlotResult(task_id=task.task_id, slot=0, outcome="rejected")
    pipe = client.pipeline(transaction=False)
    for _ in range(9000):
        pipe.xadd(run.keys.slots, codec.encode(event))
    pipe.execute()
    worker.publish(task.task_id, 1, make_sample())
    config = AssemblerConfig(lease_ttl_s=5.0, tick_interval_s=0.05, read_count=20_000)
    assert Assembler(client, run, config).run(burst=True) == 1
    c = counts(client, run)
    assert c["slots:duplicate"] == 9000 and c["decisions:complete"] == 1
    assert client.xpending(run.keys.slots, ASSEMBLER_GROUP)["pending"] == 0


def test_a_round_deciding_1100_groups_acknowledges_every_slot_and_counts_every_decision(client, run_name):
    """The commit acknowledges a round's decided slots together and writes each counter once: 8,800
    acknowledgements in one call (more than one unpack takes) and 1,100 decisions counted exactly."""
    run = join_run(client, run_name, RunConfig(n_samples=8))
    from streamgrp.store.tasks import TaskIssuer

    tasks = TaskIssuer(client, run.keys).issue([{}] * 1100)
    pipe = client.pipeline(transaction=False)
    for task in tasks:
        for slot in range(8):
            pipe.xadd(run.keys.slots, codec.encode(SlotResult(task_id=task.task_id, slot=slot, outcome="rejected")))
    pipe.execute()
    config = AssemblerConfig(lease_ttl_s=5.0, tick_interval_s=0.05, read_count=20_000)
    assert Assembler(client, run, config).run(burst=True) == 1100
    c = counts(client, run)
    assert sum(v for k, v in c.items() if k.startswith("decisions:")) == 1100
    assert c["slots:rejected"] == 8800
    assert client.xlen(run.keys.decisions) == 1100
    assert client.xpending(run.keys.slots, ASSEMBLER_GROUP)["pending"] == 0


def test_an_entry_with_10000_fields_is_dead_lettered_as_a_stub(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    fields = {f"x{i}".encode(): b"v" * 8 for i in range(10_000)}
    entry = client.xadd(run.keys.slots, fields).decode()
    Assembler(client, run, FAST).run(burst=True)
    [(_, letter)] = client.xrange(run.keys.deadletter)
    assert letter[b"entry"].decode() == entry and letter[b"reason"] == b"missing_field"
    assert letter[b"stub"] == b"1" and letter[b"n_fields"] == b"10000"
    assert len(letter) < 20  # a stub, not 10,000 copied fields
    assert counts(client, run)["deadletter:missing_field"] == 1
    assert client.xpending(run.keys.slots, ASSEMBLER_GROUP)["pending"] == 0


def test_a_commit_with_malformed_input_writes_nothing(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    keys = run.keys
    client.set(keys.assembler_lease, "me")
    commit = scripts.register(client, "commit.lua")
    header = codec.encode(decision(1))[codec.HEADER]
    script_keys = [keys.slots, keys.decisions, keys.deadletter, keys.decided, keys.counts, keys.assembler_lease]
    # a good decision first, then an acknowledgement list that claims more ids than it carries
    args = [
        "me",
        ASSEMBLER_GROUP,
        "decide",
        "t000001",
        header,
        0,
        1,
        "decisions:complete",
        1,
        "ack_count",
        "",
        50,
        "1-0",
    ]
    with pytest.raises(redis.ResponseError, match="BAD_INPUT"):
        commit(keys=script_keys, args=args)
    assert client.xlen(keys.decisions) == 0 and not client.exists(keys.decided) and not client.exists(keys.counts)
    # a dead letter of more fields than the scripts allow is refused before anything happens
    too_many = ["dead_letter", "bad_header", "1-0", "detail", 65, *(["k", "v"] * 65)]
    with pytest.raises(redis.ResponseError, match="BAD_INPUT"):
        commit(keys=script_keys, args=["me", ASSEMBLER_GROUP, *too_many])
    assert client.xlen(keys.deadletter) == 0


def test_the_batch_commit_refuses_a_wrong_step_before_writing(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    keys = run.keys
    client.set(keys.batcher_lease, "me")
    commit = scripts.register_fenced(client, "batch_commit.lua")
    script_keys = [
        keys.decisions,
        keys.steps,
        keys.discarded,
        keys.counts,
        keys.batcher_lease,
        keys.batcher_state,
        keys.control,
    ]
    ops = ["step", 0, b"{}", 1, 1, "1-0", "step", 2, b"{}", 1, 1, "2-0"]  # step 2 does not follow step 0
    # a step already written means another batcher owns the run now: the typed error, not a text match
    with pytest.raises(LeaseLost, match="STEP 2 is not the next step 1"):
        commit(keys=script_keys, args=["me", BATCHER_GROUP, *ops])
    assert client.xlen(keys.steps) == 0 and client.hget(keys.batcher_state, "next_step") is None
    with pytest.raises(LeaseLost, match="LEASE lost"):
        commit(keys=script_keys, args=["someone-else", BATCHER_GROUP, *ops[:6]])
    assert client.xlen(keys.steps) == 0
    # an input error is not a fencing error: it stays a server error for the caller to report
    with pytest.raises(redis.ResponseError, match="BAD_INPUT") as refused:
        commit(keys=script_keys, args=["me", BATCHER_GROUP, "Q", 1])
    assert not isinstance(refused.value, LeaseLost)


def test_a_task_flood_is_capped_at_max_open_groups(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2, group_timeout_s=3600))
    from streamgrp.store.tasks import TaskIssuer

    tasks = TaskIssuer(client, run.keys).issue([{}] * 15)
    assembler = Assembler(client, run, AssemblerConfig(lease_ttl_s=5, tick_interval_s=0.05, max_open_groups=10))
    assembler.run(burst=True)
    letters = [fields for _, fields in client.xrange(run.keys.deadletter)]
    assert [f[b"reason"] for f in letters] == [b"open_groups_full"] * 5
    assert counts(client, run)["deadletter:open_groups_full"] == 5
    # the ten open groups still decide; the state holds open groups only, never decided ones
    worker = WorkerClient(client, run.keys)
    for task in tasks[:10]:
        for slot in (0, 1):
            worker.publish(task.task_id, slot, make_sample())
    assembler = Assembler(client, run, FAST)
    assert assembler.run(burst=True) == 10
    assert assembler.state.open == {} and assembler.state.decided == set()


def test_decided_tasks_are_looked_up_on_the_server(client, run_name):
    """A late result and a second issue of a decided task are recognised by a fresh assembler."""
    run = join_run(client, run_name, RunConfig(n_samples=2))
    from streamgrp.store.tasks import TaskIssuer

    issuer = TaskIssuer(client, run.keys)
    [task] = issuer.issue([{}], task_ids=["only"])
    worker = WorkerClient(client, run.keys)
    for slot in (0, 1):
        worker.publish("only", slot, make_sample())
    assert Assembler(client, run, FAST).run(burst=True) == 1
    worker.publish("only", 1, make_sample())
    issuer.issue([{}], task_ids=["only"])
    assert Assembler(client, run, FAST).run(burst=True) == 0
    c = counts(client, run)
    assert c["slots:late"] == 1 and c["tasks:duplicate"] == 1
    assert client.xlen(run.keys.decisions) == 1 and client.xlen(run.keys.deadletter) == 0


def test_the_worker_refuses_an_oversized_sample_as_a_failed_slot(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    worker = WorkerClient(client, run.keys, max_entry_bytes=4096)
    worker.publish("t", 0, make_sample(tokens=2000))
    [(_, fields)] = client.xrange(run.keys.slots)
    event = codec.decode(fields)
    assert event.outcome == "failed" and "over max_entry_bytes=4096" in event.error and event.sample is None


RSS_PROBE = textwrap.dedent("""
    import sys
    from streamgrp.services.assembler import Assembler
    from streamgrp.config import AssemblerConfig
    from streamgrp.store.connection import connect
    from streamgrp.store.runs import open_run
    client = connect(sys.argv[1], check_settings=False)
    run = open_run(client, sys.argv[2])
    def peak_kib():  # VmHWM: this process's peak RSS (ru_maxrss would include the parent's, from fork)
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    before = peak_kib()
    Assembler(client, run, AssemblerConfig(lease_ttl_s=5, tick_interval_s=0.05,
                                           max_entry_bytes=int(sys.argv[3]))).run(burst=True)
    print(before, peak_kib())
""")


@pytest.mark.slow
def test_a_100_mb_entry_costs_the_assembler_one_copy_and_the_dead_letter_a_stub(client, redis_url, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    size = 100 * 1024 * 1024
    header = codec.encode(SlotResult(task_id="t", slot=0, outcome="rejected"))[codec.HEADER]
    client.xadd(run.keys.slots, {b"h": header, b"b": os.urandom(1024) * (size // 1024)})
    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, redis_url, run_name, str(64 * 1024 * 1024)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    before_kib, peak_kib = map(int, out.stdout.split())
    growth = (peak_kib - before_kib) * 1024
    # receiving a stream entry means holding it (redis has no partial read); before this bound a
    # 100 MB entry cost 5.6x its size. Now: the socket buffer and the bytes object, nothing more.
    print(f"assembler peak RSS grew by {growth / size:.2f}x the entry")
    assert growth < 2.6 * size, f"assembler peak RSS grew by {growth / size:.2f}x the entry"
    [(_, letter)] = client.xrange(run.keys.deadletter)
    assert letter[b"reason"] == b"oversized" and letter[b"stub"] == b"1"
    assert sum(len(k) + len(v) for k, v in letter.items()) < 4096
    assert letter[b"h_prefix"] == header[:512]
    assert client.xpending(run.keys.slots, ASSEMBLER_GROUP)["pending"] == 0


def test_the_publish_script_checks_its_whole_input_before_writing(client, run_name):
    keys = join_run(client, run_name, RunConfig(n_samples=2, payload_layout="stream")).keys
    publish = scripts.register(client, "publish.lua")
    header = codec.encode(SlotResult(task_id="t", slot=0, outcome="rejected"))[codec.HEADER]
    plain = [keys.slots, keys.payloads]
    with pytest.raises(redis.ResponseError, match="BAD_INPUT publish takes at most 256"):
        publish(keys=plain, args=["", 0, *[header, b"", b""] * 257])
    with pytest.raises(redis.ResponseError, match="BAD_INPUT an empty slot header at argument 6"):
        publish(keys=plain, args=["", 0, header, b"", b"", b"", b"", b""])
    with pytest.raises(redis.ResponseError, match="BAD_INPUT publish takes"):
        publish(keys=plain, args=["", 0, header, b""])
    for bad in (["", 1, "1-0"], [WORKERS_GROUP, -1], [WORKERS_GROUP, "x"], [WORKERS_GROUP, 257, *["1-0"] * 257]):
        with pytest.raises(redis.ResponseError, match="BAD_INPUT publish takes a consumer group"):
            publish(keys=[*plain, keys.tasks], args=[*bad, header, b"", b""])
    with pytest.raises(redis.ResponseError, match="BAD_INPUT publish takes a consumer group"):
        publish(keys=plain, args=[WORKERS_GROUP, 1, "1-0", header, b"", b""])  # acknowledgements, no tasks key
    assert client.xlen(keys.slots) == 0 and client.xlen(keys.payloads) == 0
    assert len(publish(keys=plain, args=["", 0, *[header, b"", b""] * 256])) == 256

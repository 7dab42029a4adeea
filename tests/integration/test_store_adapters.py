"""The assembler's and the batcher's store adapters against a real server: a commit's records applied once,
and the error mapping (a lost lease or a step written already is `LeaseLost`, with nothing written)."""

from __future__ import annotations

import pytest

from streamgrp.config import RunConfig
from streamgrp.core import codec, counters
from streamgrp.core.batch_fold import Acked
from streamgrp.core.events import GroupDecided, GroupStats, RunFinished, StepManifest
from streamgrp.core.group_fold import Closed
from streamgrp.errors import LeaseLost
from streamgrp.store.assembler_store import Acknowledge, AssemblerStore
from streamgrp.store.batcher_store import BatcherStore, Settle, Step
from streamgrp.store.keys import ASSEMBLER_CONSUMER, ASSEMBLER_GROUP, BATCHER_CONSUMER, BATCHER_GROUP
from streamgrp.store.runs import join_run
from streamgrp.store.streams import ensure_group


def _counts(client, key) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(key).items()}


def _decision(task_id: str, entries: tuple[str, ...]) -> GroupDecided:
    return GroupDecided(
        task_id=task_id,
        decision="complete",
        slots=(0, 1),
        member_entries=entries[1:],
        member_rows=(1, 1),
        member_tokens=(8, 8),
        member_versions=(0, 0),
        slot_outcomes={"0": "sample", "1": "sample"},
        stats=GroupStats.of(2, 2, 2),
        closed_by="all_slots",
        producer="assembler-x",
        seq=1,
    )


def _pending(client, stream: str, group: str, consumer: str, n: int) -> tuple[str, ...]:
    ensure_group(client, stream, group)
    ids = [client.xadd(stream, {"h": b"{}"}).decode() for _ in range(n)]
    client.xreadgroup(group, consumer, {stream: ">"}, count=n)
    return tuple(ids)


def test_an_assembler_round_decides_once_and_acknowledges_what_it_accounts_for(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    keys = run.partitions[0]
    client.set(keys.assembler_lease, "me")
    entries = _pending(client, keys.slots, ASSEMBLER_GROUP, ASSEMBLER_CONSUMER, 4)
    store = AssemblerStore(client, keys)
    decision = _decision("t1", entries[:3])
    committed = store.commit(
        "me", [Closed(decision, entries[:3]), Acknowledge(counters.slots("duplicate"), (entries[3],))]
    )
    assert committed.written == 1 and committed.redundant == 0
    assert committed.counts == {**counters.decision_increments(decision), "slots:duplicate": 1}
    assert _counts(client, keys.counts) == committed.counts
    [(decision_id, fields)] = client.xrange(keys.decisions)
    assert codec.decode(fields) == decision and client.hget(keys.decided, "t1") == decision_id
    assert client.xpending(keys.slots, ASSEMBLER_GROUP)["pending"] == 0
    # the same decision again (another assembler's round): not written, counted as redundant
    again = store.commit("me", [Closed(decision, entries[:3])])
    assert (again.written, again.redundant, again.counts) == (0, 1, {"redundant_decisions": 1})
    assert client.xlen(keys.decisions) == 1


def test_an_assembler_without_the_lease_writes_nothing(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    keys = run.partitions[0]
    client.set(keys.assembler_lease, "someone-else")
    entries = _pending(client, keys.slots, ASSEMBLER_GROUP, ASSEMBLER_CONSUMER, 3)
    with pytest.raises(LeaseLost, match="LEASE lost"):
        AssemblerStore(client, keys).commit("me", [Closed(_decision("t1", entries), entries)])
    assert client.xlen(keys.decisions) == 0 and not client.exists(keys.decided, keys.counts)
    assert client.xpending(keys.slots, ASSEMBLER_GROUP)["pending"] == 3


def test_a_batcher_step_is_written_once_and_a_repeat_is_lease_lost(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    keys = run.keys
    client.set(keys.batcher_lease, "me")
    refs = _pending(client, keys.decisions, BATCHER_GROUP, BATCHER_CONSUMER, 3)
    store = BatcherStore(client, keys, run.partitions)
    manifest = StepManifest(step=0, version=0, shards=(), imbalance=1.0, created_at=1.0, producer="b", seq=1)
    committed = store.commit("me", [Acked(refs[2:]), Step(manifest, refs[:2], ("t1", "t2"))])
    assert committed.steps == 1 and committed.counts == {"steps": 1, "groups:batched": 2}
    assert [codec.decode(fields) for _, fields in client.xrange(keys.steps)] == [manifest]
    assert client.xpending(keys.decisions, BATCHER_GROUP)["pending"] == 0
    # step 0 again: written already, so another batcher owns the run now; nothing else in the call happens
    with pytest.raises(LeaseLost, match="STEP 0 is not the next step 1"):
        store.commit("me", [RunFinished(steps=1, producer="b", seq=2), Step(manifest, refs[:2], ("t1", "t2"))])
    assert client.xlen(keys.steps) == 1 and client.hget(keys.batcher_state, "finished") is None


def test_a_settle_in_a_run_of_one_partition_is_refused_before_the_call(client, run_name):
    run = join_run(client, run_name, RunConfig(n_samples=2))
    client.set(run.keys.batcher_lease, "me")
    with pytest.raises(ValueError, match="only in a partitioned run"):
        BatcherStore(client, run.keys, run.partitions).commit("me", [Settle(("t1",))])

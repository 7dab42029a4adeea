"""The batcher and the trainer API on a real server: stall bound, staleness, the feeder window, the
group filter, manifests and what each rank gets (SPEC sections 4 and 5).

The batcher runs in-process; tests that count rounds call ``batcher.round()`` directly (one
collection round each) after taking the lease, so "exactly N rounds" means N calls.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from cluster import client_for
from processes import wait_until
from stored_payloads import delete_payload, payload_entries

from streamgrp.config import AssemblerConfig, BatcherConfig, WorkerConfig
from streamgrp.core import codec
from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    RunFinished,
    RunTerminated,
    SamplePayload,
    SlotResult,
    StepCommitted,
    StepFailed,
    StepManifest,
    TaskIssued,
    VersionAdvanced,
)
from streamgrp.core.stall import stall_message
from streamgrp.errors import ConfigError, RunFailed
from streamgrp.services.assembler import Assembler
from streamgrp.services.batcher import Batcher
from streamgrp.services.feeder import DatasetIdentity, load_dataset
from streamgrp.services.synthetic import make_sample, synthetic_rollout
from streamgrp.services.worker import WorkerClient, WorkerProcess
from streamgrp.store.keys import BATCHER_GROUP
from streamgrp.store.lease import LeaseLost
from streamgrp.train.trainer import TrainerClient

ROUND = BatcherConfig(round_s=0.05, lease_ttl_s=5)


# -- helpers ----------------------------------------------------------------------------------------


def rollout(request):
    """Rejects prompts marked ``reject`` (or one slot with ``reject_slot``); else a sample sized by the prompt."""
    prompt = request.prompt
    if prompt.get("reject") or prompt.get("reject_slot") == request.slot:
        return None
    return make_sample(
        tokens=int(prompt.get("tokens", 4)) + request.slot,
        rows=int(prompt.get("rows", 1)),
        prompt_tokens=int(prompt.get("prompt_tokens", 0)),
        version=request.version,
        reward=float(request.slot),
        seed=hash((request.task_id, request.slot)) % 10_000,
    )


def rows_rollout(request):
    """Slot 1 returns two rows (allowed: no group statistics, so no one-sample-per-slot contract)."""
    prompt = dict(request.prompt)
    if request.slot == 1:
        prompt["rows"] = 2
    return rollout(type(request)(request.task_id, request.slot, request.n_samples, prompt, request.version))


def settle(client, run, fn=rollout, *, version: int = 0) -> None:
    """Run every waiting task through a worker and the assembler (burst), so their decisions exist.

    The worker side is `WorkerClient` driven inline (take, publish every slot, ack): the same
    delivery path as `WorkerProcess` without its half-second idle wait before a burst exit.
    """
    worker = WorkerClient(client, run.keys)
    while tasks := worker.take(100, block_ms=None):
        for task in tasks:
            for request in task.requests(run.config.n_samples, version):
                try:
                    result = fn(request)
                except Exception as exc:  # a failed slot, as the worker would publish it
                    result = exc
                worker.publish(request.task_id, request.slot, result)
            worker.done(task)
    Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)


def active(client, run, config=ROUND, **kwargs) -> Batcher:
    batcher = Batcher(client, run, config, **kwargs)
    assert batcher.lease.acquire()
    batcher._activate()
    return batcher


def events(client, stream, kind=None):
    out = [codec.decode(fields) for _, fields in client.xrange(stream)]
    return [e for e in out if kind is None or isinstance(e, kind)]


def manifests(client, run) -> list[StepManifest]:
    return events(client, run.keys.steps, StepManifest)


def batched_tasks(manifest: StepManifest) -> list[str]:
    return [g.task_id for s in manifest.shards for g in s.groups]


def counts(client, run) -> dict[str, int]:
    return {k.decode(): int(float(v)) for k, v in client.hgetall(run.keys.counts).items()}


def decisions_by_task(client, run) -> dict[str, tuple[str, GroupDecided]]:
    return {codec.decode(f).task_id: (eid.decode(), codec.decode(f)) for eid, f in client.xrange(run.keys.decisions)}


def version(client, run) -> int:
    return int(client.get(run.keys.version) or 0)


def issue(issuer, run, prompts, ids=None):
    return issuer(run).issue(prompts, task_ids=ids)


# -- stall bound ---------------------------------------------------------------------------------------


def test_stall_fails_the_run_after_exactly_max_empty_rounds(client, make_run, issuer):
    run = make_run(n_samples=2, dp_size=1, batch_size=2, stall_timeout_s=0, max_empty_rounds=3)
    issue(issuer, run, [{}, {}])
    settle(client, run)
    batcher = active(client, run)
    batcher.round()
    assert len(manifests(client, run)) == 1  # one good step first

    issue(issuer, run, [{"reject": True}] * 4)  # the worker rejects everything from now on
    settle(client, run)
    for empty in (1, 2):
        batcher.round()
        assert batcher.outcome == "running" and batcher.stall.empty_rounds == empty
        assert events(client, run.keys.control, RunTerminated) == []
    batcher.round()
    assert batcher.outcome == "failed"
    [terminal] = events(client, run.keys.control, RunTerminated)
    assert terminal.reason == "stall"
    assert terminal.step == 1 == batcher.state.next_step
    # the recorded message is the stall message for this tracker and the server's counters (its
    # "Ns passed" is whatever the clock said then, at most the time since the last progress)
    expected = stall_message(batcher.stall, batcher.clock(), counts(client, run))
    [seconds] = re.findall(r"(\d+)s passed without progress", terminal.message)
    assert int(seconds) <= round(time.monotonic() - batcher.stall.last_progress)
    assert re.sub(r"\d+s passed", "Ns passed", terminal.message) == re.sub(r"\d+s passed", "Ns passed", expected)
    assert "3 consecutive batcher rounds" in terminal.message
    assert "'all_unusable': 4" in terminal.message and "usable_slot_yield=0.333" in terminal.message

    # the failure is durable: a new batcher does not resume the run, and no second terminal event appears
    batcher.lease.release()
    assert Batcher(client, run, ROUND).run(threading.Event()) == "failed"
    assert len(events(client, run.keys.control, RunTerminated)) == 1


def test_fast_empty_rounds_do_not_fail_with_the_default_timeout(client, make_run, issuer):
    run = make_run(n_samples=2, dp_size=1, batch_size=2, max_empty_rounds=3)  # stall_timeout_s 1800
    issue(issuer, run, [{"reject": True}] * 3)
    settle(client, run)
    batcher = active(client, run)
    for _ in range(8):
        batcher.round()
    assert batcher.outcome == "running" and batcher.stall.empty_rounds == 8
    assert events(client, run.keys.control, RunTerminated) == []


@pytest.mark.one_server_kind  # the stall timer's policy
def test_a_slow_trainer_is_not_a_stall(client, redis_url, make_run, background):
    # rollouts never reject, the trainer takes 1.5 s a step, and the bounds are 3 rounds and 1 s: every
    # round while the window is full waits for the trainer, and none of them counts as empty
    run = make_run(n_samples=2, dp_size=1, batch_size=2, max_staleness=0, max_empty_rounds=3, stall_timeout_s=1)
    prompts = [{"tokens": 4, "seed": i} for i in range(6)]
    reader = client_for(redis_url)
    worker = WorkerProcess(
        WorkerClient(client_for(redis_url), run.keys),
        synthetic_rollout,
        WorkerConfig(concurrency=2),
        n_samples=2,
        version=lambda: int(reader.get(run.keys.version) or 0),
    )
    background(worker.run)
    background(Assembler(client_for(redis_url), run, AssemblerConfig(lease_ttl_s=5, tick_interval_s=0.05)).run)
    batcher = Batcher(client_for(redis_url), run, BatcherConfig(round_s=0.05, lease_ttl_s=5), dataset=iter(prompts))
    outcome: list[str] = []
    background(lambda stop: outcome.append(batcher.run(stop)))
    trainer = TrainerClient(client_for(redis_url), run, poll_s=0.05)
    steps = []
    for batch in trainer.batches(rank=0, world_size=1):
        time.sleep(1.5)
        steps.append(batch.step)
        batch.commit()
    wait_until(lambda: outcome, timeout=10, message="the batcher to finish")
    assert outcome == ["finished"] and steps == [0, 1, 2]
    assert not events(client, run.keys.control, RunTerminated)
    assert batcher.stall.trainer_wait_rounds >= 20  # most of the 0.05 s rounds in 2 x 1.5 s of steps 0 and 1
    assert batcher.stall.empty_rounds < 3


@pytest.mark.cluster
def test_a_stall_fails_every_rank_with_the_same_message_at_the_same_step(client, redis_url, make_run, issuer):
    run = make_run(n_samples=2, dp_size=2, batch_size=2, stall_timeout_s=0, max_empty_rounds=3, max_staleness=100)
    issue(issuer, run, [{"tokens": 3 + i} for i in range(4)])
    settle(client, run)
    batcher = active(client, run)
    batcher.round()
    assert [m.step for m in manifests(client, run)] == [0, 1]

    seen: dict[int, list[int]] = {0: [], 1: []}
    failures: dict[int, tuple[int, str]] = {}

    def train(rank):
        trainer = TrainerClient(client_for(redis_url), run, poll_s=0.1)
        try:
            with trainer.batches(rank=rank, world_size=2) as batches:
                for batch in batches:
                    seen[rank].append(batch.step)
                    batch.commit()
        except RunFailed as exc:
            failures[rank] = (trainer.next_step(rank), str(exc))

    threads = [threading.Thread(target=train, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    wait_until(lambda: version(client, run) == 2, timeout=10, message="both good steps committed by both ranks")

    issue(issuer, run, [{"reject": True}] * 4)
    settle(client, run)
    for _ in range(3):
        batcher.round()
    assert batcher.outcome == "failed"
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive(), "a trainer rank hangs instead of failing"

    [terminal] = events(client, run.keys.control, RunTerminated)
    assert seen == {0: [0, 1], 1: [0, 1]}
    assert failures[0] == failures[1]
    step, message = failures[0]
    assert step == terminal.step == 2
    assert message == f"run {run.name} failed at step 2 (stall): {terminal.message}"
    assert "run stalled" in message


def test_a_contract_violation_fails_the_run_with_one_terminal_event_at_the_next_step(
    client, redis_url, make_run, issuer
):
    run = make_run(n_samples=2, min_usable_group_size=2, dp_size=1, batch_size=1)
    issue(issuer, run, [{}], ["good"])
    settle(client, run)
    batcher = active(client, run)
    batcher.round()  # step 0
    issue(issuer, run, [{"rows": 2}], ["two-rows"])  # two rows per slot break the one-sample-per-slot contract
    settle(client, run)
    assert events(client, run.keys.control, RunTerminated) == []  # the assembler only records the decision

    batcher.round()
    assert batcher.outcome == "failed"
    [violation] = [d for _, d in decisions_by_task(client, run).values() if d.reason == "contract_violation"]
    [terminal] = events(client, run.keys.control, RunTerminated)  # one terminal event, with its step
    assert (terminal.reason, terminal.step, terminal.message) == ("contract_violation", 1, violation.error)
    steps = []
    with pytest.raises(RunFailed, match=r"failed at step 1 \(contract_violation\): .*slot sizes \[2, 2\]"):
        for batch in TrainerClient(client_for(redis_url), run, poll_s=0.1).batches(rank=0, world_size=1):
            steps.append(batch.step)
    assert steps == [0]


# -- staleness and the feeder window --------------------------------------------------------------------


def test_stale_groups_are_discarded_counted_and_never_batched(client, make_run, issuer):
    run = make_run(n_samples=2, dp_size=1, batch_size=2, max_staleness=1)
    for task, group_version in (("A", 0), ("B", 1), ("C", 2), ("D", 2)):
        issue(issuer, run, [{}], [task])
        settle(client, run, version=group_version)
    client.set(run.keys.version, 2)  # A is 2 behind (stale), B exactly 1 behind (fresh)
    decided = decisions_by_task(client, run)

    batcher = active(client, run)
    batcher.round()
    assert [batched_tasks(m) for m in manifests(client, run)] == [["B", "C"]]
    [discarded] = events(client, run.keys.discarded, GroupDiscarded)
    assert (discarded.task_id, discarded.reason) == ("A", "stale")
    assert (discarded.group_version, discarded.current_version) == (0, 2)
    assert discarded.decision_entry == decided["A"][0]
    assert "max_staleness 1" in discarded.detail
    assert counts(client, run)["dropped:stale"] == 1
    # only D is still pending (buffered for the next step); A's entry was acknowledged with its discard
    pending = client.xpending_range(run.keys.decisions, BATCHER_GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [decided["D"][0]]

    # the policy moves on: buffered D becomes stale too and is discarded, never trained
    client.set(run.keys.version, 4)
    issue(issuer, run, [{}, {}], ["E", "F"])
    settle(client, run, version=4)
    batcher.round()
    assert [batched_tasks(m) for m in manifests(client, run)] == [["B", "C"], ["E", "F"]]
    assert [(d.task_id, d.reason) for d in events(client, run.keys.discarded)] == [("A", "stale"), ("D", "stale")]
    c = counts(client, run)
    assert c["dropped:stale"] == 2 and c["groups:discarded"] == 2 and c["groups:batched"] == 4


def test_the_batcher_says_within_a_minute_that_workers_serve_a_version_the_run_left_behind(
    client, make_run, issuer, caplog
):
    """Workers keep sampling v0 (no weights published) while the run is at v2: every group is stale. The
    batcher logs "workers serve v0, the run is at v2" within a minute and exports how long it has been."""
    from streamgrp.cli.metrics import Metrics

    run = make_run(n_samples=2, dp_size=1, batch_size=2, max_staleness=1)
    skipped = [0.0]  # the batcher's clock runs 10 s ahead per round here: a minute in seven rounds
    metrics = Metrics(role="batcher")
    batcher = active(client, run, clock=lambda: time.monotonic() + skipped[0], metrics=metrics)
    client.set(run.keys.version, 2)
    warned_at = None
    with caplog.at_level("WARNING", logger="streamgrp.services.batcher"):
        for second in range(0, 70, 10):
            skipped[0] = float(second)
            issue(issuer, run, [{}], [f"t{second}"])
            settle(client, run, version=0)
            batcher.round()
            if warned_at is None and any("workers serve v0, the run is at v2" in r.message for r in caplog.records):
                warned_at = second
    assert warned_at is not None and warned_at <= 60
    assert counts(client, run)["dropped:stale"] >= 6 and manifests(client, run) == []  # every group stale
    assert metrics.registry.get_sample_value("streamgrp_served_version") == 0
    assert metrics.registry.get_sample_value("streamgrp_served_behind_seconds") >= 30

    # weights published: groups from v2 arrive, the figure drops to 0 and nothing more is said
    caplog.clear()
    skipped[0] += 10
    issue(issuer, run, [{}], ["fresh"])
    settle(client, run, version=2)
    batcher.round()
    assert metrics.registry.get_sample_value("streamgrp_served_behind_seconds") == 0
    assert metrics.registry.get_sample_value("streamgrp_served_version") == 2
    assert not any("workers serve" in r.message for r in caplog.records)


def test_feeder_stops_at_the_window_and_resumes_when_the_version_advances(client, redis_url, make_run):
    run = make_run(n_samples=2, dp_size=2, batch_size=2, max_staleness=1)  # window (1 + version + 1) * 2
    prompts = (
        [{"tokens": 3, "seed": i} for i in range(4)]
        + [{"reject": True, "seed": i} for i in range(4, 6)]
        + [{"tokens": 3, "seed": i} for i in range(6, 40)]
    )
    batcher = active(client, run, dataset=iter(prompts))

    def cursor():
        return int(client.hget(run.keys.batcher_state, "feeder_cursor") or 0)

    batcher.round()
    assert cursor() == 4
    issued = events(client, run.keys.tasks, TaskIssued)
    assert [(t.task_id, t.prompt["seed"]) for t in issued] == [(f"t{i:08d}", i) for i in range(4)]
    settle(client, run)
    batcher.round()
    batcher.round()
    assert [m.step for m in manifests(client, run)] == [0, 1]
    assert cursor() == 4  # 4 accepted groups fill the window at version 0

    trainer = TrainerClient(client_for(redis_url), run, poll_s=0.1)
    ranks = [iter(trainer.batches(rank=r, world_size=2)) for r in (0, 1)]
    next(ranks[0]).commit()
    assert version(client, run) == 0  # one rank is not enough
    batcher.round()
    assert cursor() == 4
    next(ranks[1]).commit()
    assert version(client, run) == 1
    batcher.round()
    assert cursor() == 6  # the window grew by one batch
    batcher.round()
    assert cursor() == 6

    # the assembler drops the 2 all-rejected groups: they leave the window, so 2 more are issued at version 1
    settle(client, run, version=1)
    assert counts(client, run)["decisions:dropped"] == 2
    batcher.round()
    assert cursor() == 8
    assert version(client, run) == 1
    issued = events(client, run.keys.tasks, TaskIssued)
    assert [(t.task_id, t.prompt["seed"]) for t in issued] == [(f"t{i:08d}", i) for i in range(8)]
    assert [t.version for t in issued] == [0] * 4 + [1] * 4


# -- the group filter -----------------------------------------------------------------------------------


def test_group_filter_drops_as_filtered_and_a_raising_filter_does_not_stop_the_batcher(client, make_run, issuer):
    run = make_run(n_samples=2, dp_size=1, batch_size=2)

    def group_filter(decision: GroupDecided) -> bool:
        if decision.task_id.startswith("raise"):
            raise ValueError("boom from the filter")
        return not decision.task_id.startswith("drop")

    issue(issuer, run, [{}] * 6, ["keep-0", "drop-1", "raise-2", "keep-3", "keep-4", "keep-5"])
    settle(client, run)
    before = events(client, run.keys.decisions)
    counts_before = counts(client, run)

    batcher = active(client, run, group_filter=group_filter)
    batcher.round()
    assert [batched_tasks(m) for m in manifests(client, run)] == [["keep-0", "keep-3"], ["keep-4", "keep-5"]]
    discarded = {d.task_id: d for d in events(client, run.keys.discarded, GroupDiscarded)}
    assert sorted(discarded) == ["drop-1", "raise-2"]
    assert {d.reason for d in discarded.values()} == {"filtered"}
    assert discarded["drop-1"].detail == "the group filter returned False"
    assert "ValueError: boom from the filter" in discarded["raise-2"].detail
    c = counts(client, run)
    assert c["dropped:filtered"] == 2 and c["groups:discarded"] == 2

    # the batcher keeps running after the raising filter
    assert batcher.outcome == "running"
    issue(issuer, run, [{}] * 2, ["keep-6", "raise-7"])
    issue(issuer, run, [{}], ["keep-8"])
    settle(client, run)
    batcher.round()
    assert batched_tasks(manifests(client, run)[-1]) == ["keep-6", "keep-8"]
    assert counts(client, run)["dropped:filtered"] == 3

    # decisions and their pre-filter statistics are the assembler's, untouched by filtering
    assert events(client, run.keys.decisions)[:6] == before
    for decision in before:
        assert decision.stats.pre_filter_trainable_slot_yield == 1.0
    for field in ("target_slots", "usable_slots", "trainable_slots"):
        assert counts(client, run)[field] == counts_before[field] * 9 // 6
    assert client.xpending(run.keys.decisions, BATCHER_GROUP)["pending"] == 0


# -- manifests ------------------------------------------------------------------------------------------


def _check_manifest_against_the_log(client, run, manifest: StepManifest, decided) -> None:
    slot_log = {eid.decode(): fields for eid, fields in client.xrange(run.keys.slots)}
    payloads = {eid.decode(): fields for eid, fields in payload_entries(client, run.keys)}
    sizes = [len(s.groups) for s in manifest.shards]
    assert len(manifest.shards) == run.config.dp_size and max(sizes) - min(sizes) <= 1
    for shard in manifest.shards:
        tokens = 0
        for group in shard.groups:
            entry, decision = decided[group.task_id]
            assert group.decision_entry == entry
            assert group.members == tuple(m.placed() for m in decision.members)
            # whole: every usable slot of the task is in this group, in this shard
            usable = sorted(s for s, outcome in decision.slot_outcomes.items() if outcome == "sample")
            assert [str(m.slot) for m in group.members] == usable
            digests = []
            for slot, member in ((m.slot, m.entry) for m in group.members):
                result, payload = codec.decode(slot_log[member]), codec.decode(payloads[member])
                assert isinstance(result, SlotResult) and isinstance(payload, SamplePayload)
                assert (result.task_id, result.slot, result.outcome) == (group.task_id, slot, "sample")
                assert (payload.task_id, payload.slot) == (group.task_id, slot)  # the payload at the slot's id
                digests.append(codec.entry_digest(payloads[member]))
                assert result.sample.digest == digests[-1]  # computed once, by the publisher
                tokens += payload.sample.valid_tokens
            assert group.digest == codec.combine_digests(digests)
        assert shard.digest == codec.combine_digests(g.digest for g in shard.groups)
        assert shard.tokens == tokens
    loads = [s.tokens for s in manifest.shards]
    assert manifest.imbalance == pytest.approx(max(loads) * len(loads) / sum(loads))


@pytest.mark.cluster
def test_fixed_manifests_are_ragged_whole_and_digests_match_the_bytes(client, make_run, issuer):
    run = make_run(n_samples=3, dp_size=3, batch_size=7, max_staleness=10)
    issue(
        issuer,
        run,
        [{"tokens": 2 + (i * 7) % 23, "reject_rate": 0.3, "seed": i} for i in range(40)],
        [f"task-{i}" for i in range(40)],
    )
    settle(client, run, synthetic_rollout)
    decided = decisions_by_task(client, run)
    trainable = [t for t, (_, d) in decided.items() if d.decision != "dropped"]
    assert len(trainable) >= 14

    batcher = active(client, run)
    batcher.round()
    steps = manifests(client, run)
    assert [m.step for m in steps] == list(range(len(trainable) // 7))
    placed = Counter(t for m in steps for t in batched_tasks(m))
    assert all(n == 1 for n in placed.values()) and set(placed) <= set(trainable)
    assert any(decided[t][1].decision == "partial" for t in placed)
    for manifest in steps:
        assert len(batched_tasks(manifest)) == 7
        assert sorted(len(s.groups) for s in manifest.shards) == [2, 2, 3]
        _check_manifest_against_the_log(client, run, manifest, decided)
    # the groups of the written steps are acknowledged; the rest wait, pending, for the next step
    pending = client.xpending(run.keys.decisions, BATCHER_GROUP)["pending"]
    assert pending == len(trainable) % 7


def test_dynamic_mode_waits_for_dp_size_groups_then_batches_what_a_round_produced(client, make_run, issuer):
    run = make_run(n_samples=2, dp_size=3, batch_mode="dynamic", batch_size=2)
    batcher = active(client, run)
    issue(issuer, run, [{"tokens": 5}, {"tokens": 9}])
    settle(client, run)
    batcher.round()
    assert manifests(client, run) == []  # 2 groups for 3 ranks: the batcher waits
    issue(issuer, run, [{"tokens": 3}, {"tokens": 4}])
    settle(client, run)
    batcher.round()
    issue(issuer, run, [{"tokens": 2 + i} for i in range(5)])
    settle(client, run)
    batcher.round()
    steps = manifests(client, run)
    assert [len(batched_tasks(m)) for m in steps] == [4, 5]
    decided = decisions_by_task(client, run)
    for manifest in steps:
        _check_manifest_against_the_log(client, run, manifest, decided)
    assert all(len(s.groups) >= 1 for m in steps for s in m.shards)


# -- the trainer API ------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_each_rank_gets_padded_tensors_and_the_step_wide_loss_token_count(client, redis_url, make_run, issuer):
    run = make_run(n_samples=3, dp_size=2, batch_size=4)
    prompts = [{"tokens": 3 + i, "prompt_tokens": 1, "reject_slot": 2 if i % 2 else None} for i in range(8)]
    issue(issuer, run, prompts)
    settle(client, run, rows_rollout)
    active(client, run, BatcherConfig(round_s=0.05, max_steps=2)).round()
    decided = decisions_by_task(client, run)
    slot_log = {eid.decode(): codec.decode(fields) for eid, fields in payload_entries(client, run.keys)}

    trainer = TrainerClient(client_for(redis_url), run, poll_s=0.1)
    per_step: dict[int, list] = {}
    for rank in (0, 1):
        for batch in trainer.batches(rank=rank, world_size=2):
            per_step.setdefault(batch.step, []).append(batch)
    assert sorted(per_step) == [0, 1]
    for step, batches in per_step.items():
        manifest = trainer.manifest(step)
        total_loss_tokens = 0
        for batch in batches:
            shard = manifest.shards[batch.rank]
            samples = [slot_log[m.entry].sample for g in shard.groups for m in g.members]
            lengths = [n for s in samples for n in s.row_lengths]
            assert batch.task_ids == [g.task_id for g in shard.groups]
            assert (batch.step, batch.world_size, batch.digest) == (step, 2, shard.digest)
            assert batch.token_ids.shape == (len(lengths), max(lengths)) == (batch.rows, max(lengths))
            assert (batch.token_ids.dtype, batch.loss_mask.dtype, batch.logprobs.dtype, batch.attention_mask.dtype) == (
                torch.int64,
                torch.bool,
                torch.float32,
                torch.bool,
            )
            assert batch.loss_mask.shape == batch.logprobs.shape == batch.attention_mask.shape == batch.token_ids.shape
            assert (batch.rewards.dtype, batch.rewards.shape) == (torch.float32, (batch.rows,))
            assert (batch.versions.dtype, batch.versions.shape) == (torch.int64, (batch.rows,))
            assert batch.group_sizes.dtype == torch.int64
            assert batch.group_sizes.tolist() == [sum(m.rows for m in decided[t][1].members) for t in batch.task_ids]
            assert int(batch.group_sizes.sum()) == batch.rows
            assert batch.attention_mask.sum(dim=1).tolist() == lengths
            assert not (batch.loss_mask & ~batch.attention_mask).any()
            flat = [t for s in samples for t in s.token_ids.to_list()]
            assert batch.token_ids[batch.attention_mask].tolist() == flat
            total_loss_tokens += int(batch.loss_mask.sum())
        assert all(b.step_loss_tokens == total_loss_tokens for b in batches)
    assert any(size > 3 for bs in per_step.values() for b in bs for size in b.group_sizes.tolist())  # 2-row slots


def _two_written_steps(client, redis_url, make_run, issuer):
    """A dp_size-1 run with two one-group steps written, and a trainer client on its own connection."""
    run = make_run(n_samples=2, dp_size=1, batch_size=1)
    issue(issuer, run, [{}, {}])
    settle(client, run)
    active(client, run, BatcherConfig(round_s=0.05, max_steps=2)).round()
    return run, TrainerClient(client_for(redis_url), run, poll_s=0.1)


def test_an_exception_in_the_loop_records_step_failed_and_leaves_the_step_uncommitted(
    client, redis_url, make_run, issuer
):
    run, trainer = _two_written_steps(client, redis_url, make_run, issuer)

    with pytest.raises(RuntimeError, match="loss is nan"):
        with trainer.batches(rank=0, world_size=1) as batches:
            for batch in batches:
                raise RuntimeError(f"loss is nan at step {batch.step}")
    [failed] = events(client, run.keys.commits, StepFailed)
    assert (failed.step, failed.rank) == (0, 0)
    assert failed.error == "RuntimeError: loss is nan at step 0"
    assert client.hget(run.keys.committed, "0") is None and trainer.next_step(0) == 0
    assert version(client, run) == 0

    # a restarted rank resumes at the failed step and then runs to the end of the run
    steps = []
    with TrainerClient(client_for(redis_url), run, poll_s=0.1).batches(rank=0, world_size=1) as batches:
        for batch in batches:
            steps.append(batch.step)
    assert steps == [0, 1]
    # each start of the rank began an attempt at its next step
    assert [(type(e).__name__, e.step) for e in events(client, run.keys.commits)] == [
        ("TrainingResumed", 0),
        ("StepFailed", 0),
        ("TrainingResumed", 0),
        ("StepCommitted", 0),
        ("StepCommitted", 1),
    ]
    assert events(client, run.keys.control, RunFinished)[0].steps == 2


def _recording_loads(client, redis_url, make_run, issuer, steps: int) -> tuple[TrainerClient, Callable, list[str]]:
    """A trainer over ``steps`` written steps of 2 groups, its unrecorded load, and the list its loads
    append their thread's name to."""
    run = make_run(n_samples=2, dp_size=1, batch_size=2)
    issue(issuer, run, [{"tokens": 3 + i} for i in range(2 * steps)])
    settle(client, run)
    active(client, run, BatcherConfig(round_s=0.05, max_steps=steps)).round()
    trainer = TrainerClient(client_for(redis_url), run, poll_s=0.1)
    loaded_on: list[str] = []
    load = trainer.load
    trainer.load = lambda *args: loaded_on.append(threading.current_thread().name) or load(*args)
    return trainer, load, loaded_on


def test_the_next_step_is_loaded_ahead_on_a_thread_and_is_the_batch_a_plain_load_gives(
    client, redis_url, make_run, issuer
):
    trainer, load, loaded_on = _recording_loads(client, redis_url, make_run, issuer, 3)
    seen = []
    for batch in trainer.batches(rank=0, world_size=1):
        again = load(trainer.manifest(batch.step), 0, 1)
        assert batch.task_ids == again.task_ids and batch.digest == again.digest
        assert all(
            torch.equal(getattr(batch, name), getattr(again, name))
            for name in ("token_ids", "loss_mask", "logprobs", "attention_mask", "rewards", "versions")
        )
        seen.append((batch.step, trainer.next_step(0)))
    assert seen == [(0, 0), (1, 1), (2, 2)]  # each step once, in order, committed only after its loop body
    assert loaded_on[0] == threading.current_thread().name
    assert loaded_on[1:] == ["streamgrp-prefetch_0"] * 2


def test_a_loop_body_that_returns_at_once_gets_its_batches_loaded_in_line(client, redis_url, make_run, issuer):
    trainer, _, loaded_on = _recording_loads(client, redis_url, make_run, issuer, 4)
    steps = [batch.step for batch in trainer.batches(rank=0, world_size=1)]
    assert steps == [0, 1, 2, 3]
    # step 1 was loaded ahead before any loop body was timed; after an empty body, nothing is
    here = threading.current_thread().name
    assert loaded_on == [here, "streamgrp-prefetch_0", here, here]


def test_a_step_loaded_ahead_that_cannot_be_loaded_fails_only_when_the_loop_reaches_it(
    client, redis_url, make_run, issuer
):
    run, trainer = _two_written_steps(client, redis_url, make_run, issuer)
    delete_payload(client, run.keys, trainer.manifest(1).shards[0].groups[0].members[0].entry)
    steps = []
    with pytest.raises(RunFailed, match="step 1 cannot be trained as it was recorded: step 1 rank 0"):
        for batch in trainer.batches(rank=0, world_size=1):
            steps.append(batch.step)
    assert steps == [0] and trainer.next_step(0) == 1


def test_world_size_must_match_dp_size(client, make_run):
    run = make_run(n_samples=2, dp_size=2, batch_size=2)
    trainer = TrainerClient(client, run)
    with pytest.raises(ConfigError, match="world_size=3 but run .* dp_size=2"):
        trainer.batches(rank=0, world_size=3)
    with pytest.raises(ConfigError, match="rank 2 is outside 0..1"):
        trainer.batches(rank=2, world_size=2)


@pytest.mark.cluster
def test_the_policy_version_advances_only_when_every_rank_committed(client, redis_url, make_run, issuer):
    run = make_run(n_samples=2, dp_size=2, batch_size=2)
    issue(issuer, run, [{}] * 4)
    settle(client, run)
    active(client, run).round()
    trainer = TrainerClient(client_for(redis_url), run, poll_s=0.1)
    rank0 = iter(trainer.batches(rank=0, world_size=2))
    rank1 = iter(trainer.batches(rank=1, world_size=2))

    first = next(rank0)
    first.commit()
    first.commit()  # idempotent
    next(rank0).commit()
    assert trainer.next_step(0) == 2
    assert version(client, run) == 0 and events(client, run.keys.control, VersionAdvanced) == []
    next(rank1).commit()
    assert version(client, run) == 1
    next(rank1).commit()
    assert version(client, run) == 2
    advanced = events(client, run.keys.control, VersionAdvanced)
    assert [(v.version, v.step) for v in advanced] == [(1, 0), (2, 1)]
    committed = Counter((e.step, e.rank) for e in events(client, run.keys.commits, StepCommitted))
    assert committed == {(0, 0): 1, (1, 0): 1, (0, 1): 1, (1, 1): 1}


@pytest.mark.cluster
def test_a_batcher_that_loses_and_regains_the_lease_issues_each_prompt_once_in_order(client, make_run):
    run = make_run(n_samples=2, dp_size=1, batch_size=2, max_staleness=0)  # a window of 2 tasks per version
    prompts = [{"seed": i} for i in range(20)]
    first = active(client, run, dataset=iter(prompts))
    first.round()  # t0, t1

    # the first batcher pauses past its lease; a standby takes over and issues the next window
    client.delete(run.keys.batcher_lease)
    standby = active(client, run, dataset=iter(prompts))
    client.set(run.keys.version, 1)
    standby.round()  # t2, t3
    with pytest.raises(LeaseLost):
        first.round()  # fenced: it cannot issue (it already read its next prompts from the dataset)
    standby.lease.release()

    # the standby goes away and the first batcher takes over again, as its run loop would
    client.set(run.keys.version, 2)
    assert first.lease.acquire()
    first._activate()
    first.round()  # t4, t5
    issued = events(client, run.keys.tasks, TaskIssued)
    assert [(t.task_id, t.prompt["seed"]) for t in issued] == [(f"t{i:08d}", i) for i in range(6)]


def test_a_batcher_of_the_run_with_another_dataset_or_max_steps_is_refused_at_start(client, make_run, tmp_path):
    run = make_run(n_samples=2, dp_size=1, batch_size=2)
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(f'{{"seed": {i}}}\n' for i in range(8)))
    first = Batcher(
        client,
        run,
        BatcherConfig(max_steps=3),
        dataset=load_dataset(str(dataset)),
        dataset_identity=DatasetIdentity.of(str(dataset)),
    )
    assert first.lease.acquire()
    first._activate()  # the first one active records what it feeds
    copy = tmp_path / "elsewhere" / "prompts.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(dataset.read_bytes())
    # The same bytes under another path are the same dataset: a standby with them starts.
    Batcher(
        client,
        run,
        BatcherConfig(max_steps=3),
        dataset=load_dataset(str(copy)),
        dataset_identity=DatasetIdentity.of(str(copy)),
    )
    # Lines appended since continue it (the feeder's cursor takes them as new prompts); an edit does not.
    grown = tmp_path / "grown" / "prompts.jsonl"
    grown.parent.mkdir()
    grown.write_text(dataset.read_text() + '{"seed": 99}\n')
    Batcher(
        client,
        run,
        BatcherConfig(max_steps=3),
        dataset=load_dataset(str(grown)),
        dataset_identity=DatasetIdentity.of(str(grown)),
    )
    edited = tmp_path / "edited" / "prompts.jsonl"
    edited.parent.mkdir()
    edited.write_text(dataset.read_text().replace('"seed": 0', '"seed": 7'))
    with pytest.raises(
        ConfigError,
        match=r"another feed: dataset prompts.jsonl \(\d+ bytes, sha256 [0-9a-f]{16}\), "
        r"this batcher's prompts.jsonl \(\d+ bytes",
    ):
        Batcher(
            client,
            run,
            BatcherConfig(max_steps=3),
            dataset=load_dataset(str(edited)),
            dataset_identity=DatasetIdentity.of(str(edited)),
        )
    with pytest.raises(ConfigError, match="max_steps 3, this batcher's 5"):
        Batcher(
            client,
            run,
            BatcherConfig(max_steps=5),
            dataset=load_dataset(str(dataset)),
            dataset_identity=DatasetIdentity.of(str(dataset)),
        )


def test_wait_knows_the_in_flight_tasks_issue_versions_also_after_a_takeover(client, make_run):
    run = make_run(n_samples=2, dp_size=1, batch_size=2, max_staleness=1, staleness="wait")
    prompts = [{"tokens": 3, "seed": i} for i in range(40)]
    first = active(client, run, dataset=iter(prompts))
    first.round()
    assert first._feeder.oldest_in_flight() == 0  # 4 tasks issued at version 0, none decided
    worker = WorkerClient(client, run.keys)
    [task] = worker.take(1, block_ms=None)  # one task's group decided; three still in flight
    worker.publish_many([(r.task_id, r.slot, rollout(r)) for r in task.requests(2, 0)])
    worker.done(task)
    Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
    first.round()
    assert first._feeder.oldest_in_flight() == 0 and len(first._feeder._in_flight) == 3
    first.lease.release()

    second = active(client, run, dataset=iter(prompts))  # another process: knows only what the streams say
    assert second._feeder._in_flight == first._feeder._in_flight
    settle(client, run)  # every task decided: nothing in flight, nothing left behind: both steps written
    second.round()
    assert second._feeder.oldest_in_flight() is None
    assert [batched_tasks(m) for m in manifests(client, run)] == [
        ["t00000000", "t00000001"],
        ["t00000002", "t00000003"],
    ]

"""Rewards as events, end to end with real processes: a `streamgrp rewarder` scoring results published
with their reward pending (0.2-2 s per score) gives the run the decisions and the trained rewards a run
with inline rewards gives on the same seeds; a rewarder SIGKILLed mid-run loses no reward and posts
none twice; a reward posted once the group is decided is counted late.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from pipeline import CHILD_ENV, TrainerRank, events, write_dataset
from processes import RoleProcess, wait_until

from streamgrp.errors import ConfigError
from streamgrp.core.events import GroupDecided, RunFinished, SlotResult, SlotRewarded
from streamgrp.replay.steps import replay_step
from streamgrp.store.rewards import REWARDERS_GROUP, post_reward
from streamgrp.store.runs import open_run


PROMPTS = 24
RUN_FLAGS = [
    "--n-samples",
    "4",
    "--dp-size",
    "1",
    "--batch-size",
    "4",
    "--group-timeout-s",
    "300",
    "--max-staleness",
    "1000000",
]
HERE = str(Path(__file__).parent)
ENV = {"PYTHONPATH": os.pathsep.join([HERE, CHILD_ENV["PYTHONPATH"]])}


def _roles(url: str, run_name: str, tmp_path: Path, rollout: str) -> dict:
    common = ["--redis-url", url, "--run", run_name]
    dataset = write_dataset(tmp_path / "prompts.jsonl", PROMPTS, tokens=16, reject_rate=0.15, fail_rate=0.05)
    roles = {
        "batcher": RoleProcess(
            "batcher",
            [*common, *RUN_FLAGS, "--dataset", str(dataset), "--round-s", "0.1", "--lease-ttl-s", "1"],
            tmp_path / "batcher",
            env=ENV,
        ),
        "assembler": RoleProcess(
            "assembler", [*common, "--lease-ttl-s", "1", "--tick-interval-s", "0.1"], tmp_path / "assembler", env=ENV
        ),
        "worker": RoleProcess(
            "worker", [*common, "--concurrency", "8", "--rollout", rollout], tmp_path / "worker", env=ENV
        ),
    }
    for role in roles.values():
        role.log_dir.mkdir()
    return roles


def _rewarder(url: str, run_name: str, tmp_path: Path, label: str) -> RoleProcess:
    process = RoleProcess(
        "rewarder",
        [
            "--redis-url",
            url,
            "--run",
            run_name,
            "--reward",
            "rollouts:slow_synthetic_score",
            "--concurrency",
            "16",
            "--claim-idle-s",
            "1",
        ],
        tmp_path / label,
        env=ENV,
    )
    process.log_dir.mkdir()
    return process


def _finish(client, run_name: str, processes: list, trainer: TrainerRank, timeout: float = 240) -> None:
    def finished():
        for process in processes:
            assert process.proc.poll() in (None, 0), f"{process.role} failed:\n{process.output()[-3000:]}"
        return trainer.proc.poll() == 0

    try:
        wait_until(finished, timeout=timeout, interval=0.2, message="the run to finish")
    finally:
        for process in processes:
            process.stop()
        trainer.stop()


def _story(client, run_name: str) -> tuple[dict, dict]:
    """Per task: the decision (kind, slot outcomes, each member's mean reward), and the per-row rewards
    every step trained, read back as the trainer read them (`replay_step`)."""
    run = open_run(client, run_name)
    decisions = {
        d.task_id: (d.decision, d.slot_outcomes, [(m.slot, round(m.reward, 9)) for m in d.members])
        for d in events(client, run.keys.decisions, GroupDecided)
    }
    [finished] = events(client, run.keys.control, RunFinished)
    trained: dict[str, list[float]] = {}
    for step in range(finished.steps):
        batch = replay_step(client, run.keys, step, 0)
        rows = batch.rewards.tolist()
        at = 0
        for task_id, size in zip(batch.task_ids, batch.group_sizes.tolist()):
            trained[task_id] = [round(r, 6) for r in rows[at : at + size]]
            at += size
    return decisions, trained


@pytest.mark.slow
@pytest.mark.one_server_kind
def test_a_separate_rewarder_killed_mid_run_gives_the_inline_runs_decisions_and_trained_rewards(
    client, redis_url, run_name, tmp_path
):
    # The run with inline rewards: the reference.
    inline_name = run_name + "-inline"
    (tmp_path / "inline").mkdir()
    roles = _roles(redis_url, inline_name, tmp_path / "inline", "streamgrp.services.synthetic:synthetic_rollout")
    trainer = TrainerRank(redis_url, inline_name, 0, 1, tmp_path / "inline" / "trainer", step_s=0.0)
    for role in roles.values():
        role.start()
    trainer.start()
    _finish(client, inline_name, list(roles.values()), trainer)
    expected_decisions, expected_trained = _story(client, inline_name)

    # The same run, its rewards left to rewarders; the first is SIGKILLed while it holds results.
    (tmp_path / "later").mkdir()
    roles = _roles(redis_url, run_name, tmp_path / "later", "rollouts:synthetic_reward_later")
    trainer = TrainerRank(redis_url, run_name, 0, 1, tmp_path / "later" / "trainer", step_s=0.0)
    first = _rewarder(redis_url, run_name, tmp_path / "later", "rewarder1")
    for role in roles.values():
        role.start()
    first.start()
    trainer.start()
    run = None

    def rewarder_holds_results():
        nonlocal run
        try:
            run = run or open_run(client, run_name)
        except ConfigError:  # the batcher has not created it yet
            return False
        if not client.exists(run.keys.slots):
            return False
        groups = {g["name"]: g for g in client.xinfo_groups(run.keys.slots)}
        group = groups.get(REWARDERS_GROUP.encode()) or groups.get(REWARDERS_GROUP)
        return group is not None and group["pending"] >= 4 and len(events(client, run.keys.slots, SlotRewarded)) >= 4

    wait_until(rewarder_holds_results, timeout=120, message="the first rewarder to post rewards and hold more")
    first.kill()
    held = client.xinfo_groups(run.keys.slots)
    assert any(g["pending"] for g in held), "the killed rewarder held no result: the kill proves nothing"
    second = _rewarder(redis_url, run_name, tmp_path / "later", "rewarder2").start()
    _finish(client, run_name, [*roles.values(), second], trainer)

    decisions, trained = _story(client, run_name)
    assert decisions == expected_decisions
    assert trained == expected_trained

    # No reward lost, none posted twice: one reward per result that waited, and the slot log's every
    # pending result was scored.
    pending = [(e.task_id, e.slot) for e in events(client, run.keys.slots, SlotResult) if e.reward_pending]
    rewarded = Counter((e.task_id, e.slot) for e in events(client, run.keys.slots, SlotRewarded))
    assert pending and sorted(rewarded) == sorted(pending) and set(rewarded.values()) == {1}
    counts = {k.decode(): int(v) for k, v in client.hgetall(run.keys.counts).items()}
    assert counts.get("rewards:duplicate", 0) == 0 and counts.get("slots:timeout", 0) == 0
    assert "took over the reward" in second.output()

    # A reward for a decided group's slot is late: counted, not folded.
    task_id, slot = pending[0]
    post_reward(client, run.keys, task_id=task_id, slot=slot, reward=1.0, scorer="a human, too late")
    assembler = RoleProcess(
        "assembler",
        ["--redis-url", redis_url, "--run", run_name, "--tick-interval-s", "0.1"],
        tmp_path / "later" / "assembler",
        env=ENV,
    ).start()
    try:
        wait_until(
            lambda: client.hget(run.keys.counts, "rewards:late") == b"1",
            timeout=30,
            message="the late reward to be counted",
        )
    finally:
        assembler.stop()
    assert _story(client, run_name)[0] == expected_decisions


def test_a_reward_posted_from_anywhere_completes_a_waiting_slot(client, make_run, issuer, drain, run_name):
    """`post_reward`, the Python call for a late score: a slot that waits for its reward is decided with it;
    a second reward is a counted duplicate; one for a slot whose result carried its reward is late."""
    from rollouts import synthetic_reward_later

    from streamgrp.config import AssemblerConfig
    from streamgrp.services.assembler import Assembler
    from streamgrp.services.synthetic import synthetic_rollout

    run = make_run(n_samples=3, group_timeout_s=300.0)
    [task] = issuer(run).issue([{"tokens": 8, "seed": 3}])
    task_id = task.task_id

    def later_but_the_last(request):
        return synthetic_reward_later(request) if request.slot < 2 else synthetic_rollout(request)

    drain(client, run, later_but_the_last)
    assert events(client, run.keys.decisions, GroupDecided) == []  # slots 0 and 1 wait for their rewards
    post_reward(client, run.keys, task_id=task_id, slot=0, reward=0.625, scorer="human")
    post_reward(client, run.keys, task_id=task_id, slot=0, reward=0.0, scorer="second opinion")
    post_reward(client, run.keys, task_id=task_id, slot=2, reward=0.0, scorer="wrong slot")
    post_reward(client, run.keys, task_id=task_id, slot=1, reason="not an answer", scorer="human")
    Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
    [decision] = events(client, run.keys.decisions, GroupDecided)
    assert decision.slot_outcomes == {"0": "sample", "1": "rejected", "2": "sample"}
    assert decision.decision == "partial" and decision.members[0].rewards == (0.625,)
    assert decision.members[1].rewards is None  # slot 2's reward came with its result
    counts = {k.decode(): int(v) for k, v in client.hgetall(run.keys.counts).items()}
    assert counts["rewards:duplicate"] == 1 and counts["rewards:late"] == 1
    assert client.xpending(run.keys.slots, "assembler")["pending"] == 0

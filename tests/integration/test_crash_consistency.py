"""Crash consistency, bit for bit: the reference trainer (two gloo ranks, `streamgrp trainer` processes,
checkpoints every 5 steps) is SIGKILLed again and again, a random rank at random moments, also halfway
through a checkpoint's files and between training a step and committing it, and restarted each time.
Its final weights equal, bit for bit, one uninterrupted pass from the initial weights over the same
recorded steps, replayed from the run's log with the trainer's own step function.

Deterministic settings: the CPU, one thread per process (``OMP_NUM_THREADS=1``), the fixed seed of
the toy policy's initial weights; gloo's sum of two ranks' gradients is one IEEE addition, so the
replayed pass adds the two ranks' gradients the same way.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from made_steps import make_steps, toy_rollout
from pipeline import CHILD_ENV

from streamgrp.cli.children import free_port
from streamgrp.consumers import grpo_trainer, toy_task
from streamgrp.core import codec
from streamgrp.core.events import CheckpointSaved, StepCommitted, TrainingResumed
from streamgrp.replay.steps import replay_step
from streamgrp.train.weights import WeightCache

pytestmark = [pytest.mark.slow, pytest.mark.one_server_kind]

STEPS = 40
EVERY = 5
LR = 0.05
RANDOM_KILLS = 3


class Group:
    """Both ranks of one start of the trainer group, as `streamgrp trainer` processes."""

    started: list[Group] = []

    def __init__(
        self,
        redis_url: str,
        run_name: str,
        checkpoints: Path,
        logs: Path,
        crash: dict[int, str],
        *,
        ranks: tuple[int, ...] = (0, 1),
        extra: tuple[str, ...] = (),
        dist_url: str | None = None,
    ) -> None:
        self.dist_url = dist_url or f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        self.ranks = []
        self.logs: list[Path] = []
        for rank in ranks:
            log_path = logs / f"start{len(list(logs.iterdir()))}-rank{rank}.log"
            args = [
                sys.executable,
                "-m",
                "streamgrp",
                "trainer",
                "--redis-url",
                redis_url,
                "--run",
                run_name,
                "--rank",
                str(rank),
                "--world-size",
                "2",
                "--dist-url",
                self.dist_url,
                "--lr",
                str(LR),
                *extra,
                "--checkpoint-dir",
                str(checkpoints),
                "--checkpoint-every",
                str(EVERY),
                *(["--crash-at", crash[rank]] if rank in crash else []),
            ]
            self.logs.append(log_path)
            with open(log_path, "wb") as log:  # the child writes through its own copy of the descriptor
                self.ranks.append(
                    subprocess.Popen(
                        args,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": "1"},
                    )
                )
        Group.started.append(self)

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for rank in self.ranks:
            try:
                rank.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [rank.poll() for rank in self.ranks]

    def kill_rest(self) -> None:
        for rank in self.ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()


@pytest.fixture(autouse=True)
def _no_rank_left_running():
    yield
    for group in Group.started:
        group.kill_rest()
    Group.started.clear()


def _committed(client, run) -> dict[int, int]:
    return {int(r): int(s) for r, s in client.hgetall(run.keys.committed).items()}


def _events(client, run):
    return [codec.decode(fields) for _, fields in client.xrange(run.keys.commits)]


def test_a_trainer_group_killed_again_and_again_ends_with_the_weights_of_one_uninterrupted_pass(
    client, redis_url, make_run, tmp_path
):
    run = make_run(n_samples=3, dp_size=2, batch_size=2)
    make_steps(client, run, groups=2 * STEPS + 20, steps=STEPS, rollout=toy_rollout)  # some groups are dropped
    assert client.xlen(run.keys.steps) == STEPS
    checkpoints, logs = tmp_path / "checkpoints", tmp_path / "logs"
    logs.mkdir()
    rng = random.Random(7)
    kills: list[str] = []

    # 1. Rank 1 dies after training step 7, before committing it (rank 0 committed it).
    group = Group(redis_url, run.keys.run, checkpoints, logs, {1: "train:7"})
    assert group.wait(120)[1] == -signal.SIGKILL
    kills.append("rank 1 between training and commit of step 7")
    group.wait(60)
    group.kill_rest()
    assert _committed(client, run)[1] == 6

    # 2. Rank 0 dies halfway through the checkpoint of step 14: one file written, nothing recorded.
    group = Group(redis_url, run.keys.run, checkpoints, logs, {0: "checkpoint:14"})
    assert group.wait(120)[0] == -signal.SIGKILL
    kills.append("rank 0 halfway through the checkpoint of step 14")
    group.wait(60)
    group.kill_rest()
    assert list(checkpoints.glob(".partial-*")), "the checkpoint write was not cut off halfway"
    assert max(e.step for e in _events(client, run) if isinstance(e, CheckpointSaved)) == 9

    # 3. Random ranks at random moments: once the new attempt committed a step, within the next few steps
    #    (a step takes about 20 ms here, so the whole run is done in under a second of training).
    while len(kills) < 2 + RANDOM_KILLS:
        assert _committed(client, run) != {0: STEPS - 1, 1: STEPS - 1}, f"the run ended after only these kills: {kills}"
        attempts_before = sum(isinstance(e, TrainingResumed) for e in _events(client, run))
        group = Group(redis_url, run.keys.run, checkpoints, logs, {})
        started = _wait_for_a_commit_of_a_new_attempt(client, run, attempts_before, group)
        time.sleep(rng.uniform(0.0, 0.1))
        victim = rng.randrange(2)
        if not started or group.ranks[victim].poll() is not None:
            group.wait(120)
            group.kill_rest()
            continue
        group.ranks[victim].send_signal(signal.SIGKILL)
        kills.append(f"rank {victim} at step {_committed(client, run).get(victim)}")
        group.wait(60)
        group.kill_rest()

    # 4. The last start runs to the end of the run.
    group = Group(redis_url, run.keys.run, checkpoints, logs, {})
    assert group.wait(300) == [0, 0], _logs(logs)
    assert _committed(client, run) == {0: STEPS - 1, 1: STEPS - 1}
    assert len(kills) >= 5, kills

    events = _events(client, run)
    resumed = [e for e in events if isinstance(e, TrainingResumed)]
    assert len(resumed) == len(list(logs.iterdir())) // 2  # one attempt per start of the group
    # After the mid-checkpoint crash the group resumed after step 9, the newest recorded checkpoint.
    assert any(e.step == EVERY * 2 and e.retrain_through >= 14 for e in resumed), resumed
    # Every step's last commits are both ranks' in one attempt.
    last: dict[int, dict[int, int]] = {}
    for e in events:
        if isinstance(e, StepCommitted):
            last.setdefault(e.step, {})[e.rank] = e.attempt
    assert all(len(set(last[s].values())) == 1 and set(last[s]) == {0, 1} for s in range(STEPS)), last

    # Retention (--keep-checkpoints, default 2): the two newest recorded checkpoints are all that is left.
    newest = sorted((e.step, e.attempt) for e in events if isinstance(e, CheckpointSaved))[-1]
    assert newest[0] == STEPS - 1
    kept = sorted(path.name for path in checkpoints.iterdir() if not path.name.startswith("."))
    assert (
        len(kept) == 2
        and kept[-1] == f"step-{newest[0]:08d}-a{newest[1]}"
        and kept[0].startswith(f"step-{STEPS - 1 - EVERY:08d}-")
    ), kept

    trained = WeightCache(client, run.keys).get(int(client.get(run.keys.version)))
    assert trained is not None
    reference = _uninterrupted_pass(client, run)
    for name, tensor in reference.items():
        assert torch.equal(trained[1][name], tensor), f"{name} differs from the uninterrupted pass (kills: {kills})"
    assert not torch.equal(reference["head.weight"], toy_task.initial_policy().state_dict()["head.weight"])


def _wait_for_a_commit_of_a_new_attempt(client, run, attempts_before: int, group: Group) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and all(rank.poll() is None for rank in group.ranks):
        events = _events(client, run)
        attempts = [e for e in events if isinstance(e, TrainingResumed)]
        if len(attempts) > attempts_before and any(
            isinstance(e, StepCommitted) and e.attempt == attempts[-1].attempt for e in events
        ):
            return True
        time.sleep(0.02)
    return False


def _uninterrupted_pass(client, run) -> dict[str, torch.Tensor]:
    """The reference: both ranks' shards of every step replayed from the log, trained in one process by
    `grpo_trainer._step` on two thread ranks whose all-reduce adds their tensors, from the initial weights."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sums = ThreadSum()
        # Made here, one after the other: initialising seeds torch's one global generator.
        policies = {rank: toy_task.initial_policy() for rank in (0, 1)}
        states = {}

        def rank_pass(rank: int) -> None:
            policy = policies[rank]
            optimizer = torch.optim.Adam(policy.parameters(), lr=LR)
            collectives = sums.for_rank(rank)
            spec = run.config.adv_norm or run.config.reward_norm or grpo_trainer.DEFAULT_ADV_NORM
            for step in range(STEPS):
                grpo_trainer._step(policy, optimizer, replay_step(client, run.keys, step, rank), spec, collectives)
            states[rank] = policy.state_dict()

        threads = [threading.Thread(target=rank_pass, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert set(states) == {0, 1}
        assert all(torch.equal(states[0][n], states[1][n]) for n in states[0])
        return states[0]
    finally:
        torch.set_num_threads(threads_before)


class ThreadSum:
    """`Collectives.all_reduce` for two thread ranks: each gets rank 0's tensor plus rank 1's."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=60)
        self.tensors: list[torch.Tensor | None] = [None, None]

    def for_rank(self, rank: int):
        owner = self

        class Collectives:
            def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
                owner.tensors[rank] = tensor.clone()
                owner.barrier.wait()
                total = owner.tensors[0] + owner.tensors[1]
                owner.barrier.wait()
                tensor.copy_(total)
                return tensor

        return Collectives()


def _logs(logs: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logs.iterdir()))


def test_a_rank_that_comes_back_alone_waits_for_its_peer_or_fails_naming_it(client, redis_url, make_run, tmp_path):
    run = make_run(n_samples=3, dp_size=2, batch_size=2)
    make_steps(client, run, groups=8, steps=3, rollout=toy_rollout)
    checkpoints, logs = tmp_path / "checkpoints", tmp_path / "logs"
    logs.mkdir()

    alone = Group(redis_url, run.keys.run, checkpoints, logs, {}, ranks=(1,), extra=("--peer-wait-s", "1"))
    assert alone.wait(60) == [2]  # a clear error, no traceback
    output = alone.logs[0].read_text()
    assert "rank 1 of 2 waited 1s" in output and "rank 0 of its trainer group never joined" in output, output
    assert client.hlen(run.keys.committed) == 0 and client.xlen(run.keys.commits) == 0

    waiting = Group(redis_url, run.keys.run, checkpoints, logs, {}, ranks=(1,))
    assert waiting.wait(4) == [None], "a rank alone did not wait for its peer"
    assert client.hlen(run.keys.committed) == 0
    peer = Group(redis_url, run.keys.run, checkpoints, logs, {}, ranks=(0,), dist_url=waiting.dist_url)
    assert waiting.wait(120) + peer.wait(120) == [0, 0], _logs(logs)
    assert _committed(client, run) == {0: 2, 1: 2}

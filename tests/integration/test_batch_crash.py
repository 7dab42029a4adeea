"""SIGKILL a trainer rank and the batcher, as real processes, and check SPEC section 5 afterwards.

(a) A trainer rank killed mid-run resumes at its next uncommitted step and commits no step twice.
(b) The batcher (which also feeds the dataset) killed at random moments, at least three times, while
    workers, the assembler and two trainer ranks keep going: step numbers are 0..N-1 with none skipped
    or doubled, every prompt is issued once, and every trainable group is in exactly one manifest or
    in the discarded stream.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import redis
from pipeline import check_run
from processes import RoleProcess, wait_until

import streamgrp
from streamgrp.config import AssemblerConfig, BatcherConfig, RunConfig
from streamgrp.core import codec
from streamgrp.core.events import (
    RunFinished,
    StepCommitted,
)
from streamgrp.services.assembler import Assembler
from streamgrp.services.batcher import Batcher
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient
from streamgrp.store.runs import join_run
from streamgrp.store.tasks import TaskIssuer
from streamgrp.train.trainer import TrainerClient

pytestmark = pytest.mark.slow

TRAINER_SCRIPT = """
import os, sys, time
from streamgrp.store.runs import connect, open_run
from streamgrp.train.trainer import TrainerClient

url, run_name, rank, world_size, out = sys.argv[1:6]
rank, world_size = int(rank), int(world_size)
client = connect(url, cluster=os.environ.get("STREAMGRP_CLUSTER") == "1")
trainer = TrainerClient(client, open_run(client, run_name), poll_s=0.1)
with open(out, "a") as log:
    log.write(f"start {trainer.next_step(rank)}\\n")
    log.flush()
    with trainer.batches(rank=rank, world_size=world_size) as batches:
        for batch in batches:
            time.sleep(0.2)  # the step's work
            log.write(f"step {batch.step}\\n")
            log.flush()
            batch.commit()
    log.write("done\\n")
"""


def _events(client, stream, kind):
    return [e for e in (codec.decode(fields) for _, fields in client.xrange(stream)) if isinstance(e, kind)]


def _committed(client, run, rank: int) -> int:
    value = client.hget(run.keys.committed, str(rank))
    return -1 if value is None else int(value)


# -- (a) a trainer rank ------------------------------------------------------------------------------

STEPS_A = 12


@pytest.mark.cluster
def test_a_killed_trainer_rank_resumes_at_its_next_uncommitted_step(client, redis_url, run_name, tmp_path):
    run = join_run(client, run_name, RunConfig(n_samples=2, dp_size=2, batch_size=2))
    TaskIssuer(client, run.keys).issue([{}] * (2 * STEPS_A))
    worker = WorkerClient(client, run.keys)
    for task in worker.take(1000, block_ms=None):
        for slot in range(2):
            worker.publish(task.event.task_id, slot, make_sample(tokens=3 + slot, seed=slot))
        worker.done(task)
    Assembler(client, run, AssemblerConfig(lease_ttl_s=1, tick_interval_s=0.05)).run(burst=True)
    assert Batcher(client, run, BatcherConfig(round_s=0.05, max_steps=STEPS_A)).run(burst=True) == "finished"

    script = tmp_path / "trainer_rank.py"
    script.write_text(TRAINER_SCRIPT)
    outs = [tmp_path / f"rank{rank}.txt" for rank in (0, 1)]

    # the child imports the streamgrp this test imported, wherever the checkout is
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(streamgrp.__file__).parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }

    def start(rank: int) -> subprocess.Popen:
        with open(tmp_path / f"rank{rank}.err", "ab") as err:  # the child keeps its own copy of the fd
            return subprocess.Popen(
                [sys.executable, str(script), redis_url, run_name, str(rank), "2", str(outs[rank])],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
            )

    def steps_done(rank: int) -> int:
        text = outs[rank].read_text() if outs[rank].exists() else ""
        return text.count("step ")

    rng = random.Random(7)
    victim, steady = start(0), start(1)
    expected_starts = [0]
    try:
        for _ in range(2):
            seen = steps_done(0)
            wait_until(lambda: steps_done(0) > seen, timeout=30, message="the trainer rank to make progress")
            time.sleep(rng.uniform(0.0, 0.25))  # anywhere in a step: working, logged, or committed
            victim.kill()
            victim.wait(timeout=10)
            expected_starts.append(_committed(client, run, 0) + 1)
            assert expected_starts[-1] < STEPS_A, "the rank finished before it was killed; make the run longer"
            victim = start(0)
        assert victim.wait(timeout=60) == 0
        assert steady.wait(timeout=60) == 0
    finally:
        for process in (victim, steady):
            if process.poll() is None:
                process.kill()
                process.wait()

    lines = outs[0].read_text().split("\n")
    assert [int(line.split()[1]) for line in lines if line.startswith("start")] == expected_starts
    # each start continues at its next uncommitted step; a step logged but not committed is redone once
    runs = "\n".join(lines).split("start ")[1:]
    for number, (start_at, chunk) in enumerate(zip(expected_starts, runs)):
        steps = [int(s) for s in re.findall(r"^step (\d+)$", chunk, re.M)]
        end = expected_starts[number + 1] if number + 1 < len(expected_starts) else STEPS_A
        assert steps[: end - start_at] == list(range(start_at, end))
        extra = steps[end - start_at :]
        if number + 1 < len(expected_starts):
            assert extra in ([], [end])  # at most the step the kill interrupted before its commit
        else:
            assert extra == []
    assert lines[-2] == "done"
    assert outs[1].read_text().split("\n")[1:-2] == [f"step {s}" for s in range(STEPS_A)]

    committed = Counter((e.step, e.rank) for e in _events(client, run.keys.commits, StepCommitted))
    assert committed == Counter({(step, rank): 1 for step in range(STEPS_A) for rank in (0, 1)})
    assert _committed(client, run, 0) == _committed(client, run, 1) == STEPS_A - 1
    assert int(client.get(run.keys.version)) == STEPS_A


# -- (b) the batcher -----------------------------------------------------------------------------------

PROMPTS = 300
RUN_FLAGS = ["--n-samples", "4", "--dp-size", "2", "--batch-size", "4", "--max-staleness", "2"]


def test_sigkilled_batcher_skips_and_doubles_no_step_and_loses_no_group(client, redis_url, run_name, tmp_path):
    run = join_run(client, run_name, RunConfig(n_samples=4, dp_size=2, batch_size=4, max_staleness=2))
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_bytes(
        b"".join(orjson.dumps({"tokens": 16, "reject_rate": 0.1, "seed": i}) + b"\n" for i in range(PROMPTS))
    )
    common = ["--redis-url", redis_url, "--run", run_name]
    batcher = RoleProcess(
        "batcher",
        [*common, *RUN_FLAGS, "--dataset", str(dataset), "--round-s", "0.1", "--lease-ttl-s", "1"],
        tmp_path / "batcher",
    )
    assembler = RoleProcess(
        "assembler", [*common, "--lease-ttl-s", "1", "--tick-interval-s", "0.1"], tmp_path / "assembler"
    )
    workers = [RoleProcess("worker", [*common, "--concurrency", "4"], tmp_path / f"worker{i}") for i in range(2)]
    for process in (batcher, assembler, *workers):
        process.log_dir.mkdir()
        process.start()

    # two trainer ranks in this process: they advance the policy version, which moves the feeder's window
    stop = threading.Event()
    consumed: dict[int, list[int]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        trainer = TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.1)
        try:
            for batch in trainer.batches(rank=rank, world_size=2):
                consumed[rank].append(batch.step)
                time.sleep(0.03)
                if stop.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    trainers = [threading.Thread(target=train, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in trainers:
        thread.start()

    def steps() -> int:
        return client.xlen(run.keys.steps)

    def finished() -> bool:
        return bool(_events(client, run.keys.control, RunFinished))

    rng = random.Random(2024)
    kills = 0
    try:
        while kills < 4:
            wait_until(
                lambda: _holds_lease(client, run, batcher.pid),
                timeout=30,
                message=f"batcher start {batcher.starts} to take the lease",
            )
            before = steps()
            wait_until(lambda: steps() > before or finished(), timeout=30, message="the batcher to write a step")
            if finished():
                break
            time.sleep(rng.uniform(0.0, 0.3))  # a random moment: feeding, reading, or committing a step
            batcher.kill()
            kills += 1
            batcher.start()
        assert kills >= 3, f"the run finished after only {kills} batcher kills; make it longer"
        wait_until(finished, timeout=90, interval=0.2, message="the run to finish")
        for thread in trainers:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a trainer rank did not see the end of the run"
        assert not errors, errors
        assert batcher.proc.wait(timeout=10) == 0  # a finished run ends the batcher by itself
    finally:
        stop.set()
        for process in (batcher, assembler, *workers):
            if process.proc is not None and process.proc.poll() is None:
                process.stop()

    # every restart took over the server's position (step and feeder cursor), never its own
    activations = re.findall(r"active at step (\d+) with (\d+) buffered groups", batcher.output())
    assert len(activations) == batcher.starts == kills + 1
    assert [int(step) for step, _ in activations] == sorted(int(step) for step, _ in activations)
    _check_batches(client, run, consumed)


def _check_batches(client, run, consumed) -> None:
    n_steps = check_run(client, run, prompts=PROMPTS)
    # each rank consumed each step once, in order
    assert consumed == {0: list(range(n_steps)), 1: list(range(n_steps))}


def _holds_lease(client, run, pid: int) -> bool:
    token = client.get(run.keys.batcher_lease)
    return token is not None and f"-{pid}-" in token.decode()

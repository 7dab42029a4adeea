"""Two trainer ranks started by ``torchrun --nproc-per-node 2 -m streamgrp.consumers.grpo_trainer``, on gloo.

The ranks take rank, world size and rendezvous from torchrun's variables alone (no rank flags).
Each step gives one rank two groups and the other one (batch size 3 over 2 ranks, with partial groups),
yet both ranks consume every step once and in order and make the same collective calls at every
step: the reference trainer logs each step's calls, and ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` makes
gloo itself check before every collective that both ranks called the same one with the same shapes.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import orjson
import pytest
from made_steps import make_steps, toy_rollout
from pipeline import CHILD_ENV, events
from processes import RoleProcess

from streamgrp.config import RunConfig
from streamgrp.core import codec
from streamgrp.core.events import StepCommitted, StepManifest, TrainingResumed
from streamgrp.core.policy import NormSpec
from streamgrp.store.runs import join_run

pytestmark = pytest.mark.slow

STEPS = 5
RUN = RunConfig(
    dp_size=2, batch_size=3, n_samples=4, reward_norm=NormSpec("group", "group"), max_staleness=1, group_timeout_s=30.0
)
STEP_LINE = re.compile(r"rank (\d) step (\d+): .* collectives (.+)$")


def _prompts(path: Path, count: int) -> Path:
    # The toy task's prompts, with rejections and failures so that some groups are partial.
    lines = (orjson.dumps({"p": i % 8, "reject_rate": 0.2, "fail_rate": 0.1, "seed": 3, "i": i}) for i in range(count))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _rank_logs(log_dir: Path) -> dict[int, str]:
    # torchrun --redirects 3 --log-dir D writes D/<run id>/attempt_0/<local rank>/{stdout,stderr}.log
    found = {int(p.parent.name): p.read_text(errors="replace") for p in log_dir.rglob("stderr.log")}
    assert sorted(found) == [0, 1], f"expected one log per rank under {log_dir}, found {sorted(found)}"
    return found


@pytest.mark.one_server_kind
def test_torchrun_two_ranks_consume_every_step_in_order_with_equal_collectives(client, redis_url, run_name, tmp_path):
    # The run exists before any role starts, so every role (and both ranks) adopts its record.
    run = join_run(client, run_name, RUN)
    common = ["--redis-url", redis_url, "--run", run_name]
    dataset = _prompts(tmp_path / "prompts.jsonl", 400)
    roles = [
        RoleProcess(
            "batcher",
            [*common, "--dataset", str(dataset), "--max-steps", str(STEPS), "--round-s", "0.1"],
            tmp_path,
            env=CHILD_ENV,
        ),
        RoleProcess("assembler", [*common, "--tick-interval-s", "0.1"], tmp_path, env=CHILD_ENV),
        RoleProcess(
            "worker",
            [*common, "--rollout", "streamgrp.consumers.toy_task:rollout", "--concurrency", "8"],
            tmp_path,
            env=CHILD_ENV,
        ),
    ]
    log_dir = tmp_path / "torchrun"
    # No rank, world size or rendezvous flag: each process learns them from torchrun's environment.
    # "--" ends torchrun's own flags: its parser would take --run for an abbreviation of its --run-path.
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--redirects",
        "3",
        "--log-dir",
        str(log_dir),
        "-m",
        "streamgrp.consumers.grpo_trainer",
        "--",
        *common,
    ]
    env = {**os.environ, **CHILD_ENV, "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1"}
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "STREAMGRP_RANK",
        "STREAMGRP_WORLD_SIZE",
        "STREAMGRP_DIST_URL",
    ):
        env.pop(name, None)
    for role in roles:
        role.start()
    try:
        done = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=240)
    finally:
        codes = {role.role: role.stop() for role in roles}
    logs = _rank_logs(log_dir)
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{done.stderr[-3000:]}\n" + "\n".join(
        f"--- rank {r}\n{text[-3000:]}" for r, text in logs.items()
    )
    assert codes["batcher"] == 0, roles[0].output()[-3000:]

    manifests = [codec.decode(fields) for _, fields in client.xrange(run.keys.steps)]
    assert [m.step for m in manifests if isinstance(m, StepManifest)] == list(range(STEPS))
    # Ragged shards: one rank holds two groups, the other one.
    assert all(sorted(len(shard.groups) for shard in m.shards) == [1, 2] for m in manifests)

    committed = defaultdict(list)
    for event in events(client, run.keys.commits, StepCommitted):
        committed[event.rank].append(event.step)
    assert dict(committed) == {0: list(range(STEPS)), 1: list(range(STEPS))}, (
        "each rank commits each step once, in order"
    )

    per_rank = {}
    for rank, text in logs.items():
        assert f"joining the process group as rank {rank} of 2" in text and "rank from torchrun" in text
        lines = [STEP_LINE.search(line) for line in text.splitlines()]
        per_rank[rank] = [(int(m[2]), m[3]) for m in lines if m]
        assert [step for step, _ in per_rank[rank]] == list(range(STEPS)), text[-3000:]
    assert per_rank[0] == per_rank[1], "the ranks made different collective calls at some step"
    assert all(calls.startswith("all_reduce:float32[") and calls.count("all_reduce") == 2 for _, calls in per_rank[0])

    # Rank 0 records what `streamgrp report` charts for every step: the loss and the logprob mismatch
    # (summed over both ranks in the same metrics all-reduce, so still two collectives per step).
    metrics = {int(k): orjson.loads(v) for k, v in client.hgetall(run.keys.trainer_metrics).items()}
    assert sorted(metrics) == list(range(STEPS))
    for record in metrics.values():
        assert math.isfinite(record["loss"]) and 0.0 <= record["logprob_abs_diff_mean"] < 10.0, record


@pytest.mark.one_server_kind
def test_torchrun_max_restarts_resumes_the_group_from_its_checkpoint(client, redis_url, make_run, tmp_path):
    # Rank 0 dies halfway through the checkpoint of step 3 (steps 0..3 committed by then); torchrun
    # restarts both ranks, which resume after the checkpoint of step 1 and train steps 2 and 3 again.
    run = make_run(n_samples=3, dp_size=2, batch_size=2)
    make_steps(client, run, groups=16, steps=STEPS, rollout=toy_rollout)
    log_dir = tmp_path / "torchrun"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--redirects",
        "3",
        "--log-dir",
        str(log_dir),
        "-m",
        "streamgrp.consumers.grpo_trainer",
        "--",
        "--redis-url",
        redis_url,
        "--run",
        run.keys.run,
        "--checkpoint-dir",
        str(tmp_path / "checkpoints"),
        "--checkpoint-every",
        "2",
        "--crash-at",
        "checkpoint:3",
    ]
    env = {**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert "crash injected halfway through the checkpoint of step 3" in "".join(
        p.read_text() for p in log_dir.rglob("stderr.log")
    )

    resumed = events(client, run.keys.commits, TrainingResumed)
    assert [(e.attempt, e.step, e.reason, e.retrain_through) for e in resumed] == [
        (1, 0, "start", -1),
        (2, 2, "checkpoint", 3),
    ]
    committed = defaultdict(list)
    for event in events(client, run.keys.commits, StepCommitted):
        committed[event.rank].append((event.step, event.attempt))
    expected = [(0, 1), (1, 1), (2, 1), (3, 1), (2, 2), (3, 2), (4, 2)]
    assert committed[0] == expected and committed[1] == expected, dict(committed)

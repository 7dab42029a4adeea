"""TRL's async GRPO trainer trains from a real streamgrp pipeline (`streamgrp.train.trl_async`).

A batcher feeding prompts, an assembler and a rollout worker run as real processes on a real
server; TRL's ``AsyncGRPOTrainer`` (a real trl install, a tiny random Llama built from a config)
takes a few optimizer steps with `StreamgrpRollouts` as its rollout worker and `StreamgrpWeights` as
its weight transfer. Every sample TRL took is a row of a streamgrp step, in step order, and every
step TRL took all of is committed once, in order, and replays to exactly the rows TRL got.

TRL's trainer is GPU-first: `trl_cpu` swaps its FlashAttention-3 kernel for plain torch (test-only).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from pipeline import CHILD_ENV, events
from processes import RoleProcess

from streamgrp.config import RunConfig
from streamgrp.core.events import StepCommitted
from streamgrp.core.policy import NormSpec
from streamgrp.replay.steps import replay_step
from streamgrp.store.runs import join_run
from streamgrp.train.weights import latest_key

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
MAX_STEPS = 4
RUN = RunConfig(dp_size=1, batch_size=2, n_samples=4, reward_norm=NormSpec("group", "group"), max_staleness=2,
                group_timeout_s=30.0)


@pytest.fixture
def trl_installed() -> None:
    if importlib.util.find_spec("trl") is None:
        if os.environ.get("STREAMGRP_TEST_REQUIRE_TRL"):
            pytest.fail("trl is not installed but STREAMGRP_TEST_REQUIRE_TRL is set: pip install -e '.[trl]'")
        pytest.skip("trl is not installed (pip install -e '.[trl]')")


def test_trl_async_grpo_takes_optimizer_steps_on_streamgrp_steps(trl_installed, client, redis_url, server_kind,
                                                                 run_name, tmp_path):
    if server_kind != "valkey":
        pytest.skip("TRL's side does not depend on the server kind; delivery is tested on both elsewhere")
    run = join_run(client, run_name, RUN)
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_bytes(b"".join(orjson.dumps({"p": i}) + b"\n" for i in range(200)))
    common = ["--redis-url", redis_url, "--run", run_name]
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), CHILD_ENV["PYTHONPATH"]])}
    roles = [
        RoleProcess("batcher", [*common, "--dataset", str(dataset), "--round-s", "0.1"], tmp_path, env=env),
        RoleProcess("assembler", [*common, "--tick-interval-s", "0.1"], tmp_path, env=env),
        RoleProcess("worker", [*common, "--rollout", "rollouts:tiny_vocab_rollout", "--concurrency", "8"], tmp_path,
                    env=env),
    ]
    out = tmp_path / "result.json"
    for role in roles:
        role.start()
    try:
        done = subprocess.run([sys.executable, str(HERE / "trl_train.py"), redis_url, run_name, str(tmp_path),
                               str(MAX_STEPS), str(out)], env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=240)
    finally:
        for role in roles:
            role.stop()
    assert done.returncode == 0, done.stderr[-5000:]
    result = orjson.loads(out.read_bytes())

    assert result["global_step"] == MAX_STEPS
    train_logs = [log for log in result["logs"] if "loss" in log]
    assert len(train_logs) == MAX_STEPS and all(math.isfinite(log["loss"]) for log in train_logs)
    assert all("streamgrp/step" in log for log in train_logs[:1]), "the feed's metrics reach TRL's logs"
    assert result["moved"] > 0, "the optimizer steps changed no weight"
    # The cold sync, then one per optimizer step; each version names one weight state, so a sync at a
    # version already published is skipped: the published versions are strictly increasing.
    assert result["published"][0] == 0 and result["published"] == sorted(set(result["published"]))
    assert len(result["published"]) + result["skipped"] == MAX_STEPS + 1
    assert client.get(latest_key(run.keys)) is not None

    commits = [(e.step, e.rank) for e in events(client, run.keys.commits, StepCommitted)]
    n_committed = len(commits)
    assert n_committed == result["committed_by_feed"] >= 1
    assert commits == [(step, 0) for step in range(n_committed)], "each step committed once, in order"
    rows = []  # the committed steps' rows, unpadded, as replay rebuilds them
    for step in range(n_committed):
        batch = replay_step(client, run.keys, step, 0)
        rows += [ids[:length] for ids, length in zip(batch.token_ids.tolist(), batch.attention_mask.sum(1).tolist())]
    taken = result["taken"]
    assert len(taken) >= len(rows) >= MAX_STEPS * 4 - 8  # TRL's micro-batches of 4, minus what it held ahead
    assert taken[:len(rows)] == rows, "TRL trained on the committed steps' rows, in step order"

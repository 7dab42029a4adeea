"""TRL's async GRPO trainer trains from a real streamgrp pipeline (`streamgrp.train.trl_async`).

A batcher feeding prompts, an assembler and a rollout worker run as real processes on a real
server; TRL's ``AsyncGRPOTrainer`` (a real trl install, a tiny random Llama built from a config)
takes a few optimizer steps with `StreamgrpRollouts` as its rollout worker and `StreamgrpWeights` as
its weight transfer. Every sample TRL took is a row of a streamgrp step, in step order; the steps
committed are exactly those every row of which was in a completed optimizer step (TRL's
``max_steps`` stops it mid-step), a second start trains the rest, and across both starts each row
is trained exactly once. A start from a TRL checkpoint resumes the run at the rows that checkpoint
holds, training the later ones again.

TRL's trainer is GPU-first: `trl_cpu` swaps its FlashAttention-3 kernel for plain torch (test-only).
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from pipeline import CHILD_ENV, events
from processes import RoleProcess, wait_until

from streamgrp.config import RunConfig
from streamgrp.core.events import StepCommitted, StepRowsTrained, TrainingResumed
from streamgrp.core.policy import NormSpec
from streamgrp.replay.steps import replay_step
from streamgrp.store.runs import join_run
from streamgrp.train.trl_progress import Position, recorded_rows
from streamgrp.train.weights import latest_key

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
MAX_STEPS = 3  # of 4 samples each: 12 rows, one step of 8 (or fewer: partial groups) and part of the next
RUN = RunConfig(
    dp_size=1, batch_size=2, n_samples=4, reward_norm=NormSpec("group", "group"), max_staleness=2, group_timeout_s=30.0
)


@pytest.fixture
def trl_installed() -> None:
    if importlib.util.find_spec("trl") is None:
        if os.environ.get("STREAMGRP_TEST_REQUIRE_TRL"):
            pytest.fail("trl is not installed but STREAMGRP_TEST_REQUIRE_TRL is set: pip install -e '.[trl]'")
        pytest.skip("trl is not installed (pip install -e '.[trl]')")


@pytest.fixture
def pipeline(trl_installed, client, redis_url, server_kind, run_name, tmp_path):
    """The run's batcher, assembler and worker as processes; yields a function running one TRL start."""
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
        RoleProcess(
            "worker", [*common, "--rollout", "rollouts:tiny_vocab_rollout", "--concurrency", "8"], tmp_path, env=env
        ),
    ]

    def command(name: str, max_steps: int, *extra: str) -> dict:
        return dict(
            args=[
                sys.executable,
                str(HERE / "trl_train.py"),
                redis_url,
                run_name,
                str(tmp_path),
                str(max_steps),
                str(tmp_path / f"{name}.json"),
                *extra,
            ],
            env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        )

    def start(name: str, max_steps: int, *extra: str) -> dict:
        done = subprocess.run(**command(name, max_steps, *extra), capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-5000:]
        return orjson.loads((tmp_path / f"{name}.json").read_bytes())

    start.command = command

    for role in roles:
        role.start()
    try:
        yield run, start
    finally:
        for role in roles:
            role.stop()


def step_rows(client, run, steps) -> list[list[list[int]]]:
    """The rows of each step, unpadded, as replay rebuilds them."""
    out = []
    for step in steps:
        batch = replay_step(client, run.keys, step, 0)
        out.append([ids[:n] for ids, n in zip(batch.token_ids.tolist(), batch.attention_mask.sum(1).tolist())])
    return out


def committed_steps(client, run) -> list[tuple[int, int]]:
    return [(e.step, e.attempt) for e in events(client, run.keys.commits, StepCommitted)]


def test_trl_async_grpo_commits_only_what_it_trained_and_a_second_start_trains_the_rest(pipeline, client):
    run, start = pipeline
    first = start("first", MAX_STEPS)

    assert first["global_step"] == MAX_STEPS
    train_logs = [log for log in first["logs"] if "loss" in log]
    assert len(train_logs) == MAX_STEPS and all(math.isfinite(log["loss"]) for log in train_logs)
    assert all("streamgrp/step" in log for log in train_logs[:1]), "the feed's metrics reach TRL's logs"
    assert first["moved"] > 0, "the optimizer steps changed no weight"
    # The cold sync, then one per optimizer step; each version names one weight state, so a sync at a
    # version already published is skipped: the published versions are strictly increasing.
    assert first["published"][0] == 0 and first["published"] == sorted(set(first["published"]))
    assert len(first["published"]) + first["skipped"] == MAX_STEPS + 1
    assert client.get(latest_key(run.keys)) is not None

    trained = first["trained"]
    assert len(trained) == MAX_STEPS * 4
    assert len(first["taken"]) > len(trained), "TRL took rows it did not train (a micro-batch packed ahead)"
    commits = committed_steps(client, run)
    assert commits == [(step, 1) for step in range(len(commits))] and first["committed_by_feed"] == len(commits)
    rows = step_rows(client, run, range(len(commits) + 1))
    done = sum(len(r) for r in rows[:-1])
    assert done <= len(trained) < done + len(rows[-1]), "max_steps stopped TRL inside the next step"
    # (TRL orders the groups of a micro-batch by cost: compare as multisets.)
    assert sorted(trained) == sorted([ids for r in rows[:-1] for ids in r] + rows[-1][: len(trained) - done]), (
        "the committed steps are exactly the fully trained ones"
    )
    recorded = events(client, run.keys.commits, StepRowsTrained)[-1]
    assert (recorded.step, recorded.rows) == (len(commits), tuple(range(len(trained) - done)))

    second = start("second", MAX_STEPS)
    commits = committed_steps(client, run)
    rows = step_rows(client, run, range(len(commits) + 1))
    both = trained + second["trained"]
    done = sum(len(r) for r in rows[:-1])
    assert len(commits) > recorded.step, "the second start completed the step the first stopped in"
    assert sorted(both) == sorted([ids for r in rows[:-1] for ids in r] + rows[-1][: len(both) - done]), (
        "across both starts each row is trained exactly once, and the steps committed are the fully trained ones"
    )
    assert second["retrained_rows"] == 0
    assert [(e.step, e.reason) for e in events(client, run.keys.commits, TrainingResumed)][-1] == (
        recorded.step,
        "lowest_rank",
    )


def test_trl_resumed_from_its_checkpoint_trains_again_what_followed_it(pipeline, client, tmp_path):
    run, start = pipeline
    first = start("first", MAX_STEPS, "1")  # checkpoint-1, -2, -3: 4, 8 and 12 rows
    state = orjson.loads((tmp_path / "out" / "checkpoint-1" / "trainer_state.json").read_bytes())
    position = state["stateful_callbacks"]["StreamgrpProgress"]["attributes"]["position"]
    assert position == {"run": run.keys.run, "step": 0, "rows": [0, 1, 2, 3]}
    rows = step_rows(client, run, range(3))

    second = start("second", MAX_STEPS + 1, "0", str(tmp_path / "out" / "checkpoint-1"))
    assert second["global_step"] == MAX_STEPS + 1
    after = [ids for r in rows for ids in r][4:]
    assert sorted(second["trained"]) == sorted(after[: len(second["trained"])]), (
        "resumed at the row after what checkpoint-1 holds"
    )
    # Everything the first start trained after checkpoint-1 is trained again, counted as retrained.
    assert second["retrained_rows"] == len(first["trained"]) - 4
    resumed = events(client, run.keys.commits, TrainingResumed)[-1]
    assert (resumed.step, resumed.reason) == (0, "checkpoint")
    assert committed_steps(client, run)[-1][1] == resumed.attempt


def test_trl_killed_mid_step_hands_again_exactly_the_rows_not_recorded_as_trained(pipeline, client, tmp_path):
    run, start = pipeline
    log = (tmp_path / "killed.log").open("wb")
    trl = subprocess.Popen(**start.command("killed", 200), stdout=log, stderr=subprocess.STDOUT)
    try:
        # Some step partly trained: its rows recorded, the step not committed. Then the machine is lost.
        wait_until(
            lambda: (
                trl.poll() is None
                and (recorded_rows(client, run.keys, 0) or Position(-1)).step
                == int(client.hget(run.keys.committed, "0") or -1) + 1
            ),
            timeout=180,
            interval=0.02,
            message="a partly trained step",
        )
    finally:
        trl.send_signal(signal.SIGKILL)
        trl.wait()
        log.close()
    committed = int(client.hget(run.keys.committed, "0") or -1)
    recorded = recorded_rows(client, run.keys, 0)
    partial = recorded.rows if recorded is not None and recorded.step == committed + 1 else frozenset()
    rows = step_rows(client, run, [committed + 1, committed + 2])

    second = start("second", 2)
    handed = [ids for row, ids in enumerate(rows[0]) if row not in partial] + rows[1]
    assert second["taken"][: len(handed)] == handed[: len(second["taken"])], (
        "the next start hands the step's rows not recorded as trained (never lost), "
        "and not those recorded (never twice)"
    )
    assert events(client, run.keys.commits, TrainingResumed)[-1].step == committed + 1

"""The staleness policies through real processes on a real server (SPEC section 4): under ``wait``
nothing generated is dropped as stale, however long a generation takes; under ``mask`` every token
older than the window reaches the trainer with loss mask 0, and its group is trained, not dropped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from pipeline import CHILD_ENV, events
from processes import RoleProcess, wait_until

from streamgrp.config import RunConfig
from streamgrp.core.events import GroupDecided, GroupDiscarded, RunFinished, StepManifest
from streamgrp.store.runs import join_run

pytestmark = [pytest.mark.slow, pytest.mark.one_server_kind]  # the batcher's and loader's policy

HERE = str(Path(__file__).parent)
ENV = {**CHILD_ENV, "PYTHONPATH": os.pathsep.join([HERE, CHILD_ENV["PYTHONPATH"]])}

# A trainer rank that records, for every step, each row's token versions and loss mask as it got them.
RECORDING_TRAINER = """
import json, sys, time
from streamgrp.store.runs import connect, open_run
from streamgrp.train.trainer import TrainerClient

url, run_name, out, step_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
client = connect(url)
trainer = TrainerClient(client, open_run(client, run_name), poll_s=0.05)
with open(out, "a") as log, trainer.batches(rank=0, world_size=1) as batches:
    for batch in batches:
        time.sleep(step_s)  # a slow trainer: generations outlive several versions
        log.write(json.dumps({"step": batch.step, "version": batch.version, "masked": batch.stale_masked_tokens,
                              "versions": batch.token_versions.tolist(), "loss_mask": batch.loss_mask.tolist(),
                              "attention": batch.attention_mask.tolist()}) + "\\n")
        log.flush()
        batch.commit()
"""


def _run(
    url: str,
    run_name: str,
    tmp_path: Path,
    settings: dict,
    prompts: list[dict],
    *,
    rollout: str | None,
    step_s: float,
    workers: int = 2,
) -> tuple[list[dict], dict[str, int]]:
    """A whole run to its end; the trainer's records and the run's counters."""
    from streamgrp.store.runs import connect

    client = connect(url)
    run = join_run(client, run_name, RunConfig(**settings))
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in prompts))
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in settings.items()]
    common = ["--redis-url", url, "--run", run_name]
    roles = [
        RoleProcess(
            "batcher", [*common, *flags, "--dataset", str(dataset), "--round-s", "0.1"], tmp_path / "batcher", env=ENV
        ),
        RoleProcess("assembler", [*common, "--tick-interval-s", "0.1"], tmp_path / "assembler", env=ENV),
        *(
            RoleProcess(
                "worker",
                [*common, "--concurrency", "4", *(["--rollout", rollout] if rollout else [])],
                tmp_path / f"worker{i}",
                env=ENV,
            )
            for i in range(workers)
        ),
    ]
    script, out = tmp_path / "trainer.py", tmp_path / "trainer.jsonl"
    script.write_text(RECORDING_TRAINER)
    for role in roles:
        role.log_dir.mkdir(exist_ok=True)
        role.start()
    with open(tmp_path / "t.err", "wb") as err:  # the child keeps its own copy of the fd
        trainer = subprocess.Popen(
            [sys.executable, str(script), url, run_name, str(out), str(step_s)],
            env={**os.environ, **ENV},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:

        def finished() -> bool:
            dead = [r for r in roles if r.proc.poll() not in (None, 0)]
            assert not dead, "\n".join(r.output()[-3000:] for r in dead)
            return bool(events(client, run.keys.control, RunFinished)) and trainer.poll() is not None

        wait_until(finished, timeout=240, interval=0.5, message="the run to finish")
        assert trainer.returncode == 0, (tmp_path / "t.err").read_text()[-3000:]
    finally:
        for role in roles:
            role.stop()
        if trainer.poll() is None:
            trainer.kill()
    verify = subprocess.run(
        [sys.executable, "-m", "streamgrp", "verify", *common],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ENV},
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    counts: dict[str, int] = {}
    for key in dict.fromkeys([run.keys.counts, *(part.counts for part in run.partitions)]):
        for k, v in client.hgetall(key).items():
            counts[k.decode()] = counts.get(k.decode(), 0) + int(float(v))
    return [json.loads(line) for line in out.read_text().splitlines()], counts


def test_wait_drops_nothing_as_stale_and_trains_every_long_generation(redis_url, run_name, tmp_path):
    # One prompt in four takes 40 times as long as the others: long enough for the trainer (a step per
    # 0.15 s) to move the version past max_staleness 1 while it runs, were the batcher not holding steps
    # (with --staleness drop this run discards about a fifth of its groups as stale, most of them long).
    prompts = [
        {"seed": i, "tokens": 512 if i % 4 == 0 else 32, "sleep_s": 0.6 if i % 4 == 0 else 0.015} for i in range(48)
    ]
    settings = {"n_samples": 2, "batch_size": 4, "max_staleness": 1, "staleness": "wait", "group_timeout_s": 120}
    records, counts = _run(redis_url, run_name, tmp_path, settings, prompts, rollout=None, step_s=0.15)
    from streamgrp.store.runs import connect

    client = connect(redis_url)
    run = join_run(client, run_name, RunConfig(**settings))
    assert counts.get("dropped:stale", 0) == 0, counts
    assert not events(client, run.keys.discarded, GroupDiscarded)
    trained = {g.task_id for m in events(client, run.keys.steps, StepManifest) for s in m.shards for g in s.groups}
    decided = [d for d in events(client, run.keys.decisions, GroupDecided) if d.decision != "dropped"]
    long_decided = {d.task_id for d in decided if int(d.task_id[1:]) % 4 == 0}
    assert len(long_decided) == 12 and long_decided <= trained  # every long generation trained
    assert len(records) == len(trained) // 4 + (len(trained) % 4 > 0)


def test_mask_clears_the_loss_of_tokens_older_than_the_window_and_keeps_their_groups(redis_url, run_name, tmp_path):
    prompts = [{"seed": i} for i in range(40)]
    settings = {"n_samples": 2, "batch_size": 4, "max_staleness": 1, "staleness": "mask"}
    records, counts = _run(
        redis_url, run_name, tmp_path, settings, prompts, rollout="version_rollouts:spanning", step_s=0.1
    )
    assert counts.get("dropped:stale", 0) == 0, counts
    assert sum(r["masked"] for r in records) > 0, "no step had a token older than the window"
    masked_rows = kept_rows = 0
    for record in records:
        oldest = record["version"] - 1
        cleared = 0
        for versions, mask, attention in zip(record["versions"], record["loss_mask"], record["attention"]):
            generated = [i for i, (a, v) in enumerate(zip(attention, versions)) if a][4:]  # after the 4 prompt tokens
            for i in generated:
                if versions[i] < oldest:
                    assert not mask[i], f"step {record['step']}: a token of version {versions[i]} kept its loss"
                    cleared += 1
                else:
                    assert mask[i], f"step {record['step']}: a token of version {versions[i]} lost its loss"
            masked_rows += any(versions[i] < oldest for i in generated)
            kept_rows += any(mask[i] for i in generated)
        assert record["masked"] == cleared
    assert masked_rows > 0 and kept_rows == sum(len(r["versions"]) for r in records)  # every row still trains

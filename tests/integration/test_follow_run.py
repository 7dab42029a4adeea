"""Two followers beside a training run, as real processes: the live evaluation example (slow on purpose)
and `streamgrp export --follow`, each SIGKILLed once mid-run and restarted, with the archiver trimming
the run's streams (--retention) all along. Each applies every decision exactly once, in stream order;
retention never trims what the slower one has not read (it reads only the server, so a trimmed unread
decision would be missing); and every group reaches the trainer with the same bytes as in the same
run without followers.

What the trainer gets is compared per group, not per step: which groups share a step depends on when
decisions arrive, in either run; each group's rows (tokens, loss mask, logprobs, reward) are its own
and must be byte-identical. (The policy version a group
was sampled at is left out: it is the version when a worker took the task, timing in either run.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from pipeline import CHILD_ENV, write_dataset
from processes import RoleProcess, wait_until

from streamgrp.core.events import GroupDecided
from streamgrp.errors import ConfigError
from streamgrp.store.follow import positions
from streamgrp.store.keys import id_key
from streamgrp.store.runs import open_run
from streamgrp.store.sources import decode_all, open_run_source

PROMPTS = 48
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

# A trainer rank that logs, per group it trains, a digest of exactly its rows (padding removed; not the
# versions, which depend on when a worker took the task).
TRAINER = """
import hashlib, sys, orjson
from streamgrp.store.runs import connect, open_run
from streamgrp.train.trainer import TrainerClient

url, run_name, out = sys.argv[1:4]
client = connect(url)
with open(out, "ab") as log, TrainerClient(client, open_run(client, run_name), poll_s=0.05).batches(
        rank=0, world_size=1) as batches:
    for batch in batches:
        row = 0
        for task, size in zip(batch.task_ids, batch.group_sizes.tolist()):
            h = hashlib.sha256()
            for r in range(row, row + size):
                keep = batch.attention_mask[r].bool()
                for t in (batch.token_ids[r][keep], batch.loss_mask[r][keep], batch.logprobs[r][keep],
                          batch.rewards[r:r + 1]):
                    h.update(t.contiguous().numpy().tobytes())
            row += size
            log.write(orjson.dumps({"task": task, "rows": size, "digest": h.hexdigest()}) + b"\\n")
        log.flush()
"""


class EvalProcess(RoleProcess):
    """The live evaluation example (`python -m streamgrp.consumers.live_eval`)."""

    def start(self) -> EvalProcess:
        self.starts += 1
        with open(self.log_dir / f"{self.role}-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "streamgrp.consumers.live_eval", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        return self


def _run(url: str, run_name: str, tmp_path: Path, *, followers: bool) -> dict:
    tmp_path.mkdir()
    common = ["--redis-url", url, "--run", run_name]
    dataset = write_dataset(
        tmp_path / "prompts.jsonl", PROMPTS, tokens=12, reject_rate=0.15, fail_rate=0.05, sleep_s=0.1
    )
    roles = [
        RoleProcess(
            "batcher",
            [*common, *RUN_FLAGS, "--dataset", str(dataset), "--round-s", "0.1", "--lease-ttl-s", "1"],
            tmp_path,
            env=CHILD_ENV,
        ),
        RoleProcess("assembler", [*common, "--lease-ttl-s", "1", "--tick-interval-s", "0.1"], tmp_path, env=CHILD_ENV),
        RoleProcess("worker", [*common, "--concurrency", "4"], tmp_path, env=CHILD_ENV),
    ]
    (tmp_path / "trainer.py").write_text(TRAINER)
    trained = tmp_path / "trained.jsonl"
    with open(tmp_path / "trainer.log", "wb") as log:  # the child keeps its own fd
        trainer = subprocess.Popen(
            [sys.executable, str(tmp_path / "trainer.py"), url, run_name, str(trained)],
            env={**os.environ, **CHILD_ENV},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    for role in roles:
        role.start()
    out: dict = {}
    try:
        if followers:
            out = _with_followers(url, run_name, tmp_path, common, roles, trainer)
        wait_until(lambda: trainer.poll() is not None, timeout=240, interval=0.2, message="the trainer to finish")
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for role in roles:
            role.stop()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    groups = [orjson.loads(line) for line in trained.read_bytes().splitlines()]
    out["trained"] = {g["task"]: (g["rows"], g["digest"]) for g in groups}
    assert len(out["trained"]) == len(groups), "a group was trained twice"
    return out


def _with_followers(url, run_name, tmp_path, common, roles, trainer) -> dict:
    import redis

    client = redis.Redis.from_url(url)
    archiver = RoleProcess(
        "archiver",
        [
            *common,
            "--archive-dir",
            str(tmp_path / "archive"),
            "--retention",
            "true",
            "--retention-interval-s",
            "0.2",
            "--poll-s",
            "0.1",
        ],
        tmp_path,
        env=CHILD_ENV,
    )
    evaluation = EvalProcess(
        "live-eval",
        [
            "--redis-url",
            url,
            "--run",
            run_name,
            "--state",
            str(tmp_path / "eval.json"),
            "--keep-ids",
            "--delay-s",
            "0.3",
            "--batch",
            "4",
        ],
        tmp_path,
        env=CHILD_ENV,
    )
    export = RoleProcess(
        "export",
        [run_name, "--redis-url", url, "--follow", "true", "--flush-s", "0.3", "--out", str(tmp_path / "export")],
        tmp_path,
        env=CHILD_ENV,
    )
    for process in (archiver, evaluation, export):
        process.start()
        roles.append(process)
    run = None

    def state_ids() -> int:
        path = tmp_path / "eval.json"
        return len(orjson.loads(path.read_bytes())["ids"]) if path.exists() else 0

    wait_until(
        lambda: list((tmp_path / "export" / "decisions").glob("*.parquet")),
        timeout=120,
        message="the export to write a file",
    )
    export.kill()
    export.start()
    wait_until(lambda: state_ids() >= 10, timeout=120, message="the live evaluation to apply 10 decisions")
    evaluation.kill()
    evaluation.start()

    # Retention trims decisions while the slower follower (the evaluation) is behind, never past it.
    # It trims a prefix, so it trimmed an unread decision exactly when the oldest one it holds is newer
    # than the first decision after the follower's position.
    seen: set[str] = set()
    trimmed_while_behind = False
    while evaluation.proc.poll() is None:  # it exits once the run has ended and it read every decision
        time.sleep(0.05)
        try:
            run = run or open_run(client, run_name)
        except ConfigError:
            continue
        position = client.hget(run.keys.follow, "live-eval|decisions")
        present = [e.decode() for e, _ in client.xrange(run.keys.decisions)]
        if not position or not present:
            continue
        position = position.decode()
        seen.update(present)
        unread = sorted((e for e in seen if id_key(e) > id_key(position)), key=id_key)
        if unread:
            assert id_key(present[0]) <= id_key(unread[0]), "retention trimmed a decision the evaluation had not read"
            trimmed_while_behind |= id_key(present[0]) > min(id_key(e) for e in seen)
    for process in (evaluation, export):
        wait_until(lambda p=process: p.proc.poll() is not None, timeout=60, message=f"{process.role} to finish")
        assert process.proc.returncode == 0, process.output()[-3000:]
    return {"client": client, "run": run, "trimmed_while_behind": trimmed_while_behind}


@pytest.mark.slow
@pytest.mark.one_server_kind
def test_two_followers_one_killed_each_apply_every_decision_once_in_order_and_training_is_unchanged(
    redis_url, run_name, tmp_path
):
    alone = _run(redis_url, run_name + "-alone", tmp_path / "alone", followers=False)
    followed = _run(redis_url, run_name, tmp_path / "followed", followers=True)
    assert followed["trained"] == alone["trained"] and len(alone["trained"]) >= PROMPTS // 2

    client = followed["client"]
    run, source = open_run_source(client, run_name, archive=tmp_path / "followed" / "archive")
    decisions = [(entry_id, d) for entry_id, d in decode_all(source, "decisions") if isinstance(d, GroupDecided)]
    ids = [entry_id for entry_id, _ in decisions]
    assert len(ids) == PROMPTS
    assert client.xlen(run.keys.decisions) < PROMPTS, "retention trimmed no decision: the test proves nothing"

    # The evaluation: every decision applied once, in order, and its tallies are the decisions'.
    state = orjson.loads((tmp_path / "followed" / "eval.json").read_bytes())
    assert state["ids"] == ids and state["skipped"] == 0
    for entry_id, d in decisions:
        passed = sum(1 for m in d.members if m.reward is not None and m.reward >= 0.5)
        assert state["prompts"][d.task_id]["passed"] == passed
    assert followed["trimmed_while_behind"], "retention never trimmed while the evaluation was behind"

    # The export: every decision in exactly one file, files in order, rows in order.
    import pyarrow.parquet as pq

    files = sorted(
        (tmp_path / "followed" / "export" / "decisions").glob("part-*.parquet"),
        key=lambda p: id_key(p.stem.rsplit("-", 2)[-2] + "-" + p.stem.rsplit("-", 2)[-1]),
    )
    exported = [entry for f in files for entry in pq.read_table(f).column("entry_id").to_pylist()]
    assert exported == ids
    assert {p.name for p in positions(client, run.keys)} == {"live-eval", "export"}
    client.close()

"""Ranks of a trainer group train the same step together, across a crash (real server, two gloo ranks
of a minimal own loop as processes, SIGKILL). The issue's reproduction: rank 1 killed after training
step K and before committing it, while rank 0 committed K; both restarted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from made_steps import make_steps
from pipeline import CHILD_ENV
from stored_payloads import delete_payload

from streamgrp.cli.children import free_port
from streamgrp.core import codec
from streamgrp.core.events import StepCommitted, TrainingResumed
from streamgrp.replay.report import build_report, render_html
from streamgrp.replay.steps import list_steps
from streamgrp.replay.verifier import format_report, verify

HERE = Path(__file__).resolve().parent
STEPS = 6
KILL_AT = 2


def _start_group(redis_url: str, run_name: str, record: Path, kill_at: dict[int, int]) -> list[subprocess.Popen]:
    dist_url = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    return [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "own_loop_rank.py"),
                redis_url,
                run_name,
                str(rank),
                "2",
                dist_url,
                str(record),
                *([str(kill_at[rank])] if rank in kill_at else []),
            ],
            env={**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]


def _records(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.one_server_kind
def test_after_a_rank_dies_between_training_and_commit_the_restarted_ranks_train_the_same_steps(
    client, redis_url, make_run, tmp_path
):
    run = make_run(n_samples=3, dp_size=2, batch_size=2)
    make_steps(client, run, groups=2 * STEPS, steps=STEPS)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"

    ranks = _start_group(redis_url, run.keys.run, first, {1: KILL_AT})
    outputs = [rank.communicate(timeout=120)[0].decode(errors="replace") for rank in ranks]
    assert ranks[1].returncode == -9, outputs[1]
    assert ranks[0].returncode != 0  # its next vote lost its peer
    assert "lost its trainer group" in outputs[0], outputs[0]
    committed = {r: int(client.hget(run.keys.committed, str(r))) for r in (0, 1)}
    assert committed == {0: KILL_AT, 1: KILL_AT - 1}, "the crash did not fall between rank 1's training and commit"

    ranks = _start_group(redis_url, run.keys.run, second, {})
    outputs = [rank.communicate(timeout=120)[0].decode(errors="replace") for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs

    trained = _records(second)
    by_rank = {r: [t["step"] for t in trained if t["rank"] == r] for r in (0, 1)}
    # Both resume at the lowest rank's next step: rank 1's uncommitted KILL_AT, which rank 0 trains again.
    assert by_rank[0] == by_rank[1] == list(range(KILL_AT, STEPS))
    for t in trained:  # every "gradient" summed the same step of both ranks
        assert t["reduced"] == [2.0 * t["step"], 2.0 * t["loss_tokens"]], t
    assert {t["attempt"] for t in trained} == {2}

    events = [codec.decode(f) for _, f in client.xrange(run.keys.commits)]
    resumed = [e for e in events if isinstance(e, TrainingResumed)]
    assert [(e.attempt, e.step, e.reason, e.retrain_through) for e in resumed] == [
        (1, 0, "start", -1),
        (2, KILL_AT, "lowest_rank", KILL_AT),
    ]
    last_commits = {}
    for e in events:
        if isinstance(e, StepCommitted):
            last_commits.setdefault(e.step, {})[e.rank] = e.attempt
    assert all(last_commits[s] == {0: 2, 1: 2} for s in range(KILL_AT, STEPS))
    assert {r: int(client.hget(run.keys.committed, str(r))) for r in (0, 1)} == {0: STEPS - 1, 1: STEPS - 1}
    # versions never go back or repeat: step KILL_AT published KILL_AT + 1 in attempt 1 (rank 0 committed it,
    # so a version was reserved), attempt 2's steps publish above it
    assert int(client.get(run.keys.version)) == (KILL_AT + 1) + (STEPS - KILL_AT)

    # `steps` counts step KILL_AT trained twice (rank 0 committed it in both attempts)
    assert [s.trainings for s in list_steps(client, run.keys)] == [1] * KILL_AT + [2] + [1] * (STEPS - KILL_AT - 1)
    # the report lists the restart and what it trained again
    report = build_report(client, run.keys)
    assert [(r.attempt, r.step, r.retrain_through) for r in report.resumes] == [(2, KILL_AT, KILL_AT)]
    assert report.steps_trained_again == 1
    assert f"<td>2</td><td>{KILL_AT}</td><td>lowest_rank</td><td>{KILL_AT}..{KILL_AT}</td>" in render_html(report)
    # verify agrees, and catches a step whose ranks' last commits name different attempts
    assert verify(client, run.keys).ok, format_report(verify(client, run.keys))
    apart = StepCommitted(step=STEPS - 1, rank=1, world_size=2, attempt=1, producer="a-lost-rank", seq=1)
    client.xadd(run.keys.commits, codec.encode(apart))
    differences = verify(client, run.keys).differences
    assert [(d.kind, d.subject, d.recorded) for d in differences] == [
        ("step_ranks_apart", f"step {STEPS - 1}", {0: 2, 1: 1})
    ]
    # verify reports a trained sample's payload that was deleted (a credential that may XDEL payloads)
    member = codec.decode(client.xrange(run.keys.steps)[-1][1]).shards[0].groups[0].members[0]
    delete_payload(client, run.keys, member.entry)
    assert [(d.kind, d.field) for d in verify(client, run.keys).differences] == [
        ("payload_missing", f"payload {member.entry}"),
        ("step_ranks_apart", "attempt"),
    ]

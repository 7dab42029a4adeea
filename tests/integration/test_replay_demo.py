"""Replay end to end: a demo run whose trainers fail a step, then `streamgrp steps / replay / verify /
inspect` on its record, and on copies of the record with one fact altered."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamgrp.cli.main import main
from streamgrp.core import codec
from streamgrp.errors import ReadOnlyBatch
from streamgrp.replay import RedisSource, load_batch, read_manifest, replay_step
from streamgrp.store.keys import RunKeys

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from runlog import dump_run, load_run  # noqa: E402

pytestmark = pytest.mark.slow

FAILED_STEP = 3


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def failed_demo(redis_url, run_name, tmp_path):
    """A finished demo run (2 ranks, 5 steps) whose trainers raised at step 3."""
    demo = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamgrp",
            "demo",
            "--redis-url",
            redis_url,
            "--data-dir",
            str(tmp_path / "demo"),
            "--run",
            run_name,
            "--steps",
            "5",
            "--ranks",
            "2",
            "--workers",
            "2",
            "--trainer-fail-at-step",
            str(FAILED_STEP),
            "--json",
            "--timeout-s",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert demo.returncode == 2, demo.stderr[-3000:]
    assert "injected fault" in demo.stderr
    return RunKeys(run_name)


@pytest.mark.one_server_kind
def test_a_failed_step_is_listed_replayed_and_verified(failed_demo, client, redis_url, run_name, tmp_path, capsys):
    keys = failed_demo
    connection = ["--redis-url", redis_url, "--run", run_name]

    code, out, _ = _cli(capsys, "steps", "--failed", *connection)
    assert code == 0
    assert f"{FAILED_STEP} " in out and "injected fault: loss is NaN at step 3" in out
    failed_lines = [line for line in out.splitlines() if "failed:" in line]
    failed_ranks = sorted(int(line.split()[1]) for line in failed_lines)
    assert failed_ranks and set(failed_ranks) <= {0, 1}
    code, out, _ = _cli(capsys, "steps", *connection)
    assert code == 0 and "0:committed 1:committed" in out

    manifest = read_manifest(RedisSource(client, keys), FAILED_STEP)
    for rank in failed_ranks:
        out_file = tmp_path / f"step3-rank{rank}.safetensors"
        code, out, err = _cli(
            capsys,
            "replay",
            str(FAILED_STEP),
            "--rank",
            str(rank),
            "--out",
            str(out_file),
            "--run-fn",
            "replay_fns:shard_stats",
            *connection,
        )
        assert code == 0, err
        shard = manifest.shards[rank]
        assert f"digest {shard.digest} matches" in out
        assert f"'groups': {len(shard.groups)}" in out  # what --run-fn returned, printed
        saved = load_batch(out_file)
        assert (saved.run, saved.step, saved.rank, saved.digest) == (run_name, FAILED_STEP, rank, shard.digest)
        assert saved.task_ids == [group.task_id for group in shard.groups]
        live = replay_step(client, keys, FAILED_STEP, rank)
        for name in ("token_ids", "loss_mask", "logprobs", "attention_mask", "rewards", "versions", "group_sizes"):
            assert getattr(saved, name).equal(getattr(live, name)), name
        with pytest.raises(ReadOnlyBatch):
            live.commit()

    # The user function's exception is shown, with a failing exit status; commit is refused.
    code, _, err = _cli(
        capsys, "replay", str(FAILED_STEP), "--rank", "0", "--run-fn", "replay_fns:explode", *connection
    )
    assert code == 1 and "replayed fault at step 3 on rank 0" in err
    code, _, err = _cli(
        capsys, "replay", str(FAILED_STEP), "--rank", "0", "--run-fn", "replay_fns:commit_it", *connection
    )
    assert code == 1 and "ReadOnlyBatch" in err
    code, _, err = _cli(capsys, "replay", "99", *connection)
    assert code == 2 and "step 99 is not recorded" in err

    task = manifest.shards[0].groups[0].task_id
    code, out, _ = _cli(capsys, "inspect", task, *connection)
    assert code == 0
    assert "issued" in out and "decided" in out and f"step {FAILED_STEP} rank 0" in out

    code, out, _ = _cli(capsys, "verify", *connection)
    assert code == 0, out
    assert "all match" in out

    # Copies of the record with one fact altered (stream entries can only be appended, so a copy is
    # loaded with the same entry ids into a new run namespace, one entry changed on the way).
    dump = tmp_path / "run.jsonl"
    dump_run(client, keys, dump)
    target = manifest.shards[0].groups[0]

    def forge_decision(stream, entry_id, fields):
        if stream != "decisions" or entry_id != target.decision_entry:
            return fields
        decision = codec.decode(fields)
        keep = len(decision.members) - 1  # pretend the last usable slot was not a member
        forged = decision.with_members(decision.members[:keep])
        return codec.encode(forged)

    forged_run = run_name + "-forged"
    load_run(client, dump, forged_run, edit=forge_decision)
    code, out, _ = _cli(capsys, "verify", "--redis-url", redis_url, "--run", forged_run)
    assert code == 1, out
    assert f"decision_differs: task {target.task_id} members" in out
    assert f"step {FAILED_STEP}" in out  # the step's shard no longer matches its groups' decisions
    code, out, _ = _cli(
        capsys, "verify", "--redis-url", redis_url, "--run", forged_run, "--from", "0", "--to", str(FAILED_STEP - 1)
    )
    assert code == 1 and f"step {FAILED_STEP}" not in out  # the decision still differs; step 3 not re-sharded

    victim = target.members[0].entry

    def flip_a_byte(stream, entry_id, fields):
        if stream != "payloads" or entry_id != victim:
            return fields
        blob = bytearray(fields[codec.BLOB])
        blob[-1] ^= 0x01  # a logprob's lowest bit: still a valid entry, different bytes
        return {**fields, codec.BLOB: bytes(blob)}

    flipped_run = run_name + "-flipped"
    load_run(client, dump, flipped_run, edit=flip_a_byte)
    code, _, err = _cli(
        capsys, "replay", str(FAILED_STEP), "--rank", "0", "--redis-url", redis_url, "--run", flipped_run
    )
    assert code == 1
    assert "digest mismatch" in err and target.task_id in err
    code, out, _ = _cli(capsys, "verify", "--redis-url", redis_url, "--run", flipped_run)
    # the slot result's recorded digest no longer matches its payload's bytes
    assert code == 1 and f"payload_digest: task {target.task_id} slot {target.members[0].slot} payload {victim}" in out

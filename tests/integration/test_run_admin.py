"""`streamgrp runs --sizes` and `streamgrp delete RUN` on a real server: sizes that match the server's own
figures, a delete that removes every key of one run and nothing of another, refuses a live run (lease,
recent activity, a writing archiver) unless forced, keeps the archive unless asked, rewrites the
embedded server's append-only file, and names the user it needs when the server says NOPERM."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from streamgrp.cli.main import main
from streamgrp.config import AssemblerConfig, BatcherConfig
from streamgrp.errors import ConfigError
from streamgrp.services.archiver import Archiver
from streamgrp.services.assembler import Assembler
from streamgrp.services.batcher import Batcher
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient
from streamgrp.store.acl import access, password_hash, render
from streamgrp.store.archive_admin import archive_bytes
from streamgrp.store.keys import RUNS, RunKeys
from streamgrp.store.lease import Lease
from streamgrp.store.run_admin import delete_run, human_bytes, run_usage
from streamgrp.store.runs import open_run
from streamgrp.train.trainer import TrainerClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from runlog import load_run  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "run_v2.jsonl"
STARTED = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1.0))  # the registry score `golden` gives


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def golden(client, run: str) -> RunKeys:
    """The golden run (entries recorded long ago, so idle) under ``run``, registered like a created run."""
    keys = load_run(client, GOLDEN, run)
    client.zadd(RUNS, {run: 1.0})
    return keys


def key_names(client, keys: RunKeys) -> set[bytes]:
    return set(client.scan_iter(match=keys.pattern, count=1000))


def test_runs_sizes_shows_each_runs_keys_memory_entries_and_archive(client, redis_url, run_name, tmp_path, capsys):
    keys = golden(client, run_name)
    data_dir = tmp_path / "data"
    Archiver(client, keys, data_dir / "archive" / run_name).run(burst=True)
    names = key_names(client, keys)
    memory = sum(client.memory_usage(name, samples=0) for name in names)
    usage = run_usage(client, keys)
    assert (usage.keys, usage.bytes) == (len(names), memory)
    assert usage.entries == {name: client.xlen(key) for name, key in keys.all_streams().items() if client.exists(key)}
    assert usage.entries["slots"] == 67 and usage.entries["payloads"] == 48

    code, out, err = cli(capsys, "runs", "--sizes", "--redis-url", redis_url, "--data-dir", str(data_dir))
    assert code == 0, err
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(run_name + " "))
    archived = human_bytes(archive_bytes(data_dir / "archive" / run_name))
    assert re.fullmatch(
        rf"{run_name} +{STARTED} +{len(names)} +{re.escape(human_bytes(memory))} +"
        rf"{re.escape(archived)}",
        lines[at],
    ), lines[at]
    assert lines[at + 1] == "  entries  " + ", ".join(f"{s} {n}" for s, n in usage.entries.items())
    assert lines[-1].startswith("total: ") and lines[0].split() == ["RUN", "STARTED", "KEYS", "MEMORY", "ARCHIVE"]

    # Without --sizes the listing is what it always was; a run only on disk is listed as such.
    code, out, _ = cli(capsys, "runs", "--redis-url", redis_url)
    assert f"{run_name}\t" in out and "MEMORY" not in out
    client.delete(*names)
    code, out, _ = cli(capsys, "runs", "--sizes", "--redis-url", redis_url, "--data-dir", str(data_dir))
    assert re.search(rf"^{run_name} +{STARTED} +0 +0 B +{re.escape(archived)}$", out, re.M), out
    client.zrem(RUNS, run_name)
    code, out, _ = cli(capsys, "runs", "--sizes", "--redis-url", redis_url, "--data-dir", str(data_dir))
    assert re.search(rf"^{run_name} +archive only +0 +0 B", out, re.M), out


def test_delete_removes_every_key_of_the_run_and_its_registry_entry_and_nothing_else(
    client, redis_url, run_name, capsys, monkeypatch
):
    keys, other = golden(client, run_name), golden(client, run_name + "-other")
    pipe = client.pipeline(transaction=False)
    for version in range(1200):  # more keys than one UNLINK takes, under names no stream list knows
        pipe.set(keys.weights(version), b"w" * 64)
    pipe.execute()
    before = key_names(client, keys)
    memory = sum(client.memory_usage(name, samples=0) for name in before)
    kept = {name: client.dump(name) for name in key_names(client, other)}

    # Without a terminal to ask on (stdin here is not one), delete refuses unless told --yes.
    code, out, err = cli(capsys, "delete", run_name, "--redis-url", redis_url)
    assert code == 2 and f"delete would remove run {run_name!r} ({len(before)} keys" in err and "--yes" in err, err
    assert key_names(client, keys) == before
    # On a terminal, anything but y keeps the run; y deletes it.
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    code, _, err = cli(capsys, "delete", run_name, "--redis-url", redis_url)
    assert code == 2 and "not deleted" in err and key_names(client, keys) == before
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "y")
    code, out, err = cli(capsys, "delete", run_name, "--redis-url", redis_url)
    assert code == 0, err
    assert asked and f"Delete run {run_name!r} ({len(before)} keys" in asked[0] and "[y/N]" in asked[0]
    assert out.splitlines()[0] == (
        f"run {run_name}: deleted {len(before)} keys ({human_bytes(memory)}) and its registry entry"
    )
    assert key_names(client, keys) == set() and client.zscore(RUNS, run_name) is None
    assert {name: client.dump(name) for name in key_names(client, other)} == kept  # the other run is untouched
    assert client.zscore(RUNS, run_name + "-other") is not None

    code, _, err = cli(capsys, "delete", run_name, "--yes", "--redis-url", redis_url)
    assert code == 2 and "has no keys on this server and is not in its registry" in err
    code, _, err = cli(capsys, "delete", "*", "--yes", "--redis-url", redis_url)  # never a pattern
    assert code == 2 and "is not allowed" in err
    assert delete_run(client, other).keys == len(kept)


def test_delete_refuses_a_live_run_and_force_deletes_it(client, redis_url, make_run, run_name, capsys):
    run = make_run(n_samples=2, dp_size=1, batch_size=2)
    lease = Lease(client, run.keys.batcher_lease, "batcher-test", ttl_s=30)
    assert lease.acquire()
    connection = ["--redis-url", redis_url]
    code, _, err = cli(
        capsys, "delete", run_name, "--yes", *connection, "--idle-s", "0"
    )  # a lease counts whatever the idle
    assert code == 2 and f"run {run_name!r} is live: a batcher process holds the run's batcher lease" in err
    assert "--force" in err and client.exists(run.keys.control)
    lease.release()
    code, _, err = cli(capsys, "delete", run_name, "--yes", *connection)  # created a moment ago, not ended
    assert code == 2 and "it has not finished and its control stream got an entry 0s ago" in err
    code, out, err = cli(capsys, "delete", run_name, "--yes", *connection, "--force")
    assert code == 0 and f"run {run_name}: deleted" in out, err
    assert key_names(client, run.keys) == set()

    # A worker reading the task queue of an idle run keeps it live; the environment can force too.
    keys = golden(client, run_name)
    WorkerClient(client, keys).take(1, block_ms=None)
    code, _, err = cli(capsys, "delete", run_name, "--yes", *connection)
    assert code == 2 and "the consumer tasks/workers/" in err and "read 0s ago" in err
    assert main(["delete", run_name, "--yes", *connection, "--idle-s", "0"]) == 0


def test_an_ended_run_is_deleted_without_force_once_every_rank_committed(client, redis_url, make_run, run_name, capsys):
    run = make_run(n_samples=2, dp_size=1, batch_size=2, max_staleness=10)
    batcher = Batcher(client, run, BatcherConfig(round_s=0.05, lease_ttl_s=5), dataset=iter([{}, {}]))
    assert batcher.lease.acquire()
    batcher._activate()
    batcher.round()  # issues both tasks
    worker = WorkerClient(client, run.keys)
    for task in worker.take(10, block_ms=None):
        worker.publish_many([(r.task_id, r.slot, make_sample(tokens=3, seed=r.slot)) for r in task.requests(2, 0)])
        worker.done(task)
    Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
    while batcher.outcome == "running":
        batcher.round()
    assert batcher.outcome == "finished"
    batcher.lease.release()
    code, _, err = cli(capsys, "delete", run_name, "--yes", "--redis-url", redis_url)
    assert code == 2 and "has not finished" in err  # every step written, step 0 not trained yet
    trainer = TrainerClient(client, open_run(client, run_name), poll_s=0.05)
    with trainer.batches(rank=0, world_size=1) as batches:
        for batch in batches:
            batch.commit()
    code, out, err = cli(capsys, "delete", run_name, "--yes", "--redis-url", redis_url)
    assert code == 0 and "deleted" in out, err


def test_delete_keeps_the_archive_unless_asked_and_waits_for_its_archiver(
    client, redis_url, run_name, tmp_path, capsys
):
    keys = golden(client, run_name)
    data_dir = tmp_path / "data"
    archive = data_dir / "archive" / run_name
    connection = ["--redis-url", redis_url, "--data-dir", str(data_dir)]
    archiver = Archiver(client, keys, archive)
    archiver.archive_once()  # it holds the archive's lock until closed
    code, _, err = cli(capsys, "delete", run_name, "--yes", *connection)
    assert code == 2 and f"an archiver is writing its archive {archive}" in err and "--force" in err
    archiver.close()
    size = archive_bytes(archive)

    code, out, err = cli(capsys, "delete", run_name, "--yes", *connection)
    assert code == 0, err
    assert f"  archive {archive} kept ({human_bytes(size)}); --delete-archive removes it" in out
    assert archive_bytes(archive) == size and key_names(client, keys) == set()
    code, out, err = cli(capsys, "steps", "--redis-url", redis_url, "--archive", str(archive))
    assert code == 0 and "3 steps" in out, err  # the archive still answers for the run

    code, _, err = cli(capsys, "delete", run_name, "--yes", *connection)
    assert code == 2 and "is kept (--delete-archive removes it)" in err
    code, out, err = cli(capsys, "delete", run_name, "--yes", *connection, "--delete-archive")
    assert code == 0 and f"  archive {archive} removed ({human_bytes(size)})" in out, err
    assert not archive.exists()

    other = golden(client, run_name + "-b")
    Archiver(client, other, tmp_path / "elsewhere").run(burst=True)
    code, _, err = cli(
        capsys,
        "delete",
        run_name,
        "--yes",
        "--redis-url",
        redis_url,
        "--archive",
        str(tmp_path / "elsewhere"),
        "--delete-archive",
    )
    assert code == 2 and f"is the archive of run {run_name + '-b'!r}, not {run_name!r}" in err
    code, out, err = cli(
        capsys,
        "delete",
        other.run,
        "--yes",
        "--redis-url",
        redis_url,
        "--archive",
        str(tmp_path / "elsewhere"),
        "--delete-archive",
    )
    assert code == 0 and "removed" in out and not (tmp_path / "elsewhere").exists(), err


def test_a_role_user_is_told_which_user_may_size_and_delete(client, redis_url, run_name):
    keys = golden(client, run_name)
    password = uuid.uuid4().hex
    line = render(access(keys, "inspector"), run_name, password_hashes=[password_hash(password)]).split()
    client.execute_command("ACL", "SETUSER", *line[1:])
    inspector = redis.Redis.from_url(redis_url, username=line[1], password=password)
    try:
        for attempt in (lambda: run_usage(inspector, keys), lambda: delete_run(inspector, keys, force=True)):
            with pytest.raises(ConfigError, match="NOPERM") as refused:
                attempt()
            assert "Connect as an administrator" in str(refused.value) and "MEMORY USAGE" in str(refused.value)
    finally:
        inspector.close()
        client.execute_command("ACL", "DELUSER", line[1])
    assert len(key_names(client, keys)) == 10  # nothing was deleted


def test_deleting_on_the_embedded_server_rewrites_its_append_only_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    created = subprocess.run(
        [sys.executable, "-m", "streamgrp", "batcher", "--burst", "--run", "doomed", "--n-samples", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert created.returncode == 0, created.stderr

    def aof() -> bytes:
        return b"".join(p.read_bytes() for p in (tmp_path / ".streamgrp").rglob("appendonly*") if p.is_file())

    assert b"doomed" in aof()
    code, out, err = cli(capsys, "delete", "doomed", "--yes", "--idle-s", "0")
    assert code == 0, err
    assert re.search(r"^  append-only file rewritten \(\d+(\.\d)? (B|KiB)\)$", out, re.M), out
    assert b"doomed" not in aof()  # the next start replays nothing of it
    code, out, _ = cli(capsys, "runs")
    assert code == 0 and "doomed" not in out

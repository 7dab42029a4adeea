"""The archiver and retention on a real server: what is trimmed and what must stay, a crash between
fsync and progress, and the inspection commands reading a run from its archive.

The pipeline runs in-process (worker inline, assembler and batcher in burst or single rounds, trainer
ranks committing by hand), so each reader's position is exactly what the test set up.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from made_steps import make_steps

from streamgrp.cli.main import main
from streamgrp.config import ArchiverConfig, AssemblerConfig, BatcherConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, StepManifest
from streamgrp.replay import replay_step, verify
from streamgrp.services.archiver import Archiver
from streamgrp.services.assembler import Assembler
from streamgrp.services.batcher import Batcher
from streamgrp.services.retention import archive_progress, trim
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient
from streamgrp.store.archive_reader import ArchiveReader
from streamgrp.store.keys import (
    ASSEMBLER_GROUP,
    BATCHER_GROUP,
    WORKERS_GROUP,
    step_entry_id,
)
from streamgrp.store.sources import ArchiveSource, FallbackSource, RedisSource
from streamgrp.train.trainer import TrainerClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from runlog import load_run  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "run_v2.jsonl"


# -- helpers ----------------------------------------------------------------------------------------


def rollout(request):
    return make_sample(
        tokens=3 + request.slot + len(request.task_id) % 3,
        version=request.version,
        reward=float(request.slot),
        seed=hash((request.task_id, request.slot)) % 10_000,
    )


def work(client, run, *, slots=None, ack=True) -> None:
    """Take every waiting task and publish its slots (only ``slots`` when given); acknowledge it if ``ack``."""
    worker = WorkerClient(client, run.keys)
    while tasks := worker.take(100, block_ms=None):
        for task in tasks:
            for request in task.requests(run.config.n_samples, 0):
                if slots is None or request.slot in slots:
                    worker.publish(request.task_id, request.slot, rollout(request))
            if ack:
                worker.done(task)


def assemble(client, run) -> None:
    Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)


def commit(client, run, rank: int, step: int) -> None:
    trainer = TrainerClient(client, run)
    assert trainer.next_step(rank) == step
    batch = trainer.load(trainer.manifest(step), rank, run.config.dp_size)  # reads its slot entries from the server
    batch._client = trainer
    batch.commit()


def present(client, key: str, entry_id: str) -> bool:
    return bool(client.xrange(key, entry_id, entry_id))


def manifest(client, run, step) -> StepManifest:
    return codec.decode(client.xrange(run.keys.steps, step_entry_id(step), step_entry_id(step))[0][1])


def decision_of(client, run, task_id) -> tuple[str, GroupDecided]:
    entry_id = client.hget(run.keys.decided, task_id).decode()
    return entry_id, codec.decode(client.xrange(run.keys.decisions, entry_id, entry_id)[0][1])


# -- retention ----------------------------------------------------------------------------------------


def test_retention_keeps_the_steps_after_the_newest_checkpoint(client, make_run, tmp_path):
    # A trainer group that crashes resumes after its newest checkpoint and trains the steps since again,
    # reading them from the server: those stay however far every rank committed.
    run = make_run(n_samples=3, dp_size=2, batch_size=2)
    make_steps(client, run, groups=8, steps=4)
    for step in range(4):
        commit(client, run, 0, step), commit(client, run, 1, step)
    Archiver(client, run.keys, tmp_path / "archive").run(burst=True)
    trainer = TrainerClient(client, run)
    batch = trainer.load(trainer.manifest(1), 0, 2)
    trainer.record_checkpoint(batch, tmp_path / "checkpoint", {}, ranks=(0,))

    report = trim(client, run.keys, archive_progress(client, run.keys))
    assert report.streams["steps"].floor == step_entry_id(2) and "newest checkpoint" in report.streams["steps"].bound
    assert [e.decode() for e, _ in client.xrange(run.keys.steps)] == [step_entry_id(2), step_entry_id(3)]
    for step in (2, 3):  # and what the steps' shards read
        for rank in (0, 1):
            trainer.load(trainer.manifest(step), rank, 2)


@pytest.mark.cluster
def test_retention_trims_only_what_is_archived_and_no_reader_still_needs(client, make_run, issuer, tmp_path):
    run = make_run(n_samples=2, dp_size=2, batch_size=2, max_staleness=100)
    keys = run.keys
    issuer(run).issue([{}] * 6, task_ids=[f"a{i}" for i in range(6)])
    work(client, run)
    assemble(client, run)
    batcher = Batcher(client, run, BatcherConfig(round_s=0.05, lease_ttl_s=5))
    assert batcher.lease.acquire()
    batcher._activate()
    batcher.round()
    assert client.xlen(keys.steps) == 3
    commit(client, run, 0, 0), commit(client, run, 0, 1), commit(client, run, 1, 0)  # rank 1 is behind

    # Every kind of reader position at once:
    issuer(run).issue([{}], task_ids=["buffered"])  # decided, pending in the batcher's buffer
    work(client, run)
    assemble(client, run)
    batcher.round()
    issuer(run).issue([{}], task_ids=["undelivered"])  # decided, not read by the batcher yet
    work(client, run)
    assemble(client, run)
    issuer(run).issue([{}], task_ids=["open"])  # one slot in: its group is open, pending in the assembler
    work(client, run, slots={0})
    assemble(client, run)
    issuer(run).issue([{}], task_ids=["taken"])  # a worker holds it, unacknowledged
    WorkerClient(client, keys).take(1, block_ms=None)
    issuer(run).issue([{}], task_ids=["waiting"])  # nobody has read it

    steps = [manifest(client, run, step) for step in range(3)]
    needed_slots = [e for m in steps[1:] for s in m.shards for g in s.groups for e in (m.entry for m in g.members)]
    needed_decisions = [g.decision_entry for m in steps[1:] for s in m.shards for g in s.groups]
    for task in ("buffered", "undelivered"):
        entry_id, decision = decision_of(client, run, task)
        needed_decisions.append(entry_id)
        needed_slots += [m.entry for m in decision.members]
    needed_slots += [
        entry_id.decode()
        for entry_id, _ in client.xrange(keys.slots, "-", "+")
        if b'"open"' in _[b"h"] or b'"taken"' in _[b"h"] or b'"waiting"' in _[b"h"]
    ]
    needed_tasks = [
        entry_id.decode()
        for entry_id, fields in client.xrange(keys.tasks, "-", "+")
        if b'"taken"' in fields[b"h"] or b'"waiting"' in fields[b"h"] or b'"open"' in fields[b"h"]
    ]  # the assembler checks an open group's task against its entry
    gone_slots = [e for s in steps[0].shards for g in s.groups for e in (m.entry for m in g.members)]
    lengths = {name: client.xlen(key) for name, key in keys.all_streams().items()}

    # Nothing is trimmed before it is archived...
    assert trim(client, keys, {}).removed == 0
    first_slots = client.xrange(keys.slots, "-", "+", count=3)
    archiver = Archiver(client, keys, tmp_path / "archive", ArchiverConfig(archive_read_count=2))
    archiver.archive_once()  # the first two entries of every stream are on disk
    archiver.close()
    partial = trim(client, keys, archive_progress(client, keys))
    assert partial.streams["slots"].removed == 2 and partial.streams["slots"].bound == "archive"
    assert [e for e, _ in client.xrange(keys.slots, "-", "+", count=1)] == [first_slots[2][0]]

    # ...and once everything is, only what no reader needs goes.
    Archiver(client, keys, tmp_path / "archive").run(burst=True)
    report = trim(client, keys, archive_progress(client, keys))
    assert report.streams["control"].removed == 0 and client.xlen(keys.control) == lengths["control"]
    assert report.streams["steps"].floor == "1-1"
    assert [e for e, _ in client.xrange(keys.steps)] == [b"1-1", b"2-1"]  # rank 1 still needs steps 1 and 2
    assert report.streams["slots"].removed > 0 and report.streams["tasks"].removed > 0
    assert client.xlen(keys.tasks) == 3 and client.xlen(keys.commits) == 0  # no reader reads commits back
    for entry_id in needed_slots:
        assert present(client, keys.slots, entry_id), entry_id
    for entry_id in needed_decisions:
        assert present(client, keys.decisions, entry_id), entry_id
    for entry_id in needed_tasks:
        assert present(client, keys.tasks, entry_id), entry_id
    assert not any(present(client, keys.slots, e) for e in gone_slots)
    assert not any(present(client, keys.decisions, g.decision_entry) for s in steps[0].shards for g in s.groups)
    assert client.xpending(keys.slots, ASSEMBLER_GROUP)["pending"] == 2  # the open group's task and slot 0
    assert client.xpending(keys.decisions, BATCHER_GROUP)["pending"] == 1
    assert client.xpending(keys.tasks, WORKERS_GROUP)["pending"] == 1
    for group in client.xinfo_groups(keys.slots):  # the server's lag figure survives trimming
        assert group["lag"] is not None

    # Every role carries on from the trimmed server: the lagging rank, a fresh assembler rebuilding the
    # open group from its pending entries, the batcher's buffer, a worker reclaiming the held task.
    commit(client, run, 1, 1), commit(client, run, 1, 2), commit(client, run, 0, 2)
    work(client, run)  # "waiting"
    worker = WorkerClient(client, keys, claim_idle_s=0.001)
    for task in worker.take(10, block_ms=None):
        for request in task.requests(2, 0):
            worker.publish(request.task_id, request.slot, rollout(request))
        worker.done(task)
    WorkerClient(client, keys).publish(
        "open", 1, rollout(type("R", (), {"task_id": "open", "slot": 1, "version": 0})())
    )
    assemble(client, run)
    for _ in range(3):
        batcher.round()
    assert client.hlen(keys.decided) == 11 and int(client.hget(keys.batcher_state, "next_step")) == 5
    for step in (3, 4):
        commit(client, run, 0, step), commit(client, run, 1, step)
    batcher.lease.release()

    # Archive again, trim again: the server keeps nothing old, the archive serves every step.
    archiver = Archiver(client, keys, tmp_path / "archive", ArchiverConfig(retention=True))
    archiver.run(burst=True)
    assert client.xlen(keys.steps) == 0
    source = FallbackSource(RedisSource(client, keys), ArchiveSource(tmp_path / "archive"))
    for step in range(5):
        recorded = codec.decode(source("steps", [step_entry_id(step)])[0])
        for rank in range(2):
            assert replay_step(client, keys, step, rank, source=source).digest == recorded.shards[rank].digest
    report = verify(client, keys, source=source)
    assert report.ok, report.differences
    assert report.decisions_checked == 11 and report.steps_checked == 5


@pytest.mark.cluster
def test_a_crash_between_fsync_and_progress_copies_again_and_readers_see_each_entry_once(
    client, make_run, issuer, tmp_path
):
    run = make_run(n_samples=2)
    issuer(run).issue([{}] * 20)
    work(client, run)

    class CrashAfterSync(Archiver):
        def _record(self, advanced):
            raise SystemExit("killed after the fsync, before recording progress")

    first = CrashAfterSync(client, run.keys, tmp_path / "archive", ArchiverConfig(archive_read_count=15))
    with pytest.raises(SystemExit):
        first.archive_once()
    first.writer.segment.abandon()  # a killed process seals nothing and releases its lock
    first.writer._lock.close()
    assert client.hgetall(run.keys.archive).keys() == {b"archive_id"}  # no progress was recorded

    Archiver(client, run.keys, tmp_path / "archive", ArchiverConfig(archive_read_count=15)).run(burst=True)
    reader = ArchiveReader(tmp_path / "archive")
    for name, key in run.keys.all_streams().items():
        expected = (
            [(raw_id.decode(), fields) for raw_id, fields in client.xrange(key)]
            if name != "payloads"
            else list(RedisSource(client, run.keys).scan(name))
        )  # a keys run's payloads, at their slot entries' ids
        assert list(reader.scan(name)) == expected, name
        copies: dict[str, list[dict]] = {}
        for entry_id, _, fields in reader.copies(name):
            copies.setdefault(entry_id, []).append(fields)
        assert all(len({tuple(f.items()) for f in versions}) == 1 for versions in copies.values())
    assert len(list(reader.copies("slots"))) == client.xlen(run.keys.slots) + 15  # the first pass, twice


def test_a_second_archive_of_a_run_is_refused(client, make_run, tmp_path):
    run = make_run()
    Archiver(client, run.keys, tmp_path / "one").run(burst=True)
    with pytest.raises(Exception, match="archived by another archive"):
        Archiver(client, run.keys, tmp_path / "two")


# -- the inspection commands on an archive ----------------------------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspection_commands_read_an_archive_alone_or_behind_the_server(
    client, redis_url, run_name, server_factory, tmp_path, capsys
):
    keys = load_run(client, GOLDEN, run_name)
    data_dir = tmp_path / "data"
    code, _, err = _cli(
        capsys,
        "archiver",
        "--burst",
        "--retention",
        "--redis-url",
        redis_url,
        "--run",
        run_name,
        "--data-dir",
        str(data_dir),
    )
    assert code == 0, err
    archive = data_dir / "archive" / run_name  # the default place
    assert client.xlen(keys.steps) == 2  # step 0 was committed by every rank and trimmed

    connection = ["--redis-url", redis_url, "--run", run_name]
    # The server alone no longer has step 0; the archive at the default place fills in.
    code, _, err = _cli(capsys, "replay", "0", *connection)
    assert code == 2 and "no longer retained" in err and "--archive" in err
    code, out, err = _cli(capsys, "replay", "0", *connection, "--data-dir", str(data_dir))
    assert code == 0 and out.count("matches") == 2, err
    code, out, _ = _cli(capsys, "verify", *connection, "--data-dir", str(data_dir))
    assert code == 0 and "all match" in out
    code, out, _ = _cli(capsys, "verify", *connection)
    assert code == 1 and "log_not_retained" in out

    # The run's keys gone from the server, and another, empty server: the archive alone answers.
    client.delete(*keys.all_streams().values(), keys.committed, keys.decided, keys.counts)
    empty = server_factory()
    for url in (redis_url, empty.url):
        code, out, err = _cli(capsys, "replay", "2", "--redis-url", url, "--archive", str(archive))
        assert code == 0 and "digest" in out and "matches" in out, err
        code, out, _ = _cli(capsys, "verify", "--redis-url", url, "--archive", str(archive))
        assert code == 0 and "checked 13 decisions, " in out and "payloads and 3 steps: all match" in out
        code, out, _ = _cli(capsys, "steps", "--redis-url", url, "--archive", str(archive), "--failed")
        assert code == 0 and "3 steps, 1 with a failed rank" in out
        code, out, _ = _cli(capsys, "inspect", "g05", "--redis-url", url, "--archive", str(archive))
        assert code == 0 and "trained" in out and "step 2 rank 0" in out
    code, _, err = _cli(capsys, "replay", "0", "--redis-url", redis_url, "--run", "other", "--archive", str(archive))
    assert code == 2 and "archive of run" in err


def test_a_scan_through_the_fallback_source_sees_every_entry_once_while_retention_trims_under_it(
    client, make_run, issuer, tmp_path
):
    run = make_run()
    issuer(run).issue([{}] * 50)
    expected = [(raw_id.decode(), fields) for raw_id, fields in client.xrange(run.keys.slots)]
    Archiver(client, run.keys, tmp_path / "archive").run(burst=True)
    client.xtrim(run.keys.slots, minid=expected[5][0], approximate=False)  # trimmed before the scan starts
    source = FallbackSource(RedisSource(client, run.keys), ArchiveSource(tmp_path / "archive"))
    seen = []
    for item in source.scan("slots", page=10):
        seen.append(item)
        if len(seen) == 12:  # mid-scan, past the first server page: trim far ahead of the reader
            client.xtrim(run.keys.slots, minid=expected[40][0], approximate=False)
    assert seen == expected
    assert source("slots", [expected[0][0], expected[45][0]]) == [expected[0][1], expected[45][1]]

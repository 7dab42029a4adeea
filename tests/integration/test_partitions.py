"""Partitioned runs on a real server and on the 3-node cluster: tasks spread over partitions by their
id, one assembler per partition, the batcher over all of them, trainers loading from each, and every
task decided and trained exactly once, also when a batcher dies between its commit and the
acknowledgements it then owes the partitions."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from stored_payloads import payload_at

from streamgrp.config import AssemblerConfig, BatcherConfig, RunConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, StepManifest, TaskIssued
from streamgrp.errors import ConfigError, LeaseLost
from streamgrp.services.assembler import Assembler
from streamgrp.services.batcher import Batcher
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient
from streamgrp.store.batcher_store import BatcherStore
from streamgrp.store.keys import BATCHER_GROUP, tag_slot, task_partition
from streamgrp.store.runs import join_run
from streamgrp.store.tasks import TaskWriter
from streamgrp.train.trainer import TrainerClient

pytestmark = [pytest.mark.cluster, pytest.mark.one_server_kind]  # Valkey and the 3-node cluster

PARTITIONS = 3
TASKS = 30


def _rollout(request):
    if request.slot == 1 and int(request.task_id[1:]) % 4 == 0:
        return None  # a partial group now and then: ragged shards
    return make_sample(
        tokens=3 + request.slot + int(request.task_id[1:]) % 5,
        prompt_tokens=1,
        reward=float(request.slot),
        version=request.version,
        seed=int(request.task_id[1:]) * 10 + request.slot,
    )


def _run(client, run_name, **settings):
    return join_run(
        client,
        run_name,
        RunConfig(n_samples=3, batch_size=4, dp_size=2, max_staleness=1000, partitions=PARTITIONS, **settings),
    )


def _work(client, run) -> None:
    worker = WorkerClient(client, run.keys, partitions=run.partitions)
    while tasks := worker.take(8, block_ms=None):
        worker.publish_many(
            [(r.task_id, r.slot, _rollout(r)) for task in tasks for r in task.requests(run.config.n_samples, 0)]
        )
        worker.done(*tasks)


def _assemble(client, run) -> int:
    return sum(
        Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05), partition=p).run(burst=True)
        for p in range(PARTITIONS)
    )


def _batcher(client, run, dataset=None, **config) -> Batcher:
    batcher = Batcher(client, run, BatcherConfig(round_s=0.05, lease_ttl_s=2, **config), dataset=dataset)
    assert batcher.lease.acquire()
    batcher._activate()
    return batcher


def _fed_run(client, run_name):
    """A 3-partition run whose batcher's feeder issued every task to its partition; (run, batcher)."""
    run = _run(client, run_name)
    batcher = _batcher(client, run, dataset=iter([{"i": i} for i in range(TASKS)]))
    batcher.round()
    return run, batcher


def _finished_run(client, run_name):
    """`_fed_run` taken to its end in process: workers publish every slot, each partition's assembler
    decides, the batcher writes every step; (run, batcher)."""
    run, batcher = _fed_run(client, run_name)
    _work(client, run)
    assert _assemble(client, run) == TASKS
    while batcher.outcome == "running":
        batcher.round()
    assert batcher.outcome == "finished"
    return run, batcher


def _manifests(client, run) -> list[StepManifest]:
    return [codec.decode(fields) for _, fields in client.xrange(run.keys.steps)]


def _trained(manifests) -> Counter:
    return Counter(group.task_id for m in manifests for shard in m.shards for group in shard.groups)


def test_a_partitioned_run_decides_batches_and_trains_every_task_exactly_once(client, run_name):
    run, _ = _finished_run(client, run_name)

    ids = [f"t{i:08d}" for i in range(TASKS)]
    for part in run.partitions:  # each task in its own partition's streams, and nowhere else
        mine = {t for t in ids if task_partition(t, PARTITIONS) == part.index}
        assert mine, f"partition {part.index} got no task of {TASKS}"
        issued = [codec.decode(f) for _, f in client.xrange(part.tasks)]
        assert sorted(e.task_id for e in issued if isinstance(e, TaskIssued)) == sorted(mine)
        decided = [codec.decode(f) for _, f in client.xrange(part.decisions)]
        assert sorted(d.task_id for d in decided if isinstance(d, GroupDecided)) == sorted(mine)
        assert client.xpending(part.decisions, BATCHER_GROUP)["pending"] == 0
    assert client.hlen(run.keys.batcher_unacked) == 0
    assert client.xlen(run.keys.tasks) == client.xlen(run.keys.slots) == 0  # the unpartitioned layout is unused

    manifests = _manifests(client, run)
    assert [m.step for m in manifests] == list(range(-(-TASKS // 4)))  # the last step takes the 2 left over
    assert _trained(manifests) == Counter({t: 1 for t in ids})
    groups = [g for m in manifests for s in m.shards for g in s.groups]
    assert all(g.partition == task_partition(g.task_id, PARTITIONS) for g in groups)
    assert {g.partition for g in groups} == set(range(PARTITIONS))

    trainer = TrainerClient(client, run, check_digests=True)  # every payload read from its partition and hashed
    for manifest in manifests:
        for rank in (0, 1):
            batch = trainer.load(manifest, rank, 2)
            shard = manifest.shards[rank]
            assert batch.task_ids == [g.task_id for g in shard.groups]
            assert batch.rows == sum(g.rows for g in shard.groups)
            assert batch.token_ids.shape[0] == batch.rows
            assert torch.equal(batch.group_sizes, torch.tensor([g.rows for g in shard.groups]))


def test_a_batcher_that_dies_before_its_acknowledgements_leaves_no_group_to_train_twice(client, run_name, monkeypatch):
    run, batcher = _fed_run(client, run_name)
    _work(client, run)
    config = AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)
    early = sum(Assembler(client, run, config, partition=p).run(burst=True) for p in (0, 1))

    # The first batcher writes steps from partitions 0 and 1, then dies before acknowledging what they used.
    monkeypatch.setattr(BatcherStore, "acknowledge_recorded", lambda self: None)
    batcher.round()
    written = _manifests(client, run)
    assert len(written) == early // 4 and client.hlen(run.keys.batcher_unacked) == 4 * len(written)
    assert sum(client.xpending(p.decisions, BATCHER_GROUP)["pending"] for p in run.partitions) == early
    monkeypatch.undo()

    Assembler(client, run, config, partition=2).run(burst=True)
    batcher.lease.release()
    successor = _batcher(client, run, dataset=iter([{"i": i} for i in range(TASKS)]))
    assert client.hlen(run.keys.batcher_unacked) == 0
    assert len(successor.state.buffer) == early % 4  # only the groups no step used; partition 2's come next
    while successor.outcome == "running":
        successor.round()
    assert successor.outcome == "finished"
    assert _trained(_manifests(client, run)) == Counter({f"t{i:08d}": 1 for i in range(TASKS)})
    assert sum(client.xpending(p.decisions, BATCHER_GROUP)["pending"] for p in run.partitions) == 0


def test_a_task_a_partition_decides_again_after_its_step_is_not_trained_twice(client, run_name):
    run, batcher = _fed_run(client, run_name)
    _work(client, run)
    config = AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)
    for partition in (0, 1):
        Assembler(client, run, config, partition=partition).run(burst=True)
    batcher.round()
    trained = _trained(_manifests(client, run))
    # What a partition whose server lost its last second of writes does: its assembler, finding the
    # slots unacknowledged and no decided marker, decides a task again, after a step used the first.
    part = run.partitions[0]
    first = next(
        (entry, fields) for entry, fields in client.xrange(part.decisions) if codec.decode(fields).task_id in trained
    )
    client.xadd(part.decisions, first[1])
    Assembler(client, run, config, partition=2).run(burst=True)
    while batcher.outcome == "running":
        batcher.round()
    assert _trained(_manifests(client, run)) == Counter({f"t{i:08d}": 1 for i in range(TASKS)})
    assert sum(client.xpending(p.decisions, BATCHER_GROUP)["pending"] for p in run.partitions) == 0


def test_a_dropped_task_decided_again_is_not_trained(client, run_name):
    run = _run(client, run_name)
    victim = next(f"t{i:08d}" for i in range(TASKS) if task_partition(f"t{i:08d}", PARTITIONS) == 0)
    batcher = _batcher(client, run, dataset=iter([{"i": i} for i in range(TASKS)]))
    batcher.round()
    worker = WorkerClient(client, run.keys)  # no partitions given: the run's record names them
    assert len(worker.partitions) == PARTITIONS
    while tasks := worker.take(8, block_ms=None):
        worker.publish_many(
            [
                (r.task_id, r.slot, RuntimeError("down") if r.task_id == victim else _rollout(r))
                for task in tasks
                for r in task.requests(run.config.n_samples, 0)
            ]
        )
        worker.done(*tasks)
    config = AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)
    Assembler(client, run, config, partition=0).run(burst=True)
    batcher.round()  # reads the victim's dropped decision and acknowledges it
    part = run.partitions[0]
    dropped = next(f for _, f in client.xrange(part.decisions) if codec.decode(f).task_id == victim)
    assert codec.decode(dropped).decision == "dropped"
    # Its partition's server loses the decision and the task runs again: now it is decided complete.
    trained = next(codec.decode(f) for _, f in client.xrange(part.decisions) if codec.decode(f).decision == "complete")
    again = trained.replace(task_id=victim)
    client.xadd(part.decisions, codec.encode(again))
    for partition in (1, 2):
        Assembler(client, run, config, partition=partition).run(burst=True)
    while batcher.outcome == "running":
        batcher.round()
    assert victim not in _trained(_manifests(client, run))
    assert sum(client.xpending(p.decisions, BATCHER_GROUP)["pending"] for p in run.partitions) == 0


def test_a_finished_runs_next_batcher_still_acknowledges_what_the_last_one_owed(client, run_name, monkeypatch):
    run, batcher = _fed_run(client, run_name)
    _work(client, run)
    _assemble(client, run)
    monkeypatch.setattr(BatcherStore, "acknowledge_recorded", lambda self: None)
    while batcher.outcome == "running":
        batcher.round()
    assert sum(client.xpending(p.decisions, BATCHER_GROUP)["pending"] for p in run.partitions) == TASKS
    monkeypatch.undo()
    batcher.lease.release()
    assert _batcher(client, run).outcome == "finished"
    assert sum(client.xpending(p.decisions, BATCHER_GROUP)["pending"] for p in run.partitions) == 0
    assert client.hlen(run.keys.batcher_unacked) == 0


def test_a_feeder_issues_each_task_once_per_partition_even_when_its_cursor_write_is_fenced(client, run_name):
    run = _run(client, run_name)
    batcher = _batcher(client, run)
    writer = TaskWriter(client, run.keys, run.partitions)
    now = writer.now()
    events = [TaskIssued(task_id=f"t{i:08d}", prompt={"i": i}, version=0, issued_at=now, seq=i) for i in range(12)]
    assert writer.write(events, lease_token=batcher.lease.token, cursor=0) == 12
    # A zombie feeder at the old cursor writes the same tasks: the partitions skip them, the fence refuses it.
    with pytest.raises(LeaseLost):
        writer.write(events, lease_token=batcher.lease.token, cursor=0)
    issued = Counter(codec.decode(f).task_id for p in run.partitions for _, f in client.xrange(p.tasks))
    assert issued == Counter({e.task_id: 1 for e in events})
    assert int(client.hget(run.keys.batcher_state, "feeder_cursor")) == 12


def test_workers_take_only_from_the_partitions_they_are_given_and_publish_to_each_tasks_own(client, run_name):
    run, _ = _fed_run(client, run_name)
    worker = WorkerClient(client, run.keys, partitions=run.partitions, take_from=[1])
    taken = []
    while tasks := worker.take(8, block_ms=None):
        taken += tasks
    assert taken and {task.partition for task in taken} == {1}
    assert {task_partition(task.event.task_id, PARTITIONS) for task in taken} == {1}
    # A result goes to its task's partition whichever partition the worker reads.
    other = next(f"t{i:08d}" for i in range(TASKS) if task_partition(f"t{i:08d}", PARTITIONS) == 2)
    entry = worker.publish(other, 0, None)
    assert client.xrange(run.partitions[2].slots, entry, entry)
    with pytest.raises(ConfigError, match="partitions 0 to 2"):
        WorkerClient(client, run.keys, partitions=run.partitions, take_from=[3])
    with pytest.raises(ConfigError, match="partitions 0 to 2"):
        Assembler(client, run, AssemblerConfig(), partition=3)


def test_partition_keys_spread_over_the_slot_space_and_one_partition_is_the_unpartitioned_layout(client, run_name):
    run = _run(client, run_name)
    slots = [
        int(client.execute_command("CLUSTER KEYSLOT", part.slots)) if _is_cluster(client) else tag_slot(part.tag)
        for part in run.partitions
    ]
    assert slots == [tag_slot(part.tag) for part in run.partitions]
    assert [s * PARTITIONS // 16384 for s in slots] == list(range(PARTITIONS))
    if _is_cluster(client):  # three partitions, three primaries
        assert len({client.get_node_from_key(part.slots).name for part in run.partitions}) == PARTITIONS
    single = join_run(client, run_name + "-one", RunConfig())
    assert single.partitions[0].all_streams() == {
        name: key for name, key in single.keys.all_streams().items() if name in single.partitions[0].all_streams()
    }


def _is_cluster(client) -> bool:
    return hasattr(client, "get_node_from_key")


def test_replay_inspect_steps_report_export_and_the_run_admin_read_every_partition(client, run_name, tmp_path):
    from streamgrp.replay import replay_step
    from streamgrp.replay.steps import inspect_task
    from streamgrp.replay.summary import run_summary
    from streamgrp.store.run_admin import delete_run, run_key_names, run_usage
    from streamgrp.store.sources import RedisSource

    run, batcher = _finished_run(client, run_name)
    manifests = _manifests(client, run)
    for manifest in manifests:  # bit for bit: the digests hold over payloads of every partition
        for rank in (0, 1):
            assert replay_step(client, run.keys, manifest.step, rank).digest == manifest.shards[rank].digest

    summary = run_summary(client, run.keys)  # the partitions' counters with the run's own
    assert summary["tasks"] == summary["tasks_decided"] == TASKS and summary["slots"]["sample"] > 0
    assert summary["steps"] == len(manifests) and summary["slots"]["unread"] == summary["slots"]["open"] == 0
    assert RedisSource(client, run.keys).hash("decided").keys() == {f"t{i:08d}" for i in range(TASKS)}
    task = next(f"t{i:08d}" for i in range(TASKS) if task_partition(f"t{i:08d}", PARTITIONS) == 2)
    kinds = [event.what for event in inspect_task(client, run.keys, task)]
    assert kinds[0] == "issued" and kinds.count("slot") == 3 and kinds[-2:] == ["decided", "trained"]

    batcher.lease.release()
    from streamgrp.store.run_admin import activity

    standby = Assembler(client, run, AssemblerConfig(lease_ttl_s=30), partition=2)  # a live partition's assembler
    assert standby.lease.acquire() and "assembler" in activity(client, run.keys).leases
    with pytest.raises(ConfigError, match="is live"):
        delete_run(client, run.keys)
    standby.lease.release()
    names = run_key_names(client, run.keys)
    assert {part.slots for part in run.partitions} <= set(names)
    assert {f"slots@{p}" for p in range(PARTITIONS)} <= set(run_usage(client, run.keys).entries)
    from streamgrp.replay.report import build_report
    from streamgrp.replay.steps import list_steps

    steps = list_steps(client, run.keys)  # each step's groups found in their partitions, none "unknown"
    assert sum(sum(status.decisions.values()) for status in steps) == TASKS
    assert all("unknown" not in status.decisions for status in steps)
    report = build_report(client, run.keys)
    assert report.totals["tasks_decided"] == TASKS and len(report.steps) == len(manifests)
    pyarrow = pytest.importorskip("pyarrow.parquet")
    from streamgrp.replay.export import export_run

    rows = export_run(client, run.keys, tmp_path / "export")
    slot_results = sum(1 for p in run.partitions for _, f in client.xrange(p.slots) if b'"slot_result"' in f[b"h"])
    assert rows["decisions"] == TASKS and rows["slots"] == slot_results
    table = pyarrow.read_table(tmp_path / "export" / "decisions.parquet").to_pydict()
    assert len(set(table["entry_id"])) == TASKS  # one name per decision, the partitions' ids kept apart
    deleted = delete_run(client, run.keys, force=True)
    assert deleted.keys == len(names) and run_key_names(client, run.keys) == []


@pytest.mark.one_server_kind
def test_every_role_of_a_partitioned_run_works_under_its_own_acl_user(server_kind, kind_binary, tmp_path, run_name):
    """The users `streamgrp acl RUN --partitions 3` prints: a whole partitioned run in-process, each
    role on its own user's connection, and the server's ACL log stays empty."""
    import secrets

    from streamgrp.cli.server import EmbeddedServer
    from streamgrp.store.acl import ROLES, password_hash, render_run
    from streamgrp.store.connection import connect
    from streamgrp.store.scripts import load_library

    if server_kind == "cluster":
        pytest.skip("an ACL file is loaded by one server")
    roles = list(ROLES)
    passwords = {role: secrets.token_urlsafe(12) for role in [*roles, "admin"]}
    lines = [
        "user default off",
        f"user admin on {password_hash(passwords['admin'])} ~* &* +@all",
        *render_run(run_name, roles, passwords=passwords, partitions=PARTITIONS),
    ]
    (tmp_path / "users.acl").write_text("\n".join(lines) + "\n")
    server = EmbeddedServer(tmp_path / "server", binary=kind_binary, acl_file=tmp_path / "users.acl")
    server.start()
    try:

        def as_(role):
            return connect(f"redis://sg-{run_name}-{role}@127.0.0.1:{server.port}/0", password=passwords[role])

        admin = connect(f"redis://admin@127.0.0.1:{server.port}/0", password=passwords["admin"])
        load_library(admin)  # the administrator's step: roles call the functions, never load them
        run = _run(as_("batcher"), run_name)
        batcher = _batcher(as_("batcher"), run, dataset=iter([{"i": i} for i in range(TASKS)]))
        batcher.round()
        _work(as_("worker"), run)
        assert _assemble(as_("assembler"), run) == TASKS
        while batcher.outcome == "running":
            batcher.round()
        trainer = TrainerClient(as_("trainer"), run)
        with trainer.batches(rank=0, world_size=2) as zero:
            for batch in zero:
                assert batch.rows > 0
        from streamgrp.config import ArchiverConfig
        from streamgrp.replay import replay_step
        from streamgrp.replay.steps import list_steps
        from streamgrp.services.archiver import Archiver

        archiver = Archiver(as_("archiver"), run.keys, tmp_path / "archive", ArchiverConfig(retention=True))
        assert archiver.run(burst=True) > 0 and archiver.last_trim is not None and archiver.last_trim.removed > 0
        inspector = as_("inspector")
        assert len(list_steps(inspector, run.keys)) == -(-TASKS // 4)
        replay_step(inspector, run.keys, 0, 1)
        assert admin.execute_command("ACL", "LOG") == [], "a role was refused what its rules should allow"
        with pytest.raises(Exception, match="(?i)permission"):
            as_("worker").xadd(run.partitions[0].decisions, {"h": b"{}"})
    finally:
        server.stop()


def test_the_archiver_and_retention_cover_every_partition_and_every_step_still_replays(client, run_name, tmp_path):
    from streamgrp.config import ArchiverConfig
    from streamgrp.replay import replay_step
    from streamgrp.replay.summary import run_summary
    from streamgrp.services.archiver import Archiver
    from streamgrp.store.archive_reader import ArchiveReader
    from streamgrp.store.keys import step_entry_id
    from streamgrp.store.sources import ArchiveSource, FallbackSource, RedisSource

    run, _ = _finished_run(client, run_name)
    manifests = _manifests(client, run)
    trainer = TrainerClient(client, run)
    for rank in (0, 1):  # every rank commits all but the last step: retention must keep that one
        with trainer.batches(rank=rank, world_size=2) as batches:
            for batch in batches:
                if batch.step == len(manifests) - 1:
                    break
                batch.commit()

    archiver = Archiver(client, run.keys, tmp_path / "archive", ArchiverConfig(retention=True))
    archiver.run(burst=True)
    reader = ArchiveReader(tmp_path / "archive")
    for part in run.partitions:  # each partition's streams archived under their own names, then trimmed
        assert sum(1 for _ in reader.scan(f"slots@{part.index}")) >= client.xlen(part.slots)
        assert sum(1 for _ in reader.scan(f"decisions@{part.index}")) == len(
            [t for t in range(TASKS) if task_partition(f"t{t:08d}", PARTITIONS) == part.index]
        )
    report = archiver.last_trim
    assert report is not None and report.removed > 0
    assert {f"slots@{p}" for p in range(PARTITIONS)} <= set(report.streams)
    last = manifests[-1]
    for shard in last.shards:  # what the uncommitted step needs stayed on the server, in each partition
        for group in shard.groups:
            part = run.partitions[group.partition]
            assert client.xrange(part.decisions, group.decision_entry, group.decision_entry)
            for member in group.members:
                assert payload_at(client, part, member.entry)
    trainer.load(last, 0, 2), trainer.load(last, 1, 2)

    source = FallbackSource(RedisSource(client, run.keys), ArchiveSource(tmp_path / "archive"))
    assert len(source.partitions) == PARTITIONS
    for manifest in manifests:  # every step, trimmed or not, replays bit for bit through the archive
        recorded = codec.decode(source("steps", [step_entry_id(manifest.step)])[0])
        for rank in (0, 1):
            assert (
                replay_step(client, run.keys, manifest.step, rank, source=source).digest == recorded.shards[rank].digest
            )
    summary = run_summary(client, run.keys, source=source)
    assert summary["tasks"] == summary["tasks_decided"] == TASKS and summary["steps"] == len(manifests)
    alone = ArchiveSource(tmp_path / "archive")  # the archive by itself knows the run's partitions
    assert len(alone.partitions) == PARTITIONS and alone.hash("decided").keys() == {f"t{i:08d}" for i in range(TASKS)}


def test_verify_refolds_every_partition_and_checks_every_step(client, run_name):
    from streamgrp.replay import verify

    run, _ = _finished_run(client, run_name)
    report = verify(client, run.keys)
    assert report.ok, report.differences
    assert report.decisions_checked == TASKS and report.steps_checked == len(_manifests(client, run))
    assert report.payloads_checked == sum(
        m.rows > 0 for p in run.partitions for _, f in client.xrange(p.decisions) for m in codec.decode(f).members
    )

    # A partition's decision written twice: the re-fold of that partition has it once.
    part = run.partitions[1]
    client.xadd(part.decisions, client.xrange(part.decisions, count=1)[0][1])
    kinds = {difference.kind for difference in verify(client, run.keys).differences}
    assert "decision_duplicate" in kinds

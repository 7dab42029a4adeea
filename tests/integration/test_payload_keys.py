"""A keys-layout run's payloads (`streamgrp.store.payloads`): staged with SET NX PX, taken by the publishing
function in the same pipeline, so no payload byte is ever an argument of a function; a staged payload that is
gone refuses the whole call; retention deletes a payload key with its slot entry and the archive keeps it;
an older run's record (no layout) is still a stream run."""

from __future__ import annotations

import time

import pytest
import redis
from monitored import commands_until_fcall
from role_users import refused, role_users  # noqa: F401  (a fixture)

from streamgrp.config import ArchiverConfig, AssemblerConfig, BatcherConfig, RunConfig
from streamgrp.core import codec
from streamgrp.core.events import SlotResult
from streamgrp.replay import replay_step, verify
from streamgrp.services.archiver import Archiver
from streamgrp.services.assembler import Assembler
from streamgrp.services.batcher import Batcher
from streamgrp.services.retention import archive_progress, trim
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient
from streamgrp.store import payloads, scripts
from streamgrp.store.keys import WORKERS_GROUP, step_entry_id
from streamgrp.store.runs import join_run, open_run, recorded_layout
from streamgrp.store.sources import ArchiveSource, FallbackSource, RedisSource
from streamgrp.train.trainer import TrainerClient

TOKENS = 32768


def _payload_keys(client, keys, *, staged: bool = True) -> list[str]:
    found = (k.decode() for k in client.scan_iter(match=payloads.pattern(keys.payloads), count=1000))
    return sorted(k for k in found if staged or ":staged:" not in k)


def test_a_new_run_records_the_keys_layout_and_an_older_record_is_a_stream_run(client, make_run, run_name):
    run = make_run(n_samples=2)
    assert run.config.payload_layout == "keys" and run.record.settings["payload_layout"] == "keys"
    assert recorded_layout(client, run.keys) == "keys"
    # A record written before the layout existed (no such setting) reads as a stream run.
    older = join_run(client, run_name + "-old", RunConfig(n_samples=2))
    client.delete(older.keys.control, older.keys.batcher_state)
    settings = {k: v for k, v in older.record.settings.items() if k != "payload_layout"}
    client.xadd(older.keys.control, codec.encode(older.record.replace(settings=settings)))
    assert open_run(client, older.name).config.payload_layout == "stream"
    assert WorkerClient(client, older.keys).layout == "stream"


def test_the_publish_call_carries_no_payload_byte(client, make_run, issuer, redis_server):
    run = make_run(n_samples=2)
    [task] = issuer(run).issue([{}])
    worker = WorkerClient(client, run.keys)
    [taken] = worker.take(1, block_ms=None)
    with commands_until_fcall(client, run.keys.payloads.encode()) as seen:
        ids = worker.publish_many([(task.task_id, slot, make_sample(tokens=TOKENS)) for slot in range(2)], done=[taken])
    [call] = [c for c in seen if c.upper().startswith(b"FCALL ")]
    staging = [c for c in seen if c.upper().startswith(b"SET ")]
    assert len(staging) == 2 and all(len(c) > TOKENS * 8 for c in staging)  # the bytes went by SET...
    assert len(call) < 2048, call[:300]  # ...and the function got headers and key names only
    assert b"publish_staged" in call
    # Each payload sits at its slot entry's id, nothing is left staged, and the task was acknowledged with them.
    stored = payloads.read(client, run.keys.payloads, ids)
    assert [codec.decode(fields).slot for fields in stored] == [0, 1]
    assert _payload_keys(client, run.keys) == sorted(payloads.key(run.keys.payloads, i) for i in ids)
    assert all(client.ttl(payloads.key(run.keys.payloads, i)) == -1 for i in ids)  # persisted
    assert client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0


@pytest.mark.own_server  # it flushes the function library
def test_a_workers_publish_on_its_own_connection_rides_a_dropped_connection_and_a_lost_library(
    client, redis_url, make_run, issuer
):
    from streamgrp.store.connection import connect

    run = make_run(n_samples=2)
    issuer(run).issue([{}, {}, {}])
    riding = connect(redis_url)  # a role's client: it rides out outages
    worker = WorkerClient(riding, run.keys)
    tasks = worker.take(3, block_ms=None)

    def publish(task):
        return worker.publish_many(
            [(task.event.task_id, slot, make_sample(tokens=8)) for slot in range(2)], done=[task]
        )

    ids = publish(tasks[0])
    own = worker._own.connection  # a single server's publishes go through the worker's own connection
    host, port = own._sock.getsockname()[:2]
    assert client.client_kill_filter(addr=f"{host}:{port}") == 1  # it drops (killed by its address only)
    ids += publish(tasks[1])  # sent again, staged afresh
    assert riding.outage is not None and riding.outage.count == 1
    client.function_flush()  # the server lost the library: the publish loads it again
    ids += publish(tasks[2])
    stored = payloads.read(client, run.keys.payloads, ids)
    assert [codec.decode(fields).slot for fields in stored] == [0, 1] * 3
    # every payload at its slot entry's id; a staged key of the dropped attempt may be left, expiring
    assert _payload_keys(client, run.keys, staged=False) == sorted(payloads.key(run.keys.payloads, i) for i in ids)
    assert client.xpending(run.keys.tasks, WORKERS_GROUP)["pending"] == 0
    riding.close()


def test_a_staged_payload_that_is_gone_refuses_the_whole_call_writing_nothing(client, make_run, issuer):
    run = make_run(n_samples=2)
    keys = run.keys
    [task] = issuer(run).issue([{}])
    [taken] = WorkerClient(client, keys).take(1, block_ms=None)
    publish = scripts.register(client, "publish_staged.lua")
    result, payload = codec.sample_result(task.task_id, 0, make_sample(tokens=8), producer="p")
    header = codec.encode(result)[codec.HEADER]
    rejected = codec.encode(SlotResult(task_id=task.task_id, slot=1, outcome="rejected"))[codec.HEADER]
    before = client.xlen(keys.slots)
    live = payloads.staged_key(keys.payloads)
    client.set(live, payloads.frame(payload[codec.HEADER], payload[codec.BLOB]), px=60_000)
    expiring = payloads.staged_key(keys.payloads)
    client.set(expiring, payloads.frame(payload[codec.HEADER], payload[codec.BLOB]), px=20)
    time.sleep(0.1)
    never = payloads.staged_key(keys.payloads)
    for gone in (expiring, never):
        with pytest.raises(redis.ResponseError, match=r"STAGED the staged payload .* is gone"):
            publish(
                keys=[keys.slots, keys.payloads, keys.tasks, live, gone],
                args=[WORKERS_GROUP, 1, taken.entry_id, header, "1", rejected, "", header, "1"],
            )
    for bad_keys, args in (
        ([keys.slots, keys.payloads, keys.tasks, keys.slots], [header, "1"]),  # not a staging key
        ([keys.slots, keys.payloads, keys.tasks, live, live], [header, "1", header, "1"]),
        ([keys.slots, keys.payloads, keys.tasks, live], [header, "1", header, "1"]),
        ([keys.slots, keys.payloads, keys.tasks, live], [header, ""]),
    ):
        with pytest.raises(redis.ResponseError, match="BAD_INPUT"):
            publish(keys=bad_keys, args=["", 0, *args])
    # nothing was written: no slot entry, no payload key, the live staged key as it was, the task pending
    assert client.xlen(keys.slots) == before
    assert _payload_keys(client, keys) == [live]
    assert client.xpending(keys.tasks, WORKERS_GROUP)["pending"] == 1
    [entry, _] = publish(
        keys=[keys.slots, keys.payloads, keys.tasks, live],
        args=[WORKERS_GROUP, 1, taken.entry_id, header, "1", rejected, ""],
    )
    assert _payload_keys(client, keys) == [payloads.key(keys.payloads, entry.decode())]
    assert client.xpending(keys.tasks, WORKERS_GROUP)["pending"] == 0


def test_the_workers_user_may_stage_only_and_overwrite_no_slot_log(client, make_run, issuer, role_users):
    run = make_run(n_samples=2)
    keys = run.keys
    worker = role_users.client("worker")
    staged = payloads.staged_key(keys.payloads)
    assert worker.set(staged, b"x", nx=True, px=60_000)
    for key in (
        payloads.key(keys.payloads, "1-1"),
        keys.slots,
        keys.payloads,
        keys.tasks,
        keys.control,
        keys.pattern.replace("*", "elsewhere"),
    ):
        refused(lambda key=key: worker.set(key, b"x"))
    refused(lambda: worker.rename(staged, keys.slots))  # a staged value cannot replace the slot log
    refused(lambda: worker.xadd(keys.payloads, {"h": b"{}"}))
    refused(lambda: worker.unlink(payloads.key(keys.payloads, "1-1")))
    # and with that user a whole publish works
    [task] = issuer(run).issue([{}])
    ids = WorkerClient(worker, keys).publish_many([(task.task_id, slot, make_sample(tokens=8)) for slot in range(2)])
    assert all(fields is not None for fields in payloads.read(client, keys.payloads, ids))


def _full_run(client, run, issuer, tasks: int) -> int:
    """Issue ``tasks`` one at a time (each task's entries then its results in the slot log), publish, decide,
    batch and commit every step; returns the steps."""
    worker = WorkerClient(client, run.keys)
    for _ in range(tasks):
        issuer(run).issue([{}])
        [task] = worker.take(1, block_ms=None)
        worker.publish_many(
            [
                (r.task_id, r.slot, make_sample(tokens=16 + r.slot, reward=float(r.slot), seed=r.slot))
                for r in task.requests(run.config.n_samples, 0)
            ],
            done=[task],
        )
    Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
    batcher = Batcher(client, run, BatcherConfig(round_s=0.05, lease_ttl_s=5))
    assert batcher.lease.acquire()
    batcher._activate()
    batcher.round()
    batcher.lease.release()
    trainer = TrainerClient(client, run)
    steps = client.xlen(run.keys.steps)
    for step in range(steps):
        batch = trainer.load(trainer.manifest(step), 0, 1)
        batch._client = trainer
        batch.commit()
    return steps


def _each_payload_key_has_its_slot_entry(client, keys) -> int:
    """Every payload key left names a slot entry there is, and every sample slot entry has its key; returns how many."""
    slot_ids = {e.decode() for e, f in client.xrange(keys.slots)}
    samples = {e.decode() for e, f in client.xrange(keys.slots) if b'"sample"' in f[b"h"]}
    left = {k.rsplit(":", 1)[1] for k in _payload_keys(client, keys, staged=False)}
    assert left <= slot_ids and samples <= left, (left - slot_ids, samples - left)
    return len(left)


@pytest.mark.cluster
def test_after_a_run_with_retention_and_archive_no_payload_key_outlives_its_slot_entry(
    client, make_run, issuer, tmp_path
):
    run = make_run(n_samples=2, dp_size=1, batch_size=2, max_staleness=100)
    keys = run.keys
    # A writer killed between its two commands leaves a staged payload, which expires by itself.
    client.set(payloads.staged_key(keys.payloads), payloads.frame(b"{}", b"x"), nx=True, px=1000)
    started = time.monotonic()
    steps = _full_run(client, run, issuer, 8)
    assert steps == 4 and verify(client, keys).ok
    assert _each_payload_key_has_its_slot_entry(client, keys) == 16
    archiver = Archiver(client, keys, tmp_path / "archive", ArchiverConfig(retention=True))
    archiver.run(burst=True)
    assert archiver.last_trim is not None and archiver.last_trim.streams["payloads"].removed > 0
    time.sleep(max(0.0, started + 1.1 - time.monotonic()))  # past the staged key's TTL
    assert _each_payload_key_has_its_slot_entry(client, keys) < 16  # what retention trimmed took its payloads
    assert not list(client.scan_iter(match=payloads.staged_pattern(keys.payloads)))  # the staged one expired
    archived = ArchiveSource(tmp_path / "archive")
    assert len(list(archived.scan("payloads"))) == 16  # the archive holds each payload at its slot entry's id
    behind = FallbackSource(RedisSource(client, keys), ArchiveSource(tmp_path / "archive"))
    scanned = [entry_id for entry_id, _ in behind.scan("payloads")]  # the server's, after what it trimmed
    assert scanned == [entry_id for entry_id, _ in archived.scan("payloads")]
    for source in (archived, FallbackSource(RedisSource(client, keys), ArchiveSource(tmp_path / "archive"))):
        for step in range(steps):
            recorded = codec.decode(source("steps", [step_entry_id(step)])[0])
            assert replay_step(client, keys, step, 0, source=source).digest == recorded.shards[0].digest
        report = verify(client, keys, source=source)
        assert report.ok, report.differences
        assert report.payloads_checked == 16


def test_retention_behind_a_partial_archive_deletes_exactly_the_payloads_of_the_slot_entries_it_trims(
    client, make_run, issuer, tmp_path
):
    run = make_run(n_samples=2, dp_size=1, batch_size=2, max_staleness=100)
    keys = run.keys
    _full_run(client, run, issuer, 4)
    first = [e.decode() for e, _ in client.xrange(keys.slots, count=5)]  # task 1, its 2 results, task 2, 1 result
    archiver = Archiver(client, keys, tmp_path / "archive", ArchiverConfig(archive_read_count=5))
    archiver.archive_once()
    archiver.close()
    report = trim(client, keys, archive_progress(client, keys))
    assert report.streams["slots"].removed == 5 and report.streams["payloads"].removed == 3
    assert report.streams["slots"].floor == report.streams["payloads"].floor
    assert not any(client.exists(payloads.key(keys.payloads, entry)) for entry in first)
    assert _each_payload_key_has_its_slot_entry(client, keys) == 5

"""Slots' segments on a real server: the segment function refuses bad input and writers that do not hold the
task, writing nothing; a worker whose inference adapter generates in chunks records each as a segment, and
a worker that takes the task over continues from them (the crash test: `test_segment_crash.py`)."""

from __future__ import annotations

import pytest
import redis
from inference_fakes import Action, logprob_of, next_tokens, start
from stored_payloads import payload_entries

from streamgrp.config import InferenceConfig, WorkerConfig
from streamgrp.core import codec
from streamgrp.core.events import RawArray, SamplePayload, SlotSegment
from streamgrp.services.inference import build_rollout
from streamgrp.services.worker import WorkerClient, WorkerProcess
from streamgrp.store import scripts
from streamgrp.store.keys import WORKERS_GROUP
from streamgrp.store.segments import SegmentStore, SegmentTaken, chain_of, check_sample, task_segments


def _segment(index: int, start: int, ids: list[int], *, task: str = "t0", slot: int = 0, cause: str = "chunk"):
    return SlotSegment(
        task_id=task,
        slot=slot,
        index=index,
        start=start,
        token_ids=RawArray.from_values(ids, "int32"),
        logprobs=RawArray.from_values([-0.5] * len(ids), "float32"),
        version=1,
        cause=cause,
    )


def _held_task(client, run, issuer, consumer: str) -> str:
    issuer(run).issue([{"prompt_ids": [5, 6]}])
    reply = client.xreadgroup(WORKERS_GROUP, consumer, {run.keys.tasks: ">"}, count=1)
    return reply[0][1][0][0].decode()


def test_the_segment_function_refuses_bad_input_and_other_holders_writing_nothing(client, make_run, issuer):
    run = make_run(n_samples=1)
    WorkerClient(client, run.keys)  # makes the workers group
    entry = _held_task(client, run, issuer, "w1")
    fields = codec.encode(_segment(0, 0, [7, 8]))
    header, blob = fields[codec.HEADER], fields[codec.BLOB]
    function = scripts.register(client, "segment.lua")
    keys = [run.keys.tasks, run.keys.segments]
    for args, code in (
        ([WORKERS_GROUP, entry, "w1", header], "BAD_INPUT"),  # no tensors
        ([WORKERS_GROUP, entry, "w1", "", blob], "BAD_INPUT"),
        ([WORKERS_GROUP, "not-an-id", "w1", header, blob], "BAD_INPUT"),
        (["", entry, "w1", header, blob], "BAD_INPUT"),
        ([WORKERS_GROUP, entry, "", header, blob], "BAD_INPUT"),
        ([WORKERS_GROUP, entry, "w1", header, blob, "extra"], "BAD_INPUT"),
        ([WORKERS_GROUP, entry, "w2", header, blob], "TAKEN"),  # another worker holds it
        ([WORKERS_GROUP, "1-1", "w1", header, blob], "TAKEN"),
    ):  # not pending at all
        with pytest.raises(redis.ResponseError) as refused:
            function(keys=keys, args=args)
        assert scripts.error_code(refused.value) == code, (args[:3], str(refused.value))
        assert client.xlen(run.keys.segments) == 0
    store = SegmentStore(client, run.partitions, name="w1")
    store.record(0, entry, _segment(0, 0, [7, 8]))
    assert client.xlen(run.keys.segments) == 1
    with pytest.raises(SegmentTaken):  # w2 took the task over: w1 may not write more
        client.xclaim(run.keys.tasks, WORKERS_GROUP, "w2", 0, [entry])
        store.record(0, entry, _segment(1, 2, [9]))
    assert client.xlen(run.keys.segments) == 1
    client.xack(run.keys.tasks, WORKERS_GROUP, entry)
    with pytest.raises(SegmentTaken):  # done: nobody may
        SegmentStore(client, run.partitions, name="w2").record(0, entry, _segment(1, 2, [9]))


def test_a_segment_is_its_holders_sign_of_life_the_task_does_not_turn_idle(client, make_run, issuer):
    import time

    run = make_run(n_samples=1)
    WorkerClient(client, run.keys)
    entry = _held_task(client, run, issuer, "w1")
    time.sleep(0.3)
    [before] = client.xpending_range(run.keys.tasks, WORKERS_GROUP, entry, entry, 1)
    SegmentStore(client, run.partitions, name="w1").record(0, entry, _segment(0, 0, [7, 8]))
    [after] = client.xpending_range(run.keys.tasks, WORKERS_GROUP, entry, entry, 1)
    assert before["time_since_delivered"] >= 300 > after["time_since_delivered"]
    assert (after["consumer"], after["times_delivered"]) == (b"w1", before["times_delivered"])  # still w1's, once
    # so a worker reclaiming tasks idle 0.2 s finds none: the holder is alive
    assert WorkerClient(client, run.keys, name="w2", claim_idle_s=0.2).take(1, block_ms=None) == []


def test_a_chain_is_indexed_contiguous_and_ends_with_its_generation():
    first, second, third = _segment(0, 0, [1, 2]), _segment(1, 2, [3]), _segment(2, 3, [4], cause="stop")
    assert chain_of([first, second, first, second, third, _segment(3, 4, [5])]) == [first, second, third]
    assert chain_of([first, _segment(2, 3, [4])]) == [first]  # a gap ends it
    assert chain_of([first, _segment(1, 5, [4])]) == [first]  # so does a start that is not where the last ended
    assert chain_of([second]) == []


def test_a_worker_generating_in_chunks_records_each_and_its_sample_is_their_concatenation(client, make_run, issuer):
    run = make_run(n_samples=2)
    fake, stop = start("llamacpp")
    try:
        issuer(run).issue([{"prompt_ids": [5, 6]}])
        config = InferenceConfig(
            server_url=fake.url, max_tokens=20, segment_tokens=8, max_attempts=2, backoff_s=0.01, segment_stream=False
        )
        worker = WorkerClient(client, run.keys)
        assert (
            WorkerProcess(
                worker, build_rollout("llamacpp", config), WorkerConfig(burst=True, concurrency=2), n_samples=2
            ).run()
            == 1
        )
        # 20 tokens in chunks of at most 8, each asked for from prompt + the tokens so far
        assert sorted(body["n_predict"] for body in fake.generations()) == [4, 4, 8, 8, 8, 8]
        found = task_segments(client, run.keys.segments, _task_id(client, run))
        payloads = [codec.decode(f) for _, f in payload_entries(client, run.keys)]
        assert len(payloads) == 2 and all(isinstance(p, SamplePayload) for p in payloads)
        for payload in payloads:
            chain = chain_of(found[payload.slot])
            assert [(s.index, s.start, s.tokens, s.cause) for s in chain] == [
                (0, 0, 8, "chunk"),
                (1, 8, 8, "chunk"),
                (2, 16, 4, "length"),
            ]
            assert check_sample(payload.sample, chain) is None
            assert payload.sample.meta["segments"] == {"count": 3, "tokens": 20}
            ids = payload.sample.token_ids.to_list()
            # the continuation is what the server generates after prompt + tokens so far
            assert ids[2:10] == next_tokens([5, 6], 8) and ids[10:18] == next_tokens(ids[:10], 8)
            assert payload.sample.logprobs.to_list()[2:4] == [logprob_of(ids[2]), logprob_of(ids[3])]
            broken = payload.sample.replace(meta={**payload.sample.meta, "segments": {"count": 2, "tokens": 16}})
            assert "generated 20 tokens, its segments hold 16" in check_sample(broken, chain)
    finally:
        stop()


@pytest.mark.parametrize("dialect", ["llamacpp", "vllm", "sglang"])
def test_a_streamed_generation_is_one_request_cut_into_segments_as_it_arrives(client, make_run, issuer, dialect):
    run = make_run(n_samples=2)
    fake, stop = start(dialect)
    try:
        issuer(run).issue([{"prompt_ids": [5, 6]}])
        config = InferenceConfig(server_url=fake.url, max_tokens=20, segment_tokens=8, max_attempts=2, backoff_s=0.01)
        assert (
            WorkerProcess(
                WorkerClient(client, run.keys),
                build_rollout(dialect, config),
                WorkerConfig(burst=True, concurrency=2),
                n_samples=2,
            ).run()
            == 1
        )
        generations = fake.generations()
        assert len(generations) == 2 and all(body["stream"] for body in generations)  # one stream per slot
        assert len(fake.generated) == 40  # nothing generated twice: no chunk prefilled the context again
        found = task_segments(client, run.keys.segments, _task_id(client, run))
        for payload in (codec.decode(f) for _, f in payload_entries(client, run.keys)):
            chain = chain_of(found[payload.slot])
            assert [(s.index, s.start, s.tokens, s.cause) for s in chain] == [
                (0, 0, 8, "chunk"),
                (1, 8, 8, "chunk"),
                (2, 16, 4, "length"),
            ]
            assert check_sample(payload.sample, chain) is None
            assert payload.sample.token_ids.to_list() == [5, 6, *next_tokens([5, 6], 20)]
            assert payload.sample.meta["streams"] == 1
    finally:
        stop()


def _task_id(client, run) -> str:
    return codec.decode(client.xrange(run.keys.tasks)[0][1]).task_id


def test_without_segment_tokens_nothing_is_recorded(client, make_run, issuer):
    run = make_run(n_samples=1)
    fake, stop = start("llamacpp")
    try:
        fake.default = Action()
        issuer(run).issue([{"prompt_ids": [5, 6]}])
        config = InferenceConfig(server_url=fake.url, max_tokens=20, max_attempts=2, backoff_s=0.01)
        assert (
            WorkerProcess(
                WorkerClient(client, run.keys),
                build_rollout("llamacpp", config),
                WorkerConfig(burst=True, concurrency=1),
                n_samples=1,
            ).run()
            == 1
        )
        assert [body["n_predict"] for body in fake.generations()] == [20] and client.xlen(run.keys.segments) == 0
    finally:
        stop()


def test_a_worker_taking_a_task_over_continues_from_its_segments_and_verify_checks_them(client, make_run, issuer):
    from streamgrp.config import AssemblerConfig
    from streamgrp.replay.verifier import verify
    from streamgrp.services.assembler import Assembler

    run = make_run(n_samples=1)
    fake, stop = start("llamacpp")
    try:
        issuer(run).issue([{"prompt_ids": [5, 6]}])
        first = WorkerClient(client, run.keys, name="w1")
        [task] = first.take(1)
        # what w1 made durable before it died: two chunks, as the server generated them
        store, prompt = SegmentStore(client, run.partitions, name="w1"), [5, 6]
        one = next_tokens(prompt, 8)
        two = next_tokens(prompt + one, 8)
        for index, (start_at, ids) in enumerate(((0, one), (8, two))):
            store.record(
                0,
                task.entry_id,
                SlotSegment(
                    task_id=task.event.task_id,
                    slot=0,
                    index=index,
                    start=start_at,
                    token_ids=RawArray.from_values(ids, "int32"),
                    logprobs=RawArray.from_values([logprob_of(t) for t in ids], "float32"),
                    version=0,
                    cause="chunk",
                ),
            )
        config = InferenceConfig(server_url=fake.url, max_tokens=20, segment_tokens=8, max_attempts=2, backoff_s=0.01)
        second = WorkerClient(client, run.keys, name="w2", claim_idle_s=0.05)
        import time

        time.sleep(0.1)  # the task idles past w2's claim time
        assert (
            WorkerProcess(
                second, build_rollout("llamacpp", config), WorkerConfig(burst=True, concurrency=1), n_samples=1
            ).run()
            == 1
        )
        assert len(fake.generated) == 4  # only the 4 tokens no segment held
        [body] = fake.generations()
        assert body["prompt"] == prompt + one + two and body["n_predict"] == 4
        [payload] = [codec.decode(f) for _, f in payload_entries(client, run.keys)]
        sample = payload.sample
        assert sample.token_ids.to_list() == prompt + one + two + next_tokens(prompt + one + two, 4)
        assert sample.meta["segments"] == {"count": 3, "tokens": 20} and sample.meta["resumed_tokens"] == 16
        assert sample.meta["token_versions"] == [[0, 20]]
        Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
        report = verify(client, run.keys)
        assert report.ok, report.differences
        assert report.segments_checked == 1
        # a segment deleted behind verify's back: the sample names more than the stream holds
        client.xdel(run.keys.segments, client.xrange(run.keys.segments)[1][0])
        report = verify(client, run.keys)
        assert [d.kind for d in report.differences] == ["segments_differ"]
        assert "names 3 segments; the stream holds a chain of 1" in report.differences[0].recorded
    finally:
        stop()


@pytest.mark.one_server_kind
def test_a_worker_records_segments_under_its_own_acl_user(kind_binary, tmp_path, run_name):
    import secrets
    from pathlib import Path

    from streamgrp.cli.server import EmbeddedServer
    from streamgrp.config import RunConfig
    from streamgrp.store.acl import password_hash, template_for, user_name
    from streamgrp.store.connection import connect
    from streamgrp.store.runs import join_run
    from streamgrp.store.scripts import load_library
    from streamgrp.store.tasks import TaskIssuer

    ops_acl = Path(__file__).resolve().parents[2] / "ops" / "acl"
    admin_password, worker_password = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    rule = template_for((ops_acl / "worker.acl").read_text(), run_name).strip()
    users = tmp_path / "users.acl"
    users.write_text(
        "\n".join(
            [
                (ops_acl / "default.acl").read_text().strip(),
                f"user admin on {password_hash(admin_password)} ~* &* +@all",
                rule.replace(" resetpass ", f" resetpass {password_hash(worker_password)} ", 1),
            ]
        )
        + "\n"
    )
    server = EmbeddedServer(tmp_path / "server", binary=kind_binary, acl_file=users)
    server.start()
    fake, stop = start("llamacpp")
    try:
        admin = connect(f"redis://admin@127.0.0.1:{server.port}/0", password=admin_password)
        load_library(admin)
        run = join_run(admin, run_name, RunConfig(n_samples=1))
        TaskIssuer(admin, run.keys).issue([{"prompt_ids": [5, 6]}])
        client = connect(f"redis://{user_name(run_name, 'worker')}@127.0.0.1:{server.port}/0", password=worker_password)
        config = InferenceConfig(server_url=fake.url, max_tokens=12, segment_tokens=8, max_attempts=2, backoff_s=0.01)
        assert (
            WorkerProcess(
                WorkerClient(client, run.keys),
                build_rollout("llamacpp", config),
                WorkerConfig(burst=True, concurrency=1),
                n_samples=1,
            ).run()
            == 1
        )
        assert admin.xlen(run.keys.segments) == 2 and len(payload_entries(admin, run.keys)) == 1
        with pytest.raises(redis.exceptions.NoPermissionError):  # its selectors name no other stream for XADD
            client.xadd(run.keys.decisions, {"h": b"x"})
    finally:
        stop()
        server.stop()


def test_retention_keeps_the_segments_of_tasks_the_workers_hold(client, make_run, issuer):
    from streamgrp.services.retention import floors
    from streamgrp.store.keys import id_key

    run = make_run(n_samples=1)
    WorkerClient(client, run.keys)
    entry = _held_task(client, run, issuer, "w1")
    segment_id = SegmentStore(client, run.partitions, name="w1").record(0, entry, _segment(0, 0, [7, 8]))
    archived = dict.fromkeys(run.keys.all_streams(), "9999999999999-0")  # everything archived
    floor, why = floors(client, run.keys, archived)["segments"]
    assert floor <= id_key(segment_id) and why == "segments of tasks the workers hold"
    client.xack(run.keys.tasks, WORKERS_GROUP, entry)  # its results published: its segments are the archive's,
    import time

    time.sleep(0.01)
    client.xack(run.keys.tasks, WORKERS_GROUP, _held_task(client, run, issuer, "w1"))  # once a later task was taken
    floor, why = floors(client, run.keys, archived)["segments"]
    assert floor > id_key(segment_id), why


def test_aborted_parts_are_segments_and_a_partitioned_run_keeps_each_tasks_segments_in_its_partition(
    client, make_run, issuer
):
    from streamgrp.config import AssemblerConfig
    from streamgrp.replay.verifier import verify
    from streamgrp.services.assembler import Assembler

    run = make_run(n_samples=1, partitions=2)
    fake, stop = start("sglang")
    try:
        # the first request aborts after 5 tokens (a weight update): its part is a segment, the rest resubmitted
        fake.then(Action("abort", tokens=5, version=1))
        fake.default = Action(version=2)
        issuer(run).issue([{"prompt_ids": [5, 6]}, {"prompt_ids": [7]}, {"prompt_ids": [8]}])
        config = InferenceConfig(server_url=fake.url, max_tokens=12, segment_tokens=8, max_attempts=2, backoff_s=0.01)
        worker = WorkerClient(client, run.keys, partitions=run.partitions)
        assert (
            WorkerProcess(
                worker, build_rollout("sglang", config), WorkerConfig(burst=True, concurrency=1), n_samples=1
            ).run()
            == 3
        )
        causes = []
        for part in run.partitions:
            tasks = {codec.decode(f).task_id for _, f in client.xrange(part.tasks)}
            segments = [codec.decode(f) for _, f in client.xrange(part.segments)]
            assert {s.task_id for s in segments} == tasks  # each task's segments in its own partition
            causes += [
                [(s.tokens, s.cause, s.version) for s in chain_of([x for x in segments if x.task_id == t])]
                for t in tasks
            ]
        assert [(5, "abort", 1), (7, "length", 2)] in causes  # aborted at 5, then 7 more (under 8: the end)
        assert causes.count([(8, "chunk", 2), (4, "length", 2)]) == 2
        samples = [codec.decode(f).sample for part in run.partitions for _, f in payload_entries(client, part)]
        [spanning] = [s for s in samples if s.meta["token_versions"] == [[1, 5], [2, 7]]]  # per-token versions, as runs
        assert spanning.version == 1  # the oldest
        for partition in range(2):
            Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05), partition=partition).run(
                burst=True
            )
        report = verify(client, run.keys)
        assert report.ok and report.segments_checked == 3, report.differences
    finally:
        stop()


def test_a_tasks_chains_are_read_once_for_its_slots_and_afresh_when_it_is_taken_over_again(client, make_run, issuer):
    run = make_run(n_samples=2)
    WorkerClient(client, run.keys)
    entry = _held_task(client, run, issuer, "w1")
    task_id = _task_id(client, run)
    store = SegmentStore(client, run.partitions, name="w1")
    store.record(0, entry, _segment(0, 0, [7, 8], task=task_id))
    assert len(store.chain(0, entry, task_id, 0, 2)) == 1
    store.record(0, entry, _segment(1, 2, [9], task=task_id))
    assert len(store.chain(0, entry, task_id, 1, 2)) == 0  # slot 1 has none; read with slot 0's
    assert len(store.chain(0, entry, task_id, 0, 2)) == 2  # both slots asked: the task is read afresh


def test_queued_segments_gather_in_one_pipeline_until_a_slot_cuts_a_second_or_waits_for_its_writes(
    client, make_run, issuer
):
    import time

    from streamgrp.services.inference.segments import SlotSegments
    from streamgrp.services.worker_client import SlotRequest

    run = make_run(n_samples=2)
    WorkerClient(client, run.keys)
    entry = _held_task(client, run, issuer, "w1")
    task_id = _task_id(client, run)
    store = SegmentStore(client, run.partitions, name="w1", linger_s=30.0)  # a window no test waits out
    slots = [SlotSegments(store, SlotRequest(task_id, slot, 2, {}, 1, entry, 0, False)) for slot in range(2)]
    slots[0].record([7, 8], [-0.5, -0.5], None, "chunk")
    slots[1].record([9], [-0.5], None, "chunk")
    time.sleep(0.3)
    assert client.xlen(run.keys.segments) == 0 and store.batches == 0  # queued: the window is open
    slots[0].record([10], [-0.5], None, "chunk")  # slot 0's first is unwritten still: all three go now
    deadline = time.monotonic() + 10
    while client.xlen(run.keys.segments) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.xlen(run.keys.segments) == 3 and store.batches == 1
    slots[1].record([11], [-0.5], None, "stop")
    slots[1].settle()  # the slot's generation ended: what is queued is sent from here, not at the window's end
    assert client.xlen(run.keys.segments) == 4 and store.batches == 2
    chains = {slot: chain_of(segments) for slot, segments in task_segments(client, run.keys.segments, task_id).items()}
    assert [s.token_ids.to_list() for s in chains[0]] == [[7, 8], [10]]
    assert [(s.token_ids.to_list(), s.cause) for s in chains[1]] == [([9], "chunk"), ([11], "stop")]
    assert slots[1].meta()["segments"] == {"count": 2, "tokens": 2}


@pytest.mark.own_server  # it flushes the function library
def test_one_batch_tells_each_slot_its_own_outcome_and_survives_a_lost_library_and_a_dropped_connection(
    client, make_run, issuer
):
    run = make_run(n_samples=1)
    WorkerClient(client, run.keys)
    held = _held_task(client, run, issuer, "w1")
    taken = _held_task(client, run, issuer, "w2")  # another worker's: w1's write to it is refused
    store = SegmentStore(client, run.partitions, name="w1", linger_s=30.0)
    outcomes: list[object] = []

    def write_batch(*segments) -> list[object]:
        outcomes.clear()
        for entry, segment in segments:
            store.submit(0, entry, segment, outcomes.append)
        store.write_now()
        return list(outcomes)

    first = write_batch((held, _segment(0, 0, [7, 8])), (taken, _segment(0, 0, [9])), (held, _segment(1, 2, [10])))
    assert isinstance(first[0], str) and isinstance(first[1], SegmentTaken) and isinstance(first[2], str)
    assert client.xlen(run.keys.segments) == 2
    client.function_flush()  # the server lost the library: the batch's writes load it again and land
    second = write_batch((held, _segment(2, 3, [11])), (held, _segment(3, 4, [12])))
    assert all(isinstance(outcome, str) for outcome in second), second
    own = store._own.connection  # a single server's writes go through the store's own connection
    host, port = own._sock.getsockname()[:2]  # it drops (killed by its address only: other tests share the server)
    assert client.client_kill_filter(addr=f"{host}:{port}") == 1
    failed = write_batch((held, _segment(4, 5, [13])))  # a plain client does not ride it: the slot hears of it
    assert isinstance(failed[0], redis.ConnectionError), failed
    again = write_batch((held, _segment(4, 5, [13])))  # sent again, as a slot whose write failed would be
    assert isinstance(again[0], str), again
    chain = chain_of(task_segments(client, run.keys.segments, "t0")[0])
    assert [segment.token_ids.to_list() for segment in chain] == [[7, 8], [10], [11], [12], [13]]


def test_a_riding_clients_segment_writes_are_sent_again_through_a_dropped_connection(
    client, redis_url, make_run, issuer
):
    from streamgrp.store.connection import connect

    run = make_run(n_samples=1)
    WorkerClient(client, run.keys)
    held = _held_task(client, run, issuer, "w1")
    riding = connect(redis_url)  # a role's client: it rides out outages
    store = SegmentStore(riding, run.partitions, name="w1", linger_s=30.0)
    outcomes: list[object] = []
    store.submit(0, held, _segment(0, 0, [7, 8]), outcomes.append)
    store.write_now()
    host, port = store._own.connection._sock.getsockname()[:2]
    assert client.client_kill_filter(addr=f"{host}:{port}") == 1  # the store's own connection drops
    store.submit(0, held, _segment(1, 2, [9]), outcomes.append)
    store.write_now()
    assert all(isinstance(outcome, str) for outcome in outcomes), outcomes  # sent again, not failed
    assert riding.outage is not None and riding.outage.count == 1
    chain = chain_of(task_segments(client, run.keys.segments, "t0")[0])
    assert [segment.token_ids.to_list() for segment in chain] == [[7, 8], [9]]
    riding.close()

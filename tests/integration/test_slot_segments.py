"""Slots' segments on a real server: the segment function refuses bad input and writers that do not hold the
task, writing nothing; a worker whose inference adapter generates in chunks records each as a segment, and
a worker that takes the task over continues from them (the crash test: `test_segment_crash.py`)."""

from __future__ import annotations

import pytest
import redis
from inference_fakes import Action, logprob_of, next_tokens, start

from streamgrp.config import InferenceConfig, WorkerConfig
from streamgrp.core import codec
from streamgrp.core.events import RawArray, SamplePayload, SlotSegment
from streamgrp.services.inference import build_rollout
from streamgrp.services.worker import WorkerClient, WorkerProcess
from streamgrp.store import scripts
from streamgrp.store.keys import WORKERS_GROUP
from streamgrp.store.segments import SegmentStore, SegmentTaken, chain_of, check_sample, task_segments


def _segment(index: int, start: int, ids: list[int], *, task: str = "t0", slot: int = 0, cause: str = "chunk"):
    return SlotSegment(task_id=task, slot=slot, index=index, start=start, token_ids=RawArray.from_values(ids, "int32"),
                       logprobs=RawArray.from_values([-0.5] * len(ids), "float32"), version=1, cause=cause)


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
    for args, code in (([WORKERS_GROUP, entry, "w1", header], "BAD_INPUT"),  # no tensors
                       ([WORKERS_GROUP, entry, "w1", "", blob], "BAD_INPUT"),
                       ([WORKERS_GROUP, "not-an-id", "w1", header, blob], "BAD_INPUT"),
                       (["", entry, "w1", header, blob], "BAD_INPUT"),
                       ([WORKERS_GROUP, entry, "", header, blob], "BAD_INPUT"),
                       ([WORKERS_GROUP, entry, "w1", header, blob, "extra"], "BAD_INPUT"),
                       ([WORKERS_GROUP, entry, "w2", header, blob], "TAKEN"),  # another worker holds it
                       ([WORKERS_GROUP, "1-1", "w1", header, blob], "TAKEN")):  # not pending at all
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
        config = InferenceConfig(server_url=fake.url, max_tokens=20, segment_tokens=8, max_attempts=2, backoff_s=0.01)
        worker = WorkerClient(client, run.keys)
        assert WorkerProcess(worker, build_rollout("llamacpp", config), WorkerConfig(burst=True, concurrency=2),
                             n_samples=2).run() == 1
        # 20 tokens in chunks of at most 8, each asked for from prompt + the tokens so far
        assert sorted(body["n_predict"] for body in fake.generations()) == [4, 4, 8, 8, 8, 8]
        found = task_segments(client, run.keys.segments, _task_id(client, run))
        payloads = [codec.decode(f) for _, f in client.xrange(run.keys.payloads)]
        assert len(payloads) == 2 and all(isinstance(p, SamplePayload) for p in payloads)
        for payload in payloads:
            chain = chain_of(found[payload.slot])
            assert [(s.index, s.start, s.tokens, s.cause) for s in chain] == [
                (0, 0, 8, "chunk"), (1, 8, 8, "chunk"), (2, 16, 4, "length")]
            assert check_sample(payload.sample, chain) is None
            assert payload.sample.meta["segments"] == {"count": 3, "tokens": 20}
            ids = payload.sample.token_ids.to_list()
            # the continuation is what the server generates after prompt + tokens so far
            assert ids[2:10] == next_tokens([5, 6], 8) and ids[10:18] == next_tokens(ids[:10], 8)
            assert payload.sample.logprobs.to_list()[2:4] == [logprob_of(ids[2]), logprob_of(ids[3])]
            broken = payload.sample.model_copy(update={"meta": {**payload.sample.meta,
                                                                 "segments": {"count": 2, "tokens": 16}}})
            assert "generated 20 tokens, its segments hold 16" in check_sample(broken, chain)
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
        assert WorkerProcess(WorkerClient(client, run.keys), build_rollout("llamacpp", config),
                             WorkerConfig(burst=True, concurrency=1), n_samples=1).run() == 1
        assert [body["n_predict"] for body in fake.generations()] == [20] and client.xlen(run.keys.segments) == 0
    finally:
        stop()

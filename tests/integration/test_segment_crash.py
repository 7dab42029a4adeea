"""A worker SIGKILLed mid-generation: the worker that reclaims its task continues each slot from its last
durable segment. Real processes (two `streamgrp worker --rollout llamacpp` children), a real server, and the
fake llama-server of `inference_fakes` (in this process, so it counts every token it generates). The workers
stream each generation (one request per slot) and cut a segment from the stream every 8 tokens."""

from __future__ import annotations

import time

import pytest
from inference_fakes import Action, next_tokens, start
from processes import RoleProcess, wait_until
from stored_payloads import payload_entries

from streamgrp.config import AssemblerConfig, RunConfig
from streamgrp.core import codec
from streamgrp.core.events import SamplePayload, SlotSegment
from streamgrp.replay.verifier import verify
from streamgrp.services.assembler import Assembler
from streamgrp.store.runs import join_run
from streamgrp.store.segments import chain_of, chain_values
from streamgrp.store.tasks import TaskIssuer

pytestmark = [pytest.mark.slow]

N_SAMPLES, MAX_TOKENS, SEGMENT = 2, 64, 8
PROMPT = [5, 6]


def _chains(client, run) -> dict[int, list[SlotSegment]]:
    found: dict[int, list[SlotSegment]] = {}
    for _, fields in client.xrange(run.keys.segments):
        event = codec.decode(fields)
        found.setdefault(event.slot, []).append(event)
    return {slot: chain_of(segments) for slot, segments in found.items()}


def test_a_worker_killed_mid_generation_is_continued_from_its_segments(client, redis_url, run_name, tmp_path):
    run = join_run(client, run_name, RunConfig(n_samples=N_SAMPLES, group_timeout_s=3600.0))
    TaskIssuer(client, run.keys).issue([{"prompt_ids": PROMPT}])
    fake, stop_fake = start("llamacpp")
    fake.default = Action(token_delay=0.03)  # a slow server: a segment of 8 tokens takes a quarter second
    common = [
        "--redis-url",
        redis_url,
        "--run",
        run_name,
        "--rollout",
        "llamacpp",
        "--server-url",
        fake.url,
        "--max-tokens",
        str(MAX_TOKENS),
        "--segment-tokens",
        str(SEGMENT),
        "--concurrency",
        str(N_SAMPLES),
    ]
    first = RoleProcess("worker", [*common, "--claim-idle-s", "30"], tmp_path / "first")
    second = RoleProcess("worker", [*common, "--claim-idle-s", "0.5", "--burst"], tmp_path / "second")
    for process in (first, second):
        process.log_dir.mkdir()
    try:
        first.start()
        wait_until(
            lambda: all(len(_chains(client, run).get(slot, ())) >= 2 for slot in range(N_SAMPLES)),
            timeout=60,
            message=f"two segments of each slot\n{first.output()}",
        )
        first.kill()
        time.sleep(0.5)  # the fake notices the streams it writes to are gone (the tokens it wrote since are lost)
        durable = {slot: sum(s.tokens for s in chain) for slot, chain in _chains(client, run).items()}
        before = len(fake.generated)
        assert all(tokens < MAX_TOKENS for tokens in durable.values()), "the kill came after the generation ended"
        # at most one segment per slot was lost: the tokens streamed since the last cut (fewer than a segment, and
        # the one whose arrival cuts), plus the token or two the fake wrote before it saw the stream was gone
        assert before - sum(durable.values()) <= (SEGMENT + 2) * N_SAMPLES
        assert all(len(body["prompt"]) == len(PROMPT) for body in fake.generations())  # one stream per slot
        requests_before = len(fake.generations())

        assert second.start().proc.wait(timeout=120) == 0, second.output()
        # the second worker generated only what no segment held: nothing durable was generated again
        assert len(fake.generated) - before == sum(MAX_TOKENS - tokens for tokens in durable.values())
        resumed = fake.generations()[requests_before:]
        chains = _chains(client, run)
        for slot in range(N_SAMPLES):
            ids, _, _ = chain_values(chains[slot])
            prefix = PROMPT + ids[: durable[slot]]
            assert any(body["prompt"] == prefix for body in resumed), f"slot {slot} did not continue from its prefix"
        payloads = [codec.decode(f) for _, f in payload_entries(client, run.keys)]
        assert sorted(p.slot for p in payloads) == list(range(N_SAMPLES))
        for payload in payloads:
            assert isinstance(payload, SamplePayload)
            ids, _, _ = chain_values(chains[payload.slot])
            assert len(ids) == MAX_TOKENS and payload.sample.token_ids.to_list() == PROMPT + ids  # exactly the chain
            assert payload.sample.meta["resumed_tokens"] == durable[payload.slot]
            assert ids[:SEGMENT] == next_tokens(PROMPT, SEGMENT)
        Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
        report = verify(client, run.keys)
        assert report.ok, report.differences
        assert report.segments_checked == N_SAMPLES
    finally:
        for process in (first, second):
            if process.proc is not None and process.proc.poll() is None:
                process.kill()
        stop_fake()

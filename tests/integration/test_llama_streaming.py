"""Streamed generation on a real llama-server (SmolLM2-135M), interrupted two ways. Marker ``llama``.

- `weight-sync` restarts llama-server on a new version mid-stream: the worker keeps what streamed before
  the restart as segments of version 0, waits the restart through and streams the rest from prompt + those
  tokens on version 1. The sample's per-token versions show both; the restarted server generated exactly
  the tokens after the interruption (its own ``tokens_predicted_total``), so none before it twice.
- A worker process SIGKILLed after two segments: the worker that reclaims the task streams on from the
  last segment, the server generates exactly the tokens no segment held, the result is the segments'
  concatenation and `verify` passes.

Greedy decoding (top-k 1) keeps the reply the same English text on every run, so no character is split
over byte tokens (which a stream cannot carry: they are asked for unstreamed, and the count would differ)."""

from __future__ import annotations

import re
import threading
import time

import pytest
from llama import binary_and_model, server_command, start_llama, stop_llama
from processes import RoleProcess, wait_until
from stored_payloads import payload_entries

from streamgrp.cli.children import free_port
from streamgrp.config import InferenceConfig, WorkerConfig
from streamgrp.core import codec
from streamgrp.core.events import SamplePayload
from streamgrp.services.inference import build_rollout, make_dialect
from streamgrp.services.inference.weight_sync import LlamaServerProcess, WeightSync, version_dir
from streamgrp.services.worker import WorkerClient, WorkerProcess
from streamgrp.store.segments import chain_of, check_sample, task_segments

pytestmark = [pytest.mark.llama, pytest.mark.slow]

MAX_TOKENS, SEGMENT = 40, 8
#: The SIGKILL test: its generation, and how long its task idles before the second worker takes it over:
#: longer than a segment (8 tokens) takes even on a busy machine; each segment keeps the task of the worker
#: writing it from turning idle (else a worker would take its own task again while it generates).
KILL_MAX_TOKENS, CLAIM_IDLE_S = 32, 8
PROMPT = "<|im_start|>user\nWrite a short story about a dog.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def one_kind(redis_server) -> None:
    """The bundled server only: the streams are the same on both kinds (tested without llama elsewhere), and
    llama-server on two shared cores is the cost. Requested first, so the other kind skips before starting it."""
    if redis_server.kind != "valkey":
        pytest.skip("one server kind is enough for the llama-server run")


def _metric(url: str, name: str) -> int:
    """One of llama-server's ``--metrics`` (Prometheus text)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return int(float(re.search(rf"^llamacpp:{name} (\S+)$", text, re.M).group(1)))


def _predicted(url: str) -> int:
    """llama-server's count of the tokens it generated (a request's, once it is done or cancelled)."""
    return _metric(url, "tokens_predicted_total")


@pytest.mark.timeout(300)
def test_a_stream_interrupted_by_weight_sync_resumes_from_its_prefix_on_the_new_version(
    one_kind, client, make_run, issuer, tmp_path
):
    binary, model = binary_and_model()
    run = make_run(n_samples=1)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    for version in (0, 1):
        version_dir(tmp_path, version).mkdir(parents=True)
        (version_dir(tmp_path, version) / "model.gguf").symlink_to(model)
    llama = LlamaServerProcess(
        " ".join([*server_command(binary, port), "--metrics"]), url, alias="smollm2", log_path=tmp_path / "llama.log"
    )
    sync = WeightSync(client, run.keys, make_dialect("llamacpp", InferenceConfig()), [url], tmp_path, llama=llama)
    started = time.monotonic()
    try:
        assert sync.sync(0) == 1
        issuer(run).issue([{"text": PROMPT}])
        config = InferenceConfig(
            server_url=url, max_tokens=MAX_TOKENS, segment_tokens=SEGMENT, top_k=1, max_attempts=2, backoff_s=0.05
        )
        worker = WorkerProcess(
            WorkerClient(client, run.keys),
            build_rollout("llamacpp", config),
            WorkerConfig(burst=True, concurrency=1),
            n_samples=1,
        )
        done: list[int] = []
        thread = threading.Thread(target=lambda: done.append(worker.run()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while client.xlen(run.keys.segments) < 2:  # two segments durable: the generation is under way
            assert time.monotonic() < deadline and thread.is_alive(), "no two segments of the generation"
            time.sleep(0.005)
        assert sync.sync(1) == 1  # kills llama-server mid-stream and starts it on version 1
        thread.join(120)
        assert done == [1]
        [payload] = [codec.decode(f) for _, f in payload_entries(client, run.keys)]
        assert isinstance(payload, SamplePayload)
        sample = payload.sample
        [(first, before), (second, after)] = sample.meta["token_versions"]
        assert (first, second) == (0, 1) and before > 0 and after > 0, sample.meta
        assert before + after == MAX_TOKENS or sample.meta["finish"] == "stop"
        assert sample.version == 0 and sample.meta["interrupted"] == 1 and "unstreamed" not in sample.meta
        # the restarted server generated the tokens after the interruption and no other: none twice
        assert _predicted(url) == after
        chain = chain_of(task_segments(client, run.keys.segments, payload.task_id)[0])
        assert check_sample(sample, chain) is None  # the sample is exactly its segments' concatenation
        causes = [(s.version, s.cause) for s in chain]
        assert (
            "abort" in {c for v, c in causes if v == 0}
            and causes[-1][1] in ("length", "stop")
            and {v for v, _ in causes} == {0, 1}
        ), causes
        print({"before": before, "after": after, "segments": causes, "seconds": round(time.monotonic() - started, 1)})
    finally:
        llama.stop()


@pytest.mark.timeout(300)
def test_a_streaming_worker_sigkilled_mid_generation_is_continued_from_its_last_segment(
    one_kind, client, redis_url, run_name, make_run, issuer, tmp_path
):
    from streamgrp.config import AssemblerConfig
    from streamgrp.replay.verifier import verify
    from streamgrp.services.assembler import Assembler

    binary, model = binary_and_model()
    server = start_llama(binary, model, tmp_path / "llama.log", extra=["--metrics"])
    started = time.monotonic()
    first = second = None
    try:
        run = make_run(n_samples=1, group_timeout_s=3600.0)
        issuer(run).issue([{"text": PROMPT}])
        common = [
            "--redis-url",
            redis_url,
            "--run",
            run_name,
            "--rollout",
            "llamacpp",
            "--server-url",
            server.url,
            "--max-tokens",
            str(KILL_MAX_TOKENS),
            "--segment-tokens",
            str(SEGMENT),
            "--top-k",
            "1",
        ]
        first = RoleProcess("worker", [*common, "--claim-idle-s", "30"], tmp_path / "first")
        second = RoleProcess("worker", [*common, "--claim-idle-s", str(CLAIM_IDLE_S), "--burst"], tmp_path / "second")
        for process in (first, second):
            process.log_dir.mkdir()
        first.start()
        wait_until(
            lambda: client.xlen(run.keys.segments) >= 2,
            timeout=120,
            interval=0.005,
            message=f"two segments\n{first.output()}",
        )
        first.kill()
        # llama-server cancels the stream once it finds the connection gone, and counts its tokens then
        wait_until(lambda: _metric(server.url, "requests_processing") == 0, timeout=60, message="the stream ended")
        killed_at = _predicted(server.url)
        [task_id] = {codec.decode(f).task_id for _, f in client.xrange(run.keys.tasks)}
        durable = sum(s.tokens for s in chain_of(task_segments(client, run.keys.segments, task_id)[0]))
        assert 0 < durable < KILL_MAX_TOKENS, "the kill came after the generation ended"
        from streamgrp.store.keys import WORKERS_GROUP

        wait_until(
            lambda: (
                client.xpending_range(run.keys.tasks, WORKERS_GROUP, "-", "+", 1)[0]["time_since_delivered"]
                > CLAIM_IDLE_S * 1000 + 100
            ),
            timeout=30,
            message="the task idle",
        )
        assert second.start().proc.wait(timeout=120) == 0, second.output()
        payloads = [codec.decode(f) for _, f in payload_entries(client, run.keys)]
        assert len(payloads) == 1, [
            (
                p.producer,
                p.seq,
                p.slot,
                p.sample.meta.get("resumed_tokens"),
                p.sample.meta.get("segments"),
                p.sample.meta.get("streams"),
            )
            for p in payloads
        ]
        sample = payloads[0].sample
        assert sample.meta["resumed_tokens"] == durable and "unstreamed" not in sample.meta
        generated = len(sample.token_ids.to_list()) - sample.meta["prompt_tokens"]
        # the reclaiming worker had the server generate exactly what no segment held: nothing durable twice
        assert _predicted(server.url) - killed_at == generated - durable
        chain = chain_of(task_segments(client, run.keys.segments, task_id)[0])
        assert check_sample(sample, chain) is None and sum(s.tokens for s in chain) == generated
        Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
        report = verify(client, run.keys)
        assert report.ok and report.segments_checked == 1, report.differences
        print({"durable_at_kill": durable, "generated": generated, "seconds": round(time.monotonic() - started, 1)})
    finally:
        for process in (first, second):
            if process is not None and process.proc is not None and process.proc.poll() is None:
                process.kill()
        stop_llama(server)

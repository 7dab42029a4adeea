"""A streamed generation on a real llama-server (SmolLM2-135M) interrupted by `weight-sync`, which restarts
llama-server on a new version: the worker keeps what streamed before the restart as segments of version 0,
waits the restart through and streams the rest from prompt + those tokens on version 1. The sample's
per-token versions show both; the restarted server generated exactly the tokens after the interruption
(its own ``tokens_predicted_total``), so none before it was generated twice. Marker ``llama``.

Greedy decoding (top-k 1) keeps the reply the same English text on every run, so no character is split
over byte tokens (which a stream cannot carry: they are asked for unstreamed, and the count would differ)."""

from __future__ import annotations

import re
import threading
import time

import pytest
from llama import binary_and_model, server_command

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
PROMPT = "<|im_start|>user\nWrite a short story about a dog.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def one_kind(redis_server) -> None:
    """The bundled server only: the streams are the same on both kinds (tested without llama elsewhere), and
    llama-server on two shared cores is the cost. Requested first, so the other kind skips before starting it."""
    if redis_server.kind != "valkey":
        pytest.skip("one server kind is enough for the llama-server run")


def _predicted(url: str) -> int:
    """llama-server's count of the tokens it generated (``--metrics``, Prometheus text)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return int(float(re.search(r"^llamacpp:tokens_predicted_total (\S+)$", text, re.M).group(1)))


@pytest.mark.timeout(300)
def test_a_stream_interrupted_by_weight_sync_resumes_from_its_prefix_on_the_new_version(one_kind, client, make_run,
                                                                                       issuer, tmp_path):
    binary, model = binary_and_model()
    run = make_run(n_samples=1)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    for version in (0, 1):
        version_dir(tmp_path, version).mkdir(parents=True)
        (version_dir(tmp_path, version) / "model.gguf").symlink_to(model)
    llama = LlamaServerProcess(" ".join([*server_command(binary, port), "--metrics"]), url, alias="smollm2",
                               log_path=tmp_path / "llama.log")
    sync = WeightSync(client, run.keys, make_dialect("llamacpp", InferenceConfig()), [url], tmp_path, llama=llama)
    started = time.monotonic()
    try:
        assert sync.sync(0) == 1
        issuer(run).issue([{"text": PROMPT}])
        config = InferenceConfig(server_url=url, max_tokens=MAX_TOKENS, segment_tokens=SEGMENT, top_k=1,
                                 max_attempts=2, backoff_s=0.05)
        worker = WorkerProcess(WorkerClient(client, run.keys), build_rollout("llamacpp", config),
                               WorkerConfig(burst=True, concurrency=1), n_samples=1)
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
        [payload] = [codec.decode(f) for _, f in client.xrange(run.keys.payloads)]
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
        assert ("abort" in {c for v, c in causes if v == 0} and causes[-1][1] in ("length", "stop")
                and {v for v, _ in causes} == {0, 1}), causes
        print({"before": before, "after": after, "segments": causes, "seconds": round(time.monotonic() - started, 1)})
    finally:
        llama.stop()

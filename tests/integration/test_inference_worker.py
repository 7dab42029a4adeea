"""The inference adapters inside a real worker on a real server, and `weight-sync` recording who serves
which version: a fake vLLM/SGLang HTTP server (their documented shapes) stands in for the GPUs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from inference_fakes import Action, next_tokens, start
from stored_payloads import payload_entries

from streamgrp.config import InferenceConfig, WorkerConfig
from streamgrp.core import codec
from streamgrp.core.events import SamplePayload, SlotResult, WeightsServed
from streamgrp.services.inference import build_rollout, make_dialect
from streamgrp.services.inference.weight_sync import WeightSync, version_dir
from streamgrp.services.worker import WorkerClient, WorkerProcess


@pytest.fixture
def fake_sglang():
    server, stop = start("sglang")
    yield server
    stop()


def _events(client, stream, kind):
    return [e for e in (codec.decode(f) for _, f in client.xrange(stream)) if isinstance(e, kind)]


def test_a_worker_with_the_sglang_adapter_publishes_samples_and_failures(client, make_run, issuer, fake_sglang):
    run = make_run(n_samples=2)
    fake_sglang.then(
        Action(version=2),
        Action(version=2),
        Action("status", status=400, body={"error": {"message": "input too long"}}),
    )
    fake_sglang.default = Action(version=2)
    issuer(run).issue([{"prompt_ids": [5, 6], "answer": "x"}, {"prompt_ids": [7]}])
    config = InferenceConfig(server_url=fake_sglang.url, max_tokens=3, max_attempts=2, backoff_s=0.01)
    worker = WorkerClient(client, run.keys)
    done = WorkerProcess(
        worker, build_rollout("sglang", config), WorkerConfig(burst=True, concurrency=1), n_samples=2
    ).run()
    assert done == 2
    results = _events(client, run.keys.slots, SlotResult)
    assert sorted(r.outcome for r in results) == ["failed", "sample", "sample", "sample"]
    [failed] = [r for r in results if r.outcome == "failed"]
    assert "HTTP 400: input too long" in failed.error
    payloads = [
        e for e in (codec.decode(f) for _, f in payload_entries(client, run.keys)) if isinstance(e, SamplePayload)
    ]
    assert {p.sample.version for p in payloads} == {2}  # SGLang's weight_version, not the run's 0
    assert sorted(p.sample.token_ids.to_list() for p in payloads)[0] == [5, 6, *next_tokens([5, 6], 3)]


def test_weight_sync_loads_each_new_version_on_every_server_and_records_it(client, make_run, tmp_path):
    run = make_run(n_samples=2)
    servers = [start("sglang"), start("sglang")]
    try:
        urls = [fake.url for fake, _ in servers]
        for fake, _ in servers:
            fake.default = Action("raw", raw=b'{"success": true, "message": "Succeeded to update model weights."}')
        servers[1][0].then(Action("raw", raw=b'{"success": false, "message": "shape mismatch in lm_head"}'))
        version_dir(tmp_path, 1).mkdir(parents=True)
        version_dir(tmp_path, 2).mkdir(parents=True)
        sync = WeightSync(client, run.keys, make_dialect("sglang", InferenceConfig()), urls, tmp_path)
        client.set(run.keys.version, 1)
        client.hset(run.keys.batcher_state, "finished", "0-1")  # burst serves until the run ends: at once here
        assert sync.run(threading.Event(), burst=True) == 1  # the second server refused
        client.set(run.keys.version, 2)
        assert sync.sync(2) == 2
        assert sync.sync(2) == 0  # nothing new: nothing sent
        client.set(run.keys.version, 3)  # no v000003 yet: stays at 2, says so once
        assert sync.sync(3) == 0
        served = _events(client, run.keys.control, WeightsServed)
        assert [(e.server, e.version, e.ok) for e in served] == [
            (urls[0], 1, True),
            (urls[1], 1, False),
            (urls[0], 2, True),
            (urls[1], 2, True),
        ]
        assert "shape mismatch in lm_head" in served[1].detail and served[0].dialect == "sglang"
        bodies = [body for path, body in servers[0][0].requests if path == "/update_weights_from_disk"]
        assert bodies[-1] == {
            "model_path": str(version_dir(tmp_path, 2)),
            "weight_version": "2",
            "abort_all_requests": True,
        }
    finally:
        for _, stop in servers:
            stop()


def test_vllm_weight_loading_pauses_reloads_and_always_resumes(tmp_path):
    fake, stop = start("vllm")
    try:
        fake.default = Action("raw", raw=b'{"status": "ok"}')
        fake.then(Action("raw", raw=b'{"status": "paused"}'), Action("status", status=500))
        dialect = make_dialect("vllm", InferenceConfig())
        with pytest.raises(Exception, match="HTTP 500"):
            dialect.load_weights(fake.url, "/w/v000001", 1, timeout_s=5)
        assert [path for path, _ in fake.requests] == ["/pause?mode=abort", "/collective_rpc", "/resume"]
        dialect.load_weights(fake.url, "/w/v000001", 1, timeout_s=5)
        assert [path for path, _ in fake.requests][3:] == [
            "/pause?mode=abort",
            "/collective_rpc",
            "/update_weight_version",
            "/resume",
        ]
        assert fake.requests[4][1] == {"method": "reload_weights", "kwargs": {"weights_path": "/w/v000001"}}
    finally:
        stop()


@pytest.mark.one_server_kind  # the command's wiring
def test_the_weight_sync_command_in_burst_mode_loads_the_version_and_serves_until_the_run_ends(
    client, make_run, redis_url, tmp_path
):
    import subprocess
    import sys
    import time

    run = make_run(n_samples=2)
    fake, stop = start("sglang")
    try:
        fake.default = Action("raw", raw=b'{"success": true, "message": "ok"}')
        version_dir(tmp_path, 3).mkdir(parents=True)
        client.set(run.keys.version, 3)
        base = [
            sys.executable,
            "-m",
            "streamgrp",
            "weight-sync",
            "--redis-url",
            redis_url,
            "--run",
            run.name,
            "--weights-dir",
            str(tmp_path),
            "--server-url",
            fake.url,
        ]
        sync = subprocess.Popen(
            [*base, "--dialect", "sglang", "--burst"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + 60
            while not _events(client, run.keys.control, WeightsServed) and time.monotonic() < deadline:
                time.sleep(0.1)
            [event] = _events(client, run.keys.control, WeightsServed)
            assert (event.server, event.version, event.ok) == (fake.url, 3, True)
            time.sleep(1.0)
            assert sync.poll() is None, "burst exited before its run ended"
            client.hset(run.keys.batcher_state, "finished", "0-1")  # the run ends
            assert sync.wait(30) == 0, sync.stderr.read()
        finally:
            if sync.poll() is None:
                sync.kill()
                sync.wait()
            sync.stdout.close()
            sync.stderr.close()
        refused = subprocess.run(
            [*base, "--dialect", "llamacpp", "--burst"], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode != 0 and "--llama-server-cmd" in refused.stderr
    finally:
        stop()


def test_weight_sync_shows_why_llama_server_did_not_start_and_exits_non_zero(client, make_run, redis_url, tmp_path):
    import shlex
    import subprocess
    import sys

    from streamgrp.cli.children import free_port

    run = make_run(n_samples=2)
    version_dir(tmp_path, 0).mkdir(parents=True)
    (version_dir(tmp_path, 0) / "model.gguf").write_bytes(b"GGUF")
    # A "llama-server" that prints its complaint and exits, as a bad flag makes the real one do.
    fake_server = f"{sys.executable} -c " + shlex.quote(
        "import sys; print('error: invalid argument: --bogus'); sys.exit(1)"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamgrp",
            "weight-sync",
            "--redis-url",
            redis_url,
            "--run",
            run.name,
            "--weights-dir",
            str(tmp_path),
            "--dialect",
            "llamacpp",
            "--llama-server-cmd",
            fake_server,
            "--server-url",
            f"http://127.0.0.1:{free_port('127.0.0.1')}",
            "--burst",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "exited with code 1" in done.stderr and "error: invalid argument: --bogus" in done.stderr
    [event] = _events(client, run.keys.control, WeightsServed)
    assert (event.version, event.ok) == (0, False) and "--bogus" in event.detail


#: A "llama-server" that serves /health on the --port it is given, notes its pid, and runs until killed.
_HEALTHY_SERVER = """
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
open(os.environ["FAKE_PID_FILE"], "w").write(str(os.getpid()))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.mark.one_server_kind
def test_the_llama_server_of_a_sigkilled_weight_sync_dies_with_it(client, make_run, redis_url, tmp_path):
    """weight-sync owns the llama-server it starts: killed by SIGKILL (no chance to stop it), its server goes
    too, rather than serving an old version and holding its port for whoever starts next."""
    import os
    import shlex
    import signal
    import subprocess
    import sys

    from processes import wait_until

    from streamgrp.cli.children import free_port

    run = make_run(n_samples=2)
    version_dir(tmp_path, 0).mkdir(parents=True)
    (version_dir(tmp_path, 0) / "model.gguf").write_bytes(b"GGUF")
    pid_file = tmp_path / "server.pid"
    port = free_port("127.0.0.1")
    command = f"{sys.executable} -c {shlex.quote(_HEALTHY_SERVER)} --port {port}"
    sync = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamgrp",
            "weight-sync",
            "--redis-url",
            redis_url,
            "--run",
            run.name,
            "--weights-dir",
            str(tmp_path),
            "--dialect",
            "llamacpp",
            "--llama-server-cmd",
            command,
            "--server-url",
            f"http://127.0.0.1:{port}",
        ],
        env={**os.environ, "FAKE_PID_FILE": str(pid_file)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _events(client, run.keys.control, WeightsServed), timeout=60, message="version 0 served")
        [event] = _events(client, run.keys.control, WeightsServed)
        assert event.ok, event.detail
        server = int(pid_file.read_text())
        os.kill(server, 0)  # alive
        sync.send_signal(signal.SIGKILL)
        sync.wait()

        def gone() -> bool:
            try:
                os.kill(server, 0)
            except ProcessLookupError:
                return True
            # a zombie until its new parent (init) reaps it: as dead as it gets
            return "Z" in Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[0]

        wait_until(gone, timeout=10, message="the llama-server to end with its weight-sync")
    finally:
        if sync.poll() is None:
            sync.kill()
            sync.wait()
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass

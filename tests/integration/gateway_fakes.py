"""A llama-server stand-in for the gateway's tests: chat template, tokenizer and generation, all predictable.

- ``/apply-template``: ChatML (``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, then the assistant's
  generation prompt); with ``tools``, a system line naming them first (so a test sees them passed through).
- ``/tokenize``: ``<|im_start|>`` is 1 and ``<|im_end|>`` 2 when special tokens are parsed, every other
  character its code point + 16; ``add_special`` puts a BOS (3) first. ``/detokenize`` inverts it.
- ``/completion`` (token ids in): the next scripted reply (`FakeLlama.script`), else ``ok<n>`` where n is
  the prompt's length mod 7, as one token per character and then end-of-generation (2), each with the
  log-probability ``-(id % 7 + 1) / 8``; ``n_predict`` cuts it (``limit``). ``delay_s`` holds the answer.
  With ``stream``, the same as llama-server's event stream (an event per token, ``token_gap_s`` apart; the
  last held until ``hold_last`` is set, when it is given);
  ``GET /v1/models`` names the model (``fake@v<version>``).

Every generation is recorded (`generations`: the prompt ids and the ids answered), so a test can check
that what the gateway recorded is what the server generated. `Running` serves a `Gateway` from a thread
of the test's process; `start_proxy` records what a real llama-server generates on its way to a gateway.
"""

from __future__ import annotations

import asyncio
import queue
import re
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx2
import orjson

from streamgrp.config import InferenceConfig
from streamgrp.core import codec
from streamgrp.services.gateway.gateway import Gateway
from streamgrp.services.gateway.server import GatewayServer, serve
from streamgrp.services.gateway.templates import make_template
from streamgrp.services.gateway.upstream import Upstream
from streamgrp.store import payloads
from streamgrp.store.streams import entry_id_str

#: The control token of the gateways `Running` starts.
TOKEN = "control-token"

IM_START, IM_END, BOS = 1, 2, 3
SPECIAL = {"<|im_start|>": IM_START, "<|im_end|>": IM_END}
NAMES = {IM_START: "<|im_start|>", IM_END: "<|im_end|>", BOS: "<s>"}
_SPLIT = re.compile(r"(<\|im_start\|>|<\|im_end\|>)")


def tokenize(text: str, *, special: bool = True, bos: bool = False) -> list[int]:
    ids = [BOS] if bos else []
    for part in _SPLIT.split(text) if special else [text]:
        if special and part in SPECIAL:
            ids.append(SPECIAL[part])
        else:
            ids += [ord(c) + 16 for c in part]
    return ids


def detokenize(ids: list[int]) -> str:
    return "".join(NAMES.get(t) or chr(t - 16) for t in ids)


def logprob(token: int) -> float:
    return -((token % 7) + 1) / 8.0


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    text = ""
    if tools:
        text += "<|im_start|>system\ntools: " + ",".join(t["function"]["name"] for t in tools) + "<|im_end|>\n"
    for message in messages:
        text += f"<|im_start|>{message['role']}\n{message.get('content') or ''}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


class FakeLlama:
    def __init__(self) -> None:
        self.script: deque[str] = deque()
        self.delay_s = 0.0
        self.token_gap_s = 0.0
        self.hold_last: threading.Event | None = None
        self.version = 0
        self.generations: list[dict[str, Any]] = []
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.url = ""

    def reply(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        with self.lock:
            self.requests.append((path, body))
        if path == "/apply-template":
            return 200, {"prompt": render(body["messages"], body.get("tools"))}
        if path == "/tokenize":
            return 200, {
                "tokens": tokenize(
                    body["content"], special=body.get("parse_special", False), bos=body.get("add_special", False)
                )
            }
        if path == "/detokenize":
            return 200, {"content": detokenize(body["tokens"])}
        if path == "/completion":
            ids, stop = self.generate(body)
            content = detokenize([t for t in ids if t != IM_END])
            return 200, {
                "content": content,
                "tokens": ids,
                "stop_type": stop,
                "model": f"fake@v{self.version}",
                "completion_probabilities": [{"id": t, "logprob": logprob(t)} for t in ids],
            }
        return 404, {"error": {"message": f"no {path}"}}

    def generate(self, body: dict[str, Any]) -> tuple[list[int], str]:
        """(the ids answered, llama-server's stop_type) for a /completion request, recorded."""
        if self.delay_s:
            time.sleep(self.delay_s)
        prompt = body["prompt"]
        with self.lock:
            text = self.script.popleft() if self.script else f"ok{len(prompt) % 7}"
        ids = [*tokenize(text, special=False), IM_END]
        limit = body.get("n_predict", len(ids))
        stop = "eos" if len(ids) <= limit else "limit"
        ids = ids[:limit]
        with self.lock:
            self.generations.append({"prompt": list(prompt), "tokens": list(ids)})
        return ids, stop

    def events(self, body: dict[str, Any]) -> list[bytes]:
        """llama-server's stream for a /completion request: an event per token (its piece, its id, its entry),
        then the last (``stop``, the stop type, the model). ``token_gap_s`` passes between tokens."""
        ids, stop = self.generate(body)
        events = [
            {
                "index": 0,
                "content": detokenize([t]) if t != IM_END else "",
                "tokens": [t],
                "stop": False,
                "id_slot": -1,
                "tokens_predicted": n + 1,
                "tokens_evaluated": len(body["prompt"]),
                "completion_probabilities": [
                    {"id": t, "token": detokenize([t]), "bytes": [], "logprob": logprob(t), "top_logprobs": []}
                ],
            }
            for n, t in enumerate(ids)
        ]
        events.append(
            {
                "index": 0,
                "content": "",
                "tokens": [],
                "stop": True,
                "stop_type": stop,
                "model": f"fake@v{self.version}",
                "tokens_predicted": len(ids),
            }
        )
        return [b"data: " + orjson.dumps(event) + b"\n\n" for event in events]


def start() -> tuple[FakeLlama, ThreadingHTTPServer]:
    fake = FakeLlama()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, value: Any) -> None:
            raw = orjson.dumps(value)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": f"fake@v{fake.version}", "object": "model"}]})
                return
            self._send(200, {"status": "ok"})

        def do_POST(self) -> None:
            body = orjson.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            if self.path == "/completion" and body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                events = fake.events(body)
                for index, event in enumerate(events):
                    if index == len(events) - 1 and fake.hold_last is not None:
                        fake.hold_last.wait(30)  # a test reads the tokens before the generation ends
                    self.wfile.write(event)
                    self.wfile.flush()
                    time.sleep(fake.token_gap_s)
                self.close_connection = True
                return
            self._send(*fake.reply(self.path, body))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    return fake, server


class Recorder:
    """What a `start_proxy` saw: every ``/completion`` request and its reply, in order."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.completions: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.url = ""


def start_proxy(target: str) -> tuple[Recorder, ThreadingHTTPServer]:
    """A pass-through HTTP proxy to ``target`` that records the generations it carries, so a test can compare
    what a real server generated with what the gateway recorded."""
    import urllib.error
    import urllib.request

    recorder = Recorder(target)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _forward(self, method: str) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0"))) if method == "POST" else None
            request = urllib.request.Request(
                target + self.path, data=raw, method=method, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=300) as response:
                    status, body = response.status, response.read()
            except urllib.error.HTTPError as exc:
                status, body = exc.code, exc.read()
            if self.path == "/completion" and status == 200:
                with recorder.lock:
                    recorder.completions.append((orjson.loads(raw), orjson.loads(body)))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._forward("GET")

        def do_POST(self) -> None:
            self._forward("POST")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    recorder.url = f"http://127.0.0.1:{server.server_address[1]}"
    return recorder, server


class Running:
    """A `Gateway` served on a free port by a thread of this process, over the fake llama-server."""

    def __init__(self, client, run, fake, *, max_tokens: int = 256, metrics=None) -> None:  # fake: has .url
        upstream = Upstream.from_config(
            "llamacpp", InferenceConfig(server_url=fake.url, max_tokens=max_tokens, max_attempts=2, backoff_s=0.05)
        )
        self.fake = fake
        self.run = run
        self.client = client
        self.gateway = Gateway(
            client, run, upstream, make_template(upstream, None), public_url="http://unset", threads=8, metrics=metrics
        )
        self.stop = threading.Event()
        ports: queue.Queue[int] = queue.Queue()
        self.thread = threading.Thread(
            target=lambda: asyncio.run(
                serve(
                    GatewayServer(self.gateway, token=TOKEN), "127.0.0.1", 0, self.stop, refresh_s=0.1, ready=ports.put
                )
            ),
            daemon=True,
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{ports.get(timeout=30)}"
        self.gateway.public_url = self.url

    def close(self) -> None:
        if self.stop.is_set():
            return
        self.stop.set()
        self.thread.join(timeout=30)
        self.gateway.close()

    def control(self, path: str, body: dict | None = None, token: str = TOKEN) -> httpx2.Response:
        return httpx2.post(self.url + path, json=body or {}, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def open(self, **body) -> dict:
        reply = self.control("/sessions", {"wait_s": 5, **body})
        assert reply.status_code == 200, reply.text
        return reply.json()

    def end(self, session_id: str, **body) -> dict:
        reply = self.control(f"/sessions/{session_id}/end", body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def events(self, kind) -> list:
        sessions = self.run.keys.sessions
        entries = [(entry_id_str(i), f) for i, f in self.client.xrange(sessions)]
        decoded = (codec.decode(fields) for _, fields in payloads.with_turns(self.client, sessions, entries))
        return [event for event in decoded if isinstance(event, kind)]

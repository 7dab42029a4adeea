"""A local HTTP server that answers like vLLM, SGLang or llama.cpp, for the adapters' contract tests.

Each reply has the documented shape of its server (vLLM's OpenAI completion with ``token_ids`` or
``"token_id:N"`` tokens; SGLang's ``/generate`` with ``meta_info.output_token_logprobs`` and
``weight_version``; llama-server's ``/completion`` with ``tokens`` and ``completion_probabilities``).
A test scripts what the next requests get: a normal completion, an abort with the tokens so far, an
HTTP error, a hang, an answer trickled byte by byte, a body that is not JSON, a dropped connection, a
flood with no length, a restart (the connection dropped, then 503 "Loading model" for a while, as
llama-server restarted by weight-sync answers). Every request is recorded. The generated tokens are a pure function
of the
prompt, so a test can predict them: token ``k`` of a completion of prompt ``p`` is
``(sum(p) + k) % 1000 + 1000``.

A request with ``stream: true`` is answered as each server streams (server-sent events over a chunked
body, one token per event as the servers send them while decoding): vLLM's ``text_completion`` chunks
holding only the new tokens, ``finish_reason`` on the last, then ``data: [DONE]``
(vllm/entrypoints/openai/completion/serving.py, ``completion_stream_generator``); SGLang's ``/generate``
outputs, cumulative by default or only the new tokens with ``FakeServer.incremental`` (the server's
``--incremental-streaming-output``), then ``data: [DONE]`` (python/sglang/srt/managers/tokenizer_manager.py
and entrypoints/http_server.py); llama-server's partial results, one per token that completes a character
with ``tokens: [id]``, its probability entry and ``tokens_predicted``, then the final result with
``stop: true`` and ``tokens: []``, no ``[DONE]`` (tools/server ``send_partial_response`` /
``send_final_response``, checked against llama-server's own output). ``Action.cut_after`` breaks a
stream after that many tokens (the connection dropped, then 503 for ``seconds``: a restart).

The llama.cpp fake also follows llama-server's rule for multi-byte characters (``Action(text=...)``):
each generated token is one byte of ``text``, and a token gets a ``completion_probabilities`` entry
only when the bytes so far end in a whole UTF-8 character (``process_token`` in tools/server). It
answers the scoring requests the adapter sends for the others the same way: the forced token's entry
(if its byte leaves no character cut) with the top log-probs of every token it has generated.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson


def next_tokens(prompt: list[int], count: int) -> list[int]:
    return [(sum(prompt) + k) % 1000 + 1000 for k in range(count)]


def logprob_of(token: int) -> float:
    return -((token % 7) + 1) / 8.0


def text_of(tokens: list[int]) -> str:
    return "".join(f"<{t}>" for t in tokens)


@dataclass
class Action:
    """What the fake does with one request."""

    kind: str = "complete"  # complete | abort | status | raw | hang | trickle | close | flood (raw, no length)
    #                         | restart (close, then 503 while loading for ``seconds``)
    tokens: int | None = None  # complete/abort: how many tokens (default: the request's maximum)
    status: int = 200
    body: Any = None
    raw: bytes = b""
    seconds: float = 0.0
    version: str | int | None = None  # the weight version / model alias version the reply reports
    finish: str | None = None  # complete: "stop" instead of the length finish
    over: int = 0  # complete: this many tokens beyond the request's maximum
    logprob: float | None = None  # complete: the first token's log-probability instead of logprob_of
    delay: float = 0.0  # complete: seconds spent generating before the tokens exist (a slow server)
    text: str | None = None  # llamacpp complete: generate these UTF-8 bytes, one token each (see the docstring)
    model: str | None = None  # llamacpp: the alias a reply names (scoring replies too)
    token_delay: float = 0.0  # streamed: seconds between tokens
    cut_after: int | None = None  # streamed: drop the connection after this many tokens (a restart: ``seconds``)
    error_after: int | None = None  # streamed: an error event after this many tokens
    model_after: str | None = None  # llamacpp: the alias /v1/models names once the restart of ``cut_after`` is over


def validate_utf8(text: bytes) -> int:
    """llama-server's validate_utf8: the length of ``text`` without a character cut off at its end."""
    for back in range(1, min(4, len(text)) + 1):
        byte = text[-back]
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 0
        if back < need:
            return len(text) - back
    return len(text)


def byte_tokens(text: str) -> list[int]:
    """The ids the llama.cpp fake gives the bytes of ``text``: 2000 + the byte (distinct from next_tokens)."""
    return [2000 + byte for byte in text.encode()]


def _logprobs(tokens: list[int], action: Action) -> list[float]:
    values = [logprob_of(t) for t in tokens]
    if values and action.logprob is not None:
        values[0] = action.logprob
    return values


def _vllm(request: dict, prompt: list[int], tokens: list[int], finish: str, action: Action, dialect: str) -> dict:
    logprobs = {
        "text_offset": list(range(len(tokens))),
        "token_logprobs": _logprobs(tokens, action),
        "tokens": [f"<{t}>" for t in tokens],
        "top_logprobs": None,
    }
    choice: dict[str, Any] = {
        "index": 0,
        "text": text_of(tokens),
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": None,
    }
    if dialect == "vllm-old":
        logprobs["tokens"] = [f"token_id:{t}" for t in tokens]
    else:
        choice.update(token_ids=tokens, prompt_token_ids=prompt)
    model = request.get("model", "policy") + (f"@v{action.version}" if action.version is not None else "")
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt) + len(tokens),
        },
    }


def _sglang(request: dict, prompt: list[int], tokens: list[int], finish: str, action: Action, dialect: str) -> dict:
    reason: dict[str, Any] = {"type": finish}
    if finish == "length":
        reason["length"] = len(tokens)
    elif finish == "abort":
        reason["message"] = "Abort before weight update"
    else:
        reason["matched"] = 2
    meta = {
        "id": "abc",
        "finish_reason": reason,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(tokens),
        "cached_tokens": 0,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(_logprobs(tokens, action), tokens)],
        "e2e_latency": 0.01,
        "weight_version": "default" if action.version is None else str(action.version),
    }
    return {"text": text_of(tokens), "output_ids": tokens, "meta_info": meta}


def piece_of(token: int) -> bytes:
    return bytes([token - 2000]) if 2000 <= token < 2256 else f"<{token}>".encode()


def _entry(token: int, logprob: float, top: list[dict]) -> dict:
    piece = piece_of(token)
    return {
        "id": token,
        "token": piece[: validate_utf8(piece)].decode(errors="replace"),
        "bytes": list(piece),
        "logprob": logprob,
        "top_logprobs": top,
    }


def _llamacpp(request: dict, prompt: list[int], tokens: list[int], finish: str, action: Action, dialect: str) -> dict:
    text, probs = b"", []
    for index, token in enumerate(tokens):
        text += piece_of(token)
        if validate_utf8(text) == len(text):  # llama-server keeps the entry only then
            logprob = action.logprob if index == 0 and action.logprob is not None else logprob_of(token)
            probs.append(_entry(token, logprob, [{"id": token, "logprob": logprob}]))
    alias = action.model or "smollm2" + (f"@v{action.version}" if action.version is not None else "")
    body = {
        "index": 0,
        "content": text.decode(errors="replace"),
        "tokens": tokens,
        "id_slot": 0,
        "stop": True,
        "model": alias,
        "tokens_predicted": len(tokens),
        "tokens_evaluated": len(prompt),
        "generation_settings": {"n_probs": request.get("n_probs", 0)},
        "prompt": "",
        "has_new_line": False,
        "truncated": False,
        "stop_type": {"length": "limit", "stop": "eos"}[finish],
        "stopping_word": "",
        "tokens_cached": 0,
        "timings": {},
    }
    if probs:  # llama-server leaves the field out when it kept no entry
        body["completion_probabilities"] = probs
    return body


def _sse(body: dict) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _stream_vllm(
    request: dict, prompt: list[int], tokens: list[int], finish: str, action: Action, dialect: str, fake: FakeServer
) -> list[tuple[list[int], bytes]]:
    """(tokens generated for it, the event) per event."""
    events = []
    for index, (token, logprob) in enumerate(zip(tokens, _logprobs(tokens, action))):
        body = _vllm(
            request,
            prompt,
            [token],
            finish if index == len(tokens) - 1 and finish != "abort" else None,
            action,
            dialect,
        )
        body["choices"][0]["logprobs"]["token_logprobs"] = [logprob]
        body["choices"][0]["logprobs"]["text_offset"] = [index]
        if index:
            body["choices"][0].pop("prompt_token_ids", None)
        body.pop("usage")
        events.append(([token], _sse(body)))
    if finish == "abort" or not tokens:  # the abort (or an empty generation) ends in a chunk of its own
        body = _vllm(request, prompt, [], finish, action, dialect)
        body.pop("usage")
        events.append(([], _sse(body)))
    return [*events, ([], b"data: [DONE]\n\n")]


def _stream_sglang(
    request: dict, prompt: list[int], tokens: list[int], finish: str, action: Action, dialect: str, fake: FakeServer
) -> list[tuple[list[int], bytes]]:
    events = []
    values = _logprobs(tokens, action)
    for index, token in enumerate(tokens):
        last = index == len(tokens) - 1
        body = _sglang(request, prompt, tokens[: index + 1], finish, action, dialect)
        body["meta_info"]["output_token_logprobs"][0][0] = values[0]
        if not last:
            body["meta_info"]["finish_reason"] = None
        if fake.incremental:
            body["text"], body["output_ids"] = text_of([token]), [token]
            body["meta_info"]["output_token_logprobs"] = body["meta_info"]["output_token_logprobs"][index:]
        elif not last:
            body["text"] = None  # newer SGLang defers the cumulative text to the last event
        events.append(([token], _sse(body)))
    if not tokens:
        events.append(([], _sse(_sglang(request, prompt, [], finish, action, dialect))))
    return [*events, ([], b"data: [DONE]\n\n")]


def _stream_llamacpp(
    request: dict, prompt: list[int], tokens: list[int], finish: str, action: Action, dialect: str, fake: FakeServer
) -> list[tuple[list[int], bytes]]:
    events, text, held = [], b"", []
    for index, token in enumerate(tokens):
        text += piece_of(token)
        held.append(token)
        if validate_utf8(text) < len(text):
            continue  # llama-server sends nothing for a token that leaves a character cut
        logprob = action.logprob if index == 0 and action.logprob is not None else logprob_of(token)
        entry = _entry(token, logprob, [{"id": token, "logprob": logprob}])
        events.append(
            (
                held,
                _sse(
                    {
                        "index": 0,
                        "content": piece_of(token).decode(errors="replace"),
                        "tokens": [token],
                        "stop": False,
                        "id_slot": -1,
                        "tokens_predicted": index + 1,
                        "tokens_evaluated": len(prompt),
                        "completion_probabilities": [entry],
                    }
                ),
            )
        )
        held = []
    final = _llamacpp(request, prompt, tokens, finish, action, dialect)
    final.update(content="", tokens=[])
    final.pop("completion_probabilities", None)
    return [*events, (held, _sse(final))]


STREAMS: dict[str, Callable[..., list[tuple[list[int], bytes]]]] = {
    "vllm": _stream_vllm,
    "vllm-old": _stream_vllm,
    "sglang": _stream_sglang,
    "llamacpp": _stream_llamacpp,
}


def _llamacpp_score(request: dict, known: list[int], action: Action) -> dict:
    """A scoring request (n_predict 1, one token forced by logit_bias): every token the fake generated is a
    candidate, at its logprob_of; the forced token's entry lists the top n_probs of them."""
    [[forced, _]] = request["logit_bias"]
    top = sorted({*known, forced}, key=lambda t: (logprob_of(t), -t), reverse=True)[: request["n_probs"]]
    piece = piece_of(forced)
    body = {
        "content": "",
        "tokens": [forced],
        "stop": True,
        "stop_type": "limit",
        "model": action.model or "smollm2",
        "generation_settings": {"n_probs": request["n_probs"]},
    }
    if validate_utf8(piece) == len(piece):
        body["completion_probabilities"] = [
            _entry(forced, logprob_of(forced), [{"id": t, "logprob": logprob_of(t)} for t in top])
        ]
    return body


SHAPES: dict[str, Callable[..., dict]] = {"vllm": _vllm, "vllm-old": _vllm, "sglang": _sglang, "llamacpp": _llamacpp}
PROMPT_FIELD = {"vllm": "prompt", "vllm-old": "prompt", "sglang": "input_ids", "llamacpp": "prompt"}


def max_tokens_of(request: dict) -> int:
    return int(
        request.get("max_tokens")
        or request.get("n_predict")
        or request.get("sampling_params", {}).get("max_new_tokens")
        or 16
    )


class _QuietServer(ThreadingHTTPServer):
    """A threading HTTP server that says nothing when a client hangs up between requests (a worker that exits
    closes its kept-alive connections); any other error in a handler is printed as usual."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@dataclass
class FakeServer:
    """One fake inference server of ``dialect`` on 127.0.0.1; script replies with `then`."""

    dialect: str
    script: deque = field(default_factory=deque)
    requests: list[tuple[str, dict]] = field(default_factory=list)
    default: Action = field(default_factory=Action)
    url: str = ""
    generated: list[int] = field(default_factory=list)  # every token id the fake generated, in order
    loading_until: float = 0.0  # time.monotonic() until which it answers 503 "Loading model" (a restart)
    incremental: bool = False  # sglang streams: only the new tokens per event (--incremental-streaming-output)
    model: str = "smollm2"  # llamacpp: the alias GET /v1/models names

    def then(self, *actions: Action) -> FakeServer:
        self.script.extend(actions)
        return self

    def generations(self) -> list[dict]:
        return [
            body
            for path, body in self.requests
            if "tokenize" not in path and "health" not in path and "models" not in path and "logit_bias" not in body
        ]

    def scorings(self) -> list[dict]:
        return [body for _, body in self.requests if "logit_bias" in body]

    def reply(self, path: str, request: dict) -> tuple[Action, bytes]:
        self.requests.append((path, request))
        action = self.script.popleft() if self.script else self.default
        if action.kind not in ("complete", "abort", "trickle"):
            return action, action.raw  # raw, status, hang, close, flood
        if path.endswith("tokenize"):
            text = request.get("prompt") or request.get("content") or ""
            return action, orjson.dumps({"tokens": [ord(c) for c in text]})
        if "logit_bias" in request:
            return action, orjson.dumps(_llamacpp_score(request, self.generated, action))
        if action.delay:
            time.sleep(action.delay)
        prompt = request[PROMPT_FIELD[self.dialect]]
        budget = max_tokens_of(request)
        count = budget if action.tokens is None else min(action.tokens, budget)
        if action.text is not None:
            count = min(count, len(action.text.encode()))
        finish = "abort" if action.kind == "abort" else (action.finish or ("length" if count == budget else "stop"))
        tokens = (
            next_tokens(prompt, count + action.over)
            if action.text is None
            else byte_tokens(action.text)[: count + action.over]
        )
        if request.get("stream"):
            return action, STREAMS[self.dialect](request, prompt, tokens, finish, action, self.dialect, self)
        self.generated += tokens
        body = SHAPES[self.dialect](request, prompt, tokens, finish, action, self.dialect)
        return action, orjson.dumps(body)


def start(dialect: str) -> tuple[FakeServer, Callable[[], None]]:
    fake = FakeServer(dialect)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            if self.path == "/v1/models" and time.monotonic() >= fake.loading_until:
                fake.requests.append((self.path, {}))
                body = orjson.dumps({"object": "list", "data": [{"id": fake.model, "object": "model"}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if self.path == "/health":  # a live server is healthy whatever its script says next
                fake.requests.append((self.path, {}))
                loading = time.monotonic() < fake.loading_until
                body = b'{"error": {"message": "Loading model"}}' if loading else b'{"status": "ok"}'
                self.send_response(503 if loading else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self._answer({})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self._answer(orjson.loads(self.rfile.read(length) or b"{}"))

        def _answer(self, request: dict) -> None:
            if time.monotonic() < fake.loading_until:  # restarting, as llama-server answers while it loads
                fake.requests.append((self.path, request))
                action, payload = Action("status", status=503, body={"error": {"message": "Loading model"}}), b""
            else:
                action, payload = fake.reply(self.path, request)
            if isinstance(payload, list):
                self._stream(action, payload)
                return
            if action.kind == "restart":
                fake.loading_until = time.monotonic() + action.seconds
            if action.kind in ("close", "restart"):
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if action.kind == "hang":
                time.sleep(action.seconds)
                return
            if action.kind == "flood":  # no Content-Length: the body ends when the connection closes
                self.close_connection = True
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except OSError:  # the client stopped reading
                    pass
                return
            if action.kind == "status":
                payload = orjson.dumps(action.body if action.body is not None else {"error": {"message": "nope"}})
            status = action.status if action.kind in ("status", "raw") else 200
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            try:
                if action.kind == "trickle":
                    for byte in payload:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(action.seconds)
                    return
                self.wfile.write(payload)
            except OSError:  # the client stopped reading (a deadline, or a reply it refused as too large)
                self.close_connection = True

        def _stream(self, action: Action, events: list[tuple[list[int], bytes]]) -> None:
            """Server-sent events in a chunked body; each event's tokens count as generated when it is sent."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            sent = 0
            try:
                for tokens, event in events:
                    if action.cut_after is not None and sent + len(tokens) > action.cut_after:
                        fake.generated += tokens[: action.cut_after - sent]  # generated, never sent: a crash
                        if action.seconds:
                            fake.loading_until = time.monotonic() + action.seconds
                        fake.model = action.model_after or fake.model
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    if action.error_after is not None and sent >= action.error_after and tokens:
                        event = _sse(
                            {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}
                        )
                        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
                        return
                    if tokens and action.token_delay:
                        time.sleep(action.token_delay)
                    fake.generated += tokens
                    sent += len(tokens)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client closed the stream
                self.close_connection = True

    server = _QuietServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return fake, stop


def close_enough(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=1e-6) for x, y in zip(a, b))

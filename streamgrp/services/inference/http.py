"""JSON over HTTP for the inference adapters: one request, one deadline, one classified outcome.

Owns the wire (stdlib `http.client`, no new dependency) and sorting what went wrong into what the
caller should do about it:

- `TransportError` (retry with backoff): the server could not be reached, the connection broke, the
  deadline passed, a 5xx or 429 answer, or a 2xx body that is not JSON (a server that died mid-reply
  sends half a body);
- `ClientError` (never retried): any other 4xx answer, the request itself is wrong and sending it
  again cannot help; its message carries the server's own error text;
- `ReplyTooLarge` (never retried): the body is longer than the caller's ``max_bytes`` (what the request
  could justify); reading stops there, so a runaway server costs the worker no more than that.

The deadline bounds the whole exchange, connect to last byte: a server that accepts the connection
and then trickles its answer one byte at a time is cut off like a silent one. Nothing here retries.

`stream_events` is the streaming twin: the same request, deadline and byte bound, and the same errors
before the first event; a 2xx ``text/event-stream`` reply is yielded one server-sent event's JSON at a
time (``data:`` lines; comments, which servers send as keep-alive pings, skipped; ``[DONE]`` ends it).
A stream that breaks after some events raises `TransportError` where it broke, so the caller keeps
what it was given before.
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from streamgrp.errors import StreamgrpError

#: Bytes read per recv while a body streams in; the deadline is checked between reads.
READ_CHUNK = 64 * 1024
#: The most any reply may be, whatever the caller allows: no generation server answers with 256 MiB.
MAX_REPLY_BYTES = 256 * 1024 * 1024
ERROR_TEXT_CHARS = 500


class InferenceError(StreamgrpError):
    """A request to an inference server did not give a usable answer."""


class TransportError(InferenceError):
    """Worth retrying: unreachable, broken connection, timeout, 5xx/429, or a body that is not JSON.
    ``server_away``: the server refused or dropped the connection, or answered 503 (llama-server while it
    loads a model): what a server restarting looks like, unlike a timeout or another error status."""

    def __init__(self, message: str, *, server_away: bool = False) -> None:
        super().__init__(message)
        self.server_away = server_away


class ReplyTooLarge(InferenceError):
    """The body is longer than the request could justify; it was not read further and is not retried."""


class ClientError(InferenceError):
    """A 4xx answer (other than 429): the request is wrong, so it is not retried."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any


def request_json(
    method: str,
    url: str,
    body: Any = None,
    *,
    timeout_s: float,
    headers: dict[str, str] | None = None,
    max_bytes: int = MAX_REPLY_BYTES,
) -> Reply:
    """``method url`` with ``body`` as JSON; the decoded JSON reply of a 2xx answer.

    Raises `TransportError`, `ClientError` or `ReplyTooLarge` as the module docstring says; never waits
    longer than ``timeout_s`` in all, never reads more than ``max_bytes`` (at most `MAX_REPLY_BYTES`)."""
    deadline = time.monotonic() + timeout_s
    max_bytes = min(max_bytes, MAX_REPLY_BYTES)
    connection, path = _connection(url, timeout_s)
    payload = None if body is None else orjson.dumps(body)
    sent = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
    try:
        connection.request(method, path, body=payload, headers=sent)
        _set_timeout(connection, deadline)
        response = connection.getresponse()
        raw = _read_body(connection, response, deadline, f"{method} {url}", max_bytes)
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, bad status line
        raise TransportError(f"{method} {url}: {_describe(exc)}", server_away=_away(exc)) from None
    finally:
        connection.close()
    return _classify(method, url, response.status, raw)


class EventSplitter:
    """The JSON payload of each server-sent event in a byte stream, fed as its chunks arrive (the one parser of
    the workers' streams, `stream_events`, and the gateway's). `done` once the stream sent ``[DONE]``."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.done = False
        self._pending = b""

    def feed(self, chunk: bytes) -> Iterator[Any]:
        """The events ``chunk`` completes, each as it is parsed; `TransportError` at an event that is not JSON."""
        self._pending += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
        while not self.done and (end := self._pending.find(b"\n\n")) >= 0:  # a blank line ends an event
            block, self._pending = self._pending[:end], self._pending[end + 2 :]
            if block.startswith(b"data: ") and b"\n" not in block:  # the usual event: one data line
                payload = block[6:]
            else:  # several data lines are one payload; ":" comments (pings), event:, id: carry none
                payload = b"\n".join(
                    line[6:] if line[5:6] == b" " else line[5:]
                    for line in block.split(b"\n")
                    if line.startswith(b"data:")
                )
                if not payload:
                    continue
            if payload.strip() == b"[DONE]":
                self.done = True
                break
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError as exc:
                raise TransportError(f"{self.what}: an event that is not JSON ({exc}): {_text(payload)!r}") from None
            yield event

    def check_ended(self) -> None:
        """At the stream's end: `TransportError` when it ended inside an event."""
        if self._pending.strip():
            raise TransportError(f"{self.what}: the stream ended inside an event", server_away=True)


def stream_events(
    url: str, body: Any, *, timeout_s: float, max_bytes: int = MAX_REPLY_BYTES
) -> Generator[Any, None, None]:
    """``POST url`` with ``body`` as JSON, asking for a stream: each server-sent event's decoded JSON, in order.

    A reply that is not an event stream (an error status, or a server that answered with one JSON body) is
    classified as `request_json` does: the error raised, or the body yielded as the one event. Closing the
    generator closes the connection (the server then stops generating)."""
    deadline = time.monotonic() + timeout_s
    max_bytes = min(max_bytes, MAX_REPLY_BYTES)
    connection, path = _connection(url, timeout_s)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    what = f"POST {url} (streamed)"
    try:
        try:
            connection.request("POST", path, body=orjson.dumps(body), headers=headers)
            _set_timeout(connection, deadline)
            response = connection.getresponse()
            if not (200 <= response.status < 300 and "event-stream" in (response.getheader("Content-Type") or "")):
                raw = _read_body(connection, response, deadline, what, max_bytes)
                yield _classify("POST", url, response.status, raw).body
                return
        except (OSError, http.client.HTTPException) as exc:
            raise TransportError(f"{what}: {_describe(exc)}", server_away=_away(exc)) from None
        size, events = 0, EventSplitter(what)
        while True:
            try:
                _set_timeout(connection, deadline)
                chunk = response.read1(READ_CHUNK)
            except (OSError, http.client.HTTPException) as exc:  # a broken stream: a restart, a crash, the deadline
                raise TransportError(
                    f"{what}: broke after {size} bytes: {_describe(exc)}",
                    server_away=_away(exc) or isinstance(exc, http.client.IncompleteRead),
                ) from None
            size += len(chunk)
            if size > max_bytes:
                raise ReplyTooLarge(f"{what}: the stream is over the {max_bytes} bytes allowed; stopped reading it")
            if not chunk:
                events.check_ended()
                return
            yield from events.feed(chunk)
            if events.done:
                return
    finally:
        connection.close()


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ClientError(f"{url!r} is not an http:// or https:// URL; fix --server-url", 0)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return kind(parts.hostname, parts.port, timeout=max(0.001, timeout_s)), path


def _away(exc: BaseException) -> bool:
    return isinstance(exc, (ConnectionError, http.client.RemoteDisconnected))


def _set_timeout(connection: http.client.HTTPConnection, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    if connection.sock is not None:
        connection.sock.settimeout(left)


def _read_body(connection, response: http.client.HTTPResponse, deadline: float, what: str, max_bytes: int) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise ReplyTooLarge(f"{what}: the reply announces {int(declared)} bytes, over the {max_bytes} bytes allowed")
    chunks: list[bytes] = []
    size = 0
    while True:
        _set_timeout(connection, deadline)
        chunk = response.read1(READ_CHUNK) if hasattr(response, "read1") else response.read(READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise ReplyTooLarge(f"{what}: the reply is over the {max_bytes} bytes allowed; stopped reading it")
        chunks.append(chunk)


def _classify(method: str, url: str, status: int, raw: bytes) -> Reply:
    if 200 <= status < 300:
        try:
            return Reply(status, orjson.loads(raw))
        except orjson.JSONDecodeError as exc:
            raise TransportError(
                f"{method} {url}: HTTP {status} with a body that is not JSON ({exc}); body starts {_text(raw)!r}"
            ) from None
    text = _error_text(raw)
    if status == 429 or status >= 500:
        raise TransportError(f"{method} {url}: HTTP {status}: {text}", server_away=status == 503)
    raise ClientError(f"{method} {url}: HTTP {status}: {text}", status)


def _error_text(raw: bytes) -> str:
    """The server's own error message where its JSON has one (every dialect nests it differently)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _text(raw)
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(error, dict):
            error = error.get("message", error)
        return _text(str(error).encode())
    return _text(raw)


def _text(raw: bytes) -> str:
    return raw[:ERROR_TEXT_CHARS].decode("utf-8", "replace")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out (raise --request-timeout-s if generations are this slow)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

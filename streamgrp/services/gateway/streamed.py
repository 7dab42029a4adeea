"""A turn generated as a stream: the server's streaming reply read on the event loop, each event's tokens and
text handed on as they arrive (`OnDelta`: the gateway writes them to its client as OpenAI's chunks), and what
streamed kept for the turn's record.

Only the first request of a turn is streamed, and only the clean case is handled here: a stream that cannot
start (an error status, a refused connection, a server that is restarting) yields None and the turn is asked
for as a plain request, which `streamgrp.services.gateway.upstream.AsyncRequests` retries and waits through
restarts. A stream that breaks after some tokens (a weight sync's restart, an error event), or that loses
tokens it cannot carry (llama-server's split characters), keeps what it gave and ends as an ``abort``: the
rest is asked for unstreamed from the tokens so far (`finished_or_resubmit`'s rule, as for any abort), and
its text goes to the client when it is back. What the client was sent is exactly what is recorded: the text
of every part, in order.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import orjson

from streamgrp.services.inference.dialect import (
    Dialect,
    Finish,
    Generation,
    ProtocolError,
    Sampling,
    StreamError,
    checked_logprobs,
)
from streamgrp.services.inference.http import EventSplitter, InferenceError

if TYPE_CHECKING:
    from streamgrp.services.gateway.upstream import AsyncRequests

#: What receives each streamed part: its token ids, their log-probabilities, its text, the model serving.
OnDelta = Callable[[list[int], list[float], str, str], Awaitable[None]]


async def stream_turn(
    requests: AsyncRequests,
    dialect: Dialect,
    context: list[int],
    sampling: Sampling,
    *,
    max_bytes: int,
    on_delta: OnDelta,
) -> tuple[Generation, str, bool] | None:
    """(what streamed, the server, whether the stream was cut: it broke or lost tokens, rather than the server
    ending it) for ``context`` within ``sampling.max_tokens``; None when no stream started (the dialect cannot
    stream, or the server did not answer: ask for it plainly then, with retries)."""
    from aiohttp import ClientError

    request = dialect.stream_generate(context, sampling)
    if request is None:
        return None
    path, body = request
    with requests.pool.lease() as url:
        turn = _StreamedTurn(dialect, f"the {dialect.name} stream from {url}", sampling.max_tokens, on_delta)
        try:
            if dialect.model_path:  # llama-server's events name no model: read it first
                turn.model, turn.version = dialect.parse_model(await requests.get(url, dialect.model_path))
            await _read(requests, url + path, body, max_bytes, turn)
        except ProtocolError:
            if turn.ids:  # a malformed event after tokens were sent: the turn fails
                raise
            return None  # before any: asked for plainly, which says what is wrong if it still is
        except (InferenceError, StreamError, OSError, TimeoutError, ClientError) as exc:
            if not turn.ids:
                return None
            turn.end("abort", f"the stream broke: {type(exc).__name__}: {exc}", cut=True)
    if not turn.ids:
        return None
    if turn.finish is None:
        turn.end("abort", "the stream ended before its last event", cut=True)
    assert turn.finish is not None
    return (
        Generation(
            turn.ids,
            turn.logprobs,
            "".join(turn.text),
            turn.finish,
            reason=turn.reason,
            weight_version=turn.version,
            model=turn.model,
        ),
        url,
        turn.cut,
    )


async def _read(requests: AsyncRequests, url: str, body: dict, max_bytes: int, turn: _StreamedTurn) -> None:
    """POST ``body`` asking for a stream and fold its events into ``turn``; a reply that is one JSON body (a
    server that did not stream) is folded as one event; an error status raises for the plain request to retry."""
    async with requests.http().post(
        url, data=orjson.dumps(body), headers={"Content-Type": "application/json", "Accept": "text/event-stream"}
    ) as response:
        if not 200 <= response.status < 300:
            raise InferenceError(f"POST {url} (streamed): HTTP {response.status}")
        if "event-stream" not in response.headers.get("Content-Type", ""):
            await turn.take(orjson.loads(await response.content.read(max_bytes)))
            return
        events, size = EventSplitter(turn.where), 0
        async for chunk in response.content.iter_any():
            size += len(chunk)
            if size > max_bytes:
                raise ProtocolError(
                    f"{turn.where} is over the {max_bytes} bytes its request could need; the server "
                    "is not answering what was asked"
                )
            for event in events.feed(chunk):
                if await turn.take(event):
                    return
            if events.done:
                return


class _StreamedTurn:
    """What one stream has given so far; `take` folds an event in and hands its part on."""

    def __init__(self, dialect: Dialect, where: str, budget: int, on_delta: OnDelta) -> None:
        self.parser, self.where, self.budget, self.on_delta = dialect.stream_parser(), where, budget, on_delta
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text: list[str] = []
        self.model = ""
        self.version: int | None = None
        self.finish: Finish | None = None
        self.reason, self.cut = "", False

    def end(self, finish: Finish, reason: str, *, cut: bool = False) -> None:
        self.finish, self.reason, self.cut = finish, reason, cut

    async def take(self, event: object) -> bool:
        """Fold ``event`` in; True when it was the stream's last."""
        delta = self.parser.feed(event)
        self.model = delta.model or self.model
        if delta.weight_version is not None:
            self.version = delta.weight_version if self.version is None else min(self.version, delta.weight_version)
        if len(self.ids) + len(delta.token_ids) > self.budget:
            raise ProtocolError(
                f"{self.where} has {len(self.ids) + len(delta.token_ids)} tokens, more than the "
                f"{self.budget} the request allowed"
            )
        values = checked_logprobs(delta.logprobs, f"{self.where}, after {len(self.ids)} tokens")
        if delta.token_ids or delta.text:
            self.ids += delta.token_ids
            self.logprobs += values
            self.text.append(delta.text)
            await self.on_delta(delta.token_ids, values, delta.text, self.model)
        if delta.lost:  # what follows cannot be carried: the rest is asked for again, unstreamed
            self.end("abort", "the stream lost tokens it cannot carry", cut=True)
            return True
        if delta.finish is not None:
            self.end(delta.finish, delta.reason)
            return True
        return False

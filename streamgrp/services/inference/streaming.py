"""One streamed generation request, cut into durable segments as its tokens arrive.

`read_stream` sends a dialect's streaming request to one server and folds the events into a
`StreamedPart`: the tokens kept (each with its log-probability, checked), why the stream ended, and
whether it broke (a restart for a weight sync, a crash, an error event) or lost tokens it cannot carry
(llama-server's split characters). While it reads, `SegmentCutter` decides when the tokens so far
become a ``chunk`` segment: at ``segment_tokens`` tokens or ``segment_s`` seconds, whichever first.
A cut is made only when a later event has arrived, so the tokens of the last event are always still
pending at the end and the last segment of the stream is the one that carries its end (``stop``,
``length``, ``abort``, or ``chunk`` when the rest is asked for without streaming): a worker that takes
the task over can tell a finished chain from one to continue.

Owns no retries and no pool: a stream that breaks before its first token raises the `TransportError`
the adapter's retry loop handles as any failed request; one that breaks later returns what it had.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamgrp.services.inference.dialect import (
    Dialect,
    Finish,
    Generation,
    ProtocolError,
    StreamError,
    checked_logprobs,
)
from streamgrp.services.inference.http import TransportError, request_json, stream_events

if TYPE_CHECKING:
    from streamgrp.services.inference.segments import SlotSegments

#: Deadline of the request that reads the served model before a stream (llama.cpp's events name none).
MODEL_TIMEOUT_S = 10.0


@dataclass
class SegmentCutter:
    """When the streamed tokens pending become a segment; pure: the time comes in as data."""

    segment_tokens: int
    segment_s: float
    started: float
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def due(self, now: float) -> bool:
        if not self.ids:
            return False
        return (self.segment_tokens > 0 and len(self.ids) >= self.segment_tokens) or (
            self.segment_s > 0 and now - self.started >= self.segment_s
        )

    def take(self, now: float) -> tuple[list[int], list[float]]:
        taken = self.ids, self.logprobs
        self.ids, self.logprobs, self.started = [], [], now
        return taken


@dataclass
class StreamedPart:
    """What one stream gave: ``generation`` holds the kept tokens (its finish is ``abort`` when it broke);
    ``broke`` the error it broke with after some tokens; ``lost``: the rest is to be asked for unstreamed."""

    generation: Generation
    broke: TransportError | None = None
    lost: bool = False
    segments: int = 0


def read_stream(
    dialect: Dialect,
    url: str,
    context: list[int],
    body: dict[str, Any],
    path: str,
    *,
    budget: int,
    timeout_s: float,
    max_bytes: int,
    slot: SlotSegments | None,
    cutter: SegmentCutter,
    clock: Callable[[], float] = time.monotonic,
) -> StreamedPart:
    """Stream ``body`` to ``url + path``; at most ``budget`` tokens; segments through ``slot`` as they are due."""
    where = f"the {dialect.name} stream from {url}"
    model, version = "", None
    if dialect.model_path:
        model, version = dialect.parse_model(
            request_json("GET", url + dialect.model_path, timeout_s=min(timeout_s, MODEL_TIMEOUT_S)).body
        )
    parser = dialect.stream_parser()
    ids: list[int] = []
    logprobs: list[float] = []
    text: list[str] = []
    finish, reason, lost, broke, segments = None, "", False, None, 0
    events = stream_events(url + path, body, timeout_s=timeout_s, max_bytes=max_bytes)
    try:
        for event in events:
            delta = parser.feed(event)
            model = delta.model or model
            if delta.weight_version is not None:  # a stream spans one server process; if not, the oldest
                version = delta.weight_version if version is None else min(version, delta.weight_version)
            last = delta.finish is not None or delta.lost
            if len(ids) + len(delta.token_ids) > budget:
                raise ProtocolError(
                    f"{where} has {len(ids) + len(delta.token_ids)} tokens, more than the {budget} "
                    "the request allowed; the server does not honour the token limit, so the slot "
                    "fails"
                )
            values = checked_logprobs(delta.logprobs, f"{where}, after {len(ids)} tokens")
            now = clock()
            if slot is not None and not last and delta.token_ids and cutter.due(now):
                slot.record(*cutter.take(now), version, "chunk")
                segments += 1
            ids += delta.token_ids
            logprobs += values
            text.append(delta.text)
            cutter.ids += delta.token_ids
            cutter.logprobs += values
            if last:
                finish, reason, lost = delta.finish, delta.reason, delta.lost
                break
    except (TransportError, StreamError) as exc:
        if not ids:  # nothing to keep: a failed request like any other, for the retry loop
            raise exc if isinstance(exc, TransportError) else TransportError(str(exc)) from None
        broke = exc if isinstance(exc, TransportError) else TransportError(str(exc))
    finally:
        events.close()  # the server sees the connection close and stops generating
    if finish is None and not lost and broke is None:
        broke = TransportError(f"{where} ended before its last event", server_away=True)
        if not ids:
            raise broke
    cause = "chunk" if lost else "abort" if broke is not None else finish
    if slot is not None and cutter.ids:
        slot.record(*cutter.take(clock()), version, str(cause))
        segments += 1
    kept_finish: Finish = "abort" if broke is not None or lost or finish is None else finish
    generation = Generation(
        ids,
        logprobs,
        "".join(text),
        kept_finish,
        reason=reason if broke is None else str(broke),
        weight_version=version,
        model=model,
    )
    return StreamedPart(generation, broke=broke, lost=lost, segments=segments)

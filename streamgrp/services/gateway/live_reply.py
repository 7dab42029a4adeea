"""`LiveReply`: a streamed answer written to the client while its turn is generated.

The gateway names the reply once it knows the turn (`begin`), hands on each part of the generation as the
server streams it (`delta`), and ends the reply once the turn is recorded (`finish`): the finish and the
usage come only after the record, so a client that saw ``[DONE]`` saw a durable turn; a turn that fails
after its first part ends the stream with OpenAI's error object instead (`fail`), which the OpenAI SDKs
raise as an API error. Nothing is written before the first part, so a turn that fails before it is
answered with a plain error status as any other request.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from streamgrp.services.gateway.openai_api import (
    Answer,
    Report,
    chunk_base,
    closing_chunks,
    delta_chunk,
    opening_chunks,
)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks)


class LiveReply:
    """One streamed reply of ``endpoint`` (``chat`` or ``completions``) to ``request``."""

    def __init__(self, request: web.Request, endpoint: str) -> None:
        self.request = request
        self.endpoint = endpoint
        self.response: web.StreamResponse | None = None
        self._named: tuple[str, int, Report] | None = None
        self._base: dict[str, Any] | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    def begin(self, reply_id: str, created: int, report: Report) -> None:
        """Name the reply (before the turn's generation starts)."""
        self._named = (reply_id, created, report)

    async def delta(self, token_ids: list[int], logprobs: list[float], text: str, model: str) -> None:
        """One part of the generation, as the server gave it."""
        if self._named is None:
            raise RuntimeError("LiveReply.delta before begin")
        reply_id, created, report = self._named
        if self.response is None:
            self._base = chunk_base(self.endpoint, reply_id, created, report.model or model)
            self.response = web.StreamResponse(headers=SSE_HEADERS)
            await self.response.prepare(self.request)
            await self.response.write(sse(opening_chunks(self.endpoint, self._base)))
        assert self._base is not None
        if text or token_ids:
            await self.response.write(sse([delta_chunk(self.endpoint, self._base, text, token_ids, logprobs, report)]))

    async def finish(self, answer: Answer, report: Report) -> web.StreamResponse:
        """The closing chunks and ``[DONE]``, once the turn is recorded."""
        assert self.response is not None and self._base is not None
        await self.response.write(sse(closing_chunks(self.endpoint, self._base, answer, report)) + b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response

    async def fail(self, error: dict[str, Any]) -> web.StreamResponse:
        """End a started stream with OpenAI's error object (``error``) and no ``[DONE]``."""
        assert self.response is not None
        await self.response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        await self.response.write_eof()
        return self.response

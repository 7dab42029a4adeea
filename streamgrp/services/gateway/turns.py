"""`GatewayTurns`: one turn of a session, from the request to the recorded turn and the answer.

A request with a session's key (``/v1/chat/completions``, ``/v1/completions``) is one turn: the conversation
is rendered by the model's chat template and tokenized as the server does it, continuing the session's
earlier turns token for token where the conversation does (`streamgrp.services.gateway.live`); the server
generates from the ids (`streamgrp.services.gateway.upstream`), and the turn (prompt ids, completion ids,
log-probabilities, version) is recorded in the run before the answer is sent. A client's retry of a turn
already recorded is answered again from its record. Text the model generated is never tokenized again into
training data.

Deliberately ignores opening and ending sessions and their upkeep: `streamgrp.services.gateway.gateway.Gateway`
(which this class is a part of) owns them, and the attributes declared below.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import redis

from streamgrp.core.events import RawArray, TurnRecorded
from streamgrp.errors import SessionRefused
from streamgrp.services.gateway.live import LiveSession, LiveTurn, SessionTable, text_digest
from streamgrp.services.gateway.live_reply import LiveReply
from streamgrp.services.gateway.openai_api import (
    Answer,
    ChatRequest,
    CompletionRequest,
    Report,
    parse_chat,
    parse_completion,
)
from streamgrp.services.gateway.streamed import OnDelta
from streamgrp.services.gateway.templates import ChatTemplate
from streamgrp.services.gateway.turn_timer import TurnTimer
from streamgrp.services.gateway.upstream import Upstream
from streamgrp.services.inference.adapter import Completion
from streamgrp.services.inference.dialect import ProtocolError
from streamgrp.store.loop_client import loop_client
from streamgrp.store.sessions import SessionStore

log = logging.getLogger(__name__)

#: Headers that mark a request as a client's retry of one it sent before (the OpenAI and Anthropic SDKs
#: count their retries in the first).
RETRY_HEADER = "x-stainless-retry-count"
IDEMPOTENCY_HEADER = "idempotency-key"


class GatewayTurns:
    """The turns of a `Gateway`'s sessions (a part of `Gateway`, which sets everything declared here)."""

    client: redis.Redis
    upstream: Upstream
    template: ChatTemplate
    tool_parser: str
    metrics: Any
    name: str
    store: SessionStore
    table: SessionTable
    version: int
    crash_after_turn: int | None
    turns_recorded: int
    _aclient: Any

    if TYPE_CHECKING:  # `Gateway`'s own methods, declared for the type checker only (so they do not shadow them)

        async def blocking(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

        def server_now(self) -> float: ...

    @staticmethod
    async def _waited(timer: TurnTimer, awaitable: Awaitable[Any]) -> Any:
        """``awaitable`` (a template request on the event loop), its time counted as a wait for inference servers."""
        started = time.perf_counter()
        try:
            return await awaitable
        finally:
            timer.upstream += time.perf_counter() - started

    async def chat(
        self, key: str, body: Any, headers: Mapping[str, str], timer: TurnTimer, live: LiveReply | None = None
    ) -> tuple[Answer, Report]:
        """One turn of ``/v1/chat/completions``; with ``live``, streamed to it as generated (without tools)."""
        request = parse_chat(body)
        session = await self.table.authenticate(key)
        async with session.lock:
            session.check_open(self.server_now())
            messages = session.with_own_words(request.messages)
            text = await self._waited(
                timer, self.template.render(messages, request.tools, request.tool_choice, request.extra_template)
            )
            prompt_ids = await self._prompt_ids(session, text, timer)
            live = None if request.tools else live  # a tool call is parsed from the whole text: sent at the end
            return (await self._turn(session, request, prompt_ids, text, "chat", headers, timer, live), request.report)

    async def complete(
        self, key: str, body: Any, headers: Mapping[str, str], timer: TurnTimer, live: LiveReply | None = None
    ) -> tuple[Answer, Report]:
        """One turn of ``/v1/completions``: a text prompt is tokenized (continuing earlier turns where it
        does), a prompt of token ids is taken as it is."""
        request = parse_completion(body)
        session = await self.table.authenticate(key)
        async with session.lock:
            session.check_open(self.server_now())
            if isinstance(request.prompt, str):
                text: str | None = request.prompt
                prompt_ids = await self._prompt_ids(session, request.prompt, timer)
            else:
                text, prompt_ids = None, list(request.prompt)
            return (
                await self._turn(session, request, prompt_ids, text, "completions", headers, timer, live),
                request.report,
            )

    async def _prompt_ids(self, session: LiveSession, text: str, timer: TurnTimer) -> list[int]:
        base = session.continued(text)
        if base is None:
            return await self._waited(timer, self.template.tokenize(text, special=True))
        rest = text[base.prefix_chars :]
        tail = await self._waited(timer, self.template.tokenize(rest, special=False)) if rest else []
        return [*base.prompt_ids, *base.completion_ids, *tail]

    async def _turn(
        self,
        session: LiveSession,
        request: ChatRequest | CompletionRequest,
        prompt_ids: list[int],
        text: str | None,
        endpoint: str,
        headers: Mapping[str, str],
        timer: TurnTimer,
        live: LiveReply | None = None,
    ) -> Answer:
        idempotency = headers.get(IDEMPOTENCY_HEADER, "")[:200]
        retried = headers.get(RETRY_HEADER, "0").strip() not in ("", "0")
        turn = session.replayable(prompt_ids, retried=retried, idempotency=idempotency)
        if turn is not None:
            log.info(
                "session %s: turn %d answered again from its record (the client retried it)",
                session.session_id,
                turn.number,
            )
            if self.metrics is not None:
                self.metrics.gateway_replayed_turns.inc()
        reply_id, created = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{session.session_id}-", int(time.time())
        if turn is None:
            live = live if request.report.stream else None
            if live is not None:
                live.begin(f"{reply_id}{len(session.turns) + 1}", created, request.report)
            turn = await self._generate(
                session,
                request,
                prompt_ids,
                text,
                endpoint,
                idempotency,
                timer,
                live.delta if live is not None else None,
            )
        return Answer(
            reply_id=f"{reply_id}{turn.number}",
            created=created,
            model=request.report.model or turn.model,
            text=turn.text,
            content=turn.content,
            tool_calls=turn.tool_calls,
            finish=turn.finish,
            prompt_ids=turn.prompt_ids,
            completion_ids=turn.completion_ids,
            logprobs=turn.logprobs,
        )

    async def _generate(
        self,
        session: LiveSession,
        request: ChatRequest | CompletionRequest,
        prompt_ids: list[int],
        text: str | None,
        endpoint: str,
        idempotency: str,
        timer: TurnTimer,
        on_delta: OnDelta | None = None,
    ) -> LiveTurn:
        completion: Completion = await self._waited(
            timer, self.upstream.generate(prompt_ids, self.upstream.sampling(request.sampled), on_delta)
        )
        if not completion.token_ids:
            raise ProtocolError(
                f"the {self.upstream.dialect.name} server generated no token for session "
                f"{session.session_id}'s turn (is the prompt as long as its context?)"
            )
        generated = await self._waited(timer, self.template.completion_text(completion)) if text is not None else ""
        versions = [v for v in completion.versions if v is not None]
        tools = isinstance(request, ChatRequest) and bool(request.tools)
        turn = LiveTurn(
            number=len(session.turns) + 1,
            prompt_ids=tuple(prompt_ids),
            completion_ids=tuple(completion.token_ids),
            logprobs=tuple(completion.logprobs),
            version=min(versions) if versions else self.version,
            finish="length" if completion.finish == "length" else "stop",
            text=completion.text,
            endpoint=endpoint,
            model=completion.model,
            tools=tools,
            idempotency=idempotency,
        )
        if text is not None:
            turn.prefix_chars, turn.prefix_digest = len(text) + len(generated), text_digest(text + generated)
        turn.answer_from_text(session.session_id, self.tool_parser)
        meta: dict[str, Any] = {
            "text": turn.text,
            "endpoint": endpoint,
            "model": turn.model,
            "tools": tools,
            "server": completion.servers[-1] if completion.servers else "",
        }
        if turn.prefix_chars is not None:
            meta.update(prefix_chars=turn.prefix_chars, prefix_digest=turn.prefix_digest)
        if idempotency:
            meta["idempotency"] = idempotency
        if completion.resubmits or completion.rescored:
            meta.update(resubmits=completion.resubmits, rescored=completion.rescored)
        event = TurnRecorded(
            session=session.session_id,
            task_id=session.task_id,
            slot=session.slot,
            turn=turn.number,
            prompt_ids=RawArray.from_values(prompt_ids, "int32"),
            completion_ids=RawArray.from_values(turn.completion_ids, "int32"),
            logprobs=RawArray.from_values(turn.logprobs, "float32"),
            version=turn.version,
            finish=turn.finish,  # type: ignore[arg-type]  # a literal, checked as it is encoded
            meta=meta,
            producer=self.name,
            seq=self.store.next_seq(),
        )
        try:
            await self._record(event)
        except SessionRefused as refused:
            if refused.code in ("TURN", "ENDED", "EXPIRED"):
                await self.table.reload(session.session_id)  # another gateway wrote it: read what it did
            raise
        self.turns_recorded += 1
        if self.turns_recorded == self.crash_after_turn:  # the crash tests' point: recorded, never answered
            log.warning(
                "crash_after_turn: SIGKILL after recording turn %d of session %s", turn.number, session.session_id
            )
            os.kill(os.getpid(), signal.SIGKILL)
        session.turns.append(turn)
        if self.metrics is not None:
            self.metrics.gateway_turns.labels(endpoint).inc()
            self.metrics.gateway_tokens.labels("prompt").inc(len(prompt_ids))
            self.metrics.gateway_tokens.labels("completion").inc(len(turn.completion_ids))
        return turn

    async def _record(self, event: TurnRecorded) -> None:
        """The turn's record: on the event loop (one FCALL, in a ``keys`` run with its tensors' staging write in
        the same write; no thread hop per turn) unless the server gave no answer there, then on a thread (which
        rides outages out; a repeat is answered as the first)."""
        call = self.store.record_call(event)
        self._aclient = (loop_client(self.client) or False) if self._aclient is None else self._aclient
        if self._aclient is False or await self.store.record_on_loop(self._aclient, call) is None:
            await self.blocking(self.store.record, event)

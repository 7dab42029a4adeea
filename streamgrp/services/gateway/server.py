"""The gateway's HTTP server (aiohttp): routes, keys, streaming, errors, and the process's lifetime.

    POST /v1/chat/completions, POST /v1/completions, GET /v1/models     a session's key (Bearer sgk_...)
    POST /sessions, GET /sessions/{id}, POST /sessions/{id}/end,        the gateway's token (Bearer ...)
    POST /sessions/{id}/reward
    GET  /health                                                        anyone

Owns authentication at the door: a session key reaches only the OpenAI endpoints, and only as its own
session (the key names it; no request field can name another); the control endpoints take only the
gateway's token. Owns turning every refusal into OpenAI's error object with a status its SDK acts on
correctly: what a retry cannot fix (an ended or expired session, a bad request, an upstream that does
not answer as asked) says ``x-should-retry: false``; an inference server or store that is away is a 5xx
the SDK retries (a gateway restarting behind it is ridden out that way). Owns the per-turn clock: a
turn's overhead is its time from the request's body to its last byte sent, less its waits for
inference servers. Everything else is `streamgrp.services.gateway.gateway.Gateway`'s.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from streamgrp.errors import ConfigError, SessionRefused, StreamgrpError
from streamgrp.services import heap
from streamgrp.services.gateway.gateway import Gateway
from streamgrp.services.gateway.live_reply import SSE_HEADERS, LiveReply, sse
from streamgrp.services.gateway.openai_api import (
    Answer,
    Report,
    RequestError,
    chat_chunks,
    chat_reply,
    completion_chunks,
    completion_reply,
    error_body,
)
from streamgrp.services.gateway.turn_timer import TurnTimer
from streamgrp.services.inference.adapter import GenerationFailed
from streamgrp.services.inference.dialect import ProtocolError
from streamgrp.services.inference.http import ClientError, InferenceError, ReplyTooLarge
from streamgrp.store.connection import is_outage

log = logging.getLogger(__name__)

JSON = "application/json"
#: Refusal code -> (HTTP status, OpenAI error type, whether a retry can help).
_REFUSALS = {
    "UNKNOWN": (401, "authentication_error", False),
    "ENDED": (410, "session_ended", False),
    "EXPIRED": (410, "session_expired", False),
    "TURN": (409, "conflict", True),
    "TAKEN": (409, "task_taken", False),
    "EXISTS": (409, "conflict", False),
    "BAD_INPUT": (400, "invalid_request_error", False),
    "EARLY": (409, "conflict", False),
}


class GatewayServer:
    """The aiohttp application of one `Gateway`; ``token`` guards the control endpoints (None: none may be
    used, unless ``open_control`` says a loopback-only gateway leaves them open)."""

    def __init__(
        self,
        gateway: Gateway,
        *,
        token: str | None,
        max_request_bytes: int = 16 * 1024 * 1024,
        models: tuple[str, ...] = ("policy",),
    ) -> None:
        self.gateway = gateway
        self.token = token
        self.models = models
        self.app = web.Application(client_max_size=max_request_bytes)
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/models", self.list_models),
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.post("/sessions", self.open_sessions),
                web.get("/sessions/{session_id}", self.session_info),
                web.post("/sessions/{session_id}/end", self.end_session),
                web.post("/sessions/{session_id}/reward", self.post_reward),
            ]
        )

    # -- the OpenAI endpoints ------------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, "chat", self.gateway.chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, "completions", self.gateway.complete)

    async def _turn(
        self, request: web.Request, endpoint: str, handler: Callable[..., Awaitable[tuple[Answer, Report]]]
    ) -> web.StreamResponse:
        timer = TurnTimer.start()
        live = LiveReply(request, endpoint)
        try:
            body = _json(await request.read())
            answer, report = await handler(_bearer(request), body, request.headers, timer, live)
        except Exception as exc:  # noqa: BLE001 - every failure is answered as OpenAI's error object
            if live.started:  # the stream began: the error ends it
                return await live.fail(self._error_body(exc)[1])
            return self._error(exc)
        response: web.StreamResponse
        if live.started:
            response = await live.finish(answer, report)
        elif not report.stream:
            reply = chat_reply(answer, report) if endpoint == "chat" else completion_reply(answer, report)
            response = web.Response(body=orjson.dumps(reply), content_type=JSON)
            await response.prepare(request)
            await response.write_eof()
        else:  # not streamed as generated (a retry answered from its record, a request with tools): at once
            chunks = chat_chunks(answer, report) if endpoint == "chat" else completion_chunks(answer, report)
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            await response.write(sse(chunks) + b"data: [DONE]\n\n")
            await response.write_eof()
        metrics = self.gateway.metrics
        if metrics is not None:
            metrics.gateway_overhead.observe(timer.own())
            metrics.gateway_upstream.observe(timer.upstream)
        return response

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            await self.gateway.table.authenticate(_bearer(request))
        except Exception as exc:  # noqa: BLE001
            return self._error(exc)
        return _reply(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "streamgrp"} for name in self.models
                ],
            }
        )

    # -- the control endpoints ------------------------------------------------------------------------------

    async def open_sessions(self, request: web.Request) -> web.Response:
        try:
            self._control(request)
            body = _json(await request.read()) if request.can_read_body else {}
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            entry, partition, wait_s = body.get("task_entry"), body.get("partition", 0), body.get("wait_s", 0.0)
            if (
                (entry is not None and not isinstance(entry, str))
                or type(partition) is not int
                or not isinstance(wait_s, (int, float))
                or wait_s < 0
            ):
                raise RequestError("give task_entry (a task entry id you took) and partition, or wait_s (online mode)")
            opened = await self.gateway.open_sessions(task_entry=entry, partition=partition, wait_s=float(wait_s))
        except Exception as exc:  # noqa: BLE001
            return self._error(exc)
        return web.Response(status=204) if opened is None else _reply(opened)

    async def end_session(self, request: web.Request) -> web.Response:
        try:
            self._control(request)
            body = _json(await request.read())
            pending = isinstance(body, dict) and body.get("reward_pending") is True
            if not isinstance(body, dict) or ("reward" in body) + ("error" in body) + pending != 1:
                raise RequestError(
                    'give "reward" (a number, or null to reject the session), "error" (its text), or '
                    '"reward_pending": true (the reward is posted later, to /sessions/ID/reward)'
                )
            error = body.get("error")
            if "error" in body and (not isinstance(error, str) or not error):
                raise RequestError("error must be the failure's text", "error")
            ended = await self.gateway.end_session(
                request.match_info["session_id"], reward=_reward(body), error=error, reward_pending=pending
            )
        except Exception as exc:  # noqa: BLE001
            return self._error(exc)
        return _reply(ended)

    async def post_reward(self, request: web.Request) -> web.Response:
        try:
            self._control(request)
            body = _json(await request.read())
            if not isinstance(body, dict) or "reward" not in body:
                raise RequestError('give "reward": a number, or null with a "reason" to reject the sample')
            reason = body.get("reason")
            if reason is not None and not isinstance(reason, str):
                raise RequestError("reason must be text", "reason")
            posted = await self.gateway.post_reward(
                request.match_info["session_id"], reward=_reward(body), reason=reason
            )
        except Exception as exc:  # noqa: BLE001
            return self._error(exc)
        return _reply(posted)

    async def session_info(self, request: web.Request) -> web.Response:
        try:
            self._control(request)
            info = await self.gateway.session_info(request.match_info["session_id"])
        except Exception as exc:  # noqa: BLE001
            return self._error(exc)
        return _reply(info)

    async def health(self, request: web.Request) -> web.Response:
        return _reply({"status": "ok", "sessions": len(self.gateway.table)})

    def _control(self, request: web.Request) -> None:
        given = _bearer(request)
        if self.token is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            raise _Unauthorized(
                "the control endpoints take the gateway's token (Authorization: Bearer TOKEN); a "
                "session key reaches only its own session's OpenAI endpoints"
            )

    # -- errors ------------------------------------------------------------------------------------------------

    def _error(self, exc: BaseException) -> web.Response:
        (status, retry), body = self._error_body(exc)
        return web.Response(
            status=status,
            body=orjson.dumps(body),
            content_type=JSON,
            headers={"x-should-retry": "true" if retry else "false"},
        )

    def _error_body(self, exc: BaseException) -> tuple[tuple[int, bool], dict[str, Any]]:
        """((status, whether a retry can help), OpenAI's error object) for a failure, logged and counted."""
        status, kind, retry, code, param = _classify(exc)
        if status >= 500:
            log.warning("%d answered: %s: %s", status, type(exc).__name__, exc)
        metrics = self.gateway.metrics
        if metrics is not None:
            metrics.gateway_errors.labels(str(status)).inc()
        return (status, retry), error_body(str(exc), kind, code=code, param=param)


class _Unauthorized(StreamgrpError):
    pass


def _classify(exc: BaseException) -> tuple[int, str, bool, str | None, str | None]:
    """(status, OpenAI error type, whether a retry can help, code, param) of a failure."""
    if isinstance(exc, RequestError):
        return 400, "invalid_request_error", False, None, exc.param
    if isinstance(exc, _Unauthorized):
        return 401, "authentication_error", False, None, None
    if isinstance(exc, SessionRefused):
        status, kind, retry = _REFUSALS.get(exc.code, (500, "server_error", True))
        return status, kind, retry, exc.code.lower(), None
    if isinstance(exc, ConfigError):
        return 400, "invalid_request_error", False, None, None
    if isinstance(exc, ClientError):
        return 400, "invalid_request_error", False, "upstream_refused", None
    if isinstance(exc, (ProtocolError, ReplyTooLarge)):
        return 502, "upstream_error", False, "upstream_protocol", None
    if isinstance(exc, (GenerationFailed, InferenceError)):
        return 502, "upstream_error", True, "upstream_unavailable", None
    if is_outage(exc):
        return 503, "store_unavailable", True, None, None
    log.error("the gateway failed a request", exc_info=exc)
    return 500, "server_error", True, None, None


def _reward(body: dict[str, Any]) -> float | None:
    reward = body.get("reward")
    if reward is not None and (type(reward) is bool or not isinstance(reward, (int, float))):
        raise RequestError("reward must be a number or null", "reward")
    return None if reward is None else float(reward)


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the body is not JSON: {exc}") from None


def _reply(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), content_type=JSON)


async def serve(
    server: GatewayServer,
    host: str,
    port: int,
    stop: threading.Event,
    *,
    refresh_s: float = 1.0,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve until ``stop`` is set: the sessions' upkeep (`Gateway.refresh`) every ``refresh_s`` seconds;
    ``ready`` gets the port once listening. In-flight requests finish before it returns."""
    # In-flight turns get a few seconds to finish; a client whose turn is cut off asks again (its retry is
    # answered from the record when the turn was recorded).
    runner = web.AppRunner(server.app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    log.info(
        "gateway for run %s on http://%s:%d (OpenAI base URL %s/v1)",
        server.gateway.run.name,
        host,
        bound,
        server.gateway.public_url,
    )
    heap.settle()  # imports and set-up out of the collector's way: its full passes were the latency tail
    if ready is not None:
        ready(bound)
    try:
        next_refresh = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            if loop.time() >= next_refresh:
                try:
                    await server.gateway.refresh()
                except Exception as exc:
                    if not is_outage(exc):
                        log.exception("session upkeep failed; trying again in %.1fs", refresh_s)
                next_refresh = loop.time() + refresh_s
            await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()
        await server.gateway.aclose()

"""`RetriedRequests`: one request to the pool's servers, retried and waited through restarts, its reply bounded.

The worker's synchronous side of the inference adapter's rules (the module docstring of
`streamgrp.services.inference.adapter` states them; the gateway's event-loop side is
`streamgrp.services.gateway.upstream.AsyncRequests`): transport errors, 5xx and 429 retried with bounded,
jittered exponential backoff (`Retry`), on another server when there is one; a lone server that went away
waited for on ``GET /health`` without counting the wait as an attempt; a reply read only up to the bytes
its tokens could take. Deliberately ignores what a request asks and what its reply means (the dialect's
and the adapter's).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import orjson

from streamgrp.services.inference.completion import GenerationFailed
from streamgrp.services.inference.http import InferenceError, ReplyTooLarge, TransportError, request_json
from streamgrp.services.inference.pool import ServerPool

#: A reply may be this long beyond its tokens (settings, timings, ids; the request body is added too) ...
REPLY_BASE_BYTES = 64 * 1024
#: ... plus this much per token it can carry: prompt echoed back, generated, or log-probability entry. A
#: generated token takes a few hundred bytes in the most verbose dialect (llama.cpp: its text three times
#: over, as a string, as bytes, in its top log-probs), so this is room, not a squeeze.
REPLY_BYTES_PER_TOKEN = 1024
#: How often a server that went away is asked whether it is back.
HEALTH_POLL_S = 0.05
#: Restarts one request waits through without counting them as attempts (a bound, so a server that
#: keeps dropping requests while its /health says it is fine still ends the slot).
MAX_RESTARTS_WAITED = 4


@dataclass(frozen=True)
class Retry:
    """Bounded exponential backoff: ``attempts`` tries, pauses ``base * 2**n`` capped at ``cap``, jittered."""

    attempts: int = 4
    base_s: float = 0.5
    cap_s: float = 8.0

    def pause(self, retry: int, rng: random.Random) -> float:
        return min(self.cap_s, self.base_s * 2 ** (retry - 1)) * rng.uniform(0.5, 1.0)


class RetriedRequests:
    """The requests of an `InferenceRollout` (a part of it, which sets everything declared here)."""

    pool: ServerPool
    retry: Retry
    request_timeout_s: float
    restart_wait_s: float
    sleep: Callable[[float], None]
    rng: random.Random

    @staticmethod
    def _reply_limit(body: dict[str, Any], reply_tokens: int) -> int:
        return REPLY_BASE_BYTES + len(orjson.dumps(body)) + REPLY_BYTES_PER_TOKEN * reply_tokens

    def _await_restart(self, url: str, budget_s: float) -> tuple[bool, float]:
        """(whether ``url`` was down and came back, seconds waited): poll ``GET url/health`` (every dialect's
        server has it; llama-server answers 503 while it loads) until it answers 200 or ``budget_s`` is spent."""
        polls = int(budget_s / HEALTH_POLL_S)
        for poll in range(polls + 1):
            try:
                request_json("GET", url + "/health", timeout_s=1.0)
                return poll > 0, poll * HEALTH_POLL_S
            except InferenceError:
                if poll < polls:
                    self.sleep(HEALTH_POLL_S)
        return False, polls * HEALTH_POLL_S

    def _with_retries(
        self,
        path: str,
        body: dict[str, Any],
        parse: Callable[[Any], Any] | None,
        *,
        reply_tokens: int,
        server: str | None = None,
        send: Callable[[str], Any] | None = None,
    ) -> tuple[Any, str, int]:
        """(parsed reply, server, attempts) of one request, to ``server`` or one from the pool; transport errors
        retried with backoff. The reply may hold ``reply_tokens`` tokens' worth of bytes, no more. ``send``
        (a server URL -> its result) replaces the request and ``parse``: a stream."""
        limit = self._reply_limit(body, reply_tokens)
        avoid, last = None, None
        restart_budget, waited_through = self.restart_wait_s, 0
        for attempt in range(1, self.retry.attempts + 1 + MAX_RESTARTS_WAITED):
            restarting = False
            with self.pool.lease(avoid=avoid) if server is None else nullcontext(server) as url:
                try:
                    if send is not None:
                        result = send(url)
                    else:
                        reply = request_json(
                            "POST", url + path, body, timeout_s=self.request_timeout_s, max_bytes=limit
                        )
                except TransportError as exc:
                    if server is None:
                        self.pool.failed(url)
                    avoid, last = url, exc
                    restarting = exc.server_away and (server is not None or len(self.pool.urls) == 1)
                except ReplyTooLarge as exc:
                    raise ReplyTooLarge(
                        f"{exc}, which is {reply_tokens} tokens' worth (prompt and --max-tokens) and "
                        "more than such a reply needs: the server is not answering what was asked "
                        "(check --server-url and --sampling); not retried"
                    ) from None
                else:
                    if server is None:
                        self.pool.succeeded(url)
                    return (result if send is not None else parse(reply.body)), url, attempt  # type: ignore[misc]
            if restarting and restart_budget > 0 and waited_through < MAX_RESTARTS_WAITED:
                back, waited = self._await_restart(url, restart_budget)
                restart_budget -= waited
                if back:  # it restarted (a weight sync): send again at once, an attempt not counted
                    waited_through += 1
                    continue
            if attempt - waited_through >= self.retry.attempts:
                break
            self.sleep(self.retry.pause(attempt - waited_through, self.rng))
        raise GenerationFailed(
            f"{self.retry.attempts} attempts failed, the last with: {last}; check the servers "
            "(--server-url), or raise --max-attempts / --request-timeout-s"
        )

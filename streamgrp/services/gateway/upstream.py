"""The inference servers behind the gateway: one turn generated from token ids, on the event loop.

`Upstream` generates one turn on a server of the pool, token ids in and out, speaking each server's
dialect (`streamgrp.services.inference`: vLLM, SGLang, llama.cpp; their request and reply shapes exist
once, there) with the inference adapter's rules: the completion is the server's ids with one checked
log-probability each, positions a reply left unscored are scored again teacher-forced on the same
server, an aborted generation is resubmitted with the tokens so far (or fails, ``on_abort = fail``),
transport errors, 5xx and 429 are retried with backoff (another server first), a lone server that went
away is waited for on ``/health`` without counting the wait as an attempt, and no reply is read past
what its request could justify. Unlike the adapter, it runs on the gateway's event loop over kept-alive
connections (aiohttp): the worker's adapter is synchronous, one thread and one new connection per
request, which at hundreds of sessions cost the gateway more CPU than everything else it does per turn
(bench/README.md, the gateway's section).

The chat templates that turn messages into token ids are `streamgrp.services.gateway.templates`'s.
"""

from __future__ import annotations

import asyncio
import random
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import orjson

from streamgrp.config import InferenceConfig
from streamgrp.errors import ConfigError
from streamgrp.services.gateway.streamed import OnDelta, stream_turn
from streamgrp.services.inference import make_dialect, server_urls
from streamgrp.services.inference.adapter import (
    Completion,
    GenerationFailed,
    WeightsChanged,
    finished_or_resubmit,
    regenerate,
)
from streamgrp.services.inference.dialect import Dialect, Generation, ProtocolError, Sampling, checked_logprobs
from streamgrp.services.inference.http import ClientError, ReplyTooLarge, TransportError
from streamgrp.services.inference.pool import ServerPool
from streamgrp.services.inference.retries import (
    HEALTH_POLL_S,
    MAX_RESTARTS_WAITED,
    REPLY_BASE_BYTES,
    REPLY_BYTES_PER_TOKEN,
    Retry,
)


class AsyncRequests:
    """JSON requests to the pool's servers on the event loop, connections kept alive (see the module docstring
    for the rules). Make and use it on one event loop."""

    def __init__(self, pool: ServerPool, retry: Retry, timeout_s: float, restart_wait_s: float = 60.0) -> None:
        self.pool = pool
        self.retry = retry
        self.timeout_s = timeout_s
        self.restart_wait_s = restart_wait_s
        self._session: Any = None
        self._rng = random.Random()

    def http(self) -> Any:
        """The keep-alive client session (made on first use, on the loop)."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def post(
        self, path: str, body: dict[str, Any], *, max_bytes: int, server: str | None = None
    ) -> tuple[Any, str]:
        """(the JSON reply, the server that gave it), to ``server`` or one the pool picks."""
        payload, avoid, last = orjson.dumps(body), None, None
        budget, waited, attempt = self.restart_wait_s, 0, 0
        while True:
            attempt += 1
            away = False
            with self.pool.lease(avoid=avoid) if server is None else nullcontext(server) as url:
                try:
                    value = await self._once(url, path, payload, max_bytes)
                except TransportError as exc:
                    last, avoid, away = exc, url, exc.server_away
                    if server is None:
                        self.pool.failed(url)
                else:
                    if server is None:
                        self.pool.succeeded(url)
                    return value, url
            lone = server is not None or len(self.pool.urls) == 1
            if away and lone and budget > 0 and waited < MAX_RESTARTS_WAITED:
                back, spent = await self._await_restart(url, budget)
                budget -= spent
                if back:  # it restarted (a weight sync): send again at once, an attempt not counted
                    waited += 1
                    continue
            if attempt - waited >= self.retry.attempts:
                raise GenerationFailed(
                    f"{self.retry.attempts} attempts failed, the last with: {last}; check the "
                    "servers (--server-url), or raise --max-attempts / --request-timeout-s"
                )
            await asyncio.sleep(self.retry.pause(attempt - waited, self._rng))

    async def _once(self, url: str, path: str, payload: bytes, max_bytes: int) -> Any:
        import aiohttp

        try:
            async with self.http().post(
                url + path, data=payload, headers={"Content-Type": "application/json"}
            ) as response:
                raw = await response.content.read(max_bytes + 1)
                status = response.status
        except (aiohttp.ClientConnectionError, ConnectionError) as exc:
            raise TransportError(f"POST {url}{path}: {type(exc).__name__}: {exc}", server_away=True) from None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise TransportError(f"POST {url}{path}: {type(exc).__name__}: {exc}") from None
        if len(raw) > max_bytes:
            raise ReplyTooLarge(
                f"POST {url}{path}: the reply is over the {max_bytes} bytes its request could need; "
                "the server is not answering what was asked (check --server-url); not retried"
            )
        if 200 <= status < 300:
            try:
                return orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise TransportError(
                    f"POST {url}{path}: HTTP {status} with a body that is not JSON: "
                    f"{raw[:500].decode('utf-8', 'replace')!r}"
                ) from None
        text = raw[:500].decode("utf-8", "replace")
        if status == 429 or status >= 500:
            raise TransportError(f"POST {url}{path}: HTTP {status}: {text}", server_away=status == 503)
        raise ClientError(f"POST {url}{path}: HTTP {status}: {text}", status)

    async def get(self, url: str, path: str) -> Any:
        """The JSON reply to ``GET url + path`` (no retries: the caller falls back when it fails)."""
        async with self.http().get(url + path) as response:
            if not 200 <= response.status < 300:
                raise TransportError(f"GET {url}{path}: HTTP {response.status}")
            return orjson.loads(await response.content.read(REPLY_BASE_BYTES))

    async def _await_restart(self, url: str, budget_s: float) -> tuple[bool, float]:
        """(whether ``url`` answers ``GET /health`` again within ``budget_s``, seconds waited)."""
        import aiohttp

        spent = 0.0
        while spent <= budget_s:
            try:
                async with self.http().get(url + "/health", timeout=aiohttp.ClientTimeout(total=1.0)) as response:
                    if response.status == 200:
                        return spent > 0, spent
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(HEALTH_POLL_S)
            spent += HEALTH_POLL_S
        return False, spent

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class Upstream:
    """One dialect's servers (a pool of URLs) and the gateway's default sampling for them."""

    def __init__(
        self,
        dialect: Dialect,
        pool: ServerPool,
        defaults: Sampling,
        *,
        retry: Retry | None = None,
        request_timeout_s: float = 120.0,
        on_abort: str = "resubmit",
        max_resubmits: int = 4,
        restart_wait_s: float = 60.0,
    ) -> None:
        self.dialect = dialect
        self.pool = pool
        self.defaults = defaults
        self.on_abort = on_abort
        self.max_resubmits = max_resubmits
        self.requests = AsyncRequests(pool, retry or Retry(), request_timeout_s, restart_wait_s)
        self._anchor: int | None = None

    @classmethod
    def from_config(cls, dialect_name: str, config: InferenceConfig) -> Upstream:
        extra = None
        if config.sampling:
            try:
                extra = orjson.loads(config.sampling)
            except orjson.JSONDecodeError as exc:
                raise ConfigError(f"--sampling {config.sampling!r} is not JSON: {exc}") from None
        defaults = Sampling(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            extra=extra,
            model=config.server_model,
        )
        dialect = make_dialect(dialect_name, config)
        dialect.check_extra(extra)
        return cls(
            dialect,
            ServerPool(server_urls(config), config.server_choice),
            defaults,
            retry=Retry(config.max_attempts, config.backoff_s, config.backoff_max_s),
            request_timeout_s=config.request_timeout_s,
            on_abort=config.on_abort,
            max_resubmits=config.max_resubmits,
            restart_wait_s=config.restart_wait_s,
        )

    def sampling(self, sampled: Any) -> Sampling:
        """The turn's sampling (`openai_api.Sampled`): what it asked for over the gateway's defaults;
        ``max_tokens`` at most the gateway's ``--max-tokens``."""
        cap = self.defaults.max_tokens
        extra = dict(self.defaults.extra or {})
        wanted: dict[str, Any] = {}
        if sampled.stop:
            wanted["stop"] = list(sampled.stop)
        if sampled.seed is not None:
            wanted["sampling_seed" if self.dialect.name == "sglang" else "seed"] = sampled.seed
        if self.dialect.name == "sglang" and wanted:
            extra["sampling_params"] = {**extra.get("sampling_params", {}), **wanted}
        else:
            extra.update(wanted)
        chosen = {
            name: getattr(self.defaults, name) if getattr(sampled, name) is None else getattr(sampled, name)
            for name in ("temperature", "top_p", "top_k")
        }
        sampling = replace(self.defaults, max_tokens=min(cap, sampled.max_tokens or cap), extra=extra or None, **chosen)
        self.dialect.check_extra(sampling.extra)
        return sampling

    async def generate(self, prompt_ids: list[int], sampling: Sampling, on_delta: OnDelta | None = None) -> Completion:
        """The completion of ``prompt_ids``: generated until the server stops by itself or the token budget is
        spent, aborts resubmitted with the tokens so far, every log-probability there and checked; a part whose
        tokens the server could not score on the weights that generated them is generated again (bounded).
        With ``on_delta``, the first request is streamed and every part is handed to it as it arrives
        (`streamgrp.services.gateway.streamed`)."""
        completion = Completion()
        stream = on_delta is not None
        while True:
            budget = sampling.max_tokens - len(completion.token_ids)
            context = prompt_ids + completion.token_ids
            asked = replace(sampling, max_tokens=budget)
            path, body = self.dialect.generate(context, asked)
            limit = _reply_limit(body, len(context) + budget)
            streamed = None
            if stream and on_delta is not None:
                stream = False
                streamed = await stream_turn(
                    self.requests,
                    self.dialect,
                    context,
                    asked,
                    max_bytes=STREAM_BYTES_FACTOR * limit,
                    on_delta=on_delta,
                )
            cut = False
            if streamed is not None:
                generation, server, cut = streamed
            else:
                reply, server = await self.requests.post(path, body, max_bytes=limit)
                try:
                    generation = await self._every_logprob(self.dialect.parse(reply), context, budget, server, sampling)
                except WeightsChanged as changed:  # a weight sync between generating and scoring: the worker's rule
                    regenerate(completion, changed, 1)
                    continue
                if on_delta is not None:
                    await on_delta(generation.token_ids, generation.logprobs, generation.text, generation.model)
            completion.add(generation, server, 1)
            if cut and len(completion.token_ids) < sampling.max_tokens:
                continue  # the stream broke or lost tokens (not an abort the server chose): the rest, plainly
            if finished_or_resubmit(
                completion,
                generation,
                server,
                self.dialect.name,
                sampling.max_tokens,
                self.on_abort,
                self.max_resubmits,
            ):
                return completion

    async def _every_logprob(
        self, generation: Generation, context: list[int], budget: int, server: str, sampling: Sampling
    ) -> Generation:
        where = f"the {self.dialect.name} reply from {server}"
        if len(generation.token_ids) > budget:
            raise ProtocolError(
                f"{where} has {len(generation.token_ids)} tokens, more than the {budget} the request "
                "allowed; the server does not honour the token limit"
            )
        values = list(generation.logprobs)
        for position in generation.unscored:
            values[position] = await self._score(
                context + generation.token_ids[:position],
                generation.token_ids[position],
                server,
                generation.model,
                sampling,
                where=f"{where}, completion token {position}",
            )
        return replace(generation, logprobs=checked_logprobs(values, where))

    async def _score(
        self, context: list[int], token: int, server: str, model: str, sampling: Sampling, *, where: str
    ) -> float:
        """``token``'s log-probability after ``context``, teacher-forced on the server that sampled it."""
        if self.dialect.anchor_text and self._anchor is None:
            request = self.dialect.tokenize({"text": self.dialect.anchor_text}, sampling.model)
            if request is not None:
                reply, _ = await self.requests.post(request[0], request[1], max_bytes=REPLY_BASE_BYTES, server=server)
                self._anchor = self.dialect.parse_tokens(reply)[-1]
        for path, body, entries in self.dialect.score_requests(context, token, self._anchor, sampling):
            reply, _ = await self.requests.post(
                path, body, max_bytes=_reply_limit(body, len(context) + entries), server=server
            )
            value, scored_by = self.dialect.parse_score(reply, token)
            if scored_by != model:
                raise WeightsChanged(where, model, scored_by)
            if value is not None:
                return value
        raise ProtocolError(
            f"{where} (id {token}) came without a log-probability, and scoring it again teacher-forced "
            f"gave none either; check the {self.dialect.name} server's version and flags"
        )


#: A stream carries each token in an event of its own (ids, log-probabilities, text, framing): room for that.
STREAM_BYTES_FACTOR = 4


def _reply_limit(body: dict[str, Any], tokens: int) -> int:
    return REPLY_BASE_BYTES + len(orjson.dumps(body)) + REPLY_BYTES_PER_TOKEN * tokens

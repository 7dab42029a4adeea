"""`InferenceRollout`: one slot's generation on a real inference server, turned into a `Sample`.

Owns what users get bitten by when they write this themselves:

- token ids in, token ids out: the prompt is token ids (a text prompt is tokenized once, by the
  server, and the ids are what is sent); the completion is the server's ids, never its text
  tokenized again; ``token_ids = prompt + completion``, ``loss_mask`` 0 over the prompt and 1 over
  the completion, ``logprobs`` 0 over the prompt and the server's over the completion;
- a generation the server aborted (weight update, preemption) is resubmitted with the tokens so far
  (prompt + generated, for the tokens still allowed), at most ``max_resubmits`` times, or, with
  ``on_abort = "fail"``, fails the slot with the server's reason;
- transport errors (unreachable, timeout, 5xx/429, a body that is not JSON) are retried with bounded
  exponential backoff and jitter, on another server when there is one, then fail the slot naming the
  last error; a 4xx or a reply without the ids and log-probs asked for fails at once (retrying the
  same request cannot help). A lone server that went away (refused or dropped the connection, or 503
  while it loads: a restart for a weight sync) is waited for, up to ``restart_wait_s`` per request,
  by polling ``GET /health``; the moment it answers, the request is sent again, and that attempt
  does not count against ``attempts``: a sync is something to wait through, not an error, and it
  costs what the restart takes, not a backoff;
- the slot's policy version is the weight version the server reports, else the run's version when
  the request started; a completion stitched from several segments (aborted, resubmitted, maybe
  served by new weights) records the oldest version any segment used, so staleness is never understated;
- one log-probability per generated token id, always: where a reply lacks some (llama-server and
  multi-byte characters), each missing one is scored again, teacher-forced, on the server that
  generated it, or the slot fails saying why; every value must be a finite float32 not above 0
  (float noise up to `core.value_checks.LOGPROB_TOLERANCE` is recorded as 0). When that server
  answers the scoring with another model than it generated with (a weight sync restarted it on a
  new version in between), nothing of the segment is kept: it is generated again, on the weights
  served now, at most `MAX_REGENERATIONS` times per slot (a sync is waited through, not a failure;
  a log-probability of one version is never recorded beside tokens of another);
- with ``segment_tokens`` (and a worker that binds a segment store: `bind_segments`), a generation is
  streamed, one request for all of it, and cut into durable `SlotSegment` events as it arrives: every
  ``segment_tokens`` tokens or ``segment_s`` seconds, and at its end, an abort or a broken stream
  (`streamgrp.services.inference.streaming`); a stream broken by a restart (a weight sync) keeps what it
  streamed and goes on from it under the new weights, waited through like a restart before a request.
  With ``segment_stream`` off (or a dialect that cannot stream), it is asked for in chunks of at most
  ``segment_tokens`` tokens instead, each continued from prompt + tokens so far (each prefills the whole
  context again). A slot of a task taken over from a worker that stopped continues from its segments
  instead of from scratch, and its sample is exactly their concatenation
  (`streamgrp.services.inference.segments`);
- the reply is bounded by what was asked: never more tokens than ``max_tokens``, and a body is read
  only up to what that many tokens (and the prompt echoed back) could take, so a runaway server fails
  the slot at once instead of costing the worker its memory.

Every wait is bounded (request deadline x attempts, backoff cap, resubmission cap), so a slot always
ends: a sample, a rejection (the reward function returned None) or a failure with the reason.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson

from streamgrp.core.events import Sample
from streamgrp.services.inference.completion import (  # noqa: F401  (the gateway's and tests' names, from here)
    MAX_REGENERATIONS,
    Completion,
    GenerationFailed,
    WeightsChanged,
    finished_or_resubmit,
    regenerate,
)
from streamgrp.services.inference.dialect import Dialect, Generation, ProtocolError, Sampling, checked_logprobs
from streamgrp.services.inference.pool import ServerPool
from streamgrp.services.inference.retries import RetriedRequests, Retry
from streamgrp.services.inference.streaming import SegmentCutter, StreamedPart, read_stream

if TYPE_CHECKING:
    from streamgrp.services.inference.segments import SlotSegments
    from streamgrp.store.segments import SegmentStore

RewardFn = Callable[[dict[str, Any], list[int], str], "float | None"]
#: Tokenized text prompts kept per worker process: a task's slots share one tokenization.
TOKENIZE_CACHE = 1024


class InferenceRollout(RetriedRequests):
    """A rollout function (``SlotRequest -> Sample | None``) backed by inference servers of one dialect."""

    def __init__(
        self,
        dialect: Dialect,
        pool: ServerPool,
        sampling: Sampling,
        reward: RewardFn,
        *,
        retry: Retry = Retry(),  # noqa: B008 - a frozen dataclass (`streamgrp.services.inference.retries`)
        request_timeout_s: float = 120.0,
        on_abort: str = "resubmit",
        max_resubmits: int = 4,
        keep_text: bool = True,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        restart_wait_s: float = 60.0,
        segment_tokens: int = 0,
        segment_s: float = 30.0,
        segment_stream: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        dialect.check_extra(sampling.extra)
        self.dialect = dialect
        self.pool = pool
        self.sampling = sampling
        self.reward = reward
        self.retry = retry
        self.request_timeout_s = request_timeout_s
        self.on_abort = on_abort
        self.max_resubmits = max_resubmits
        self.keep_text = keep_text
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.restart_wait_s = restart_wait_s
        self.segment_tokens = segment_tokens
        self.segment_s = segment_s
        self.segment_stream = segment_stream
        self.clock = clock
        self.segments: SegmentStore | None = None
        self._tokenized: dict[bytes, list[int]] = {}
        self._lock = threading.Lock()

    def bind_segments(self, client: Any, partitions: Any, name: str) -> None:
        """Record slots' segments through the worker's connection as consumer ``name`` (with ``segment_tokens``)."""
        if self.segment_tokens > 0:
            from streamgrp.store.segments import SegmentStore

            self.segments = SegmentStore(client, partitions, name=name)

    def __call__(self, request: Any) -> Sample | None:
        prompt_ids = self.prompt_ids(request.prompt)
        slot = None
        task_entry: str = getattr(request, "task_entry", "")
        if self.segments is not None and task_entry:
            from streamgrp.services.inference.segments import SlotSegments

            slot = SlotSegments(self.segments, request)
        completion = self.complete(prompt_ids, slot=slot)
        if slot is not None:
            slot.settle()  # its segments durable before its result is published
        reward = self.reward(request.prompt, list(completion.token_ids), completion.text)
        if reward is None:
            return None
        version = min(request.version if v is None else v for v in completion.versions)
        n_prompt, n_completion = len(prompt_ids), len(completion.token_ids)
        meta: dict[str, Any] = {
            "server": completion.servers[-1] if completion.servers else "",
            "finish": completion.finish,
            "versions": completion.versions,
            "resubmits": completion.resubmits,
            "attempts": completion.attempts,
            "prompt_tokens": n_prompt,
            "model": completion.model,
        }
        if completion.reason:
            meta["reason"] = completion.reason
        if completion.rescored:
            meta["rescored"] = completion.rescored  # log-probabilities the reply lacked, scored again
        if completion.regenerated:
            meta["regenerated"] = completion.regenerated  # segments generated again after a weight sync
        if completion.streams:
            meta["streams"] = completion.streams
        for name in ("interrupted", "unstreamed"):  # streams broken (their tokens kept); parts asked unstreamed
            if getattr(completion, name):
                meta[name] = getattr(completion, name)
        if self.keep_text:
            meta["text"] = completion.text  # of what this worker generated: not of a prefix it continued from
        if slot is not None:
            meta.update(slot.meta())
        return Sample.from_rows(
            token_ids=[prompt_ids + completion.token_ids],
            loss_mask=[[0] * n_prompt + [1] * n_completion],
            logprobs=[[0.0] * n_prompt + completion.logprobs],
            rewards=[float(reward)],
            version=version,
            meta=meta,
        )

    # -- the prompt ---------------------------------------------------------------------------------------

    def prompt_ids(self, prompt: dict[str, Any]) -> list[int]:
        """The prompt's token ids: ``prompt_ids`` (or ``input_ids``) as given, else the server's tokenization
        of ``text`` (or of ``messages`` where the dialect has a chat tokenizer), done once per prompt."""
        for name in ("prompt_ids", "input_ids"):
            if name in prompt:
                ids = prompt[name]
                if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
                    raise ValueError(f"prompt {name} must be a non-empty list of token ids, got {str(ids)[:100]}")
                return ids
        request = self.dialect.tokenize(prompt, self.sampling.model)
        if request is None:
            raise ValueError(
                f"the prompt has neither prompt_ids nor a form the {self.dialect.name} adapter "
                f"tokenizes (keys: {sorted(prompt)[:10]}); give prompt_ids"
            )
        key = orjson.dumps(request, option=orjson.OPT_SORT_KEYS)
        with self._lock:
            cached = self._tokenized.get(key)
        if cached is None:
            path, body = request
            cached, _, _ = self._with_retries(path, body, self.dialect.parse_tokens, reply_tokens=len(key))
            if not cached:
                raise ValueError(f"the {self.dialect.name} server tokenized the prompt to no tokens")
            with self._lock:
                if len(self._tokenized) >= TOKENIZE_CACHE:
                    self._tokenized.clear()
                self._tokenized[key] = cached
        return list(cached)

    # -- the completion -----------------------------------------------------------------------------------

    def complete(self, prompt_ids: list[int], slot: SlotSegments | None = None) -> Completion:
        """Generate until the server stops by itself or the token budget is spent, resubmitting aborts; with
        ``slot``, from its durable prefix on, streamed and cut into segments recorded there (or in chunks of
        ``segment_tokens``, each one segment)."""
        completion = Completion()
        if slot is not None and slot.chain:
            completion.token_ids, completion.logprobs, completion.versions = slot.resumed_values()
            if slot.ended:
                completion.finish = slot.chain[-1].cause
                return completion
        streaming = (
            slot is not None
            and self.segment_stream
            and self.dialect.stream_generate(prompt_ids, self.sampling) is not None
        )
        unstreamed = False  # the next part is asked for without streaming: a stream lost tokens it cannot carry
        while True:
            left = self.sampling.max_tokens - len(completion.token_ids)
            if left <= 0:
                completion.finish = "length"
                return completion
            if streaming and not unstreamed:
                part = self._stream_part(prompt_ids, completion, left, slot)
                unstreamed = part.lost
                if part.lost or part.broke is not None:
                    continue  # from the tokens kept: unstreamed, or streamed again (after a restart)
                if finished_or_resubmit(
                    completion,
                    part.generation,
                    completion.servers[-1],
                    self.dialect.name,
                    self.sampling.max_tokens,
                    self.on_abort,
                    self.max_resubmits,
                ):
                    return completion
                continue
            if unstreamed:
                completion.unstreamed += 1
                unstreamed = False
            budget = min(left, self.segment_tokens) if slot is not None else left
            context = prompt_ids + completion.token_ids
            path, body = self.dialect.generate(context, replace(self.sampling, max_tokens=budget))
            generation, server, attempts = self._with_retries(
                path, body, self.dialect.parse, reply_tokens=len(context) + budget
            )
            try:
                generation = self._every_logprob(generation, context, budget, server)
            except WeightsChanged as changed:
                regenerate(completion, changed, attempts)
                continue  # the same segment again, on the weights the servers serve now
            completion.add(generation, server, attempts)
            # a chunk: the server stopped at the chunk's budget, not the slot's; go on from prompt + tokens so far
            chunk = generation.finish == "length" and len(generation.token_ids) == budget < left
            if slot is not None:
                slot.record(
                    generation.token_ids,
                    generation.logprobs,
                    generation.weight_version,
                    "chunk" if chunk else generation.finish,
                )
            if chunk:
                continue
            if finished_or_resubmit(
                completion,
                generation,
                server,
                self.dialect.name,
                self.sampling.max_tokens,
                self.on_abort,
                self.max_resubmits,
            ):
                return completion

    def _stream_part(
        self, prompt_ids: list[int], completion: Completion, left: int, slot: SlotSegments | None
    ) -> StreamedPart:
        """One stream of the rest of the generation (from prompt + tokens so far), added to ``completion``; a
        stream broken by a lone server going away waits for it to come back, as a request would."""
        context = prompt_ids + completion.token_ids
        request = self.dialect.stream_generate(context, replace(self.sampling, max_tokens=left))
        assert request is not None
        path, body = request
        cutter = SegmentCutter(self.segment_tokens, self.segment_s, self.clock())
        limit = self._reply_limit(body, len(context) + left)

        def send(url: str) -> StreamedPart:
            return read_stream(
                self.dialect,
                url,
                context,
                body,
                path,
                budget=left,
                timeout_s=self.request_timeout_s,
                max_bytes=limit,
                slot=slot,
                cutter=cutter,
                clock=self.clock,
            )

        part, server, attempts = self._with_retries(path, body, None, reply_tokens=len(context) + left, send=send)
        completion.add(part.generation, server, attempts)
        completion.streams += 1
        if part.broke is not None:
            completion.interrupted += 1
            if part.broke.server_away and len(self.pool.urls) == 1:
                self._await_restart(server, self.restart_wait_s)
        return part

    def _every_logprob(self, generation: Generation, context: list[int], budget: int, server: str) -> Generation:
        """``generation`` within its budget, with the log-probabilities its reply lacked scored again, all checked."""
        where = f"the {self.dialect.name} reply from {server}"
        if len(generation.token_ids) > budget:
            raise ProtocolError(
                f"{where} has {len(generation.token_ids)} tokens, more than the {budget} the request "
                "allowed; the server does not honour the token limit, so the slot fails"
            )
        values = list(generation.logprobs)
        for position in generation.unscored:
            values[position] = self._score(
                context + generation.token_ids[:position],
                generation.token_ids[position],
                server,
                generation.model,
                where=f"{where}, completion token {position}",
            )
        return replace(generation, logprobs=checked_logprobs(values, where))

    def _score(self, context: list[int], token: int, server: str, model: str, *, where: str) -> float:
        """The log-probability of ``token`` after ``context``, teacher-forced on the server that sampled it
        (another server may serve other weights)."""
        anchor = self.prompt_ids({"text": self.dialect.anchor_text})[-1] if self.dialect.anchor_text else None
        for path, body, entries in self.dialect.score_requests(context, token, anchor, self.sampling):
            (value, scored_by), _, _ = self._with_retries(
                path,
                body,
                lambda reply: self.dialect.parse_score(reply, token),
                reply_tokens=len(context) + entries,
                server=server,
            )
            if scored_by != model:
                raise WeightsChanged(where, model, scored_by)
            if value is not None:
                return value
        raise ProtocolError(
            f"{where} (id {token}) came without a log-probability, and scoring it again teacher-forced "
            f"gave none either, so it cannot be trained on; check the {self.dialect.name} server's "
            "version and flags (it must report log-probabilities, n_probs)"
        )

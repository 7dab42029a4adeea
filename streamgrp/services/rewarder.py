"""The reward stage: score results published with their reward pending, and post each reward as an event.

Owns running the user's reward function over the results a `RewardClient` takes: sync functions on a
thread pool, async ones on an event loop of their own, at most ``concurrency`` at once, each within
``timeout_s``; a transient failure (a timeout, a connection or OS error) is retried up to ``retries``
times with a growing pause, any other exception fails the slot at once with its text. The function
takes a `ScoreRequest` and returns a number (every row's reward), one number per row, or None
(the sample is rejected).

Several rewarders share a run's results (one consumer group); one that is killed leaves its results
pending, and another takes them over after ``claim_idle_s`` (a live rewarder refreshes the claims it
is still scoring, so a slow score is not taken from it). Posting acknowledges the result in the same
call, so a result scored by two rewarders has one reward. Deciding what a reward does to the group is
the assembler's business.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from streamgrp.core.events import Sample
from streamgrp.errors import ConfigError
from streamgrp.store.rewards import PendingResult, RewardClient

__all__ = ["TRANSIENT", "Rewarder", "ScoreRequest", "Scored"]

log = logging.getLogger(__name__)

#: Exceptions worth a retry: the scorer's service was slow or unreachable, not wrong.
TRANSIENT: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError, OSError)
MAX_ERROR_CHARS = 4000
#: The pause before retry n (seconds): RETRY_PAUSE_S * 2**n.
RETRY_PAUSE_S = 0.25
#: How many failures one warning line sums up at most once per this many seconds.
FAILURE_LOG_EVERY_S = 30.0


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """What a reward function scores: ``sample`` (its token ids, logprobs, mask, ``meta``) of ``slot`` of
    ``task_id``, whose task asked ``prompt`` (None when the task is beyond what the rewarder can find)."""

    task_id: str
    slot: int
    prompt: dict[str, Any] | None
    sample: Sample
    #: The worker that generated it.
    producer: str = ""


@dataclass(frozen=True, slots=True)
class Scored:
    """What scoring one result came to: rewards (one per row, or one for all), a rejection, or an error."""

    rewards: tuple[float, ...] | None = None
    reason: str | None = None
    error: str | None = None

    @property
    def outcome(self) -> str:
        return "sample" if self.rewards is not None else "rejected" if self.reason is not None else "failed"


class Rewarder:
    """Scores pending results with ``reward`` and posts their rewards until ``stop`` is set."""

    def __init__(
        self,
        client: RewardClient,
        reward: Callable[[ScoreRequest], Any],
        *,
        concurrency: int = 16,
        timeout_s: float = 60.0,
        retries: int = 2,
        metrics: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if concurrency < 1:
            raise ConfigError(f"concurrency={concurrency}: give at least 1")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s={timeout_s}: give a positive number of seconds")
        if retries < 0:
            raise ConfigError(f"retries={retries}: give 0 or more")
        self.client = client
        self.reward = reward
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.metrics = metrics
        self._clock = clock
        self._is_async = inspect.iscoroutinefunction(reward) or (
            # mypy takes ``reward.__call__`` of a Callable-typed value for a call of it (not a library's hint).
            callable(reward) and inspect.iscoroutinefunction(reward.__call__)  # type: ignore[operator]
        )
        self._threads = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="reward-loop", daemon=True)
        self.posted = 0
        self._failures = 0
        self._failure_logged_at = 0.0

    def run(self, stop: threading.Event | None = None, *, until_idle_s: float | None = None) -> int:
        """Score and post until ``stop`` is set (or, with ``until_idle_s``, until nothing came that long);
        returns the number of rewards posted."""
        stop = stop or threading.Event()
        self._loop_thread.start()
        in_flight: dict[Future, PendingResult] = {}
        refresh_every = self.client.claim_idle_ms / 3000
        refreshed_at = time.monotonic()
        idle_since = time.monotonic()
        try:
            while not stop.is_set():
                room = self.concurrency - len(in_flight)
                if room > 0:
                    for result in self.client.take(room, block_ms=None if in_flight else 500):
                        in_flight[self._submit(result)] = result
                        idle_since = time.monotonic()
                if in_flight:
                    done, _ = wait(list(in_flight), timeout=0.05, return_when=FIRST_COMPLETED)
                    for future in done:
                        self._post(in_flight.pop(future), future.result())
                    if time.monotonic() - refreshed_at > refresh_every and in_flight:
                        self.client.refresh(list(in_flight.values()))
                        refreshed_at = time.monotonic()
                elif until_idle_s is not None and time.monotonic() - idle_since > until_idle_s:
                    break
                if self.metrics is not None:
                    self.metrics.rewards_in_flight.set(len(in_flight))
        finally:
            for future in in_flight:
                future.cancel()  # their results stay pending in the group: another rewarder takes them
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._threads.shutdown(wait=False, cancel_futures=True)
        return self.posted

    def _submit(self, result: PendingResult) -> Future:
        request = ScoreRequest(result.task_id, result.slot, result.prompt, result.sample, result.producer)
        return asyncio.run_coroutine_threadsafe(self._score(request), self._loop)

    async def _score(self, request: ScoreRequest) -> Scored:
        """The request's score, never an exception: a failure that retries cannot mend becomes an error."""
        for attempt in range(self.retries + 1):
            try:
                if self._is_async:
                    value = await asyncio.wait_for(self.reward(request), self.timeout_s)
                else:
                    value = await asyncio.wait_for(
                        asyncio.get_running_loop().run_in_executor(self._threads, self.reward, request), self.timeout_s
                    )
                return _scored(value, request.sample.rows)
            except TRANSIENT as exc:
                why = (
                    f"timed out after {self.timeout_s:g} s (--reward-timeout-s)"
                    if isinstance(exc, TimeoutError) and not str(exc)
                    else _text(exc)
                )
                if attempt == self.retries:
                    return Scored(error=f"scoring failed {attempt + 1} time(s); last: {why}"[:MAX_ERROR_CHARS])
                self._count_failure("transient")
                await asyncio.sleep(RETRY_PAUSE_S * 2**attempt)
            except Exception as exc:  # the user's function raised: the slot fails with its text
                return Scored(error=_text(exc)[:MAX_ERROR_CHARS])
        raise AssertionError("unreachable")

    def _post(self, result: PendingResult, scored: Scored) -> None:
        if scored.error is not None:
            self._count_failure("error")
            self._log_failure(result, scored.error)
        entry = self.client.post(result, rewards=scored.rewards, reason=scored.reason, error=scored.error)
        if entry is None:
            log.info("task %s slot %s: another rewarder posted its reward first", result.task_id, result.slot)
            return
        self.posted += 1
        if self.metrics is not None:
            self.metrics.rewards.labels(scored.outcome).inc()
            self.metrics.reward_latency.observe(max(0.0, self._clock() - result.published_at))

    def _count_failure(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.reward_failures.labels(kind).inc()

    def _log_failure(self, result: PendingResult, error: str) -> None:
        self._failures += 1
        now = time.monotonic()
        if now - self._failure_logged_at >= FAILURE_LOG_EVERY_S:
            log.warning(
                "scoring task %s slot %s failed (%d failure(s) since the last warning): %s",
                result.task_id,
                result.slot,
                self._failures,
                error,
            )
            self._failures, self._failure_logged_at = 0, now


def _scored(value: Any, rows: int) -> Scored:
    """What the reward function returned, as a `Scored`; a value that is no reward is an error."""
    if value is None:
        return Scored(reason="the reward function returned None")
    if isinstance(value, bool) or not isinstance(value, (int, float, Sequence)):
        return Scored(
            error=f"the reward function returned {type(value).__name__}; return a number, one number per row, or None"
        )
    values = (value,) if isinstance(value, (int, float)) else tuple(value)
    if len(values) not in (1, rows) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return Scored(
            error=f"the reward function returned {value!r:.200}; return a number, one number per row ({rows}), or None"
        )
    rewards = tuple(float(v) for v in values)
    if not all(r == r and abs(r) != float("inf") for r in rewards):
        return Scored(error=f"the reward function returned {rewards!r:.200}: rewards must be finite")
    return Scored(rewards=rewards)


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip() or type(exc).__name__

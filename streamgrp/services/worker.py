"""Rollout workers: take tasks from the run's queue, run a user function per slot, publish results.

Owns the worker side of delivery (the store side is `streamgrp.services.worker_client.WorkerClient`):
a consumer group over the task stream, reclaiming a dead worker's tasks after ``claim_idle_s``
(XAUTOCLAIM), and publishing one `SlotResult` per slot. A task is acknowledged only after every slot's
publish returned, so a worker killed mid-group leaves its task pending; whoever reclaims it republishes
every slot and the assembler counts the repeats as duplicates (first result wins). A task that runs
longer than ``claim_idle_s`` is claimed again by its worker every third of that while it runs, so
only a worker that stopped loses its tasks. Deciding groups is not the worker's business.

The user function takes a `SlotRequest` and returns a `Sample` (usable), a `RewardLater` (a sample
whose reward another process posts later: the slot waits for it), None (rejected), or raises
(failed, with the exception text). It may be sync (run on a thread pool) or async. A sample
whose values cannot train (`streamgrp.core.value_checks`: non-finite or positive logprobs, token ids
below 0 or at or above the run's ``vocab_size``, a loss mask that is not 0/1 or trains nothing) is
published as a failed slot saying what is wrong (`InvalidSample`), counted as ``invalid``: values are
refused where they enter, and a bad rollout never stops the worker.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis

from streamgrp.config import WorkerConfig
from streamgrp.core.events import Sample
from streamgrp.core.values import RewardLater
from streamgrp.services import heap
from streamgrp.services.worker_client import (
    InvalidSample,
    RateLimitedWarning,
    SlotOutcome,
    SlotRequest,
    Task,
    WorkerClient,
)
from streamgrp.store.connection import is_outage, outage_of
from streamgrp.store.run_end import RunEndWatch

__all__ = ["InvalidSample", "SlotOutcome", "SlotRequest", "Task", "WorkerClient", "WorkerProcess"]

log = logging.getLogger(__name__)

#: What the server answers an append to a stream at the largest id there is; and how long to wait then.
LOG_FULL = "exhausted the last possible ID"
LOG_FULL_WAIT_S = 5.0


@dataclass
class _InFlight:
    """A task whose slots are running: their futures, and which of them are published already."""

    task: Task
    requests: list[SlotRequest]
    futures: list[Future[Any]]
    published: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.published) == len(self.futures)


class WorkerProcess:
    """The `streamgrp worker` loop: keeps up to ``concurrency`` slots running, publishes whatever slots
    are ready in one call per round, and acknowledges each task once all its slots are published."""

    def __init__(
        self,
        worker: WorkerClient,
        rollout: Callable[..., Any],
        config: WorkerConfig,
        *,
        n_samples: int,
        version: Callable[[], int] = lambda: 0,
        metrics: Any = None,
    ) -> None:
        self.worker = worker
        self.rollout = rollout
        self.config = config
        self.n_samples = n_samples
        self.version = version
        self.metrics = metrics
        self.tasks_done = 0
        self._raised = RateLimitedWarning(
            "%d rollout(s) raised since the last warning; their slots are published "
            "as failed with the exception's text (the latest: %s)"
        )
        self._is_async = inspect.iscoroutinefunction(rollout)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.run_end = RunEndWatch(worker.client, worker.keys)
        if hasattr(rollout, "bind_segments"):  # an inference adapter records its slots' segments through us
            rollout.bind_segments(worker.client, worker.partitions, worker.name)

    def run(self, stop: threading.Event | None = None) -> int:
        stop = stop or threading.Event()
        heap.settle()  # imports and the rollout's set-up: out of the collector's way while slots run
        in_flight: list[_InFlight] = []
        loop_thread = self._start_loop() if self._is_async else None
        held_at = time.monotonic()
        with ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="slot") as pool:
            while not stop.is_set():
                in_flight = self._publish_ready(in_flight)
                if in_flight and time.monotonic() - held_at >= self.worker.hold_every_s:
                    held_at = self._hold(in_flight)
                room = self._room(in_flight)
                if room is None:
                    break  # max_tasks reached and nothing left in flight
                if room <= 0:
                    _wait_any(in_flight, timeout=self.worker.hold_every_s)
                    continue
                # A burst worker drains what is queued and exits: its empty read must not wait for more.
                tasks = self._take(room, block=not in_flight and not self.config.burst)
                if tasks is None:
                    continue  # the server was away; ridden out
                if not tasks:
                    if self.config.burst and not in_flight:
                        break
                    ended = None if in_flight else self.run_end.ended()
                    if ended is not None:
                        log.info(
                            "run %s %s: no task will come; worker %s exits",
                            self.worker.keys.run,
                            ended,
                            self.worker.name,
                        )
                        break
                    if in_flight:
                        _wait_any(in_flight, timeout=0.05)
                    continue
                version = self.version()
                for task in tasks:
                    requests = task.requests(self.n_samples, version)
                    in_flight.append(_InFlight(task, requests, [pool.submit(self._run_slot, r) for r in requests]))
            for item in in_flight:  # stopping: finish and publish what is running, so no slot is lost
                for future in item.futures:
                    future.result()
            self._publish_ready(in_flight)
        if loop_thread is not None and self._loop is not None:  # the loop _start_loop made for async rollouts
            self._loop.call_soon_threadsafe(self._loop.stop)
            loop_thread.join()
            self._loop.close()
            self._loop = None
        return self.tasks_done

    def _start_loop(self) -> threading.Thread:
        self._loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self._loop.run_forever, name="rollout-loop", daemon=True)
        thread.start()
        return thread

    def _hold(self, in_flight: list[_InFlight]) -> float:
        """Claim the tasks still running again (`WorkerClient.hold`); returns when (time.monotonic())."""
        try:
            self.worker.hold([item.task for item in in_flight])
        except Exception as exc:
            if not is_outage(exc):
                raise
            # Not ridden out here: the next round tries again, and the publish rides the outage.
            log.warning("could not claim the running tasks again (%s); trying again next round", exc)
        return time.monotonic()

    def _room(self, in_flight: list[_InFlight]) -> int | None:
        """How many more tasks to take now; None once ``max_tasks`` is reached and nothing is in flight."""
        capacity = max(1, -(-self.config.concurrency // self.n_samples))  # tasks whose slots fill the pool
        room = capacity - len(in_flight)
        max_tasks = self.config.max_tasks
        if max_tasks is not None:
            left = max_tasks - self.tasks_done - len(in_flight)
            if left <= 0:
                return None if not in_flight else 0
            room = min(room, left)
        return room

    def _take(self, room: int, *, block: bool) -> list[Task] | None:
        try:
            return self.worker.take(room, block_ms=500 if block else None)  # None: don't block
        except Exception as exc:
            if not is_outage(exc):
                raise
            # A task read whose reply was lost sits in our pending list; XAUTOCLAIM hands it
            # back (to us or another worker) once it has been idle for claim_idle_s.
            outage_of(self.worker.client).ride_out(exc, self.worker.client)
            return None

    def _publish_ready(self, in_flight: list[_InFlight]) -> list[_InFlight]:
        """Publish every finished, unpublished slot in one call; acknowledge the tasks now complete."""
        ready: list[tuple[_InFlight, int]] = []
        complete: list[Task] = []  # the tasks this publish completes: acknowledged in the same call
        for item in in_flight:
            finished = [
                index for index, future in enumerate(item.futures) if index not in item.published and future.done()
            ]
            ready += [(item, index) for index in finished]
            if len(item.published) + len(finished) == len(item.futures):
                complete.append(item.task)
        if ready:
            results = [(item.task.event.task_id, index, item.futures[index].result()) for item, index in ready]
            # a publish error surfaces here and stops the worker; results were checked on their slot's thread
            try:
                self.worker.publish_many(results, done=complete, checked=True)
            except redis.exceptions.ResponseError as exc:
                if self.config.burst or LOG_FULL not in str(exc):
                    raise
                # A foreign entry at the largest stream id: nothing can be published to this run again. The
                # results wait and the worker with them (the batcher's stall bound ends the run), not exiting.
                log.error("slot results cannot be published; retrying in %.0f s: %s", LOG_FULL_WAIT_S, exc)
                time.sleep(LOG_FULL_WAIT_S)
                return in_flight
            for (item, index), (_, _, result) in zip(ready, results):
                item.published.add(index)
                self._count(result, item.requests[index].version)
        self.tasks_done += len(complete)
        return [item for item in in_flight if not item.complete]

    def _count(self, result: Any, version: int) -> None:
        if self.metrics is not None:
            outcome = (
                "invalid"
                if isinstance(result, InvalidSample)
                else "failed"
                if isinstance(result, BaseException)
                else "rejected"
                if result is None
                else "reward_pending"
                if isinstance(result, RewardLater)
                else "sample"
            )
            self.metrics.slots_published.labels(outcome).inc()
            self.metrics.policy_version.set(version)

    def _run_slot(self, request: SlotRequest) -> SlotOutcome:
        """The slot's result, never an exception raised: the user's failure becomes a failed slot."""
        metrics, started = self.metrics, time.monotonic()
        if metrics is not None:
            metrics.rollouts_in_flight.inc()
        try:
            if self._is_async:
                if self._loop is None:
                    raise RuntimeError("an async rollout runs inside Worker.run, which starts its event loop")
                result = asyncio.run_coroutine_threadsafe(self.rollout(request), self._loop).result()
            else:
                result = self.rollout(request)
            if result is not None and not isinstance(result, (Sample, RewardLater)):
                result = TypeError(
                    f"rollout returned {type(result).__name__}; return a streamgrp.Sample, a RewardLater or None"
                )
        except Exception as exc:
            result = exc
        finally:
            if metrics is not None:
                metrics.rollouts_in_flight.dec()
                metrics.rollout_seconds.observe(time.monotonic() - started)
        if isinstance(result, BaseException):
            text = "".join(traceback.format_exception_only(type(result), result)).strip()
            self._raised.add(f"task {request.task_id} slot {request.slot}: {text[:500]}")
            if metrics is not None:
                metrics.rollout_raised(result)
        return self.worker.check(result)


def _wait_any(in_flight, timeout: float | None = None) -> None:
    """Wait until a slot finishes, unless one already has and is not published yet: results that finished
    while the last publish was on the wire go out in the next round, never behind a slow rollout."""
    from concurrent.futures import FIRST_COMPLETED, wait

    if any(
        future.done() and index not in item.published for item in in_flight for index, future in enumerate(item.futures)
    ):
        return
    pending = [f for item in in_flight for f in item.futures if not f.done()]
    if pending:
        wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

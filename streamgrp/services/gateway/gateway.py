"""`Gateway`: what `streamgrp gateway` does per request, whatever HTTP server carries it.

Owns the lifecycle of agent sessions over a run's tasks:

- **open** (`open_sessions`): the sessions of one task, one per slot, each with its own key. The task is
  one a caller took from the run's queue (`streamgrp agent`, a worker of sessions), or in online mode
  one the gateway takes itself for an external app. Opening acknowledges the task: from then on the
  sessions own it, and each ends by the task's group deadline at the latest.
- **turns** (`chat`, `complete`, from `streamgrp.services.gateway.turns.GatewayTurns`): a request with a
  session's key is one turn of that session, recorded in the run before the answer is sent.
- **end** (`end_session`): with a reward the session's turns become its slot's sample
  (`streamgrp.core.session_rows`: one row while they extend each other), with None a rejection, with an
  error a failure; published with the session's end in one call. An online app may end a session with
  its reward pending and post the reward later (`post_reward`, the run's `SlotRewarded` event). A session
  still open at its group's deadline is ended as ``timeout`` by `refresh` and publishes nothing: the
  assembler times its slot out.

Requests to inference servers are made on the event loop (`streamgrp.services.gateway.upstream`); the
store's calls, which block, run on a thread pool. `TurnTimer` keeps the time a turn spent waiting for
the inference server apart, so the gateway's own time per turn (its overhead) can be measured. Several
gateways may serve one run: the store numbers each session's turns and refuses a second writer, which
then reads the session again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from streamgrp.core.events import Sample
from streamgrp.core.session_rows import Turn, contract_problem, session_sample
from streamgrp.errors import SessionRefused
from streamgrp.services.gateway.live import LiveSession, SessionTable
from streamgrp.services.gateway.templates import ChatTemplate
from streamgrp.services.gateway.turns import GatewayTurns
from streamgrp.services.gateway.upstream import Upstream
from streamgrp.services.worker import WorkerClient
from streamgrp.store.rewards import post_reward
from streamgrp.store.runs import Run, server_time
from streamgrp.store.sessions import (
    SessionStore,
    StoredSession,
    key_digest,
    new_key,
    new_session_id,
)
from streamgrp.store.streams import producer_name
from streamgrp.store.version import VersionReader

log = logging.getLogger(__name__)

#: Longest an online-mode open waits for a task to arrive.
MAX_TAKE_WAIT_S = 30.0


class Gateway(GatewayTurns):
    """The sessions of one run, served over the inference servers of ``upstream``.

    ``metrics``: the gateway's `streamgrp.cli.metrics.Metrics` (role ``gateway``), or None."""

    def __init__(
        self,
        client: redis.Redis,
        run: Run,
        upstream: Upstream,
        template: ChatTemplate,
        *,
        public_url: str,
        tool_parser: str = "hermes",
        max_entry_bytes: int | None = None,
        metrics: Any = None,
        threads: int = 32,
        claim_idle_s: float = 30.0,
        vocab_size: int | None = None,
        crash_after_turn: int | None = None,
    ) -> None:
        self.client = client
        self.run = run
        self.upstream = upstream
        self.template = template
        self.public_url = public_url.rstrip("/")
        self.tool_parser = tool_parser
        self.max_entry_bytes = max_entry_bytes
        self.metrics = metrics
        self.name = producer_name("gateway")
        self.store = SessionStore(client, run.partitions, producer=self.name)
        self.worker = WorkerClient(
            client,
            run.keys,
            name=self.name,
            claim_idle_s=claim_idle_s,
            partitions=run.partitions,
            vocab_size=vocab_size if vocab_size is not None else "recorded",
        )
        # The worker client resolved its "recorded" marker to the run's number: no text remains.
        self.vocab_size = None if isinstance(self.worker.vocab_size, str) else self.worker.vocab_size
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="gateway")
        self.table = SessionTable(lambda sid: self.blocking(self._load, sid), tool_parser)
        self._versions = VersionReader(run.keys)
        self.version = self._versions.read(client)
        self._clock_offset = server_time(client) - time.time()
        self.crash_after_turn = crash_after_turn
        self.turns_recorded = 0
        self._taking = asyncio.Lock()
        self._aclient: Any = None  # the loop's client of the server, made on the loop (False: none)

    async def aclose(self) -> None:
        """Release the template's connections (on the loop that used them)."""
        await self.template.close()
        if self._aclient:
            await self._aclient.aclose()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    async def blocking(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` on the thread pool."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(function, *args, **kwargs)
        )

    def server_now(self) -> float:
        """The server's clock, as last measured against this machine's (`refresh`)."""
        return time.time() + self._clock_offset

    # -- control: open and end sessions ------------------------------------------------------------------

    async def open_sessions(
        self, *, task_entry: str | None = None, partition: int = 0, wait_s: float = 0.0
    ) -> dict[str, Any] | None:
        """Open the sessions of a task: the one at ``task_entry`` (taken by the caller), or, without one, the
        next task of the run's queue, waiting up to ``wait_s`` for one (None: none came)."""
        if task_entry is None:
            async with self._taking:  # one take at a time: the worker client's reclaim cursors are not shared
                taken = await self.blocking(
                    self.worker.take, 1, block_ms=int(min(wait_s, MAX_TAKE_WAIT_S) * 1000) or None
                )
            if not taken:
                return None
            task_entry, partition, task = taken[0].entry_id, taken[0].partition, taken[0].event
        else:
            if not 0 <= partition < len(self.run.partitions):
                raise SessionRefused("UNKNOWN", f"partition {partition}: the run has {len(self.run.partitions)}")
            task = await self.blocking(self.store.read_task, partition, task_entry)
            if task is None:
                raise SessionRefused("UNKNOWN", f"no task at entry {task_entry} of partition {partition}'s queue")
        config = self.run.config
        deadline = None if config.group_timeout_s is None else task.issued_at + config.group_timeout_s
        opened = [
            (sid, slot, new_key(sid))
            for slot, sid in ((slot, new_session_id(partition)) for slot in range(config.n_samples))
        ]
        version = self.version
        await self.blocking(
            self.store.open_task, partition, task_entry, task, opened, deadline=deadline, version=version
        )
        for session_id, slot, key in opened:
            self.table.add(
                LiveSession(
                    session_id=session_id,
                    task_id=task.task_id,
                    slot=slot,
                    task_entry=task_entry,
                    deadline=deadline,
                    version=version,
                    status="open",
                    key_digest=key_digest(key),
                )
            )
        if self.metrics is not None:
            self.metrics.gateway_sessions_opened.inc(len(opened))
        left = None if deadline is None else round(deadline - self.server_now(), 3)
        return {
            "task_id": task.task_id,
            "task_entry": task_entry,
            "partition": partition,
            "prompt": task.prompt,
            "n_samples": config.n_samples,
            "version": version,
            "deadline": deadline,
            "deadline_in_s": left,
            "sessions": [
                {"session_id": sid, "slot": slot, "api_key": key, "base_url": f"{self.public_url}/v1"}
                for sid, slot, key in opened
            ],
        }

    async def end_session(
        self, session_id: str, *, reward: float | None, error: str | None = None, reward_pending: bool = False
    ) -> dict[str, Any]:
        """End a session: with a reward its turns become the slot's sample; None rejects it; ``error`` fails it.
        With ``reward_pending`` the sample is published waiting for its reward (`post_reward`, later), which
        its group's deadline bounds."""
        if reward_pending:
            reward = 0.0  # a placeholder the posted reward replaces
        session = await self.table.get(session_id)
        async with session.lock:
            if session.status != "open":
                return await self._ended_before(
                    session, "failed" if error is not None else "rejected" if reward is None else "sample"
                )
            turns = list(session.turns)
            sample, rows = None, 0
            if error is None and reward is not None:
                try:
                    recorded = [Turn(t.prompt_ids, t.completion_ids, t.logprobs, t.version) for t in turns]
                    sample = session_sample(
                        recorded, reward, meta={"session": session_id, "model": turns[-1].model if turns else ""}
                    )
                except ValueError as exc:
                    error = f"SessionError: {exc}"
                if sample is not None:
                    rows = sample.rows
                    problem = contract_problem(self.run.config.policy(), rows) or sample.value_problem(self.vocab_size)
                    if problem is not None:
                        error, sample = f"SessionError: {problem}", None
            try:
                outcome, entry, error = await self._end(
                    session.stored,
                    len(turns),
                    sample,
                    error,
                    reward=None if reward_pending else reward,
                    reward_pending=reward_pending,
                )
            except SessionRefused as refused:
                if refused.code != "EXPIRED":
                    raise
                await self._time_out(session.stored)
                session.status = "timeout"
                self.table.drop(session_id)
                raise SessionRefused(
                    "EXPIRED",
                    f"session {session_id}'s group deadline passed before it ended; it "
                    "timed out and its slot counts as timeout",
                ) from None
            session.status = outcome
            self.table.drop(session_id)
        self._count_end(outcome)
        return {
            "session_id": session_id,
            "outcome": outcome,
            "entry": entry,
            "turns": len(turns),
            "rows": rows if outcome == "sample" else 0,
            "error": error if outcome == "failed" else None,
            "reward_pending": reward_pending and outcome == "sample",
        }

    async def _end(
        self, stored: StoredSession, turns: int, sample: Sample | None, error: str | None, **options: Any
    ) -> tuple[str, str, str | None]:
        """`SessionStore.end`: (the outcome, the slot result's entry id, the error published). A sample the
        payloads stream can never take (a foreign entry at the largest id there is) is published as a failed
        slot saying so, as a worker does, and the session still ends."""
        end = functools.partial(
            self.blocking, self.store.end, stored, turns=turns, max_entry_bytes=self.max_entry_bytes, **options
        )
        try:
            return (*await end(sample=sample, error=error), error)
        except SessionRefused as refused:
            if refused.code != "PAYLOAD":
                raise
            error = f"not published: {refused}"
        log.error("session %s ended as failed: %s", stored.session_id, error)
        return (*await end(error=error), error)

    async def post_reward(self, session_id: str, *, reward: float | None, reason: str | None = None) -> dict[str, Any]:
        """The reward of a session that ended with its reward pending (`streamgrp.store.rewards.post_reward`): a
        number completes its slot's sample, None with a ``reason`` rejects it. The first reward of a slot
        stands; one after its group's deadline is late (the slot timed out waiting)."""
        stored = await self.blocking(self.store.load, session_id, turns=False)
        if stored is None:
            raise SessionRefused("UNKNOWN", f"no session {session_id} in this run")
        if stored.status != "sample" or not stored.reward_pending:
            raise SessionRefused(
                "ENDED",
                f"session {session_id} did not end waiting for its reward "
                f"({stored.status}); end it with reward_pending to post the reward later",
            )
        entry = await self.blocking(
            post_reward,
            self.client,
            self.run.keys,
            task_id=stored.task_id,
            slot=stored.slot,
            reward=reward,
            reason=None if reward is not None else (reason or "rejected"),
            scorer=self.name,
            partitions=self.run.partitions,
        )
        return {"session_id": session_id, "entry": entry, "task_id": stored.task_id, "slot": stored.slot}

    async def _ended_before(self, session: LiveSession, asked: str) -> dict[str, Any]:
        """A session asked to end as it already did (the caller's retry of an end whose answer it lost, maybe
        from a gateway that died): what it published then. Any other end of an ended session is refused."""
        stored = await self.blocking(self.store.load, session.session_id, turns=False)
        if stored is None or stored.status != asked:
            raise SessionRefused(
                "ENDED",
                f"session {session.session_id} ended already "
                f"({stored.status if stored is not None else session.status})",
            )
        return {
            "session_id": session.session_id,
            "outcome": stored.status,
            "entry": stored.result,
            "turns": stored.turn_count,
            "rows": None,
            "error": None,
            "repeat": True,
        }

    async def session_info(self, session_id: str) -> dict[str, Any]:
        stored = await self.blocking(self.store.load, session_id, turns=False)
        if stored is None:
            raise SessionRefused("UNKNOWN", f"no session {session_id} in this run")
        return {
            "session_id": session_id,
            "task_id": stored.task_id,
            "slot": stored.slot,
            "status": stored.status,
            "turns": stored.turn_count,
            "deadline": stored.deadline,
            "entry": stored.result or None,
        }

    # -- upkeep --------------------------------------------------------------------------------------------

    async def refresh(self) -> int:
        """The run's version and the server's clock read again, and every session past its group's deadline
        ended as timed out (publishing nothing); returns how many were."""
        now = await self.blocking(server_time, self.client)
        self._clock_offset = now - time.time()
        self.version = await self.blocking(self._versions.read, self.client)
        ended = 0
        for session_id in await self.blocking(self.store.due, now):
            stored = await self.blocking(self.store.load, session_id, turns=False)
            if stored is None or stored.status != "open":
                continue
            live = self.table.cached(session_id)
            if live is not None:
                async with live.lock:
                    ended += await self._time_out(stored)
                    live.status = "timeout"
                self.table.drop(session_id)
            else:
                ended += await self._time_out(stored)
        if self.metrics is not None:
            self.metrics.gateway_open_sessions.set(await self.blocking(self.store.open_count))
        return ended

    async def _time_out(self, stored: StoredSession) -> int:
        try:
            await self.blocking(self.store.end, stored, turns=stored.turn_count, timeout=True)
        except SessionRefused as refused:
            if refused.code in ("ENDED", "UNKNOWN"):
                return 0  # another gateway ended it first
            raise
        log.info(
            "session %s (task %s, slot %d) timed out with its group", stored.session_id, stored.task_id, stored.slot
        )
        self._count_end("timeout")
        return 1

    def _count_end(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.gateway_sessions.labels(outcome).inc()

    def _load(self, session_id: str) -> StoredSession | None:
        """The session for the table: its state, and its turns only when it is open."""
        state = self.store.load(session_id, turns=False)
        return self.store.load(session_id) if state is not None and state.status == "open" else state

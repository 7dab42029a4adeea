"""`streamgrp agent`: take tasks like a worker and run the user's agent once per slot, each in its own session.

    # myagent.py
    def solve(session):                     # or: async def solve(session), with an AsyncOpenAI client
        reply = session.client.chat.completions.create(model=session.model, messages=[...], tools=[...])
        ...                                 # tools, more turns: any agent framework that takes a client
        return 1.0 if correct else 0.0      # None rejects the slot; raising fails it
    # streamgrp agent --agent myagent:solve --gateway-url http://127.0.0.1:8000

Owns the worker side of agent sessions. Tasks come from the run's queue through a `WorkerClient` (its
consumer group, reclaiming a dead runner's task after ``claim_idle_s``); for each task the gateway opens
one session per slot (`POST /sessions`, which acknowledges the task: from then on the sessions own it),
the agent runs once per session with an OpenAI client whose base URL and key are that session's and
nothing else, and the session is ended with the agent's verdict (`POST /sessions/{id}/end`): a number is
the reward and the gateway publishes the session's recorded turns as the slot's sample, None a
rejection, an exception a failure with its text. An agent still running at its group's deadline is
abandoned: the runner stops waiting, publishes nothing, and the gateway times the session out, so the
slot counts as ``timeout`` like any slot without a result.

Why not `streamgrp.services.worker.WorkerProcess`: an agent's slot may end with no result at all (the
deadline passed), which a rollout function cannot say, and agent sessions spend their time waiting on
HTTP, so one event loop holds them all instead of a thread per slot. Sync agents run on threads.
The agent's client retries what the gateway marks retryable (``--agent-retries``), which rides out a
gateway restart: the restarted gateway reads the session back from the run and goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from streamgrp.errors import StreamgrpError
from streamgrp.services.worker import Task, WorkerClient
from streamgrp.store.connection import is_outage, outage_of

log = logging.getLogger(__name__)

#: Pause between tries of a control call the gateway could not answer (it may be restarting).
CONTROL_RETRY_S = (0.2, 2.0)


class GatewayError(StreamgrpError):
    """The gateway refused a control call, or could not be reached before the session's deadline."""

    def __init__(self, message: str, status: int = 0, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class AgentSession:
    """What an agent function gets: its slot's task and an OpenAI client pointed at its own session.

    ``client`` is an ``openai.OpenAI`` for a plain function, an ``openai.AsyncOpenAI`` for an ``async def``;
    ``base_url`` and ``api_key`` make another client (LangGraph, smolagents, ...) talk as this session.
    The key is good for this session only, and only until it ends."""

    task_id: str
    slot: int
    prompt: dict[str, Any]
    session_id: str
    base_url: str
    api_key: str
    version: int
    client: Any = None
    model: str = "policy"


class GatewayControl:
    """The gateway's control endpoints, over one aiohttp client session, with the gateway's token."""

    def __init__(self, http: Any, url: str, token: str) -> None:
        self.http = http
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}

    async def call(self, path: str, body: dict[str, Any], *, until: float) -> dict[str, Any]:
        """POST ``body``; a reply the gateway marks retryable (or none at all) is tried again until ``until``
        (monotonic)."""
        import aiohttp

        attempt = 0
        while True:
            attempt += 1
            try:
                async with self.http.post(self.url + path, json=body, headers=self.headers) as response:
                    payload = await response.json(content_type=None) if response.status != 204 else {}
                    if response.status < 300:
                        return payload
                    error = (payload or {}).get("error", {}) if isinstance(payload, dict) else {}
                    failure = GatewayError(
                        f"{path}: HTTP {response.status}: {error.get('message', payload)}",
                        response.status,
                        error.get("code"),
                    )
                    if response.headers.get("x-should-retry") != "true":
                        raise failure
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                failure = GatewayError(f"{path}: {type(exc).__name__}: {exc}")
            pause = min(CONTROL_RETRY_S[1], CONTROL_RETRY_S[0] * 2 ** min(attempt, 8)) * random.uniform(0.5, 1.0)
            if time.monotonic() + pause >= until:
                raise failure
            await asyncio.sleep(pause)


class AgentProcess:
    """The `streamgrp agent` loop: keeps up to ``concurrency`` sessions running (whole tasks: their
    ``n_samples`` sessions together) and ends each with its agent's verdict."""

    def __init__(
        self,
        worker: WorkerClient,
        agent: Callable[..., Any],
        *,
        gateway_url: str,
        token: str,
        n_samples: int,
        concurrency: int = 16,
        max_tasks: int | None = None,
        burst: bool = False,
        retries: int = 6,
        request_timeout_s: float = 600.0,
        open_timeout_s: float = 60.0,
    ) -> None:
        self.worker = worker
        self.agent = agent
        self.gateway_url = gateway_url
        self.token = token
        self.n_samples = n_samples
        self.concurrency = concurrency
        self.max_tasks = max_tasks
        self.burst = burst
        self.retries = retries
        self.request_timeout_s = request_timeout_s
        self.open_timeout_s = open_timeout_s
        self.is_async = inspect.iscoroutinefunction(agent)
        self.outcomes: dict[str, int] = {}
        self.tasks_done = 0
        self._threads = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="agent")

    def run(self, stop: threading.Event | None = None) -> int:
        """Take and run tasks until ``stop`` (or, with ``burst``, until none is waiting); the tasks done."""
        try:
            asyncio.run(self._main(stop or threading.Event()))
        finally:
            self._threads.shutdown(wait=False, cancel_futures=True)
        return self.tasks_done

    async def _main(self, stop: threading.Event) -> None:
        import aiohttp

        capacity = max(1, self.concurrency // self.n_samples)
        timeout = aiohttp.ClientTimeout(total=max(self.request_timeout_s, 60.0))
        async with aiohttp.ClientSession(timeout=timeout) as http:
            control = GatewayControl(http, self.gateway_url, self.token)
            running: set[asyncio.Task[None]] = set()
            while not stop.is_set():
                done = {task for task in running if task.done()}
                running -= done
                self.tasks_done += len(done)
                room = capacity - len(running)
                if self.max_tasks is not None:
                    room = min(room, self.max_tasks - self.tasks_done - len(running))
                    if room <= 0 and not running:
                        break
                if room <= 0:
                    await asyncio.wait(running, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    continue
                taken = await asyncio.to_thread(self._take, room, not running)
                if taken is None:
                    continue
                if not taken:
                    if self.burst and not running:
                        break
                    if running:
                        await asyncio.wait(running, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                    continue
                running |= {asyncio.create_task(self._run_task(control, task)) for task in taken}
            if running:  # stopping: the sessions under way end (their deadline bounds the wait)
                await asyncio.wait(running)
                self.tasks_done += len(running)

    def _take(self, room: int, block: bool) -> list[Task] | None:
        try:
            return self.worker.take(room, block_ms=500 if block else None)
        except Exception as exc:
            if not is_outage(exc):
                raise
            outage_of(self.worker.client).ride_out(exc, self.worker.client)
            return None

    async def _run_task(self, control: GatewayControl, task: Task) -> None:
        try:
            opened = await control.call(
                "/sessions",
                {"task_entry": task.entry_id, "partition": task.partition},
                until=time.monotonic() + self.open_timeout_s,
            )
        except GatewayError as exc:
            # TAKEN: another runner opened it. Otherwise the task stays pending and is reclaimed later.
            log.warning("task %s: the gateway opened no sessions (%s)", task.event.task_id, exc)
            return
        left = opened.get("deadline_in_s")
        until = time.monotonic() + (left if isinstance(left, (int, float)) else 365 * 86400.0)
        await asyncio.gather(*(self._run_session(control, opened, session, until) for session in opened["sessions"]))

    async def _run_session(
        self, control: GatewayControl, opened: dict[str, Any], spec: dict[str, Any], until: float
    ) -> None:
        session = AgentSession(
            task_id=opened["task_id"],
            slot=spec["slot"],
            prompt=dict(opened["prompt"]),
            session_id=spec["session_id"],
            base_url=spec["base_url"],
            api_key=spec["api_key"],
            version=opened.get("version", 0),
        )
        session.client = self._client(session)
        body: dict[str, Any]
        try:
            if self.is_async:
                verdict = await asyncio.wait_for(self.agent(session), timeout=max(0.0, until - time.monotonic()))
            else:
                future = asyncio.get_running_loop().run_in_executor(self._threads, self.agent, session)
                verdict = await asyncio.wait_for(future, timeout=max(0.0, until - time.monotonic()))
            if verdict is not None and (type(verdict) is bool or not isinstance(verdict, (int, float))):
                raise TypeError(
                    f"the agent returned {type(verdict).__name__}; return a reward (a number), or None "
                    "to reject the slot"
                )
            body = {"reward": None if verdict is None else float(verdict)}
        except TimeoutError:
            log.warning(
                "session %s (task %s, slot %d): the agent was still running at the group's deadline; "
                "abandoned, its slot times out",
                session.session_id,
                session.task_id,
                session.slot,
            )
            self._count("timeout")
            await self._close(session.client)
            return
        except Exception as exc:  # noqa: BLE001 - the agent's failure is the slot's
            body = {"error": "".join(traceback.format_exception_only(type(exc), exc)).strip() or type(exc).__name__}
        await self._close(session.client)
        try:
            ended = await control.call(f"/sessions/{session.session_id}/end", body, until=until)
        except GatewayError as exc:
            log.warning(
                "session %s (task %s, slot %d) could not be ended: %s",
                session.session_id,
                session.task_id,
                session.slot,
                exc,
            )
            self._count("timeout" if exc.code == "expired" else "unended")
            return
        self._count(ended.get("outcome", "?"))

    def _client(self, session: AgentSession) -> Any:
        import openai

        kind = openai.AsyncOpenAI if self.is_async else openai.OpenAI
        return kind(
            base_url=session.base_url, api_key=session.api_key, max_retries=self.retries, timeout=self.request_timeout_s
        )

    @staticmethod
    async def _close(client: Any) -> None:
        closing = client.close()
        if inspect.isawaitable(closing):
            await closing

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

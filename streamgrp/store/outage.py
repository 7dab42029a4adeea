"""Riding out an outage: which errors are one, and the policy (backoff, budget, log lines) for waiting it out.

Owns `Outage`, the one retry policy of a process: a command that met an *outage* (see `is_outage`) is sent
again with bounded exponential backoff and full jitter, one warning is logged when the outage starts and
one when the server is back, and after ``budget_s`` seconds of one outage the command raises
`OutageBudgetExceeded`. A stop requested meanwhile (SIGTERM) raises `StopRequested`. Which commands may be
sent again (`NOT_REPEATED` may not) and how a client applies the policy is `streamgrp.store.connection`'s.

What this module deliberately ignores: what the commands mean, and which client sent them.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from streamgrp.errors import OutageBudgetExceeded, StopRequested
from streamgrp.store.credentials import tls_refusal

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Default seconds one outage may last before a process gives up (``--outage-budget-s``).
DEFAULT_OUTAGE_BUDGET_S = 300.0
#: Errors that mean "the server does not answer now", not "the command is wrong".
OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,  # refused, reset, and BusyLoadingError (LOADING) is one of these
    redis.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,  # CLUSTERDOWN (MasterDownError is one of these)
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.RedisClusterUnreachableError,  # no node of the cluster answers
)
#: Commands never sent again by the client: their lost reply must be handled by the role.
NOT_REPEATED = frozenset(
    {
        b"XREADGROUP",
        b"XAUTOCLAIM",
        b"XCLAIM",
        b"INCR",
        b"INCRBY",
        b"DECR",
        b"DECRBY",
        b"HINCRBY",
        b"HINCRBYFLOAT",
        b"INCRBYFLOAT",
    }
)
#: A ``BUSY`` reply (a script or function running past the time limit), alone or inside a pipeline's
#: annotated error; not ``BUSYKEY`` or ``BUSYGROUP``, which are answers about keys.
_BUSY_REPLY = re.compile(r"(?:^|: )BUSY\s")


def is_outage(exc: BaseException) -> bool:
    """True for an error that says the server is unavailable right now (including a script's OOM and BUSY)."""
    if isinstance(exc, redis.AuthenticationError):  # a ConnectionError to redis-py, but waiting cannot fix it
        return False
    if isinstance(exc, OUTAGE_ERRORS):
        return tls_refusal(exc, "") is None  # a refused certificate is refused on every attempt
    if not isinstance(exc, redis.ResponseError):
        return False
    text = str(exc)
    return "OOM command not allowed" in text or _BUSY_REPLY.search(text) is not None


@dataclass
class Outage:
    """The outage policy of one process, shared by all its threads: backoff, budget, one log line.

    ``budget_s`` bounds one outage (from its first failed command to the next success), not a
    single command. ``stop``, when set, ends every wait with `StopRequested`.
    """

    budget_s: float = DEFAULT_OUTAGE_BUDGET_S
    base_s: float = 0.05
    cap_s: float = 2.0
    stop: threading.Event | None = None
    name: str = "the server"
    #: The setting that raises ``budget_s``, named in the messages.
    budget_flag: str = "--outage-budget-s"
    #: Outages seen so far; roles compare it between rounds to know they must resynchronise.
    count: int = 0
    _down_since: float | None = field(default=None, repr=False)
    _last_error: str = field(default="", repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def down_for(self) -> float:
        """Seconds the current outage has lasted (0 when the server answers)."""
        since = self._down_since
        return 0.0 if since is None else time.monotonic() - since

    def call(self, fn, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, sent again through outages until it answers or the budget runs out."""
        attempt = 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                if not is_outage(exc):
                    refusal = tls_refusal(exc, self.name)
                    if refusal is not None:
                        raise refusal from None
                    raise
                self.failed(exc, attempt)
                attempt += 1
                continue
            if self._down_since is not None:
                self.recovered()
            return result

    def failed(self, exc: BaseException, attempt: int = 0) -> None:
        """Record a failure, raise when the budget is spent or a stop was asked, else back off."""
        with self._lock:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
                self.count += 1
                log.warning(
                    "%s is unavailable (%s: %s); retrying with backoff for up to %gs (%s)",
                    self.name,
                    type(exc).__name__,
                    _short(exc),
                    self.budget_s,
                    self.budget_flag,
                )
            self._last_error = f"{type(exc).__name__}: {_short(exc)}"
            down_for = now - self._down_since
        if down_for >= self.budget_s:
            raise OutageBudgetExceeded(
                f"{self.name} has been unavailable for {down_for:.0f}s, over the outage budget of {self.budget_s:g}s "
                f"(last error {self._last_error}); check that the server runs and is reachable "
                f"(a full server under noeviction needs more maxmemory or retention), or raise {self.budget_flag}"
            ) from None
        # Full jitter: processes that lost the server together do not come back in lockstep.
        delay = random.uniform(0, min(self.cap_s, self.base_s * 2 ** min(attempt, 16)))
        delay = min(delay, max(0.0, self.budget_s - down_for))
        if self.stop is not None:
            if self.stop.is_set() or self.stop.wait(delay):
                raise StopRequested(f"stopped while {self.name} was unavailable") from None
        else:
            time.sleep(delay)

    def recovered(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            log.warning("%s answers again after %.1fs", self.name, time.monotonic() - self._down_since)
            self._down_since = None

    def ride_out(self, exc: BaseException, client: redis.Redis) -> None:
        """After ``exc`` (an outage) reached a role: wait until the server answers again.

        The role then resumes from what the server says (its pending entries, its commits), since
        the command that failed may or may not have taken effect.
        """
        from streamgrp.store.connection import without_retries  # the clients are built on this module

        self.failed(exc)
        self.call(without_retries(client).ping)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""

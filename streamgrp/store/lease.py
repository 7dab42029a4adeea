"""A lease with a TTL that makes one process of a role the active one (assembler, batcher).

The holder renews it while working; a standby acquires it once the TTL runs out after the holder
died. Commit scripts check the lease value (the holder's token) on the server, so a process that
lost its lease while paused cannot write: that is the fence. A pause longer than the remaining
TTL between the last renewal and a read is the one window it does not close; renewing at a third
of the TTL keeps it small.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import redis

from streamgrp.errors import LeaseLost
from streamgrp.store import scripts
from streamgrp.store.connection import is_outage, outage_of, without_retries

log = logging.getLogger(__name__)

#: A process standing by says so when it starts waiting, and again this often while it waits.
STANDBY_REMINDER_S = 300.0


class Lease:
    def __init__(self, client: redis.Redis, key: str, owner: str, ttl_s: float) -> None:
        self.client = client
        self.key = key
        self.token = f"{owner}:{uuid.uuid4().hex}"
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._renewed_at = 0.0
        self._acquire = scripts.register(client, "lease_acquire.lua")
        self._renew = scripts.register(client, "lease_renew.lua")
        self._release = scripts.register(client, "lease_release.lua")

    def acquire(self) -> bool:
        if self._acquire(keys=[self.key], args=[self.token, self.ttl_ms]):
            self._renewed_at = time.monotonic()
            return True
        return False

    def holder(self) -> str | None:
        """Who holds the lease now (the owner part of its token: a process name), None when nobody does."""
        try:
            token = self.client.get(self.key)
        except redis.RedisError:
            return None
        if token is None:
            return None
        text = token.decode(errors="replace") if isinstance(token, bytes) else str(token)
        return text.rsplit(":", 1)[0]

    def renew_if_due(self) -> None:
        """Renew once a third of the TTL has passed; raises `LeaseLost` if someone else holds it."""
        if (time.monotonic() - self._renewed_at) * 1000 < self.ttl_ms / 3:
            return
        if not self._renew(keys=[self.key], args=[self.token, self.ttl_ms]):
            raise LeaseLost(f"lease {self.key} expired or was taken")
        self._renewed_at = time.monotonic()

    def release(self) -> None:
        try:  # once, without riding out an outage: shutting down must not wait for the server
            self._release(keys=[self.key], args=[self.token], client=without_retries(self.client))
        except redis.RedisError:
            pass  # the TTL frees it anyway


def _say_standing_by(lease: Lease, who: str) -> None:
    holder = lease.holder()
    log.info(
        "%s stands by: %s holds the lease %s; this one takes over when that one stops (within %.0f s of it "
        "stopping renewing)",
        who,
        holder or "another process",
        lease.key,
        lease.ttl_ms / 1000,
    )


def run_while_leased(
    lease: Lease,
    *,
    who: str,
    stop: threading.Event,
    is_active: Callable[[], bool],
    activate: Callable[[], None],
    work: Callable[[], int],
    deactivate: Callable[[], None],
    burst: bool = False,
    running: Callable[[], bool] = lambda: True,
) -> None:
    """The loop of a role with one active process: stand by until the lease is free, `activate`
    (rebuild state from the server), then `work` rounds until stopped; on a lost lease `deactivate`
    and stand by again. In burst mode return after a round that read nothing (``work`` returns 0).

    An outage that reaches the loop (a consumer-group read whose reply may be lost, or a command
    whose outage outlasted nothing yet) is waited out, then the role deactivates and activates
    again: it rebuilds from the server exactly as after a crash, since what the failed command
    did is unknown. `OutageBudgetExceeded` and `StopRequested` end the loop.
    """
    poll_s = min(1.0, lease.ttl_ms / 3000)
    outage = outage_of(lease.client)
    said_at: float | None = None  # when standing by was last said (monotonic)
    try:
        while not stop.is_set() and running():
            if not is_active() and not lease.acquire():
                if said_at is None or time.monotonic() - said_at >= STANDBY_REMINDER_S:
                    said_at = time.monotonic()
                    _say_standing_by(lease, who)
                stop.wait(poll_s)
                continue
            said_at = None
            try:
                if not is_active():
                    activate()
                    if not running():
                        break
                lease.renew_if_due()
                read = work()
            except LeaseLost:
                log.warning("%s lost its lease; standing by", who)
                deactivate()
                continue
            except Exception as exc:
                if not is_outage(exc):
                    raise
                outage.ride_out(exc, lease.client)
                log.info("%s resumes from the server's record after the outage", who)
                deactivate()
                continue
            if burst and read == 0:
                break
    finally:
        if is_active():
            lease.release()

"""Server functions called on an event loop (redis.asyncio, hiredis), for the gateway's hot path.

Owns the one asyncio client a process makes beside its synchronous client of the same server, with the
same address, credentials and TLS, and the call of a library function through it. It is a fast path, not
a second policy: it never retries and never loads the library. Anything but the function's own answer (a
lost connection, an outage, ``BUSY``/``OOM``, a library the server lost) comes back as `UNANSWERED`, and the
caller makes the same call the synchronous way (`streamgrp.store.connection`'s outage riding, the library
reloaded), which is safe for functions that answer a repeat with what the first call did. A cluster client
or connection settings it cannot copy get no loop client (`loop_client` returns None).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.connection as async_connection
import redis.connection as sync_connection
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff

from streamgrp.store.connection import is_outage

log = logging.getLogger(__name__)

#: What `LoopFunction.__call__` returns when the server gave no answer of the function's own.
UNANSWERED: Any = object()

_CLASSES = {
    sync_connection.Connection: async_connection.Connection,
    sync_connection.SSLConnection: async_connection.SSLConnection,
    sync_connection.UnixDomainSocketConnection: async_connection.UnixDomainSocketConnection,
}
#: Settings of the synchronous pool that make no sense on the loop: its retry object and its set-up
#: callback (the server's eviction check, done once by the synchronous client already), and the
#: synchronous pool's own handlers (``maint_notifications*``, ``orig_*``).
_NOT_COPIED = {"retry", "redis_connect_func", "command_packer", "connection_pool"}


def loop_client(client: Any) -> redis.asyncio.Redis | None:
    """An asyncio client of ``client``'s server with its settings, or None (a cluster client, or a
    connection class it does not know). Make it on the loop that will use it; close it with ``aclose``."""
    if not isinstance(client, redis.Redis):
        return None
    pool = client.connection_pool
    cls = _CLASSES.get(pool.connection_class)
    if cls is None:
        return None
    accepted: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            accepted |= set(inspect.signature(vars(klass)["__init__"]).parameters)
    kwargs = {
        k: v
        for k, v in pool.connection_kwargs.items()
        if k in accepted and k not in _NOT_COPIED and not k.startswith(("maint_notifications", "orig_"))
    }
    # No retries of its own: a call that got no answer goes the synchronous way (see the module docstring).
    kwargs["retry"] = AsyncRetry(NoBackoff(), 0)
    # from_pool: the client owns its pool, so ``aclose`` closes its connections too.
    return redis.asyncio.Redis.from_pool(redis.asyncio.ConnectionPool(connection_class=cls, **kwargs))


async def call(
    client: redis.asyncio.Redis,
    name: str,
    keys: list[Any],
    args: list[Any],
    *,
    staging: Sequence[Any] | None = None,
) -> Any:
    """``FCALL name`` on ``client``: its reply, a function's error reply raised (`redis.ResponseError`),
    or `UNANSWERED` (see the module docstring). ``staging``: a staging write (`streamgrp.store.payloads.staging`)
    sent first, with the call in one write (bytes the function takes by name, never as an argument)."""
    try:
        if staging is None:
            return await client.fcall(name, len(keys), *keys, *args)
        replies = await _send_together(client, [tuple(staging), ("FCALL", name, len(keys), *keys, *args)])
        for reply in replies:  # the staging write's error first (its outage, or a right the user lacks)
            if isinstance(reply, Exception):
                raise reply
        return replies[-1]
    except redis.ResponseError as exc:
        if is_outage(exc) or "function not found" in str(exc).lower():
            return UNANSWERED
        raise
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        log.debug("a call on the loop got no answer (%s); sent again the synchronous way", exc)
        return UNANSWERED


async def _send_together(client: redis.asyncio.Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``commands`` in one write on one connection, and their replies in order (an error reply as its
    exception): a pipeline without redis.asyncio's pipeline object, which cost the gateway about 30 µs of
    CPU per turn (bench/bench_turns.py). A connection left mid-reply (an error, a cancelled request) is
    dropped, never reused."""
    pool = client.connection_pool
    connection = await pool.get_connection()
    try:
        await connection.send_packed_command(connection.pack_commands(commands), check_health=False)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await connection.read_response())
            except redis.ResponseError as exc:
                replies.append(exc)
    except BaseException:
        await connection.disconnect()
        raise
    finally:
        await pool.release(connection)
    return replies

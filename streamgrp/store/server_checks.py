"""The server checks every connection passes: a supported version, and no setting that loses a run's data.

Owns what streamgrp refuses in a server (one that evicts keys: `refuse_eviction`, checked on every new
connection by `eviction_checked`) and what it warns about (a nearly full server, no append-only file,
``appendfsync no``: `check_server_settings`), and the errors that say what to change when the server
refuses this user (`refused`, `server_info`).

What this module deliberately ignores: outages (the caller rides them out around these calls).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis
from redis._parsers.helpers import parse_info
from redis.utils import str_if_bytes

from streamgrp.errors import ConfigError, ServerError

log = logging.getLogger(__name__)

MIN_SERVER_VERSION = (7, 0)
MEMORY_WARNING_RATIO = 0.9


def eviction_checked(where: str, *, set_up: bool) -> Callable[[Any], None]:
    """A redis-py ``redis_connect_func``: on every new connection, refuse a server that evicts keys.

    Checked per connection, not only at `connect`: redis-py reconnects by itself, after an outage
    and after an idle server restarted, and the server that answers then may be configured to
    evict. ``set_up``: run redis-py's own set-up (AUTH, HELLO) first, which the cluster client does itself.
    """

    def connect_func(connection: Any) -> None:
        if set_up:
            connection.on_connect()
        connection.send_command("INFO", "memory")
        info = parse_info(str_if_bytes(connection.read_response()))
        server = where if set_up else f"{where} (node {connection.host}:{connection.port})"
        refuse_eviction(info, server)

    return connect_func


def refused(where: str, exc: BaseException) -> ServerError:
    return ServerError(
        f"the server at {where} refused the credentials: {exc}; fix the password "
        "(--password-file, STREAMGRP_PASSWORD, or the one in --redis-url) or the user name"
    )


def server_info(server: redis.Redis, where: str) -> dict[str, Any]:
    """INFO server and cluster of one server, with errors that say what to change."""
    try:
        return {**server.info("server"), **server.info("cluster")}
    except redis.AuthenticationError as exc:
        raise refused(where, exc) from None
    except redis.exceptions.NoPermissionError as exc:
        raise ServerError(
            f"the server at {where} does not let this user run INFO ({exc}); give the user the "
            "rules `streamgrp acl RUN` prints for its role"
        ) from None


def check_server_settings(client: redis.Redis, where: str, *, read_config: bool = True) -> None:
    """Refuse a server that evicts keys; warn when it is nearly full or does not persist.

    ``read_config`` False skips the one check that needs ``CONFIG GET`` (``appendfsync no``).

    An evicting server silently deletes a run's state (committed steps, decisions, leases), so a
    restarted trainer would start again from step 0: that is refused, not warned about.
    """
    memory = client.info("memory")
    refuse_eviction(memory, where)
    maxmemory, used = int(memory.get("maxmemory", 0) or 0), int(memory.get("used_memory", 0) or 0)
    if maxmemory and used >= MEMORY_WARNING_RATIO * maxmemory:
        log.warning(
            "the server at %s uses %d of its %d bytes of maxmemory; writes stop when it is full "
            "(raise maxmemory or run the archiver with --retention)",
            where,
            used,
            maxmemory,
        )
    persistence = client.info("persistence")
    if not int(persistence.get("aof_enabled", 0) or 0):
        log.warning(
            "the server at %s does not keep an append-only file (appendonly no): a server restart loses "
            "every write since its last snapshot. Turn it on with CONFIG SET appendonly yes (and "
            "appendfsync everysec or always), or use the embedded server, which does",
            where,
        )
        return
    if not read_config:
        return
    try:
        # One name asked, one value answered (its name bytes or text, as the client decodes).
        fsync = next(iter(client.config_get("appendfsync").values()), None)
    except redis.ResponseError:
        return  # CONFIG may be refused to this user; the AOF is on, which is what matters most
    if fsync in (b"no", "no"):
        log.warning(
            "the server at %s runs appendfsync no: a machine crash can lose about 30 s of acknowledged "
            "writes; use everysec (about 1 s) or always (none)",
            where,
        )


def refuse_eviction(memory: dict[str, Any], where: str) -> None:
    """Raise `ConfigError` when ``INFO memory`` says the server evicts keys."""
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if policy != "noeviction":
        raise ConfigError(
            f"the server at {where} evicts keys (maxmemory-policy {policy}): it would silently delete a run's "
            "committed steps, decisions and leases. Set maxmemory-policy to noeviction (CONFIG SET "
            "maxmemory-policy noeviction, or in its configuration file); a full server then refuses writes, "
            "which streamgrp waits out and reports"
        )

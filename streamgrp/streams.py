"""Small helpers over redis-py stream replies shared by every driver (no semantics of their own)."""

from __future__ import annotations

import os
import socket
import uuid

import redis


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) from the beginning, if it does not exist."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def producer_name(role: str) -> str:
    """A producer identity unique across hosts and restarts: role, host, pid and a random suffix."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def entry_id_str(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def entry_time(entry_id: str) -> float:
    """The server time (seconds) at which an entry was added, from its id."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


def read_entries(client: redis.Redis, stream: str, ids: list[str]) -> list[dict[bytes, bytes] | None]:
    """The fields of each entry id of ``stream``, in order, None where an entry is gone (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for entry in ids:
        pipe.xrange(stream, entry, entry)
    return [found[0][1] if found else None for found in pipe.execute()] if ids else []

"""A batch of commands sent in one write on a connection of the caller's own, each reply read as it comes.

Owns the cheap way to send the hot writes that go as one batch to a single server: a worker's publish (its
payloads' staging SETs and the publishing call, `streamgrp.store.payloads.call_staged`) and its slot segments
(`streamgrp.store.segments`). redis-py's pipeline costs about twice the CPU for the same bytes (its command stack,
the pool's checkout and a callback per reply): 10-12 µs a sample of a worker's publish at 256-1024 tokens
(`bench/README.md`). A Redis Cluster client has none (`for_client` gives None): its pipeline routes each command
to its node.

Deliberately ignores outages: the caller rides them as the client's pipelines do (`streamgrp.store.outage`),
sending the batch again whole, so a batch must be safe to repeat. A LOADING or BUSY reply is raised as the
outage it is, but only once every reply of the batch is read, so the connection stays in step with the server;
a dropped connection is reconnected by the next batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import redis

from streamgrp.store.outage import is_outage
from streamgrp.store.resp import packs_pieces

__all__ = ["OwnConnection", "for_client"]


class OwnConnection:
    """A connection taken from a single-server client's pool (its address, credentials and set-up) for this
    object's life: given back when it is dropped (or `close`d), so the pool's ``disconnect`` (the client's
    ``close``) also closes it. Thread-safe: one batch on the wire at a time."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.connection: Any = None  # taken on the first batch
        #: Whether a command may take an argument as its parts (`streamgrp.store.resp.packs_pieces`).
        self.pieces = packs_pieces(client.connection_pool)
        self._lock = threading.Lock()

    def execute(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """The replies to ``commands`` (each a command's arguments), in order; an error reply is its exception,
        returned, not raised (every other reply of the batch stands)."""
        with self._lock:
            if self.connection is None:
                self.connection = self.client.connection_pool.get_connection()
            connection = self.connection
            connection.send_packed_command(connection.pack_commands(commands), check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(connection.read_response())
                except redis.ResponseError as exc:  # one command's error reply: the next replies are still to read
                    replies.append(exc)
        for reply in replies:
            if isinstance(reply, BaseException) and is_outage(reply):
                raise reply
        return replies

    def close(self) -> None:
        """Give the connection back to the client's pool (the next batch takes one again)."""
        with self._lock:
            connection, self.connection = self.connection, None
        if connection is not None:
            self.client.connection_pool.release(connection)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the pool may be gone already
            pass


def for_client(client: redis.Redis) -> OwnConnection | None:
    """An `OwnConnection` of ``client``, or None for a cluster client (which keeps redis-py's pipeline)."""
    return None if isinstance(client, redis.RedisCluster) else OwnConnection(client)

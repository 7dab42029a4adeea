"""A batch of commands sent in one write on a connection of the caller's own, each reply read as it comes; and
the payloads' reads, into one buffer of the reply's own.

Owns the cheap way to send the hot writes that go as one batch to a single server: a worker's publish (its
payloads' staging SETs and the publishing call, `streamgrp.store.payloads.call_staged`) and its slot segments
(`streamgrp.store.segments`). redis-py's pipeline costs about twice the CPU for the same bytes (its command stack,
the pool's checkout and a callback per reply): 10-12 µs a sample of a worker's publish at 256-1024 tokens
(`bench/README.md`). A Redis Cluster client has none (`for_client` gives None): its pipeline routes each command
to its node.

And the hot reads, the assembler's and the trainer's payloads (`values`: an MGET): the reply goes from the socket
into one buffer and each value is a view of it, where hiredis copies each value twice (into its own buffer, then
into a new `bytes`), and a new `bytes` of 330 KB costs the page faults of fresh memory every time: 217-224 CPU µs
a 330 KB value through redis-py, 56-78 here (`bench/bench_reads.py`).

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
    ``close``) also closes it. Thread-safe: one batch on the wire at a time. Keeps the buffers of its last
    `_KEPT_BUFFERS` replies to read into again (a trainer's at 32k tokens: up to four of 21 MB)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.connection: Any = None  # taken on the first batch
        #: Whether a command may take an argument as its parts (`streamgrp.store.resp.packs_pieces`).
        self.pieces = packs_pieces(client.connection_pool)
        self._lock = threading.Lock()
        self._buffers: list[bytearray] = []  # the last replies', newest first

    def execute(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """The replies to ``commands`` (each a command's arguments), in order; an error reply is its exception,
        returned, not raised (every other reply of the batch stands)."""
        with self._lock:
            connection = self._taken()
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

    def values(self, keys: Sequence[str]) -> list[memoryview | None]:
        """``MGET keys``: each value as a read-only view of one buffer holding the whole reply (it lives as long
        as any view of it), None where there is none. An error reply is raised; a dropped or timed-out
        connection is closed (the next call opens another) and raised as redis-py's `ConnectionError` or
        `TimeoutError`, outages a caller rides (`streamgrp.store.connection.ride`)."""
        with self._lock:
            connection = self._taken()
            connection.send_packed_command(connection.pack_command("MGET", *keys), check_health=False)
            try:
                # Straight from the socket: nothing of an earlier reply waits in redis-py's parser, since every
                # command on this connection is this object's, and each batch's replies are read whole.
                reply = _Reply(connection, self._spare())
                values = reply.bulk_strings(len(keys))
            except BaseException:
                connection.disconnect()  # whatever is left of the reply must not be read as the next one's
                raise
            # The next replies are likely as large: read into these again once their views are gone (a reader
            # may hold a few replies' at once: a trainer's shard is several reads).
            if not any(buffer is reply.buffer for buffer in self._buffers):
                self._buffers = [reply.buffer, *self._buffers][:_KEPT_BUFFERS]
        return values

    def _taken(self) -> Any:
        """This object's connection, taken from the pool on first use (the lock held)."""
        if self.connection is None:
            self.connection = self.client.connection_pool.get_connection()
        return self.connection

    def _spare(self) -> bytearray:
        """A buffer of the last replies of which no view is left (warm memory: no page to fault in, nothing to
        zero), else a new one as large as the largest."""
        for buffer in self._buffers:
            try:  # a buffer with views cannot change size: shrink by a byte and back as the test
                last = buffer[-1]
                del buffer[-1]
            except BufferError:
                continue
            buffer.append(last)
            return buffer
        return bytearray(max((len(buffer) for buffer in self._buffers), default=_MIN_READ))

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


#: The first buffer a reply is read into; it grows to the largest reply.
_MIN_READ = 1 << 16
#: Buffers of past replies kept to read into again.
_KEPT_BUFFERS = 4
#: The longest line a bulk string's length or a nil takes (``$`` and 20 digits); an error line may be longer.
_LENGTH_LINE = 24


class _Reply:
    """One RESP2 reply read from ``connection``'s socket into ``buffer`` (grown, the part read copied once, when it
    is too small), parsed in place."""

    def __init__(self, connection: Any, buffer: bytearray) -> None:
        self.sock = connection._sock
        self.parse_error = getattr(connection._parser, "parse_error", redis.ResponseError)
        self.buffer = buffer
        self.view = memoryview(self.buffer)
        self.filled = 0
        self.at = 0

    def bulk_strings(self, count: int) -> list[memoryview | None]:
        """The reply as an array of ``count`` bulk strings (an MGET's)."""
        head = self._line()
        if head[:1] == b"-":
            raise self.parse_error(head[1:].decode("utf-8", "replace"))
        if head != b"*%d" % count:
            raise redis.ConnectionError(f"an MGET of {count} keys was answered {head[:40]!r}: out of step")
        spans: list[tuple[int, int] | None] = []
        for _ in range(count):
            line = self._line()
            if line == b"$-1" or line == b"_":  # nil (RESP2, RESP3)
                spans.append(None)
                continue
            if line[:1] != b"$":
                raise redis.ConnectionError(f"an MGET's value was answered {line[:40]!r}: out of step")
            size = int(line[1:])
            self._fill(self.at + size + 2)
            spans.append((self.at, size))
            self.at += size + 2
        view = self.view.toreadonly()  # the buffer is final: every view of it is taken from here
        return [None if span is None else view[span[0] : span[0] + span[1]] for span in spans]

    def _line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            window = self.view[self.at : min(self.filled, self.at + _LENGTH_LINE)].tobytes()
            end = window.find(b"\r\n")
            if end < 0 and self.filled - self.at > _LENGTH_LINE:  # a long line (an error's text): search it all
                window = self.view[self.at : self.filled].tobytes()
                end = window.find(b"\r\n")
            if end >= 0:
                self.at += end + 2
                return window[:end]
            self._fill(self.filled + 1)

    def _fill(self, end: int) -> None:
        """Read until the buffer holds its first ``end`` bytes (growing it, the part read copied once)."""
        while self.filled < end:
            if self.filled == len(self.buffer):
                grown = bytearray(max(2 * len(self.buffer), end))
                grown[: self.filled] = self.view[: self.filled]
                self.view.release()  # the old map closes with its last view
                self.buffer, self.view = grown, memoryview(grown)
            try:
                got = self.sock.recv_into(self.view[self.filled :])
            except TimeoutError:
                raise redis.TimeoutError("timeout reading an MGET's reply") from None
            except OSError as exc:
                raise redis.ConnectionError(f"error reading an MGET's reply: {exc}") from None
            if not got:
                raise redis.ConnectionError("the server closed the connection while sending an MGET's reply")
            self.filled += got


def for_client(client: redis.Redis) -> OwnConnection | None:
    """An `OwnConnection` of ``client``, or None for a cluster client (which keeps redis-py's pipeline)."""
    return None if isinstance(client, redis.RedisCluster) else OwnConnection(client)

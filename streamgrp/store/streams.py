"""Small helpers over redis-py stream replies shared by every driver (no semantics of their own)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar, cast

import redis
from redis.client import CaseInsensitiveDict

from streamgrp.core.entry_fields import entry_fields

S = TypeVar("S")
R = TypeVar("R")
T = TypeVar("T")
C = TypeVar("C", bound=redis.Redis | redis.RedisCluster)

#: One stream entry as `STREAM_CALLBACKS` parse it: its id and its fields (None: the entry was deleted while
#: pending; an `EntryFields` when a field name repeats).
Entry = tuple[bytes, dict[bytes, bytes] | None]


def read_reply(reply: object) -> list[tuple[bytes, list[Entry]]]:
    """The (stream, entries) pairs of an XREAD or XREADGROUP reply ([] when the read timed out).

    redis-py declares every shape the protocols allow (RESP3 maps among them); streamgrp's clients speak
    RESP2 and `_xread` hands RESP2's pairs over in any case, so this is the shape callers get."""
    return cast("list[tuple[bytes, list[Entry]]]", reply or [])


#: One entry of an XRANGE or XREVRANGE reply: its id and its fields (never None: a range reads what exists).
RangeEntry = tuple[bytes, dict[bytes, bytes]]


def range_reply(reply: object) -> list[RangeEntry]:
    """The entries of an XRANGE or XREVRANGE reply, oldest first for XRANGE.

    redis-py declares ids and fields that may be text and a reply that may be None (decoded responses,
    other protocols); streamgrp's clients read bytes over RESP2 and the server answers a range with a list."""
    return cast("list[RangeEntry]", reply)


def hash_reply(reply: object) -> dict[bytes, bytes]:
    """An HGETALL reply: streamgrp's clients read field names and values as bytes (redis-py's hints allow text)."""
    return cast("dict[bytes, bytes]", reply)


def first_entries(reply: object) -> list[Entry]:
    """The entries of the first stream of a read reply (reads that name one stream); [] when none came."""
    pairs = read_reply(reply)
    return pairs[0][1] if pairs else []


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


def entry_size(fields) -> int:
    """Bytes of an entry's field names and values (every pair, where the reader kept repeats)."""
    pairs = getattr(fields, "pairs", None)
    return sum(len(name) + len(value) for name, value in (pairs if pairs is not None else fields.items()))


def entry_time(entry_id: str) -> float:
    """The server time (seconds) at which an entry was added, from its id."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


def read_in_turn(
    sources: Sequence[S], read: Callable[[S, int | None], list[R]], block_ms: int | None, *, first: bool
) -> list[tuple[S, list[R]]]:
    """Read several streams (a partitioned run's, one per source) the way one blocking read of one would:
    ``read(source, block_ms)`` -> what it brought. One source: one read with ``block_ms``. Several: each
    without waiting (stopping at the first that brought something when ``first``), then, when none did
    and ``block_ms`` is not None, a wait on each in turn for its share of ``block_ms``: a cluster cannot
    block on keys of several slots in one call. Returns (source, results) for the reads that brought some."""
    if len(sources) == 1:
        found = read(sources[0], block_ms)
        return [(sources[0], found)] if found else []
    ready: list[tuple[S, list[R]]] = []
    for source in sources:
        found = read(source, None)
        if found:
            ready.append((source, found))
            if first:
                return ready
    if ready or block_ms is None:
        return ready
    for source in sources:
        found = read(source, max(1, block_ms // len(sources)))
        if found:
            return [(source, found)]
    return []


#: Entry ids per round trip: bounds one reply's size whatever the caller asks for.
READ_CHUNK = 512


def read_entries(client: redis.Redis, stream: str, ids: list[str]) -> list[dict[bytes, bytes] | None]:
    """The fields of each entry id of ``stream``, in order, None where an entry is gone.

    Ids that are certainly adjacent in the stream (same millisecond, consecutive sequence numbers:
    nothing can sit between them) are read with one XRANGE per run, every run of a chunk in one
    pipelined round trip. A worker's batched publish writes consecutive ids, so a trainer rank usually
    reads its shard's payloads in a few ranges; the server then copies each entry into the reply once,
    which costs it far less than a script's per-entry XRANGE."""
    out: list[dict[bytes, bytes] | None] = []
    for start in range(0, len(ids), READ_CHUNK):
        chunk = ids[start : start + READ_CHUNK]
        runs = _adjacent_runs(chunk)
        pipe = client.pipeline(transaction=False)
        # Every field kept whatever callbacks the caller's client has (a copy: the client's own stay). A
        # cluster pipeline parses with its nodes' clients, which `keep_every_field` gave these callbacks.
        if hasattr(pipe, "response_callbacks"):
            callbacks = CaseInsensitiveDict(pipe.response_callbacks)
            callbacks["XRANGE"] = _entries
            pipe.response_callbacks = callbacks
        for first, last in runs:
            pipe.xrange(stream, first, last)
        out += _in_order(chunk, pipe.execute())
    return out


def _in_order(ids: list[str], replies: list[list[Entry]]) -> list[dict[bytes, bytes] | None]:
    """The fields of each of ``ids`` from XRANGE replies (parsed by `_entries`), None where one is gone."""
    found = {entry_id: fields for entries in replies for entry_id, fields in entries}
    got = [found.get(entry.encode()) for entry in ids]
    if None in got:  # gone, or asked in another spelling ("5" is 5-0)
        by_position = {_position(entry_id.decode()): fields for entry_id, fields in found.items()}
        got = [by_position.get(_position(entry)) for entry in ids]
    return [fields or None for fields in got]


class Retry(Protocol):
    """Runs a read attempt, and again after a failure if its policy says so (the trainer's outage policy)."""

    def __call__(self, attempt: Callable[[], T], /) -> T: ...


def _once(attempt: Callable[[], T], /) -> T:
    return attempt()


#: Entry ids per part of `stream_entries`: one part's reply is made while the caller reads the last.
STREAM_PART = 64


def stream_entries(
    client: redis.Redis, stream: str, ids: list[str], *, retry: Retry = _once
) -> Iterator[dict[bytes, bytes] | None]:
    """`read_entries`, yielded in order part by part: the request for the next `STREAM_PART` ids is sent
    before a part is handed over, so the server makes that reply while the caller works on this one
    (loading a 1024-token shard, 29 -> 23 µs a row here). ``retry(attempt)`` runs each part's read
    (the trainer passes its outage policy): a part that failed is asked for again, and nothing is handed
    over twice. A cluster client reads through `read_entries` (its connections are per node)."""
    if isinstance(client, redis.RedisCluster) or not hasattr(client, "connection_pool"):
        yield from read_entries(client, stream, ids)
        return
    parts = [ids[start : start + STREAM_PART] for start in range(0, len(ids), STREAM_PART)]
    runs = [_adjacent_runs(part) for part in parts]
    pool = client.connection_pool
    # Taking a connection connects it (or checks a pooled one): a server down or restarting fails it too.
    connection = retry(pool.get_connection)
    on_the_wire: int | None = None  # the part whose request was sent and whose reply is unread

    def send(index: int) -> None:
        nonlocal on_the_wire
        on_the_wire = None
        connection.send_packed_command(
            connection.pack_commands([("XRANGE", stream, first, last) for first, last in runs[index]])
        )
        on_the_wire = index

    def read(index: int) -> list[list[Entry]]:
        nonlocal on_the_wire
        try:
            if on_the_wire != index:  # the first part, or one asked for again after a failure
                send(index)
            replies = [_entries(connection.read_response()) for _ in runs[index]]
        except BaseException:
            connection.disconnect()  # whatever was on the wire is lost with it
            on_the_wire = None
            raise
        on_the_wire = None
        return replies

    try:
        for index, part in enumerate(parts):
            replies = retry(partial(read, index))
            if index + 1 < len(parts):
                try:
                    send(index + 1)
                except redis.RedisError:
                    connection.disconnect()  # the next read sends it again, under ``retry``
            yield from _in_order(part, replies)
    finally:
        if on_the_wire is not None:
            connection.disconnect()  # a reply nobody will read must not reach the connection's next user
        pool.release(connection)


def _position(entry_id: str) -> tuple[int, int] | str:
    """(milliseconds, sequence) of a stream id; the text itself when it is not one (the server judges)."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return entry_id


def _adjacent_runs(ids: list[str]) -> list[tuple[str, str]]:
    """``ids`` as (first, last) ranges of certainly adjacent ids, each id in one range."""
    positions = sorted({p for p in map(_position, ids) if isinstance(p, tuple)})
    runs: list[tuple[str, str]] = [(text, text) for text in {p for p in map(_position, ids) if isinstance(p, str)}]
    # both None before the first position, both set after it
    first: tuple[int, int] | None = None
    previous: tuple[int, int] | None = None
    for ms, seq in positions:
        if first is not None and previous is not None and (ms, seq - 1) != previous:
            runs.append((f"{first[0]}-{first[1]}", f"{previous[0]}-{previous[1]}"))
            first = None
        if first is None:
            first = (ms, seq)
        previous = (ms, seq)
    if first is not None and previous is not None:
        runs.append((f"{first[0]}-{first[1]}", f"{previous[0]}-{previous[1]}"))
    return runs


# -- stream replies that keep every field ------------------------------------------------------------
# redis-py turns an entry's fields into a dict, so an entry that repeats a field name loses a value
# before anyone can see it. These parsers keep such entries whole (`EntryFields`), so the codec
# refuses them (``repeated_field``) and the dead letter carries every pair.


def _entries(response, **options):
    if response is None:
        return None
    out: list[tuple[Any, ...]] = []
    for item in response:
        if item is None:
            out.append((None, None))
        elif "claim_min_idle_time" in options:
            out.append((item[0], entry_fields(item[1]), *item[2:]))
        else:
            out.append((item[0], entry_fields(item[1])))
    return out


def _xread(response, **options):
    if response is None:
        return []
    # RESP3 replies map stream -> entries, RESP2 ones are [stream, entries] pairs; callers get the
    # RESP2 shape either way, as redis-py gives it.
    pairs = response.items() if isinstance(response, dict) else response
    return [[stream, _entries(items, **options)] for stream, items in pairs]


def _xautoclaim(response, **options):
    if options.get("parse_justid", False):
        return response[1]
    response[1] = _entries(response[1])
    return response


def _xclaim(response, **options):
    return response if options.get("parse_justid", False) else _entries(response)


STREAM_CALLBACKS = {
    "XREAD": _xread,
    "XREADGROUP": _xread,
    "XRANGE": _entries,
    "XREVRANGE": _entries,
    "XAUTOCLAIM": _xautoclaim,
    "XCLAIM": _xclaim,
}


def keep_every_field(client: C) -> C:
    """Make ``client`` parse stream replies with `STREAM_CALLBACKS` (RESP2, the default protocol).

    A cluster client parses each reply with the client of the node that sent it (its own callbacks
    run after that, on parsed replies), so there the callbacks go to every node's client, and to
    those of nodes it discovers later."""
    if isinstance(client, redis.RedisCluster):
        _keep_on_nodes(client)
        return client
    for command, callback in STREAM_CALLBACKS.items():
        client.set_response_callback(command, callback)
    return client


def _keep_on_nodes(client: redis.RedisCluster) -> None:
    manager = client.nodes_manager
    create = manager.create_redis_node

    def create_keeping(*args, **kwargs):
        return keep_every_field(create(*args, **kwargs))

    # Deliberately replaced on this one manager's instance: nodes it discovers later get the callbacks too.
    manager.create_redis_node = create_keeping  # type: ignore[method-assign]
    for node in [*client.get_nodes(), *manager.startup_nodes.values()]:
        if node.redis_connection is not None:
            keep_every_field(node.redis_connection)

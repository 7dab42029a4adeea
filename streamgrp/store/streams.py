"""Small helpers over redis-py stream replies shared by every driver (no semantics of their own)."""

from __future__ import annotations

import os
import socket
import uuid
import weakref

import redis

from streamgrp.core.entry_fields import entry_fields


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


#: Entry ids per read script call: bounds the script's input and reply whatever the caller asks for.
READ_CHUNK = 512


def read_entries(client: redis.Redis, stream: str, ids: list[str]) -> list[dict[bytes, bytes] | None]:
    """The fields of each entry id of ``stream``, in order, None where an entry is gone.

    One script call per `READ_CHUNK` ids: a single reply costs the client far less than one reply per
    entry (a trainer rank reads every payload of its shard this way)."""
    read = _reader(client)
    out: list[dict[bytes, bytes] | None] = []
    for start in range(0, len(ids), READ_CHUNK):
        chunk = ids[start:start + READ_CHUNK]
        out += [entry_fields(flat) if flat else None for flat in read(keys=[stream], args=chunk)]
    return out


_READERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reader(client: redis.Redis):
    reader = _READERS.get(client)
    if reader is None:
        from streamgrp.store import (
            scripts,  # scripts -> errors only; imported here to keep this module light
        )

        reader = _READERS[client] = scripts.register_read_only(client, "read_entries.lua")
    return reader


# -- stream replies that keep every field ------------------------------------------------------------
# redis-py turns an entry's fields into a dict, so an entry that repeats a field name loses a value
# before anyone can see it. These parsers keep such entries whole (`EntryFields`), so the codec
# refuses them (``repeated_field``) and the dead letter carries every pair.


def _entries(response, **options):
    if response is None:
        return None
    out = []
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


STREAM_CALLBACKS = {"XREAD": _xread, "XREADGROUP": _xread, "XRANGE": _entries, "XREVRANGE": _entries,
                    "XAUTOCLAIM": _xautoclaim, "XCLAIM": _xclaim}


def keep_every_field(client: redis.Redis) -> redis.Redis:
    """Make ``client`` parse stream replies with `STREAM_CALLBACKS` (RESP2, the default protocol)."""
    for command, callback in STREAM_CALLBACKS.items():
        client.set_response_callback(command, callback)
    return client

"""Where a sample's payload lives on the server, and the one way to write and read it.

Owns the payload layout of a run: the key names, the framing of a stored payload, the staging write
and every read of live payloads. A run records its layout when it is created (``payload_layout`` in
its record, `streamgrp.config.RunConfig`):

``keys`` (runs this version creates)
    The payload of slot entry id ``I`` of a partition is the string key ``<payloads>:<I>`` (``<payloads>``:
    the partition's payloads stream's name, so the same hash tag and cluster slot as its slot log), whose
    value is `frame` d: a 4-byte little-endian header length, the header, the blob. A writer stages each
    payload with ``SET <payloads>:staged:<128-bit hex> value NX PX ttl`` and, in the same pipeline, calls
    the publishing function with the staged keys; the function checks every staged key exists before its
    first write, appends the slot headers and RENAMEs each staged key to its slot entry's payload key (and
    PERSISTs it). So payload bytes never pass through Lua, and a refused call or a writer killed between
    the two commands leaves only a staged key that expires by itself.
``stream`` (runs recorded without the field: older versions, golden logs, archives)
    The payload is an entry of the payloads stream at its slot entry's id (``h``, ``b``), written by
    ``publish.lua`` and read with XRANGE, exactly as those versions did.

An agent session's turn (`streamgrp.store.sessions`, the sessions stream of a partition) follows the same
rule. In a ``keys`` run the turn's entry of the sessions stream holds its header only (``h``), and its
tensors are `frame` d with the header in ``<sessions>:turn:<entry id>``, staged by the gateway as
``<sessions>:staged:<128-bit hex>`` and renamed there by ``session_turn.lua``; in a ``stream`` run the
entry holds them (``b``). `with_turns` is the one read of turns that gives every entry its ``b`` again,
wherever it lives, so the gateway's reload, replay, the inspector and the archive see the entries a
``stream`` run has.

Either way a reader gets each payload as the fields a payloads-stream entry has (``{b"h": header,
b"b": blob}``), so replay, verify, the loader and the archive do not know which layout a run has. A payload
key can be written by a role directly (a worker may RENAME under ``<payloads>:*``), like a stream entry
could: it is checked where it is read, against the digest its slot result and the step's manifest carry.
Deliberately ignores what a payload means: it frames and moves bytes.
"""

from __future__ import annotations

import functools
import secrets
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:  # the names module (streamgrp.store.keys) imports this one, and must stay free of redis
    import redis

    from streamgrp.store.own_connection import OwnConnection
    from streamgrp.store.streams import Retry

__all__ = [
    "KEYS",
    "STAGED_TTL_MS",
    "STREAM",
    "Layout",
    "entry_fetch",
    "frame",
    "key",
    "pattern",
    "read",
    "stage",
    "staged_key",
    "staged_pattern",
    "staging",
    "stream",
    "turn_key",
    "turn_pattern",
    "turn_prefix",
    "unframe",
    "unlink",
    "with_turns",
]

#: The run stores each payload in a key of its own (this version's runs).
KEYS = "keys"
#: The run stores payloads as entries of its payloads stream (runs recorded before the layout existed).
STREAM = "stream"
Layout = Literal["keys", "stream"]

#: How long a staged payload lives unless a publish takes it: far beyond any pipeline's round trip,
#: short enough that what a killed writer staged does not pile up.
STAGED_TTL_MS = 600_000
#: Payload keys per GET round trip (bounds one reply's memory as `streamgrp.store.streams.READ_CHUNK` does).
READ_CHUNK = 64

_LENGTH = struct.Struct("<I")
#: What a turn's header holds (`streamgrp.core.generation_events.TurnRecorded`'s kind, as the wire writes it);
#: inside a string of its ``meta`` the quotes would be escaped, so only a turn's header matches.
_TURN_KIND = b'"kind":"session_turn"'


def key(payloads: str, entry_id: str) -> str:
    """The key of the payload of slot entry ``entry_id`` of the partition whose payloads stream is ``payloads``."""
    return f"{payloads}:{_canonical(entry_id)}"


def staged_key(payloads: str) -> str:
    """A fresh staging key (128 random bits: no two writers ever pick the same)."""
    return f"{payloads}:staged:{secrets.token_hex(16)}"


def staged_pattern(payloads: str) -> str:
    """Every staging key of a partition, as an ACL key pattern."""
    return f"{payloads}:staged:*"


def pattern(payloads: str) -> str:
    """Every payload key (and staging key) of a partition, as an ACL or SCAN pattern; never the stream itself."""
    return f"{payloads}:*"


def turn_prefix(sessions: str) -> str:
    """The prefix of a ``keys`` run's turn keys of the sessions stream ``sessions`` (`trim_below` takes it)."""
    return f"{sessions}:turn"


def turn_key(sessions: str, entry_id: str) -> str:
    """The key of the tensors of the turn at entry ``entry_id`` of the sessions stream ``sessions``: named by
    the entry's id, so retention deletes it with its entry (`trim_below`) and a reader of the stream finds it."""
    return key(turn_prefix(sessions), entry_id)


def turn_pattern(sessions: str) -> str:
    """Every turn key of a sessions stream, as an ACL or SCAN pattern (never its staging keys or deadlines)."""
    return f"{sessions}:turn:*"


def frame(header: bytes, blob: bytes) -> bytes:
    """The stored value of a payload: header length (4 bytes, little-endian), header, blob."""
    return b"".join((_LENGTH.pack(len(header)), header, blob))


def unframe(value: bytes | memoryview, *, views: bool = False) -> dict[bytes, Any] | None:
    """A stored value as a payload entry's fields (``h``, ``b``); None when it is not a framed payload.
    ``views``: the blob as a memoryview of ``value`` (no copy), for a reader that only reads it."""
    if len(value) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack_from(value)
    if _LENGTH.size + length > len(value):
        return None
    view = memoryview(value)
    header = bytes(view[_LENGTH.size : _LENGTH.size + length])
    blob = view[_LENGTH.size + length :]
    return {b"h": header, b"b": blob if views else bytes(blob)}


def call_staged(
    client: redis.Redis,
    payloads: str,
    frames: Sequence[tuple[bytes, bytes]],
    function: Any,
    call: Callable[[list[str]], tuple[list[Any], list[Any]]],
    *,
    own: OwnConnection | None = None,
) -> Any:
    """Stage each (header, blob) of ``frames`` and call ``function`` (a registered server function,
    `streamgrp.store.scripts.register`) with the keys and arguments ``call(staged keys)`` gives, in one round
    trip; returns the function's reply and raises any error reply. Through ``own`` (a connection of the
    caller's own, `streamgrp.store.own_connection`: about half the CPU) when given, else a redis-py pipeline.

    A server that lost streamgrp's library (restarted empty) gets it again and the payloads are staged afresh;
    an outage is ridden the same way: the batch's replies hold its connection errors instead of raising them,
    so the client's own riding never sees them. A first attempt whose reply was lost is folded as a duplicate,
    and staged keys the function never took expire."""
    import redis

    from streamgrp.store import scripts
    from streamgrp.store.connection import ride

    def send() -> list[Any]:
        if own is None:
            pipe = client.pipeline(transaction=False)
            keys, args = call([stage(pipe, payloads, header, blob) for header, blob in frames])
            function(keys=keys, args=args, client=pipe)
            return pipe.execute(raise_on_error=False)
        staging_writes = [staging(payloads, header, blob, own.pieces) for header, blob in frames]
        keys, args = call([command[1] for command in staging_writes])
        return own.execute([*staging_writes, ("FCALL", function.name, len(keys), *keys, *args)])

    def attempt() -> Any:
        for retry in range(2):
            replies = send()
            reply = replies[-1]
            if isinstance(reply, redis.ResponseError) and "function not found" in str(reply).lower() and not retry:
                scripts.forget_loaded()
                scripts.ensure_library(client)
                continue
            for outcome in replies:
                if isinstance(outcome, Exception):
                    raise outcome
            return reply
        raise AssertionError("unreachable")

    return ride(client, attempt)


def staging(payloads: str, header: bytes, blob: bytes, pieces: bool, ttl_ms: int = STAGED_TTL_MS) -> tuple[Any, ...]:
    """The staging write of one payload, ``SET <fresh staging key> <frame> NX PX ttl``, as a command's arguments.
    ``pieces``: the connection packs with streamgrp's own packer (`streamgrp.store.resp.packs_pieces`), which
    writes the frame's parts into the command without joining them first: a long sample's bytes are copied
    once in the writer, as when they were a function's argument."""
    from streamgrp.store.resp import Pieces

    value = Pieces((_LENGTH.pack(len(header)), header, blob)) if pieces else frame(header, blob)
    return ("SET", staged_key(payloads), value, "NX", "PX", ttl_ms)


def stage(pipe: Any, payloads: str, header: bytes, blob: bytes, *, ttl_ms: int = STAGED_TTL_MS) -> str:
    """Queue on ``pipe`` the staging write of one payload (`staging`); returns its staging key (for the
    function's KEYS)."""
    from streamgrp.store.resp import packs_pieces

    command = staging(payloads, header, blob, packs_pieces(getattr(pipe, "connection_pool", None)), ttl_ms)
    pipe.execute_command(*command)
    return command[1]


def read(
    client: redis.Redis,
    payloads: str,
    ids: Sequence[str],
    *,
    views: bool = False,
    own: OwnConnection | None = None,
) -> list[dict[bytes, Any] | None]:
    """The payload of each slot entry id (``payloads``: the partition's payloads stream's name), in order,
    None where there is none (never written, deleted by retention, or not a framed payload)."""
    return list(stream(client, payloads, ids, views=views, own=own))


def stream(
    client: redis.Redis,
    payloads: str,
    ids: Sequence[str],
    *,
    views: bool = False,
    own: OwnConnection | None = None,
) -> Iterator[dict[bytes, Any] | None]:
    """`read`, chunk by chunk (one MGET each), so a caller may start on the first payloads early. Through
    ``own`` (`streamgrp.store.own_connection`: each chunk's reply in one buffer, its values views of it; a
    third of the CPU of redis-py's reply at 330 KB a value) when given, riding outages as ``client`` does."""
    from streamgrp.store.connection import ride

    for start in range(0, len(ids), READ_CHUNK):
        chunk = [key(payloads, entry_id) for entry_id in ids[start : start + READ_CHUNK]]
        if own is None:
            values: list[Any] = client.mget(chunk)  # streamgrp's clients read bytes
        else:
            values = ride(client, functools.partial(own.values, chunk))
        for value in values:
            yield unframe(value, views=views) if value is not None else None


def with_turns(
    client: redis.Redis, sessions: str, entries: Iterable[tuple[str, Mapping[bytes, Any]]]
) -> list[tuple[str, dict[bytes, Any]]]:
    """Entries of the sessions stream ``sessions`` (``(id, fields)``, in any order), each turn with its tensors
    (``b``) wherever they live: a ``keys`` run's turn (a header alone) from its turn key, one MGET per
    `READ_CHUNK` turns, provided the key holds this entry's header; a ``stream`` run's turn, and every event
    without tensors, as it is. A turn whose key is gone (deleted by retention with its entry, or never
    renamed there) stays without ``b``, and does not decode (`streamgrp.errors.DecodeError`, as a trimmed
    entry's absence): the reader says what that means to it."""
    out = [(entry_id, dict(fields)) for entry_id, fields in entries]
    bare = [i for i, (_, fields) in enumerate(out) if b"b" not in fields and _TURN_KIND in (fields.get(b"h") or b"")]
    for start in range(0, len(bare), READ_CHUNK):
        chunk = bare[start : start + READ_CHUNK]
        values = cast("list[bytes | None]", client.mget([turn_key(sessions, out[i][0]) for i in chunk]))
        for i, value in zip(chunk, values):
            stored = unframe(value) if value is not None else None
            if stored is not None and stored[b"h"] == out[i][1][b"h"]:
                out[i][1][b"b"] = stored[b"b"]
    return out


def entry_fetch(
    client: redis.Redis, stream_key: Callable[[str], str], layout: str, *, retry: Retry | None = None
) -> Callable[[str, Sequence[str]], Iterable[dict[bytes, Any] | None]]:
    """A loader's ``fetch(stream, ids)`` over the server (`streamgrp.train.loader`): a ``keys``-layout run's
    payloads from their keys (blobs as views of the reply, no copy), every other stream's entries with
    `streamgrp.store.streams.stream_entries`; ``stream_key`` names a stream's key (``payloads@1``...)."""
    from streamgrp.store import own_connection
    from streamgrp.store.streams import stream_entries

    own = own_connection.for_client(client) if layout == KEYS else None

    def fetch(name: str, ids: Sequence[str]) -> Iterable[dict[bytes, Any] | None]:
        key = stream_key(name)
        if layout == KEYS and name.partition("@")[0] == "payloads":
            return stream(client, key, list(ids), views=True, own=own)
        return stream_entries(client, key, list(ids), **({"retry": retry} if retry is not None else {}))

    return fetch


def unlink(client: redis.Redis, payloads: str, ids: Iterable[str]) -> int:
    """Delete the payload keys of these slot entry ids (retention, behind the archive); returns how many were there."""
    removed = 0
    chunk: list[str] = []
    for entry_id in ids:
        chunk.append(key(payloads, entry_id))
        if len(chunk) == 512:
            removed += int(client.unlink(*chunk))
            chunk = []
    if chunk:
        removed += int(client.unlink(*chunk))
    return removed


def trim_below(client: redis.Redis, slots: str, payloads: str, floor: str, *, page: int = 1000) -> int:
    """Delete the payload keys of the slot log's entries before ``floor`` (retention, just before it trims the
    slot log to that floor; a key outlives its slot entry never). Returns how many keys were there. A sessions
    stream's turn keys go the same way: ``trim_below(client, sessions, turn_prefix(sessions), floor)``."""
    removed, start = 0, "-"
    while True:
        entries = cast("list[tuple[bytes, Any]]", client.xrange(slots, start, f"({floor}", count=page))
        if not entries:
            return removed
        ids = [_canonical(raw_id) for raw_id, _ in entries]
        removed += unlink(client, payloads, ids)
        if len(entries) < page:
            return removed
        start = f"({ids[-1]}"


def _canonical(entry_id: str | bytes) -> str:
    """An entry id as XADD returns it (``ms-seq``): ``5`` is ``5-0``."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return text if "-" in text else f"{text}-0"

"""Dead letters: what one holds, and dead-lettering entries of streams the assembler does not fold.

A dead letter records the reason, a detail sentence, the stream and entry id, and the entry's own
fields (each name prefixed ``f:``, every pair kept, repeated names included). An entry larger than
`COPY_LIMIT_BYTES` or with more than `MAX_COPIED_FIELDS` fields is not copied: a *stub* stands in
for it (``stub``, the number of fields, the total bytes, a digest of every pair, the names and
sizes of the first fields, and the first `HEADER_PREFIX_BYTES` of its header), so a 100 MB entry
costs a few hundred bytes in the dead-letter stream and the commit scripts never unpack a list
whose length an attacker chose.

The slot log's dead letters go through the assembler's commit (`commit.lua`); the task queue's
(workers) and the control stream's (trainer ranks, the batcher) through `dead_letter` here, once
per entry whoever meets it first (`deadletter.lua`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any, TypeVar

import orjson
import redis

from streamgrp.core import codec
from streamgrp.errors import DecodeError
from streamgrp.store import scripts
from streamgrp.store.keys import PartitionKeys, RunKeys
from streamgrp.store.limits import MAX_DEAD_LETTER_FIELDS

log = logging.getLogger(__name__)

E = TypeVar("E")

#: Fields an entry may have and be copied whole; within the `MAX_DEAD_LETTER_FIELDS` pairs the functions take.
MAX_COPIED_FIELDS = MAX_DEAD_LETTER_FIELDS - 16
COPY_LIMIT_BYTES = 64 * 1024
HEADER_PREFIX_BYTES = 512
MAX_DETAIL_CHARS = 2000
_LISTED_SIZES = 32


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def field_pairs(fields: Mapping[Any, Any]) -> list[tuple[bytes, bytes]]:
    """Every (name, value) pair of an entry, repeated names included where the reader kept them."""
    pairs = getattr(fields, "pairs", None)
    items = pairs if pairs is not None else fields.items()
    return [(_bytes(name), _bytes(value)) for name, value in items]


def dead_letter_fields(fields: Mapping[Any, Any]) -> list[bytes]:
    """The flat (name, value, ...) list a dead letter carries for ``fields``: a copy or a stub."""
    pairs = field_pairs(fields)
    size = sum(len(name) + len(value) for name, value in pairs)
    if len(pairs) <= MAX_COPIED_FIELDS and size <= COPY_LIMIT_BYTES:
        flat: list[bytes] = []
        for name, value in pairs:
            flat += [b"f:" + name, value]
        return flat
    digest = hashlib.blake2b(digest_size=16)
    for name, value in pairs:
        digest.update(len(name).to_bytes(8, "little") + name + len(value).to_bytes(8, "little"))
        digest.update(value)
    header = next((value for name, value in pairs if name == b"h"), b"")
    sizes = [[name.decode(errors="replace")[:64], len(value)] for name, value in pairs[:_LISTED_SIZES]]
    return [
        b"stub",
        b"1",
        b"n_fields",
        str(len(pairs)).encode(),
        b"bytes",
        str(size).encode(),
        b"digest",
        digest.hexdigest().encode(),
        b"sizes",
        orjson.dumps(sizes),
        b"h_prefix",
        header[:HEADER_PREFIX_BYTES],
    ]


def op_fields(fields: Mapping[Any, Any]) -> list[Any]:
    """``n_fields`` then the pairs, as the commit scripts read a dead letter's fields."""
    flat = dead_letter_fields(fields)
    return [len(flat) // 2, *flat]


class DeadLetters:
    """Dead-lettering entries of the task queue or the control stream for one run, each once."""

    def __init__(self, client: redis.Redis, keys: RunKeys | PartitionKeys, *, metrics: Any = None) -> None:
        self.client = client
        self.keys = keys
        self.metrics = metrics
        self._script = scripts.register(client, "deadletter.lua")

    def send(
        self,
        stream: str,
        entry_id: str,
        reason: str,
        detail: str,
        fields: Mapping[Any, Any] | None,
        *,
        group: str = "",
        counter: str,
    ) -> bool:
        """Dead-letter ``entry_id`` of ``stream``; True when this call did it (False: already done).

        ``group`` acknowledges the entry in that consumer group; without one a marker makes the
        dead letter happen once. ``counter`` is the field counted with it (in ``deadletter_counts``)
        (``invalid:tasks``, ``invalid:control``, ``invalid:decisions``).
        """
        done = self._script(
            keys=[stream, self.keys.deadletter, self.keys.deadletter_counts, self.keys.deadlettered],
            args=[group, entry_id, reason, detail[:MAX_DETAIL_CHARS], counter, *op_fields(fields or {})],
        )
        if done and self.metrics is not None:
            self.metrics.dead_letters.labels(reason).inc()
        if done:
            log.warning("dead-lettered %s entry %s (%s): %s", stream.rsplit(":", 1)[-1], entry_id, reason, detail[:200])
        return bool(done)

    def decoded(
        self,
        stream: str,
        entry_id: str,
        fields: Mapping[Any, Any],
        kind: type[E],
        where: str,
        *,
        group: str = "",
        counter: str,
        max_entry_bytes: int = codec.DEFAULT_MAX_ENTRY_BYTES,
    ) -> E | None:
        """``fields`` decoded as a ``kind`` event; None after dead-lettering the entry (one that does not decode,
        with the codec's reason; one of another kind, ``unexpected_kind``, ``where`` naming the stream)."""
        try:
            event = codec.decode(fields, max_entry_bytes=max_entry_bytes)
        except DecodeError as exc:
            self.send(stream, entry_id, exc.reason, exc.detail, fields, group=group, counter=counter)
            return None
        if not isinstance(event, kind):
            self.send(
                stream,
                entry_id,
                "unexpected_kind",
                f"a {event.kind} event does not belong in {where}",
                fields,
                group=group,
                counter=counter,
            )
            return None
        return event

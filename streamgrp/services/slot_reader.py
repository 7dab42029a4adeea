"""The assembler's reads of its partition's slot log, through the `assembler` consumer group.

Owns creating that group, reading new entries (on one server with the server's clock in the same round
trip: the moment a round was read is when the groups it closes were decided), reading back the entries
pending for the assembler when it takes over (after claiming those pending under other consumer names),
how many entries one read asks for (fewer once entries are large), and decoding entries into the events the
fold takes, dead-lettering (into the round's records) what does not decode or does not belong in the slot
log. It deliberately ignores what the events decide: the assembler (`streamgrp.services.assembler`) folds them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis

from streamgrp.config import AssemblerConfig
from streamgrp.core import codec, counters
from streamgrp.core.events import SlotResult, SlotRewarded, TaskIssued, Tick
from streamgrp.errors import DecodeError
from streamgrp.services.slot_screen import dead_letter
from streamgrp.store.assembler_store import Record
from streamgrp.store.keys import ASSEMBLER_CONSUMER, ASSEMBLER_GROUP, PartitionKeys
from streamgrp.store.streams import ensure_group, entry_id_str, entry_size, first_entries

__all__ = ["FOLDED_KINDS", "SlotReader"]

#: The events the assembler's fold takes; any other kind in the slot log is dead-lettered.
FOLDED_KINDS = (TaskIssued, SlotResult, SlotRewarded, Tick)


class SlotReader:
    """Reads and decodes ``keys``' slot log as the assembler's consumer; creates its group."""

    def __init__(self, client: redis.Redis, keys: PartitionKeys, config: AssemblerConfig) -> None:
        self.client = client
        self.keys = keys
        self.config = config
        self._largest_entry = 0
        self._cluster = isinstance(client, redis.RedisCluster)
        ensure_group(client, keys.slots, ASSEMBLER_GROUP)

    def new(self, start: str, *, block_ms: int | None) -> tuple[list, float | None]:
        """Entries after ``start`` (``>``: never delivered), and the server's clock when they were read
        (None on a cluster: read apart, once a round needs it)."""
        if self._cluster:
            # A cluster client sends a keyless TIME to any node: asked apart, only when a group closes.
            reply, read_at = (
                self.client.xreadgroup(
                    ASSEMBLER_GROUP,
                    ASSEMBLER_CONSUMER,
                    {self.keys.slots: start},
                    count=self.read_count(),
                    block=block_ms,
                ),
                None,
            )
        else:
            # The server's clock rides with the read (one round trip, not two): the moment the round's
            # entries were read, which is when the groups they close were decided.
            pipe = self.client.pipeline(transaction=False)
            pipe.xreadgroup(
                ASSEMBLER_GROUP, ASSEMBLER_CONSUMER, {self.keys.slots: start}, count=self.read_count(), block=block_ms
            )
            pipe.time()
            reply, (seconds, micros) = pipe.execute()
            read_at = seconds + micros / 1e6
        return first_entries(reply), read_at

    def pending(self) -> Iterator[list]:
        """The entries pending for the assembler, oldest first, a page at a time (each page read when the
        one before has been handled); those pending under other consumer names are claimed first."""
        self._claim_orphans()
        last = "0"
        while True:
            reply = self.client.xreadgroup(
                ASSEMBLER_GROUP, ASSEMBLER_CONSUMER, {self.keys.slots: last}, count=self.read_count()
            )
            entries = first_entries(reply)
            if not entries:
                return
            last = entry_id_str(entries[-1][0])
            yield entries

    def _claim_orphans(self) -> None:
        """Move entries pending under any other consumer name to ours (assemblers that used --name)."""
        cursor = "0-0"
        while True:
            cursor, _claimed, *_ = self.client.xautoclaim(
                self.keys.slots, ASSEMBLER_GROUP, ASSEMBLER_CONSUMER, 0, start_id=cursor, count=1000
            )
            cursor = entry_id_str(cursor)
            if cursor == "0-0":
                break

    def read_count(self) -> int:
        """Entries per read: ``read_count``, fewer once entries are large, so that a round brings in
        about ``read_bytes`` at most (plus one entry: a stream entry cannot be read in parts)."""
        return max(1, min(self.config.read_count, self.config.read_bytes // max(1, self._largest_entry)))

    def decode(self, entries, records: list[Record], acks: dict[str, list[str]]) -> list[tuple[str, Any, Any]]:
        """The round's foldable events; what does not decode or belong is dead-lettered into ``records``."""
        decoded = []
        largest = 0
        for raw_id, fields in entries:
            entry_id = entry_id_str(raw_id)
            if fields is None:  # trimmed from the stream while pending: nothing left to fold
                acks.setdefault(counters.slots("trimmed"), []).append(entry_id)
                continue
            largest = max(largest, entry_size(fields))
            try:
                event = codec.decode(fields, max_entry_bytes=self.config.max_entry_bytes)
            except DecodeError as exc:
                dead_letter(records, exc.reason, entry_id, exc.detail, fields)
                continue
            if not isinstance(event, FOLDED_KINDS):
                dead_letter(
                    records,
                    "unexpected_kind",
                    entry_id,
                    f"a {event.kind} event does not belong in the slot log",
                    fields,
                )
                continue
            decoded.append((entry_id, fields, event))
        self._largest_entry = largest
        return decoded

"""The batcher's reads of its run's decisions: each partition's decisions stream through the `batcher` group.

Owns creating that consumer group, reading new entries (from every partition that has some, in turn; on one
server and one partition with the policy version in the same round trip), reading back the entries pending
for the batcher when it takes over, and decoding entries into decisions, dead-lettering (once, with the
reason) those that are not. It deliberately ignores what the decisions become: the batcher
(`streamgrp.services.batcher`) folds them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import redis

from streamgrp.core import counters
from streamgrp.core.events import GroupDecided
from streamgrp.store.deadletter import DeadLetters
from streamgrp.store.keys import BATCHER_CONSUMER, BATCHER_GROUP, PartitionKeys, RunKeys
from streamgrp.store.streams import ensure_group, entry_id_str, first_entries, read_in_turn
from streamgrp.store.version import VersionReader

__all__ = ["Batches", "Decided", "DecisionReader"]

#: Read entries of the decisions stream, each list from one partition.
Batches = list[tuple[PartitionKeys, list]]
#: A read decision: its partition, its entry id, and the decision (None: a pending entry the server no
#: longer holds).
Decided = tuple[int, str, GroupDecided | None]


class DecisionReader:
    """Reads and decodes ``partitions``' decisions as the batcher's consumer; creates its group on each."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        partitions: Sequence[PartitionKeys],
        version: VersionReader,
        *,
        metrics: Any = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.partitions = partitions
        self._version = version
        # One server, one partition: the policy version rides with each read (one round trip, not two).
        self._reads_with_version = len(partitions) == 1 and not isinstance(client, redis.RedisCluster)
        self.dead_letters = {part.index: DeadLetters(client, part, metrics=metrics) for part in partitions}
        for part in partitions:
            ensure_group(client, part.decisions, BATCHER_GROUP)

    def new(self, block_ms: int) -> tuple[Batches, int | None]:
        """New decision entries of every partition that has some (`read_in_turn`), and the policy version
        read with them (None when it could not ride along)."""
        if self._reads_with_version:
            [part] = self.partitions
            pipe = self.client.pipeline(transaction=False)
            pipe.xreadgroup(BATCHER_GROUP, BATCHER_CONSUMER, {part.decisions: ">"}, count=512, block=block_ms)
            pipe.get(self.keys.version)  # run once the read returns: as fresh as a GET after it
            reply, version = pipe.execute()
            entries = first_entries(reply)
            return ([(part, entries)] if entries else []), self._version.parse(version)

        def read(part: PartitionKeys, block: int | None) -> list:
            reply = self.client.xreadgroup(
                BATCHER_GROUP, BATCHER_CONSUMER, {part.decisions: ">"}, count=512, block=block
            )
            return first_entries(reply)

        return read_in_turn(self.partitions, read, block_ms, first=False), None

    def pending(self) -> Iterator[Batches]:
        """The entries pending for the batcher, partition by partition, a page at a time (each page read
        when the one before has been handled)."""
        for part in self.partitions:
            last = "0"
            while True:
                reply = self.client.xreadgroup(BATCHER_GROUP, BATCHER_CONSUMER, {part.decisions: last}, count=512)
                entries = first_entries(reply)
                if not entries:
                    break
                last = entry_id_str(entries[-1][0])
                yield [(part, entries)]

    def decode(self, batches: Batches) -> list[Decided]:
        """The decisions of ``batches``, in order; an entry that is not one is dead-lettered and left out."""
        decided: list[Decided] = []
        for part, entries in batches:
            dead_letters = self.dead_letters[part.index]
            for raw_id, fields in entries:
                entry_id = entry_id_str(raw_id)
                decision: GroupDecided | None = None  # None: a pending entry the server no longer holds
                if fields is not None:
                    decision = dead_letters.decoded(
                        part.decisions,
                        entry_id,
                        fields,
                        GroupDecided,
                        "the decisions stream",
                        group=BATCHER_GROUP,
                        counter=counters.INVALID_DECISIONS,
                    )
                    if decision is None:
                        continue
                decided.append((part.index, entry_id, decision))
        return decided

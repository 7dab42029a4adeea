"""What the batcher reads from and settles on the server besides its fold and commit script: the run's
counters for the stall message, whether the server is full, the trainers' lowest commit, whether every
decision was read, and the acknowledgements a partitioned run's commits recorded.

Owns no state: each function takes the client and keys it reads; `streamgrp.services.batcher` calls them.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from streamgrp.core.events import GroupDecided
from streamgrp.core.manifest import split_decision_ref
from streamgrp.store.keys import BATCHER_GROUP, PartitionKeys, RunKeys
from streamgrp.store.streams import entry_id_str, hash_reply


def run_counts(client: redis.Redis, keys: RunKeys, partitions: Sequence[PartitionKeys]) -> dict[str, int]:
    """The run's counters, the batcher's and every assembler's added up."""
    counts: dict[str, int] = {}
    for key in dict.fromkeys([keys.counts, *(part.counts for part in partitions)]):
        for name, value in hash_reply(client.hgetall(key)).items():
            counts[name.decode()] = counts.get(name.decode(), 0) + int(float(value))
    return counts


def memory_note(client: redis.Redis) -> str:
    """A sentence for the stall message when the server is full (writes refused under noeviction)."""
    memory = client.info("memory")
    maxmemory, used = int(memory.get("maxmemory", 0) or 0), int(memory.get("used_memory", 0) or 0)
    if maxmemory and used >= 0.95 * maxmemory:
        return (f"The server is full ({used} of maxmemory {maxmemory} bytes): it refuses writes (OOM) until "
                "maxmemory is raised or retention trims the run (streamgrp archiver --retention).")
    return ""


def lowest_committed(client: redis.Redis, keys: RunKeys, dp_size: int) -> int:
    """The lowest step every rank has committed; -1 while some rank has committed none."""
    committed = client.hvals(keys.committed)
    if len(committed) < dp_size:
        return -1
    return min(int(v) for v in committed)


def read_every_decision(client: redis.Redis, part: PartitionKeys) -> bool:
    """Whether the batcher's consumer group was delivered the partition's last decision."""
    last_written = client.xinfo_stream(part.decisions)["last-generated-id"]
    for group in client.xinfo_groups(part.decisions):
        if group["name"] in (BATCHER_GROUP, BATCHER_GROUP.encode()):
            return group["last-delivered-id"] == last_written
    return False


def acknowledge_recorded(client: redis.Redis, keys: RunKeys, partitions: Sequence[PartitionKeys]) -> None:
    """Acknowledge, in their partitions, the decisions a partitioned run's commits recorded as used,
    then forget them. Idempotent: an acknowledgement of an acknowledged entry changes nothing, so a
    batcher that dies halfway leaves the rest to the next."""
    recorded = [entry_id_str(ref) for ref in client.hkeys(keys.batcher_unacked)]  # decision refs: entry ids
    by_partition: dict[int, list[str]] = {}
    for ref in recorded:
        partition, entry_id = split_decision_ref(ref)
        by_partition.setdefault(partition, []).append(entry_id)
    for partition, entry_ids in by_partition.items():
        if partition < len(partitions):
            for start in range(0, len(entry_ids), 512):
                client.xack(partitions[partition].decisions, BATCHER_GROUP, *entry_ids[start:start + 512])
    for start in range(0, len(recorded), 512):
        client.hdel(keys.batcher_unacked, *recorded[start:start + 512])


def settled_tasks(client: redis.Redis, keys: RunKeys, task_ids: list[str], buffer: Sequence[tuple[str, GroupDecided]]
                  ) -> set[str]:
    """Of a partitioned run, the tasks that may not be used again: those of ``task_ids`` its steps and
    discards used (`RunKeys.batcher_settled`), and the buffered ones. (Unpartitioned, one server's log
    holds a decision and its marker together and cannot decide a task twice: nothing to ask.)"""
    used = client.hmget(keys.batcher_settled, task_ids) if task_ids else []
    return {task for task, hit in zip(task_ids, used) if hit is not None} | {decision.task_id for _, decision in buffer}

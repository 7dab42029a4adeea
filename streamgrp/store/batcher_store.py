"""The batcher's store adapter: the records a commit applies, the one function call that applies them, and
what else the batcher reads from and settles on the server.

Owns the batcher's server-side function (`batch_commit.lua`): registering it, encoding records into its
arguments (`encode_batch`), calling it fenced by the batcher lease, waiting for replicas, decoding its
reply (`BatchCommitted`), and, in a partitioned run, acknowledging in their partitions the decisions a
commit recorded as used (`acknowledge_recorded`). The function's operation names are private to this
module and `batch_commit.lua`, one name per meaning. Besides: the run's counters for the stall message,
whether the server is full, the trainers' lowest commit, whether every decision was read, and which
tasks a partitioned run settled. The batcher (`streamgrp.services.batcher`) decides what a commit
applies and in what order, and never sees an argument list.

A commit is a sequence of records, applied in order in one atomic call:

- `streamgrp.core.batch_fold.Acked`: decision entries acknowledged (groups the assembler dropped);
- `GroupDiscarded` (stamped): a trainable group discarded, written and counted once per decision entry;
- `Step`: a step's manifest, written only if it is the next step, with its decision entries acknowledged;
- `Settle`: (partitioned runs) tasks marked used, so a decision a partition repeats is refused; the tasks
  of a `Step` and a `GroupDiscarded` are settled with them without asking;
- `RunTerminated`, `RunFinished`: the run's terminal or finished event, written once.

Errors: a lost lease or a step written already raises `streamgrp.errors.LeaseLost`
(`streamgrp.store.scripts.FencedScript`); an input the function refuses (``BAD_INPUT``, a bug here) stays a
`redis.ResponseError`, and the function has written nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from streamgrp.core import codec, counters
from streamgrp.core.batch_fold import Acked
from streamgrp.core.events import GroupDecided, GroupDiscarded, RunFinished, RunTerminated, StepManifest
from streamgrp.core.manifest import split_decision_ref
from streamgrp.store import scripts
from streamgrp.store.connection import wait_for_replicas
from streamgrp.store.keys import BATCHER_GROUP, PartitionKeys, RunKeys
from streamgrp.store.streams import entry_id_str, hash_reply

# batch_commit.lua's operations (private: only this module and the Lua name them).
_STEP = "step"
_DISCARD = "discard"
_ACK = "ack"
_SETTLE = "settle"
_TERMINAL = "terminal"
_FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Step:
    """A step's ``manifest`` (stamped), the decision references it uses (acknowledged with it) and their tasks."""

    manifest: StepManifest
    refs: tuple[str, ...]
    task_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Settle:
    """Tasks a partitioned run's batcher used outside a step or a discard (a decision the assembler dropped)."""

    task_ids: tuple[str, ...]


Record = Acked | GroupDiscarded | Step | Settle | RunTerminated | RunFinished


@dataclass(frozen=True, slots=True)
class BatchCommitted:
    """What a call did: steps written, and every counter change it applied."""

    steps: int
    counts: dict[str, int]


def encode_batch(records: Sequence[Record], *, partitioned: bool) -> list[Any]:
    """The function's arguments after the lease token and consumer group, for ``records`` in order;
    ``partitioned``: the run has more than one partition (tasks are settled, acknowledgements recorded)."""
    args: list[Any] = []
    for record in records:
        if isinstance(record, Acked):
            args += [_ACK, len(record.entry_ids), *record.entry_ids]
        elif isinstance(record, GroupDiscarded):
            args += [_DISCARD, record.reason, codec.encode(record)[codec.HEADER], record.decision_entry]
            if partitioned:
                args += [_SETTLE, 1, record.task_id]
        elif isinstance(record, Step):
            refs = record.refs
            args += [
                _STEP,
                record.manifest.step,
                codec.encode(record.manifest)[codec.HEADER],
                len(refs),
                len(refs),
                *refs,
            ]
            if partitioned:
                args += [_SETTLE, len(record.task_ids), *record.task_ids]
        elif isinstance(record, Settle):
            if not partitioned:
                raise ValueError("tasks are settled only in a partitioned run (one server cannot decide a task twice)")
            args += [_SETTLE, len(record.task_ids), *record.task_ids]
        elif isinstance(record, RunTerminated):
            args += [_TERMINAL, codec.encode(record)[codec.HEADER]]
        elif isinstance(record, RunFinished):
            args += [_FINISHED, codec.encode(record)[codec.HEADER]]
        else:
            raise TypeError(
                f"a batcher commit applies Acked, GroupDiscarded, Step, Settle, RunTerminated or "
                f"RunFinished records, not {type(record).__name__}"
            )
    return args


def decode_reply(reply: Sequence[Any]) -> BatchCommitted:
    """The function's reply ``{steps, counter, amount, ...}`` as a `BatchCommitted`."""
    steps, *applied = reply
    return BatchCommitted(int(steps), counters.pairs_to_counts(applied))


class BatcherStore:
    """One run's batcher commits: ``commit(lease_token, records)``."""

    def __init__(self, client: redis.Redis, keys: RunKeys, partitions: Sequence[PartitionKeys]) -> None:
        self.client = client
        self.keys = keys
        self.partitions = partitions
        self.partitioned = len(partitions) > 1
        self._keys = [
            keys.decisions,
            keys.steps,
            keys.discarded,
            keys.counts,
            keys.batcher_lease,
            keys.batcher_state,
            keys.control,
        ]
        if self.partitioned:  # acknowledgements recorded in the run's slot, applied after the call
            self._keys[0:1] = [keys.batcher_unacked]
            self._keys += [keys.batcher_unacked, keys.batcher_settled]
        self._commit = scripts.register_fenced(client, "batch_commit.lua")

    def commit(self, lease_token: str, records: Sequence[Record]) -> BatchCommitted:
        """Apply ``records`` in one atomic call fenced by the lease, wait for replicas (when configured), then
        (partitioned) acknowledge what the call recorded."""
        reply = self._commit(
            keys=self._keys, args=[lease_token, BATCHER_GROUP, *encode_batch(records, partitioned=self.partitioned)]
        )
        wait_for_replicas(self.client)
        self.acknowledge_recorded()
        return decode_reply(reply)

    def acknowledge_recorded(self) -> None:
        """What a partitioned run's commits recorded, acknowledged (a batcher taking over owes it first)."""
        if self.partitioned:
            acknowledge_recorded(self.client, self.keys, self.partitions)


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
        return (
            f"The server is full ({used} of maxmemory {maxmemory} bytes): it refuses writes (OOM) until "
            "maxmemory is raised or retention trims the run (streamgrp archiver --retention)."
        )
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
                client.xack(partitions[partition].decisions, BATCHER_GROUP, *entry_ids[start : start + 512])
    for start in range(0, len(recorded), 512):
        client.hdel(keys.batcher_unacked, *recorded[start : start + 512])


def settled_tasks(
    client: redis.Redis, keys: RunKeys, task_ids: list[str], buffer: Sequence[tuple[str, GroupDecided]]
) -> set[str]:
    """Of a partitioned run, the tasks that may not be used again: those of ``task_ids`` its steps and
    discards used (`RunKeys.batcher_settled`), and the buffered ones. (Unpartitioned, one server's log
    holds a decision and its marker together and cannot decide a task twice: nothing to ask.)"""
    used = client.hmget(keys.batcher_settled, task_ids) if task_ids else []
    return {task for task, hit in zip(task_ids, used) if hit is not None} | {decision.task_id for _, decision in buffer}

"""The worker's store side (`WorkerClient`): taking tasks from the run's queue (reclaiming what a stopped
worker left idle), keeping the tasks it runs claimed, publishing slot results, acknowledging tasks. The
loop that runs rollouts on them is `streamgrp.services.worker`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis

from streamgrp.core import codec, counters
from streamgrp.core.events import Sample, SlotResult, TaskIssued
from streamgrp.core.values import RewardLater
from streamgrp.errors import ConfigError, DecodeError
from streamgrp.store import own_connection, payloads, scripts
from streamgrp.store.connection import wait_for_replicas
from streamgrp.store.deadletter import DeadLetters
from streamgrp.store.keys import WORKERS_GROUP, PartitionKeys, RunKeys, task_partition
from streamgrp.store.limits import MAX_RESULTS
from streamgrp.store.runs import read_record, recorded_layout, recorded_partitions
from streamgrp.store.streams import ensure_group, entry_id_str, entry_size, producer_name, read_in_turn, read_reply

# The worker's logger: its warnings read as the worker's, wherever in it they come from.
log = logging.getLogger("streamgrp.services.worker")


MAX_ERROR_CHARS = 4000
#: Slot results per publish script call: bounds the script's input whatever the caller hands over.
PUBLISH_CHUNK = 64
#: At most one warning about refused samples per this many seconds (a rollout bug refuses every slot).
REFUSAL_LOG_EVERY_S = 60.0
#: ``vocab_size`` not given: the run's record says it.
RECORDED = "recorded"


#: What a slot's rollout ended in, as published: a sample, a sample waiting for its reward, a
#: rejection (None) or a failure.
SlotOutcome = Sample | RewardLater | BaseException | None


class InvalidSample(ValueError):
    """A rollout returned a sample whose values cannot train; published as a failed slot with this text."""


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """What a rollout function is asked to do: sample ``slot`` of ``task_id`` for ``prompt``."""

    task_id: str
    slot: int
    n_samples: int
    prompt: dict[str, Any]
    version: int
    #: The task's entry in its partition's queue, and whether it was taken over from a worker that stopped
    #: (its slots may have segments to continue from: `streamgrp.store.segments`).
    task_entry: str = ""
    partition: int = 0
    reclaimed: bool = False


@dataclass(frozen=True, slots=True)
class Task:
    entry_id: str
    event: TaskIssued
    #: The run partition whose task queue the task came from (0 in an unpartitioned run).
    partition: int = 0
    reclaimed: bool = False

    def requests(self, n_samples: int, version: int) -> list[SlotRequest]:
        return [
            SlotRequest(
                self.event.task_id,
                slot,
                n_samples,
                self.event.prompt,
                version,
                self.entry_id,
                self.partition,
                self.reclaimed,
            )
            for slot in range(n_samples)
        ]


class WorkerClient:
    """The Python API of a worker: `take` tasks, `publish` slot results, `done` with a task.

    In a partitioned run (``partitions``: every partition's keys, `streamgrp.store.runs.Run.partitions`)
    a worker takes tasks from the partitions in ``take_from`` (default all), in turn, and publishes each
    result to its task's partition, so each partition's writes stay in its own hash slot."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        *,
        name: str | None = None,
        claim_idle_s: float = 30.0,
        max_entry_bytes: int = codec.DEFAULT_MAX_ENTRY_BYTES,
        metrics: Any = None,
        partitions: Sequence[PartitionKeys] | None = None,
        take_from: Collection[int] | None = None,
        vocab_size: int | str | None = RECORDED,
    ) -> None:
        self.client = client
        self.keys = keys
        #: Token ids at or above it are refused (None: only negative ones); by default the run's record's.
        if isinstance(vocab_size, str) and vocab_size != RECORDED:
            raise ConfigError(f"vocab_size {vocab_size!r}: give a number, None, or {RECORDED!r} for the run's own")
        self.vocab_size = _recorded_vocab_size(client, keys) if isinstance(vocab_size, str) else vocab_size
        self._refusals = RateLimitedWarning(
            "%d sample(s) published as failed slots since the last warning: their values cannot train (the latest: %s)"
        )
        # Not given: the run's record names them (writing to the unpartitioned keys of a partitioned
        # run would publish where no assembler reads).
        self.partitions = tuple(partitions) if partitions else recorded_partitions(client, keys)
        chosen = sorted(set(take_from)) if take_from is not None else range(len(self.partitions))
        unknown = [index for index in chosen if not 0 <= index < len(self.partitions)]
        if unknown or not chosen:
            raise ConfigError(
                f"partitions {list(chosen)} to take tasks from: the run has partitions 0 to "
                f"{len(self.partitions) - 1}; fix --take-partitions"
            )
        self.sources = tuple(self.partitions[index] for index in chosen)
        self.name = name or producer_name("worker")
        self.max_entry_bytes = max_entry_bytes
        self.dead_letters = {part.index: DeadLetters(client, part, metrics=metrics) for part in self.partitions}
        self.claim_idle_ms = int(claim_idle_s * 1000)
        #: How often the tasks running here are claimed again (`hold`): well inside the claim time.
        self.hold_every_s = claim_idle_s / 3
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()
        self._claim_cursors = {part.index: "0-0" for part in self.sources}
        # When each source's last full scan for idle tasks ended finding none (time.monotonic()): a task
        # turns idle only after claim_idle_s, so scanning again sooner than a tenth of that finds what a
        # later scan would, a little earlier, at the cost of one round trip per take.
        self._scanned_clean: dict[int, float] = {}
        self._scan_every_s = min(1.0, claim_idle_s / 10)
        self._turn = 0  # which source a take starts at, so no partition's queue waits behind another's
        #: Where the run keeps payloads (`streamgrp.store.payloads`): this version's runs, ``keys``.
        self.layout = recorded_layout(client, keys)
        self._publish = scripts.register(client, "publish.lua")
        self._publish_keys = scripts.register(client, "publish_staged.lua")
        #: A single server's publishes go on a connection of the worker's own (`streamgrp.store.own_connection`).
        self._own = own_connection.for_client(client)
        self._hold = scripts.register(client, "tasks_held.lua")
        for part in self.sources:
            ensure_group(client, part.tasks, WORKERS_GROUP)

    def take(self, count: int = 1, *, block_ms: int | None = 1000) -> list[Task]:
        """Up to ``count`` tasks: first ones a dead worker left idle too long, then new ones."""
        sources = self.sources[self._turn :] + self.sources[: self._turn]
        self._turn = (self._turn + 1) % len(self.sources)
        for part in sources:
            claimed = self._reclaim(part, count)
            if claimed:
                return claimed
        found = read_in_turn(sources, lambda part, block: self._read(part, count, block), block_ms, first=True)
        return found[0][1] if found else []

    def _read(self, part: PartitionKeys, count: int, block_ms: int | None) -> list[Task]:
        reply = self.client.xreadgroup(WORKERS_GROUP, self.name, {part.tasks: ">"}, count=count, block=block_ms)
        return self._tasks(part, (entry for _, entries in read_reply(reply) for entry in entries))

    def _reclaim(self, part: PartitionKeys, count: int) -> list[Task]:
        clean_at = self._scanned_clean.get(part.index)
        if clean_at is not None and time.monotonic() - clean_at < self._scan_every_s:
            return []
        cursor, entries, *_ = self.client.xautoclaim(
            part.tasks,
            WORKERS_GROUP,
            self.name,
            self.claim_idle_ms,
            start_id=self._claim_cursors[part.index],
            count=count,
        )
        self._claim_cursors[part.index] = cursor = entry_id_str(cursor)
        if cursor == "0-0" and not entries:  # the whole pending list scanned: nothing idle long enough
            self._scanned_clean[part.index] = time.monotonic()
        else:
            self._scanned_clean.pop(part.index, None)
        tasks = [replace(task, reclaimed=True) for task in self._tasks(part, entries)]
        for task in tasks:
            log.info("reclaimed task %s (entry %s) from a worker that stopped", task.event.task_id, task.entry_id)
        return tasks

    def _tasks(self, part: PartitionKeys, entries) -> list[Task]:
        tasks = []
        dead_letters = self.dead_letters[part.index]
        for entry_id, fields in entries:
            entry_id = entry_id_str(entry_id)
            if fields is None:  # trimmed while pending
                self.client.xack(part.tasks, WORKERS_GROUP, entry_id)
                continue
            event = dead_letters.decoded(
                part.tasks,
                entry_id,
                fields,
                TaskIssued,
                "the task queue",
                group=WORKERS_GROUP,
                counter=counters.INVALID_TASKS,
                max_entry_bytes=self.max_entry_bytes,
            )
            if event is not None:
                tasks.append(Task(entry_id, event, part.index))
        return tasks

    def publish(self, task_id: str, slot: int, result: SlotOutcome) -> str:
        """Publish one slot result; when this returns, the result is in the server (SPEC section 5)."""
        return self.publish_many([(task_id, slot, result)])[0]

    def check(self, result: SlotOutcome) -> SlotOutcome:
        """``result`` as it is published: a sample whose values cannot train becomes an `InvalidSample`."""
        sample = result.sample if isinstance(result, RewardLater) else result
        if not isinstance(sample, Sample):
            return result
        problem = sample.value_problem(self.vocab_size)
        if problem is None:
            return result
        self._refusals.add(problem)
        return InvalidSample(problem)

    def publish_many(
        self, results: Sequence[tuple[str, int, SlotOutcome]], *, done: Sequence[Task] = (), checked: bool = False
    ) -> list[str]:
        """Publish slot results (``(task_id, slot, result)``: a `Sample`, a `RewardLater`, None for a
        rejection, an exception for a failure) in as few round trips as `PUBLISH_CHUNK` allows; returns their slot
        entry ids.
        Each result is `check`ed first, unless ``checked`` says the caller did.

        When this returns, every result is in the server. A sample's tensors go to its payload key (staged,
        then taken by the function; `streamgrp.store.payloads`) and its summary, with the payload's digest,
        to the group log, both in one function call (per partition, in a partitioned run). ``done``: tasks whose
        every slot's result is then published
        (these results among them), acknowledged as `done` would, in the same call as their
        partition's last results (so never left published but unacknowledged), else after them."""
        by_partition: dict[int, list[int]] = {}
        for at, (task_id, _, _) in enumerate(results):
            by_partition.setdefault(task_partition(task_id, len(self.partitions)), []).append(at)
        owed: dict[int, list[Task]] = {}
        for task in done:
            owed.setdefault(task.partition, []).append(task)
        ids: list[str] = [""] * len(results)
        for index, positions in by_partition.items():
            part = self.partitions[index]
            triples = [self._encode(*results[at], checked=checked) for at in positions]
            for start in range(0, len(triples), PUBLISH_CHUNK):
                chunk = triples[start : start + PUBLISH_CHUNK]
                acks = owed.pop(index, []) if start + PUBLISH_CHUNK >= len(triples) else []
                if len(acks) > MAX_RESULTS:  # the rest after the call, as `done` would
                    owed[index], acks = acks[MAX_RESULTS:], acks[:MAX_RESULTS]
                # Sent again through an outage: a copy whose first reply was lost is folded as a duplicate
                # (and acknowledging again changes nothing).
                head = [WORKERS_GROUP if acks else "", len(acks), *(task.entry_id for task in acks)]
                if self.layout == payloads.KEYS:
                    written = self._publish_staged(part, head, chunk)
                else:
                    written = self._publish_stream(
                        part, head, chunk, bool(acks), [results[at] for at in positions[start : start + PUBLISH_CHUNK]]
                    )
                for at, entry_id in zip(positions[start : start + PUBLISH_CHUNK], written):
                    ids[at] = entry_id_str(entry_id)
        self.done(*(task for tasks in owed.values() for task in tasks))
        wait_for_replicas(self.client)
        return ids

    def _publish_staged(
        self, part: PartitionKeys, head: list[Any], chunk: list[tuple[bytes, bytes, bytes]]
    ) -> list[Any]:
        """One publish of a keys-layout run: each payload staged and the function that takes them, in one round
        trip on the worker's own connection (`streamgrp.store.payloads.call_staged`); the function's arguments
        hold no payload byte."""
        args = [
            *head,
            *(item for header, payload_header, _ in chunk for item in (header, b"1" if payload_header else b"")),
        ]
        return payloads.call_staged(
            self.client,
            part.payloads,
            [(payload_header, blob) for _, payload_header, blob in chunk if payload_header],
            self._publish_keys,
            lambda staged: ([part.slots, part.payloads, part.tasks, *staged], args),
            own=self._own,
        )

    def _publish_stream(
        self,
        part: PartitionKeys,
        head: list[Any],
        chunk: list[tuple[bytes, bytes, bytes]],
        acks: bool,
        results: Sequence[tuple[str, int, SlotOutcome]],
    ) -> list[Any]:
        """One publish of a stream-layout run (recorded by an older version): the payloads as arguments."""
        keys = [part.slots, part.payloads, part.tasks] if acks else [part.slots, part.payloads]
        try:
            return self._publish(keys=keys, args=[*head, *(item for triple in chunk for item in triple)])
        except redis.exceptions.ResponseError as exc:
            if not str(exc).startswith("PAYLOAD"):
                raise
            # The payloads stream holds the largest id there is (a foreign entry): no payload can be
            # written after it, ever. The results go out as failed slots saying so, and the worker goes on.
            log.error("slot results published as failed: %s", exc)
            failed = [
                self._encode(*result[:2], RuntimeError(f"not published: {exc}"), checked=True) for result in results
            ]
            return self._publish(keys=keys, args=[*head, *(item for triple in failed for item in triple)])

    def _encode(self, task_id: str, slot: int, result: SlotOutcome, *, checked: bool) -> tuple[bytes, bytes, bytes]:
        """(slot header, payload header, payload blob) for one result; the payload is empty without a sample."""
        with self._seq_lock:
            seq = next(self._seq)
        if not checked:
            result = self.check(result)
        later = isinstance(result, RewardLater)
        sample = result.sample if isinstance(result, RewardLater) else result
        if isinstance(sample, Sample):
            slot_header, payload_header, blob = codec.encode_sample(
                task_id, slot, sample, producer=self.name, seq=seq, reward_pending=later
            )
            size = entry_size({codec.HEADER: payload_header, codec.BLOB: blob})
            if size <= self.max_entry_bytes:
                return slot_header, payload_header, blob
            # refused here, where the data enters, not after it is stored
            result = ValueError(
                f"the sample is {size} bytes encoded, over max_entry_bytes={self.max_entry_bytes}; "
                "return shorter samples, or raise --max-entry-bytes on the workers and trainers"
            )
        if isinstance(result, BaseException):
            text = "".join(traceback.format_exception_only(type(result), result)).strip() or type(result).__name__
            event = SlotResult(
                task_id=task_id, slot=slot, outcome="failed", error=text[:MAX_ERROR_CHARS], producer=self.name, seq=seq
            )
        elif result is None:
            event = SlotResult(task_id=task_id, slot=slot, outcome="rejected", producer=self.name, seq=seq)
        else:
            raise TypeError(f"a rollout returns a streamgrp.Sample, a RewardLater or None, not {type(result).__name__}")
        return codec.encode(event)[codec.HEADER], b"", b""

    def hold(self, tasks: Sequence[Task]) -> int:
        """Claim ``tasks`` (still running here) again, so their idle time starts over and no worker takes
        them over as a stopped worker's; one call per partition. Returns how many were still ours."""
        by_partition: dict[int, list[str]] = {}
        for task in tasks:
            by_partition.setdefault(task.partition, []).append(task.entry_id)
        held = 0
        for index, entry_ids in by_partition.items():
            for start in range(0, len(entry_ids), MAX_RESULTS):
                held += int(
                    self._hold(
                        keys=[self.partitions[index].tasks],
                        args=[WORKERS_GROUP, self.name, *entry_ids[start : start + MAX_RESULTS]],
                    )
                )
        return held

    def done(self, *tasks: Task) -> None:
        """Acknowledge tasks once every slot's result of each was published: one XACK per partition."""
        by_partition: dict[int, list[str]] = {}
        for task in tasks:
            by_partition.setdefault(task.partition, []).append(task.entry_id)
        for index, entry_ids in by_partition.items():
            self.client.xack(self.partitions[index].tasks, WORKERS_GROUP, *entry_ids)


def _recorded_vocab_size(client: redis.Redis, keys: RunKeys) -> int | None:
    """The vocabulary size the run recorded; None when it recorded none, or has no readable record yet."""
    first = client.xrange(keys.control, "-", "+", count=1)
    if not first:
        return None
    try:
        return read_record(keys.run, first[0][1], "the control stream's first entry")[1].vocab_size
    except (ConfigError, DecodeError):
        return None


class RateLimitedWarning:
    """Warns at most once per `REFUSAL_LOG_EVERY_S`, with how many there were since (slot threads add
    concurrently; a rollout bug fails every slot, and must not flood the log). ``message`` takes the
    count and the latest case's text."""

    def __init__(self, message: str) -> None:
        self.message = message
        self._lock = threading.Lock()
        self._since = 0
        self._warned_at: float | None = None

    def add(self, latest: str) -> None:
        with self._lock:
            self._since += 1
            now = time.monotonic()
            if self._warned_at is not None and now - self._warned_at < REFUSAL_LOG_EVERY_S:
                return
            count, self._since, self._warned_at = self._since, 0, now
        log.warning(self.message, count, latest)

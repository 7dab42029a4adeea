"""Issuing tasks: the one path by which a `TaskIssued` reaches the workers' queue and the group log.

Every task is written by `issue_tasks.lua`, to both streams in one atomic call, stamped with the
server's clock. The batcher's feeder issues fenced by its lease and dataset cursor (`TaskWriter`
with a lease token); `TaskIssuer` issues unfenced, for producers that bring their own tasks (tests,
benchmarks, a user's own scheduler).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis

from streamgrp.core import codec
from streamgrp.core.events import TaskIssued
from streamgrp.store import scripts
from streamgrp.store.connection import wait_for_replicas
from streamgrp.store.keys import WORKERS_GROUP, PartitionKeys, RunKeys, task_partition
from streamgrp.store.runs import recorded_partitions, server_time
from streamgrp.store.streams import ensure_group, producer_name

#: Tasks per script call: bounds the script's input whatever the caller hands over.
MAX_TASKS_PER_CALL = 256


class TaskWriter:
    """Writes encoded tasks for one run; the fenced form is the feeder's (lease and cursor checked).

    In a partitioned run (``partitions``: every partition's keys) each task goes to its partition, and
    the fenced form issues each task id at most once per partition and then advances the cursor (see
    `issue_once.lua`)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, partitions: Sequence[PartitionKeys] | None = None) -> None:
        self.client = client
        self.keys = keys
        self.partitions = tuple(partitions) if partitions else recorded_partitions(client, keys)  # the record's
        self._script = scripts.register_fenced(client, "issue_tasks.lua")
        if len(self.partitions) > 1:
            self._issue_once = scripts.register(client, "issue_once.lua")
            self._advance = scripts.register_fenced(client, "feeder_cursor.lua")
        for part in self.partitions:
            ensure_group(client, part.tasks, WORKERS_GROUP)

    def now(self) -> float:
        """The server's clock: what every ``issued_at`` is stamped with."""
        return server_time(self.client)

    def write(self, events: Sequence[TaskIssued], *, lease_token: str = "", cursor: int = 0) -> int:
        """Write ``events`` (at most `MAX_TASKS_PER_CALL`). With ``lease_token`` the write is fenced by
        the batcher lease and the expected dataset ``cursor`` (`LeaseLost` otherwise) and the new cursor
        is returned; without, the number written."""
        if len(events) > MAX_TASKS_PER_CALL:
            raise ValueError(f"{len(events)} tasks in one call; write at most {MAX_TASKS_PER_CALL} at a time")
        headers = [codec.encode(event)[codec.HEADER] for event in events]
        if len(self.partitions) > 1:
            return self._write_partitioned(events, headers, lease_token, cursor)
        result = self._script(
            keys=[self.keys.tasks, self.keys.slots, self.keys.batcher_state, self.keys.batcher_lease],
            args=[lease_token, cursor if lease_token else "", *headers],
        )
        wait_for_replicas(self.client)
        return int(result)

    def _write_partitioned(
        self, events: Sequence[TaskIssued], headers: list[bytes], lease_token: str, cursor: int
    ) -> int:
        by_partition: dict[int, list[int]] = {}
        for at, event in enumerate(events):
            by_partition.setdefault(task_partition(event.task_id, len(self.partitions)), []).append(at)
        written = 0
        for index, positions in sorted(by_partition.items()):
            part = self.partitions[index]
            if lease_token:
                args = [item for at in positions for item in (events[at].task_id, headers[at])]
                written += int(self._issue_once(keys=[part.tasks, part.slots, part.issued], args=args))
            else:  # unfenced: as issue_tasks.lua always did (its lease and cursor keys are not read)
                written += int(
                    self._script(
                        keys=[part.tasks, part.slots, part.issued, part.issued],
                        args=["", "", *(headers[at] for at in positions)],
                    )
                )
        if lease_token:
            written = int(
                self._advance(
                    keys=[self.keys.batcher_state, self.keys.batcher_lease], args=[lease_token, cursor, len(events)]
                )
            )
        wait_for_replicas(self.client)
        return written


class TaskIssuer:
    """Publishes tasks for one run without a feeder, numbering them with its producer identity."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        *,
        producer: str | None = None,
        partitions: Sequence[PartitionKeys] | None = None,
    ) -> None:
        self.keys = keys
        self.producer = producer or producer_name("issuer")
        self._writer = TaskWriter(client, keys, partitions)
        self._seq = itertools.count()

    def issue(
        self, prompts: Iterable[Mapping[str, Any]], *, version: int = 0, task_ids: Iterable[str] | None = None
    ) -> list[TaskIssued]:
        """Issue one task per prompt; returns the events written. Task ids default to unique ones."""
        now = self._writer.now()
        ids = iter(task_ids) if task_ids is not None else None
        events = []
        for prompt in prompts:
            seq = next(self._seq)
            task_id = next(ids) if ids is not None else f"{uuid.uuid4().hex[:12]}-{seq}"
            events.append(
                TaskIssued(
                    task_id=task_id,
                    prompt=dict(prompt),
                    version=version,
                    issued_at=now,
                    producer=self.producer,
                    seq=seq,
                )
            )
        for start in range(0, len(events), MAX_TASKS_PER_CALL):
            self._writer.write(events[start : start + MAX_TASKS_PER_CALL])
        return events

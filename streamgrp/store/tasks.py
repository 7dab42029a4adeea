"""Issuing tasks: each task goes to the workers' queue and to the group log in one transaction.

Writing `TaskIssued` to both streams in one MULTI/EXEC means a task is either everywhere or
nowhere, and its entry in the group log always precedes its slot results (a worker can only see
the task after the transaction), which is what lets the assembler fold one ordered stream.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from streamgrp.core import codec
from streamgrp.core.events import TaskIssued
from streamgrp.store.keys import WORKERS_GROUP, RunKeys
from streamgrp.store.runs import server_time
from streamgrp.store.streams import ensure_group, producer_name


class TaskIssuer:
    """Publishes tasks for one run, numbering them with its producer identity and sequence."""

    def __init__(self, client: redis.Redis, keys: RunKeys, *, producer: str | None = None) -> None:
        self.client = client
        self.keys = keys
        self.producer = producer or producer_name("issuer")
        self._seq = itertools.count()
        ensure_group(client, keys.tasks, WORKERS_GROUP)

    def issue(self, prompts: Iterable[Mapping[str, Any]], *, version: int = 0,
              task_ids: Iterable[str] | None = None) -> list[TaskIssued]:
        """Issue one task per prompt; returns the events written. Task ids default to unique ones."""
        now = server_time(self.client)
        ids = iter(task_ids) if task_ids is not None else None
        events = []
        pipe = self.client.pipeline(transaction=True)
        for prompt in prompts:
            seq = next(self._seq)
            task_id = next(ids) if ids is not None else f"{uuid.uuid4().hex[:12]}-{seq}"
            event = TaskIssued(task_id=task_id, prompt=dict(prompt), version=version, issued_at=now,
                               producer=self.producer, seq=seq)
            fields = codec.encode(event)
            pipe.xadd(self.keys.tasks, fields)
            pipe.xadd(self.keys.slots, fields)
            events.append(event)
        if events:
            pipe.execute()
        return events

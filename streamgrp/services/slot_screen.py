"""What the assembler refuses before folding a round: task entries no issue wrote, and samples whose payload
cannot train.

Owns the two checks against the run's other streams (the task queue, the payloads) and the dead-letter
record they add to a round's commit (`dead_letter`). Why each exists is told in
`streamgrp.services.assembler`'s docstring; which entries a round checks (those that would open a group,
those of groups not yet decided) is the assembler's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import redis

from streamgrp.core import codec
from streamgrp.core.refusal import TASK_NOT_ISSUED, refused
from streamgrp.core.shown import show
from streamgrp.store import payloads as payload_store
from streamgrp.store.assembler_store import DeadLetter, Record
from streamgrp.store.own_connection import OwnConnection
from streamgrp.store.streams import read_entries

# The assembler's logger: these lines are its refusals, found by its name (log filters, caplog).
log = logging.getLogger("streamgrp.services.assembler")

#: A stream entry id as XADD returns it.
QUEUE_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
#: Payloads read and checked at once: bounds the memory of a round of long samples.
PAYLOAD_READ_CHUNK = 64

#: One decoded entry of a round: its id, its fields and its event.
Decoded = tuple[str, Any, Any]


def refuse_unissued(
    client: redis.Redis, tasks: str, decoded: list[Decoded], opening: Sequence[int], records: list[Record]
) -> list[Decoded]:
    """``decoded`` without the task entries (at the indexes ``opening``, those that would open a group) that
    no issue wrote, which are dead-lettered into ``records``: one pipelined XRANGE of the task queue ``tasks``
    per entry."""
    checked = [(at, _queue_entry(decoded[at][1])) for at in opening]
    if not checked:
        return decoded
    pipe = client.pipeline(transaction=False)
    for _, queued in checked:
        if queued is not None:
            pipe.xrange(tasks, queued, queued, count=1)
    found = iter(pipe.execute(raise_on_error=False))
    refused_at = set()
    for at, queued in checked:
        entry_id, fields, event = decoded[at]
        reply = next(found) if queued is not None else None
        if queued is None:
            why = "it names no task-queue entry (field q): no issue wrote it"
        elif isinstance(reply, Exception) or not reply:
            why = f"its task-queue entry {queued} does not exist: no issue wrote it"
        elif (reply[0][1] or {}).get(codec.HEADER) != fields.get(codec.HEADER):
            why = f"its task-queue entry {queued} holds another task: no issue wrote it"
        else:
            continue
        refused_at.add(at)
        log.warning("task entry %s (task %s) refused: %s", entry_id, show(event.task_id), why)
        dead_letter(records, TASK_NOT_ISSUED, entry_id, why, fields)
    return [item for at, item in enumerate(decoded) if at not in refused_at]


def refuse_untrainable(
    client: redis.Redis,
    payloads: str,
    decoded: list[Decoded],
    samples: Sequence[int],
    *,
    vocab_size: int | None,
    max_entry_bytes: int,
    layout: str = payload_store.KEYS,
    own: OwnConnection | None = None,
) -> dict[str, tuple[str, Any]]:
    """Check the payload (of the payloads stream ``payloads``, kept in ``layout``: `streamgrp.store.payloads`)
    of each sample at the indexes ``samples``; a refused one's slot result is replaced in ``decoded`` by a
    failed one saying why. Returns the refused entries: entry id -> (what is wrong, its fields), for the
    dead letter of its group's commit. ``own``: the reader's own connection for payload keys
    (`streamgrp.store.own_connection`)."""
    found: dict[str, tuple[str, Any]] = {}
    for start in range(0, len(samples), PAYLOAD_READ_CHUNK):
        chunk = samples[start : start + PAYLOAD_READ_CHUNK]
        ids = [decoded[at][0] for at in chunk]
        read = (
            payload_store.read(client, payloads, ids, views=True, own=own)
            if layout == payload_store.KEYS
            else read_entries(client, payloads, ids)
        )
        for at, payload in zip(chunk, read):
            entry_id, fields, event = decoded[at]
            if payload is None and codec.is_inline_sample(fields):
                continue  # a schema-1 entry: its sample was inline, and checked when it decoded
            problem = codec.payload_problem(payload, event, vocab_size=vocab_size, max_entry_bytes=max_entry_bytes)
            if problem is not None:
                decoded[at] = (entry_id, fields, refused(event, problem))
                found[entry_id] = (problem, fields)
    return found


def _queue_entry(fields: Any) -> str | None:
    """The task-queue entry id a group-log task entry names, if it is one."""
    raw = fields.get(b"q", fields.get("q"))
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    if not isinstance(text, str) or not QUEUE_ID.fullmatch(text):
        return None
    return text


def dead_letter(records: list[Record], reason: str, entry_id: str, detail: str, fields: dict[Any, Any]) -> None:
    """Add the dead letter of ``entry_id`` (``reason``, ``detail``, its fields) to a round's commit ``records``."""
    records.append(DeadLetter(reason, entry_id, detail, fields))

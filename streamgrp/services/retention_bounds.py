"""The bounds retention's floors are made of: for each reader of a run's streams, the entries it still needs.

Owns `Floors` (each stream's bounds, its floor the lowest) and one function per kind of bound: the
archive's progress, a consumer group's pending and undelivered entries, the decisions the batcher has not
batched, the steps some rank has not committed (and the newest checkpoint), the tasks the assembler checks,
the segments of tasks the workers hold and the turns of open agent sessions; and `consumer_state`, one
instant's consumer groups of a partition read in one MULTI/EXEC. Why these bounds, and why reading them in
this order is safe, is `streamgrp.services.retention`'s docstring; that module also owns putting them
together per run and trimming.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis

from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, StepManifest
from streamgrp.errors import DecodeError
from streamgrp.store.keys import (
    ASSEMBLER_GROUP,
    BATCHER_GROUP,
    WORKERS_GROUP,
    IdKey,
    PartitionKeys,
    RunKeys,
    id_key,
    step_entry_id,
)
from streamgrp.store.streams import entry_id_str, range_reply, read_entries

__all__ = [
    "KEEP_ALL",
    "NEVER_TRIMMED",
    "SESSION_CLOCK_MARGIN_S",
    "ConsumerState",
    "Floors",
    "archive_bounds",
    "consumer_bounds",
    "consumer_state",
    "held_segment_bounds",
    "id_text",
    "open_session_bounds",
    "queued_task_bounds",
    "unbatched_bounds",
    "uncommitted_step_bounds",
]

NEVER_TRIMMED = ("control",)
#: Pending decisions read one page at a time; more than this many falls back to a wider, safe range.
PENDING_PAGE = 10_000
_PAGE = 1000
KEEP_ALL: IdKey = (0, 0)
#: Seconds kept before an open session's task was issued: the issue time is the server's clock read just
#: before its entry was written, and a second covers rounding to whole milliseconds with room to spare.
SESSION_CLOCK_MARGIN_S = 1.0


def _next(key: IdKey) -> IdKey:
    return key[0], key[1] + 1


def id_text(key: IdKey) -> str:
    """``key`` as an entry id (``ms-seq``), as XRANGE and XTRIM MINID take it."""
    return f"{key[0]}-{key[1]}"


#: Streams whose entries share another's ids: a sample's payload sits at its slot result's id, so
#: whatever slot entry must stay keeps its payload too.
_SAME_IDS = {"slots": ("payloads",)}


class Floors:
    """Each stream's bounds (an entry id that must stay and why); its floor is the lowest."""

    def __init__(self, streams: Iterable[str]) -> None:
        self.bounds: dict[str, list[tuple[IdKey, str]]] = {name: [] for name in streams}

    def keep(self, stream: str, key: IdKey | None, why: str) -> None:
        """Entries at or after ``key`` must stay (None: everything must stay)."""
        self.bounds[stream].append((KEEP_ALL if key is None else key, why))
        base, at, partition = stream.partition("@")  # a partition's slot log keeps that partition's payloads
        for twin in _SAME_IDS.get(base, ()):
            if twin + at + partition in self.bounds:
                self.bounds[twin + at + partition].append((KEEP_ALL if key is None else key, f"{why} (slot log)"))

    def result(self) -> dict[str, tuple[IdKey, str]]:
        return {name: min(bounds) if bounds else (KEEP_ALL, "no bound") for name, bounds in self.bounds.items()}


def _group(infos, name: str) -> dict | None:
    if isinstance(infos, Exception):
        return None
    for info in infos:
        if info["name"] in (name, name.encode()):
            return info
    return None


def _pending_min(summary) -> IdKey | None:
    if isinstance(summary, Exception) or not summary or not summary.get("pending"):
        return None
    return id_key(entry_id_str(summary["min"]))


def consumer_bounds(floors: Floors, stream: str, infos, summary, group: str) -> bool:
    """Keep what ``group`` has pending or was not delivered; False when the group does not exist."""
    info = _group(infos, group)
    if info is None:
        floors.keep(stream, None, f"no {group} group yet")
        return False
    floors.keep(stream, _next(id_key(entry_id_str(info["last-delivered-id"]))), f"{group} undelivered")
    pending = _pending_min(summary)
    if pending is not None:
        floors.keep(stream, pending, f"{group} pending")
    return True


def open_session_bounds(
    floors_: Floors, client: redis.Redis, part: PartitionKeys, group_timeout_s: float | None, suffix: str = ""
) -> None:
    """Open agent sessions' events: a restarted gateway reads their turns back. A session is opened for an
    issued task and ends by its group's deadline (issue time + group timeout, its score in the deadlines
    set), so the oldest deadline less the timeout is at or before every open session's first entry."""
    oldest = client.zrange(part.session_deadlines, 0, 0, withscores=True)
    if not oldest:
        return  # none open with a deadline; ended ones are the archive's
    if group_timeout_s is None:
        floors_.keep("sessions" + suffix, None, "open agent sessions")
        return
    issued_ms = int((float(oldest[0][1]) - group_timeout_s - SESSION_CLOCK_MARGIN_S) * 1000)
    floors_.keep("sessions" + suffix, (max(0, issued_ms), 0), "open agent sessions")


def _scan(client: redis.Redis, key: str, start: str) -> Iterable[tuple[str, dict[bytes, bytes]]]:
    """Entries of ``key`` from ``start`` (an XRANGE start, ``(`` for exclusive) to the end, in pages."""
    while True:
        page = range_reply(client.xrange(key, start, "+", count=_PAGE))
        for raw_id, fields in page:
            yield entry_id_str(raw_id), fields
        if len(page) < _PAGE:
            return
        start = "(" + entry_id_str(page[-1][0])


def _decoded(pairs: Iterable[tuple[str, dict[bytes, bytes] | None]]):
    for entry_id, fields in pairs:
        if not fields:
            continue
        try:
            yield entry_id, codec.decode(fields)
        except DecodeError:
            continue


def queued_task_bounds(floors_: Floors, client: redis.Redis, part: PartitionKeys, suffix: str) -> None:
    """A task the assembler has yet to fold, or folds again after a restart, is checked against its queue
    entry: keep the task queue from the millisecond of the slot log's assembler bound, or from the queue
    entry of the task logged there, whichever is older.

    An issue writes the queue entry, then the log's, in one call; a log entry at or after the bound logs a
    task queued in the same millisecond or later, except the entry at the bound itself: on a server whose
    stream ids take the clock at each XADD (Redis 7.0; Valkey and Redis 7.2+ take it once a call) its queue
    entry may be a millisecond older, so that one is read (its ``q`` field)."""
    kept = [key for key, why in floors_.bounds["slots" + suffix] if ASSEMBLER_GROUP in why]
    if not kept:
        return
    bound = min(kept)
    floor: IdKey = (bound[0], 0)
    if bound != KEEP_ALL:
        first = range_reply(client.xrange(part.slots, id_text(bound), "+", count=1))
        queued = first[0][1].get(b"q") if first else None
        if queued:
            floor = min(floor, id_key(queued.decode()))
    floors_.keep("tasks" + suffix, floor, "tasks the assembler checks")


def held_segment_bounds(floors_: Floors, suffix: str) -> None:
    """A task's segments are written while it is pending in the workers group (``segment.lua`` checks), so
    after its queue entry: keep the segments stream from the millisecond of the task queue's workers bound."""
    kept = [key for key, why in floors_.bounds["tasks" + suffix] if WORKERS_GROUP in why]
    if kept:
        floors_.keep("segments" + suffix, (min(kept)[0], 0), "segments of tasks the workers hold")


def archive_bounds(floors_: Floors, streams: Iterable[str], archive_progress: Mapping[str, str]) -> None:
    """Only what the archiver has fsynced may go; control never does."""
    for name in streams:
        if name in NEVER_TRIMMED:
            floors_.keep(name, None, "never trimmed")
        elif name in archive_progress:
            floors_.keep(name, _next(id_key(archive_progress[name])), "archive")
        else:
            floors_.keep(name, None, "not archived yet")


@dataclass(frozen=True)
class ConsumerState:
    """The replies of one MULTI/EXEC; a reply can be the exception the server returned for it."""

    slot_groups: Any
    slot_pending: Any
    decision_groups: Any
    decision_pending: Any
    pending_decisions: Any
    task_groups: Any
    task_pending: Any
    committed: Any


def consumer_state(client: redis.Redis, part: PartitionKeys, committed: str | None) -> ConsumerState:
    """One instant's consumer state of a partition's streams, with the ``committed`` hash when it shares
    their slot (`streamgrp.services.retention`'s docstring says why this order of reads is safe)."""
    pipe = client.pipeline(transaction=True)
    pipe.xinfo_groups(part.slots)
    pipe.xpending(part.slots, ASSEMBLER_GROUP)
    pipe.xinfo_groups(part.decisions)
    pipe.xpending(part.decisions, BATCHER_GROUP)
    pipe.xpending_range(part.decisions, BATCHER_GROUP, "-", "+", PENDING_PAGE)
    pipe.xinfo_groups(part.tasks)
    pipe.xpending(part.tasks, WORKERS_GROUP)
    if committed is not None:
        pipe.hgetall(committed)
    replies = pipe.execute(raise_on_error=False)
    return ConsumerState(*replies, *([] if committed is not None else [None]))


def unbatched_bounds(
    floors_: Floors,
    client: redis.Redis,
    keys: PartitionKeys,
    state: ConsumerState,
    *,
    batcher: bool,
    suffix: str = "",
) -> None:
    """Decisions not batched yet: their member slot entries will be some step's."""
    if not batcher:
        floors_.keep("slots" + suffix, None, "no batcher group yet")
        return
    group = _group(state.decision_groups, BATCHER_GROUP)
    assert group is not None, "batcher=True: the batcher's group exists"
    delivered = entry_id_str(group["last-delivered-id"])
    pending_decisions = state.pending_decisions
    if not isinstance(pending_decisions, Exception) and len(pending_decisions) < PENDING_PAGE:
        ids = [entry_id_str(p["message_id"]) for p in pending_decisions]
        unbatched: Iterable[tuple[str, dict[bytes, bytes] | None]] = [
            *zip(ids, read_entries(client, keys.decisions, ids)),
            *_scan(client, keys.decisions, "(" + delivered),
        ]
    else:  # too many to list: every decision from the oldest pending one on (a superset)
        low = _pending_min(state.decision_pending)
        unbatched = _scan(client, keys.decisions, id_text(low) if low is not None else "(" + delivered)
    for _, decision in _decoded(unbatched):
        if isinstance(decision, GroupDecided) and decision.decision != "dropped" and decision.members:
            floors_.keep("slots" + suffix, min(id_key(m.entry) for m in decision.members), "unbatched decisions")


def uncommitted_step_bounds(
    floors_: Floors, client: redis.Redis, keys: RunKeys, committed: Any, dp_size: int, *, partitioned: bool = False
) -> None:
    """Steps some rank has not committed: their manifests, decisions and slot entries."""
    if isinstance(committed, Exception):
        raise committed
    done = {int(rank): int(step) for rank, step in committed.items()}
    lowest = min(done.get(rank, -1) for rank in range(dp_size))
    why = f"steps after {lowest}, committed by every rank"
    # A trainer group that crashes resumes after its newest checkpoint and trains the steps since again.
    checkpointed = client.hget(keys.checkpoint, "step")
    if checkpointed is not None and int(checkpointed) < lowest:
        lowest = int(checkpointed)
        why = f"steps after {lowest}, the newest checkpoint (a restarted trainer group trains them again)"
    floors_.keep("steps", id_key(step_entry_id(lowest + 1)), why)
    for _, manifest in _decoded(_scan(client, keys.steps, step_entry_id(lowest + 1))):
        if not isinstance(manifest, StepManifest):
            continue
        for shard in manifest.shards:
            for group in shard.groups:
                suffix = f"@{group.partition}" if partitioned else ""
                if "decisions" + suffix not in floors_.bounds:
                    continue  # a partition the run does not have: nothing of it to keep
                floors_.keep("decisions" + suffix, id_key(group.decision_entry), "uncommitted steps")
                if group.members:
                    floors_.keep("slots" + suffix, min(id_key(m.entry) for m in group.members), "uncommitted steps")

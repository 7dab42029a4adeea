"""Retention: trim a run's streams behind the archive and behind every reader that still needs them.

    trim(client, keys, archive_progress) -> TrimReport

For each stream the smallest entry id that must stay (its *floor*) is the lowest of the bounds
below; ``XTRIM key MINID floor`` (exact) removes the entries before it and nothing else:

    every stream but control   the archive: only entries at or before the last id the archiver
                               fsynced (``archive_progress``, the run's ``archive`` hash) may go
    slots       the assembler group's pending entries and everything it was not delivered yet;
                the members of decisions the batcher has not batched (pending or undelivered);
                the members of every step some rank has not committed (after min over ranks)
    payloads    the slot log's floor (a sample's payload sits at its slot result's id), and its own archive;
                keys layout: one floor for both, each trimmed slot entry's payload key UNLINKed before it
    decisions   the batcher group's pending and undelivered entries; the decisions of uncommitted steps
    steps       every step after the lowest step all ranks committed (a rank that restarts reads its
                next step's manifest) and after the newest recorded checkpoint (`CheckpointSaved`: a
                group that restarts from it trains those steps again)
    tasks       the workers group's pending and undelivered entries; the tasks of the slot log's kept
                entries (from the millisecond of the slot log's assembler bound: the assembler checks an
                issued task against its queue entry, written in the same call just before)
    sessions    the turns of open agent sessions (a restarted gateway reads them back); keys layout: each
                trimmed turn entry's turn key (its tensors) UNLINKed before it
    segments    the segments of tasks the workers group holds (pending or undelivered): a worker that
                takes one over continues its slots from them; each was written while its task was
                pending, so after the task's entry id (from the millisecond of the tasks' workers bound)
    followed    (any of the above) what each registered follower (`streamgrp.store.follow`) has not
                handled yet, unless it is over ``max_follow_lag_s`` behind: then its unread entries may
                go, and what goes is recorded as a skip the follower sees before its next entry
    discarded, commits, deadletter    the archive only: no service reads them back
    control     never: it is small and every process reads the run's record from it

A stream whose consumer group does not exist yet is not trimmed: no reader has said what it took;
nor is the slot log while the decisions stream has no batcher group (every decision is unbatched).

Why this is safe while every role runs: entries move one way (slot log -> decision -> step ->
committed by every rank), and an entry leaves a stage only atomically with entering the next
(`commit.lua` acknowledges slot entries with the decision it writes; `batch_commit.lua` acknowledges
decisions with the step it writes). The group positions, pending entries and committed steps are
read in one MULTI/EXEC, so they are one instant's state; the decisions and steps they point at are
read after it, which can only find more to keep. Entries added after that instant have ids above
every floor. So no entry a role or a restarted role still reads is trimmed.

A partitioned run's partitions (`streamgrp.store.keys.PartitionKeys`, streams named ``slots@2``) get
the bounds above from their own consumer groups, each partition's state read in one MULTI/EXEC of its
own (a cluster runs a transaction in one slot); the committed steps and their manifests are read after
every partition's state, so a decision a step took meanwhile is kept by that step if some rank has not
committed it. The batcher acknowledges a partitioned run's decisions after writing the step that used
them, so they stay pending (kept) until then.

Why XTRIM MINID, not XDEL, also for `steps`, whose ids are explicit (``{step}-1``): MINID compares
ids, and explicit ids are ordered like any others (there they are step numbers), so one command per
stream removes exactly the prefix below the floor, with no list of ids to read first. What is
trimmed is always a prefix, which is what lets `streamgrp.store.sources.FallbackSource` find every
trimmed entry in the archive by id range.

Each kind of bound is read by a function of `streamgrp.services.retention_bounds`; this module puts them
together per run (`floors`) and trims (`trim`).

Deliberately ignores the hashes (``decided``, ``counts``, ``committed``...): they grow by one small
field per task or step and every role reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import redis

from streamgrp.config import RunConfig
from streamgrp.core.shown import show_names
from streamgrp.services.retention_bounds import (
    KEEP_ALL,
    NEVER_TRIMMED,
    SESSION_CLOCK_MARGIN_S,
    ConsumerState,
    Floors,
    archive_bounds,
    consumer_bounds,
    consumer_state,
    held_segment_bounds,
    id_text,
    open_session_bounds,
    queued_task_bounds,
    unbatched_bounds,
    uncommitted_step_bounds,
)
from streamgrp.store import payloads
from streamgrp.store.follow import Position, follower_bounds, record_skips
from streamgrp.store.keys import (
    ASSEMBLER_GROUP,
    BATCHER_GROUP,
    WORKERS_GROUP,
    IdKey,
    PartitionKeys,
    RunKeys,
    run_streams,
)
from streamgrp.store.runs import read_record, recorded_layout, server_time
from streamgrp.store.streams import hash_reply, range_reply

__all__ = ["NEVER_TRIMMED", "SESSION_CLOCK_MARGIN_S", "StreamTrim", "TrimReport", "archive_progress", "floors", "trim"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamTrim:
    """One stream after a trim: its floor (entries before it were removed), which bound set it, how many went."""

    stream: str
    floor: str | None  # None: nothing may be trimmed
    bound: str
    removed: int = 0


@dataclass
class TrimReport:
    streams: dict[str, StreamTrim] = field(default_factory=dict)
    #: Followers past their bound whose unread entries this trim removed, and what was recorded for each.
    skips: list = field(default_factory=list)

    @property
    def removed(self) -> int:
        return sum(s.removed for s in self.streams.values())

    def __str__(self) -> str:
        return ", ".join(
            f"{s.stream} -{s.removed} (floor {s.floor or 'none'}: {s.bound})" for s in self.streams.values()
        )


def archive_progress(
    client: redis.Redis, keys: RunKeys, partitions: Sequence[PartitionKeys] | None = None
) -> dict[str, str]:
    """The archiver's durable progress: stream name -> last archived entry id (a partitioned run's
    streams by `streamgrp.store.keys.run_streams` names, given its ``partitions``)."""
    streams = run_streams(keys, tuple(partitions) if partitions else keys.partitions(1))
    return {
        k.decode(): v.decode() for k, v in hash_reply(client.hgetall(keys.archive)).items() if k.decode() in streams
    }


def _recorded_config(client: redis.Redis, keys: RunKeys) -> RunConfig | None:
    first = range_reply(client.xrange(keys.control, "-", "+", count=1))
    return read_record(keys.run, first[0][1], "the control stream's first entry")[1] if first else None


def floors(
    client: redis.Redis,
    keys: RunKeys,
    archive_progress: Mapping[str, str],
    *,
    dp_size: int | None = None,
    partitions: Sequence[PartitionKeys] | None = None,
    max_follow_lag_s: float = 0.0,
) -> dict[str, tuple[IdKey, str]]:
    """Each stream's floor (the lowest entry id that must stay) and the bound that set it; a partitioned
    run's streams (``partitions``) by `streamgrp.store.keys.run_streams` names (``slots@2``)."""
    return _floors(
        client, keys, archive_progress, dp_size=dp_size, partitions=partitions, max_follow_lag_s=max_follow_lag_s
    )[0].result()


def _floors(
    client: redis.Redis,
    keys: RunKeys,
    archive_progress: Mapping[str, str],
    *,
    dp_size: int | None,
    partitions: Sequence[PartitionKeys] | None,
    max_follow_lag_s: float,
) -> tuple[Floors, list[Position]]:
    partitions = tuple(partitions) if partitions else keys.partitions(1)
    streams = run_streams(keys, partitions)
    floors_ = Floors(streams)
    archive_bounds(floors_, streams, archive_progress)
    config = _recorded_config(client, keys)
    if dp_size is None:
        dp_size = config.dp_size if config is not None else 1
    group_timeout_s = config.group_timeout_s if config is not None else None
    committed = None
    for part in partitions:  # each partition's state one instant of its own; the steps' after every one
        suffix = f"@{part.index}" if len(partitions) > 1 else ""
        state = consumer_state(client, part, keys.committed if len(partitions) == 1 else None)
        committed = state.committed
        _warn_foreign_groups(part, state)
        consumer_bounds(floors_, "slots" + suffix, state.slot_groups, state.slot_pending, ASSEMBLER_GROUP)
        consumer_bounds(floors_, "tasks" + suffix, state.task_groups, state.task_pending, WORKERS_GROUP)
        queued_task_bounds(floors_, client, part, suffix)
        held_segment_bounds(floors_, suffix)
        batcher = consumer_bounds(
            floors_, "decisions" + suffix, state.decision_groups, state.decision_pending, BATCHER_GROUP
        )
        unbatched_bounds(floors_, client, part, state, batcher=batcher, suffix=suffix)
        open_session_bounds(floors_, client, part, group_timeout_s, suffix)
    if len(partitions) > 1:
        committed = client.hgetall(keys.committed)
    uncommitted_step_bounds(floors_, client, keys, committed, dp_size, partitioned=len(partitions) > 1)
    # A follower's position only moves forward, so reading it after the rest can only keep less of what it read.
    kept, over = follower_bounds(client, keys, streams, max_follow_lag_s, server_time(client))
    for stream, key, why in kept:
        floors_.keep(stream, key, why)
    return floors_, over


#: The consumer groups streamgrp's roles read each stream with.
_OWN_GROUPS = {"tasks": {WORKERS_GROUP}, "slots": {ASSEMBLER_GROUP, "rewarders"}, "decisions": {BATCHER_GROUP}}


def _warn_foreign_groups(part: PartitionKeys, state: ConsumerState) -> None:
    """Say so when a stream has consumer groups no role of streamgrp made. A role that may read a stream
    through its own group may create groups on it (Redis ACLs cannot name groups): such groups hold no
    entry back from trimming (the floors above name streamgrp's groups), but each costs server memory."""
    for stream, infos in (
        ("tasks", state.task_groups),
        ("slots", state.slot_groups),
        ("decisions", state.decision_groups),
    ):
        if isinstance(infos, Exception):
            continue
        names = sorted({_text_name(info["name"]) for info in infos} - _OWN_GROUPS[stream])
        if names:
            log.warning(
                "%s has %d consumer groups streamgrp did not make (%s): a role's credential made them; "
                "delete them with XGROUP DESTROY",
                getattr(part, stream),
                len(names),
                show_names(names[:5]),
            )


def _text_name(name: bytes | str) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else name


def _unlink_keyed(
    client: redis.Redis,
    keys: RunKeys,
    streams: Mapping[str, str],
    result: dict[str, tuple[IdKey, str]],
    *,
    dry_run: bool,
) -> dict[str, int]:
    """Keys layout: slot log and payloads share the lower floor; the going slot entries' payload keys go first,
    and the going sessions entries' turn keys (`streamgrp.store.payloads.turn_key`) before their entries. Returns
    the payload keys unlinked per payloads stream (its entries, as the report counts them)."""
    if recorded_layout(client, keys) != payloads.KEYS:
        return {}
    unlinked: dict[str, int] = {}
    for name in [name for name in result if name.partition("@")[0] == "slots"]:
        twin = name.replace("slots", "payloads")
        result[name] = result[twin] = (floor, _) = min(result[name], result[twin])
        if floor != KEEP_ALL and not dry_run:
            unlinked[twin] = payloads.trim_below(client, streams[name], streams[twin], id_text(floor))
    for name, (floor, _) in result.items():
        if name.partition("@")[0] == "sessions" and floor != KEEP_ALL and not dry_run:
            sessions = streams[name]
            payloads.trim_below(client, sessions, payloads.turn_prefix(sessions), id_text(floor))
    return unlinked


def trim(
    client: redis.Redis,
    keys: RunKeys,
    archive_progress: Mapping[str, str],
    *,
    dp_size: int | None = None,
    dry_run: bool = False,
    partitions: Sequence[PartitionKeys] | None = None,
    max_follow_lag_s: float = 0.0,
) -> TrimReport:
    """Trim every stream of the run down to its floor (see the module docstring); returns what was removed.

    ``archive_progress`` is stream name -> last archived id (`archive_progress` reads the run's hash);
    a stream missing from it is not trimmed. ``dp_size`` defaults to the run's recorded one;
    ``partitions``, a partitioned run's (`streamgrp.store.runs.Run.partitions`); ``max_follow_lag_s``, how
    far behind (seconds since its oldest unread entry was written) a follower may fall before its unread
    entries are trimmed anyway (0: never), each such trim recorded as the follower's skip first.
    """
    report = TrimReport()
    partitions = tuple(partitions) if partitions else keys.partitions(1)
    streams = run_streams(keys, partitions)
    found, over = _floors(
        client, keys, archive_progress, dp_size=dp_size, partitions=partitions, max_follow_lag_s=max_follow_lag_s
    )
    result = found.result()
    if over and not dry_run:
        report.skips = record_skips(
            client, keys, streams, over, {name: floor for name, (floor, _) in result.items() if floor != KEEP_ALL}
        )
    unlinked = _unlink_keyed(client, keys, streams, result, dry_run=dry_run)
    for name, (floor, why) in result.items():
        if floor == KEEP_ALL:
            report.streams[name] = StreamTrim(name, None, why)
            continue
        removed = 0 if dry_run else int(client.xtrim(streams[name], minid=id_text(floor), approximate=False))
        report.streams[name] = StreamTrim(name, id_text(floor), why, removed + unlinked.get(name, 0))
    if report.removed:
        log.info("retention on run %s: %s", keys.run, report)
    return report

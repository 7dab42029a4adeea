"""A run's keys on the server as a whole: what they weigh, whether the run is live, deleting them.

Owns `streamgrp runs --sizes` and `streamgrp delete RUN` on the server's side:

- finding a run's keys by SCAN with its hash-tag pattern ``sg:{RUN}:*`` (never KEYS, which blocks the
  server; every key of a run sits in one Cluster slot, so the multi-key UNLINK below is legal there);
- sizing them: MEMORY USAGE (every nested value counted) summed over the keys, and entries per stream;
- deciding whether a run is *live* (`live_reason`, pure): a process holds its batcher or assembler
  lease, or the run has not ended and something happened within ``idle_s`` (an entry appended, a
  consumer reading). A run has ended when its batcher recorded a terminal event, or recorded that it
  finished and every trainer rank committed the last step; both markers sit in the batcher's state,
  which only the batcher's user may write (`streamgrp.store.control`);
- deleting its keys in bounded UNLINK chunks, then its registry entry, and rewriting the AOF so the
  server's next start does not replay what was deleted.

Every key of a run is under ``sg:{RUN}:`` (`streamgrp.store.keys`), so nothing of another run is
touched. The role users of `streamgrp.store.acl` may not run SCAN, MEMORY USAGE or UNLINK (the
inspector reads only): such a refusal becomes a `ConfigError` naming the user that can. Archives on
disk are `streamgrp.store.archive_admin`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import redis

from streamgrp.config import DeleteConfig
from streamgrp.core import codec
from streamgrp.core.events import RunFinished, RunTerminated
from streamgrp.errors import ConfigError, DecodeError
from streamgrp.store.control import MARKERS
from streamgrp.store.keys import PARTITION_STREAMS, PREFIX, RUNS, RunKeys, check_run_name, id_key, run_streams
from streamgrp.store.runs import read_record
from streamgrp.store.sources import RedisSource
from streamgrp.store.streams import entry_id_str, range_reply

__all__ = [
    "DEFAULT_IDLE_S",
    "Activity",
    "Deleted",
    "RunUsage",
    "activity",
    "compact_aof",
    "delete_run",
    "human_bytes",
    "live_reason",
    "privileged",
    "rewrites_done",
    "run_key_names",
    "run_usage",
    "usage_by_run",
]

#: A run that has not ended counts as live while it showed activity this recently (seconds).
DEFAULT_IDLE_S: float = DeleteConfig.model_fields["idle_s"].default
SCAN_COUNT = 1000
#: Keys per UNLINK (and per MEMORY USAGE pipeline): bounds one command whatever the run holds.
CHUNK = 500

_ADMIN_HINT = (
    "sizing and deleting runs needs a user that may run SCAN, MEMORY USAGE, XINFO, UNLINK and ZREM on "
    "sg:{RUN}:* and sg:runs; the role users `streamgrp acl` prints (the read-only inspector too) may not. "
    "Connect as an administrator (an ACL file line such as `user admin on >PASSWORD ~* &* +@all`) or "
    "with the server's password"
)


@contextmanager
def privileged(what: str) -> Iterator[None]:
    """Turn the server's NOPERM refusal into a `ConfigError` that says which user can do ``what``."""
    try:
        yield
    except redis.exceptions.NoPermissionError as exc:
        raise ConfigError(f"the server refused {what} to this user (NOPERM: {exc}): {_ADMIN_HINT}") from None


# -- sizes -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunUsage:
    """One run's keys on the server: how many, their memory (MEMORY USAGE, bytes), entries per stream."""

    run: str
    keys: int = 0
    bytes: int = 0
    entries: dict[str, int] = field(default_factory=dict)  # stream name -> entries, for the streams present


def run_key_names(client: redis.Redis, keys: RunKeys) -> list[str]:
    """Every key of the run (SCAN may return one twice; each is listed once)."""
    return list(
        dict.fromkeys(
            entry_id_str(k)
            for pattern in (keys.pattern, keys.partition_pattern)
            for k in client.scan_iter(match=pattern, count=SCAN_COUNT)
        )
    )


def run_usage(client: redis.Redis, keys: RunKeys) -> RunUsage:
    """The run's keys, their memory and the entries of each of its streams."""
    with privileged(f"sizing run {keys.run!r}"):
        return _measure(client, keys.run, run_key_names(client, keys))


def usage_by_run(client: redis.Redis) -> dict[str, RunUsage]:
    """`RunUsage` of every run that has keys on the server, in one SCAN of ``sg:{*``, registered or not
    (a run whose registry entry is gone still holds memory)."""
    with privileged("sizing runs"):
        by_run: dict[str, list[str]] = {}
        for raw in client.scan_iter(match=f"{PREFIX}:{{*", count=SCAN_COUNT):
            name = entry_id_str(raw)
            end = name.find("}")
            if end > 0:  # a partition's tag is the run's name, "/" and the partition
                by_run.setdefault(name[len(PREFIX) + 2 : end].split("/")[0], []).append(name)
        return {run: _measure(client, run, list(dict.fromkeys(names))) for run, names in sorted(by_run.items())}


def _measure(client: redis.Redis, run: str, names: Sequence[str]) -> RunUsage:
    total = 0
    for chunk in _chunks(names):
        pipe = client.pipeline(transaction=False)
        for name in chunk:
            pipe.memory_usage(name, samples=0)  # 0: every element, not an estimate from five
        total += sum(size or 0 for size in pipe.execute())  # None: gone since the scan
    try:
        streams = {name: key for name, key in RunKeys(run).all_streams().items() if key in set(names)}
    except ConfigError:
        streams = {}  # a key under sg:{...} whose name is no run name: counted, not a stream of a run
    for key in names:  # a partition's streams, as `streamgrp.store.keys.stream_key` names them
        tag, _, stream = key[len(PREFIX) + 2 :].partition("}:")
        if "/" in tag and stream in (*PARTITION_STREAMS, "deadletter"):
            streams[f"{stream}@{tag.split('/')[1].split('.')[0]}"] = key
    pipe = client.pipeline(transaction=False)
    for key in streams.values():
        pipe.xlen(key)
    return RunUsage(run, len(names), total, dict(zip(streams, pipe.execute())))


def human_bytes(size: int) -> str:
    """``1536`` -> ``1.5 KiB``: sizes as people read them (binary units, like ``du -h``)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _chunks(items: Sequence[str], size: int = CHUNK) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# -- live or not --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Activity:
    """What the server shows of a run's processes, as `live_reason` reads it.

    ``leases``: role -> seconds left on the lease a process of that role holds (None: no expiry);
    ``ended``: ``failed`` or ``finished`` when the run is over, else None; ``newest_entry``: the stream
    that got the newest appended entry and how many seconds ago; ``recent_consumer``: the consumer
    (``stream/group/consumer``) that read most recently and how many seconds ago.
    """

    leases: dict[str, float | None] = field(default_factory=dict)
    ended: str | None = None
    newest_entry: tuple[str, float] | None = None
    recent_consumer: tuple[str, float] | None = None


def live_reason(activity: Activity, idle_s: float = DEFAULT_IDLE_S) -> str | None:
    """Why the run counts as live (a sentence), or None when deleting it cannot pull data from under a process.

    A held lease always counts: its holder writes on its next round. An ended run's remaining
    processes have nothing left to do (workers may still poll its task queue), so only a lease
    counts then. Otherwise an entry appended or a consumer read within ``idle_s`` seconds does."""
    for role, left in sorted(activity.leases.items()):
        held = "with no expiry" if left is None else f"for {left:.1f}s more"
        return f"a {role} process holds the run's {role} lease ({held})"
    if activity.ended is not None:
        return None
    if activity.newest_entry is not None and activity.newest_entry[1] < idle_s:
        stream, age = activity.newest_entry
        return (
            f"it has not finished and its {stream} stream got an entry {max(age, 0.0):.0f}s ago "
            f"(within --idle-s {idle_s:g})"
        )
    if activity.recent_consumer is not None and activity.recent_consumer[1] < idle_s:
        consumer, age = activity.recent_consumer
        return (
            f"it has not finished and the consumer {consumer} read {max(age, 0.0):.0f}s ago "
            f"(within --idle-s {idle_s:g})"
        )
    return None


def activity(client: redis.Redis, keys: RunKeys) -> Activity:
    """Read the run's `Activity` from the server: leases, the batcher's end markers, streams, consumers."""
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    partitions = RedisSource(client, keys).partitions  # a partitioned run's assemblers and streams too
    leases: dict[str, float | None] = {}
    assemblers = [("assembler", part.assembler_lease) for part in partitions]
    for role, key in (("batcher", keys.batcher_lease), *assemblers):
        left = client.pttl(key)
        if (left == -1 or left > 0) and role not in leases:  # -2: no such key; -1: no TTL, held until deleted
            leases[role] = None if left == -1 else left / 1000
    newest: tuple[str, float] | None = None
    recent: tuple[str, float] | None = None
    for name, key in run_streams(keys, partitions).items():
        if not client.exists(key):
            continue
        if name != "steps":  # step ids are step numbers, not times
            last_ms = id_key(entry_id_str(client.xinfo_stream(key)["last-generated-id"]))[0]
            if last_ms and (newest is None or (now_ms - last_ms) / 1000 < newest[1]):
                newest = (name, (now_ms - last_ms) / 1000)
        for group in client.xinfo_groups(key):
            for consumer in client.xinfo_consumers(key, group["name"]):
                idle = consumer["idle"] / 1000
                if recent is None or idle < recent[1]:
                    who = f"{name}/{entry_id_str(group['name'])}/{entry_id_str(consumer['name'])}"
                    recent = (who, idle)
    return Activity(leases, _ended(client, keys), newest, recent)


def _ended(client: redis.Redis, keys: RunKeys) -> str | None:
    terminal, finished = client.hmget(keys.batcher_state, [MARKERS[RunTerminated], MARKERS[RunFinished]])
    if terminal is not None:
        return "failed"
    if finished is None:
        return None
    try:
        first = range_reply(client.xrange(keys.control, "-", "+", count=1))
        _, config = read_record(keys.run, first[0][1] if first else None, "the control stream's first entry")
        steps = _finished_steps(client, keys, entry_id_str(finished))
    except (ConfigError, DecodeError):
        return None  # a damaged record: nothing proves the run is over
    if steps is None:
        return None
    committed = {int(rank): int(step) for rank, step in client.hgetall(keys.committed).items()}
    if all(committed.get(rank, -1) >= steps - 1 for rank in range(config.dp_size)):
        return "finished"
    return None  # finished writing steps, but some rank is still training the last ones


def _finished_steps(client: redis.Redis, keys: RunKeys, marker: str) -> int | None:
    """The step count of the run's trusted `RunFinished` event (the entry the marker names)."""
    if marker != "1":
        entries = range_reply(client.xrange(keys.control, marker, marker))
    else:  # runs recorded before markers named their entry: the newest RunFinished on control
        entries = range_reply(client.xrevrange(keys.control, "+", "-", count=1000))
    for _, fields in entries:
        event = codec.decode(fields)
        if isinstance(event, RunFinished):
            return event.steps
    return None


# -- deleting --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Deleted:
    """What `delete_run` removed: keys, their memory (MEMORY USAGE before deleting), the registry entry;
    ``reappeared`` keys of the run existed again right after (a process of the run is still running)."""

    run: str
    keys: int
    bytes: int
    registered: bool
    reappeared: int = 0


def delete_run(
    client: redis.Redis,
    keys: RunKeys,
    *,
    force: bool = False,
    idle_s: float = DEFAULT_IDLE_S,
    confirm: Callable[[RunUsage], None] | None = None,
) -> Deleted:
    """Delete every ``sg:{RUN}:*`` key and the run's registry entry; a run with neither deletes nothing.

    Refuses a live run (`live_reason`) with a `ConfigError` unless ``force``. ``confirm`` is shown what
    is about to go, after those checks and before anything is deleted; it raises to keep the run."""
    run = check_run_name(keys.run)
    with privileged(f"deleting run {run!r}"):
        if not force:
            reason = live_reason(activity(client, keys), idle_s)
            if reason is not None:
                raise ConfigError(
                    f"run {run!r} is live: {reason}. Stop its processes first, or pass --force "
                    "(STREAMGRP_FORCE=1) to delete it anyway"
                )
        names = run_key_names(client, keys)
        usage = _measure(client, run, names)
        if confirm is not None and (names or client.zscore(RUNS, run) is not None):
            confirm(usage)
        for chunk in _chunks(names):
            client.unlink(*chunk)
        # The registry entry goes last: a delete interrupted halfway leaves the run listed, and running
        # it again finishes the job.
        registered = bool(client.zrem(RUNS, run))
        reappeared = len(run_key_names(client, keys))
    return Deleted(run, usage.keys, usage.bytes, registered, reappeared)


def compact_aof(client: redis.Redis, *, timeout_s: float = 60.0, poll_s: float = 0.05) -> str:
    """Rewrite the server's append-only file (BGREWRITEAOF) and wait for it; a sentence saying what happened.

    Deleted keys stay in the AOF, and are replayed at every start, until it is rewritten."""
    try:
        if not int(client.info("persistence").get("aof_enabled", 0)):
            return "the server keeps no append-only file"
        client.bgrewriteaof()
    except redis.exceptions.NoPermissionError:
        return (
            "this user may not run BGREWRITEAOF; the append-only file shrinks at the server's next rewrite "
            "(an administrator can run BGREWRITEAOF now)"
        )
    except redis.ResponseError as exc:
        if "in progress" not in str(exc):
            raise
    info = rewrites_done(client, timeout_s=timeout_s, poll_s=poll_s)
    if info is None:
        return f"append-only file rewrite still running after {timeout_s:g}s; the server finishes it by itself"
    size = info.get("aof_current_size")
    return "append-only file rewritten" + (f" ({human_bytes(int(size))})" if size is not None else "")


def rewrites_done(client: redis.Redis, *, timeout_s: float = 60.0, poll_s: float = 0.05) -> dict | None:
    """The server's persistence INFO once no AOF rewrite runs or is scheduled; None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.info("persistence")
        if not int(info.get("aof_rewrite_in_progress", 0)) and not int(info.get("aof_rewrite_scheduled", 0)):
            return info
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)

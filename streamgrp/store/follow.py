"""Followers' durable positions: where each named consumer of a run's stream stopped, and what retention skipped.

Owns the run's ``follow`` hash (`streamgrp.store.keys.RunKeys.follow`), one set of fields per follower
and stream (``NAME|decisions``, ``NAME|slots@2``, ``NAME|steps``):

    NAME|STREAM            the last entry id the follower handled ("0-0": nothing yet)
    NAME|STREAM|skip       "AFTER BEFORE COUNT": retention trimmed the entries between AFTER and BEFORE
                           (exclusive; about COUNT of them) that the follower had not read, because it fell
                           further behind than the archiver's --max-follow-lag-s
    NAME|STREAM|skipped    entries skipped that way over the follower's life

A follower writes its position only through the ``follow_position`` function, which checks its whole
input and only moves a position forward; the archiver's retention (`follower_bounds`, `record_skips`)
reads the positions and writes only the skip fields. Nothing here is read by the trainer's path (the
batcher, the assembler, trainer ranks), so a follower cannot change what the trainer gets.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis

from streamgrp.core import codec
from streamgrp.core.events import StepManifest
from streamgrp.errors import DecodeError
from streamgrp.store import scripts
from streamgrp.store.keys import IdKey, RunKeys, check_consumer_name, id_key
from streamgrp.store.streams import entry_id_str, entry_time, range_reply

__all__ = ["FollowPositions", "Position", "Skip", "follower_bounds", "positions", "previous_id", "record_skips"]

log = logging.getLogger(__name__)

START = "0-0"
_MAX_SEQ = 2**64 - 1
#: Entries counted per XRANGE when retention counts what a follower skips.
_COUNT_PAGE = 1000


@dataclass(frozen=True)
class Skip:
    """Entries of a stream retention trimmed before a follower read them: ids after ``after`` and before
    ``before`` (both exclusive), about ``count`` of them."""

    after: str
    before: str
    count: int

    def text(self) -> str:
        return f"{self.after} {self.before} {self.count}"

    @classmethod
    def parse(cls, raw: bytes | str | None) -> Skip | None:
        if raw is None:
            return None
        try:
            after, before, count = entry_id_str(raw).split()
            id_key(after), id_key(before)
            return cls(after, before, int(count))
        except ValueError:
            return None  # not ours: ignored, as a reader of a hash others may write must


@dataclass(frozen=True)
class Position:
    """One follower's state in one stream."""

    name: str
    stream: str
    position: str
    skip: Skip | None = None
    skipped: int = 0


def positions(client: redis.Redis, keys: RunKeys) -> list[Position]:
    """Every follower's position in every stream it follows (malformed fields are ignored)."""
    raw = {entry_id_str(k): entry_id_str(v) for k, v in client.hgetall(keys.follow).items()}
    out = []
    for field, value in raw.items():
        parts = field.split("|")
        if len(parts) != 2:
            continue
        try:
            id_key(value)
        except ValueError:
            continue
        skipped = raw.get(field + "|skipped", "0")
        out.append(
            Position(
                parts[0],
                parts[1],
                value,
                Skip.parse(raw.get(field + "|skip")),
                int(skipped) if skipped.isdigit() else 0,
            )
        )
    return sorted(out, key=lambda p: (p.name, p.stream))


def previous_id(entry_id: str) -> str:
    """The greatest entry id before ``entry_id``: a position from which reading resumes at ``entry_id``."""
    ms, seq = id_key(entry_id)
    if seq:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-{_MAX_SEQ}" if ms else START


class FollowPositions:
    """One follower's positions, through the ``follow_position`` function (forward only)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, name: str) -> None:
        self.client = client
        self.keys = keys
        self.name = check_consumer_name(name)
        self._call = scripts.register(client, "follow_position.lua")

    def _op(self, op: str, stream: str, entry_id: str) -> str | None:
        reply = self._call(keys=[self.keys.follow], args=[op, self.name, stream, entry_id])
        return entry_id_str(reply) if reply else None

    def register(self, stream: str, start: str = START) -> str:
        """The follower's position in ``stream``: the one recorded, else ``start`` (recorded now)."""
        return self._op("register", stream, start)  # type: ignore[return-value]

    def ack(self, stream: str, entry_id: str) -> str:
        """Record that every entry of ``stream`` up to ``entry_id`` is handled; returns the position stored."""
        return self._op("ack", stream, entry_id)  # type: ignore[return-value]

    def forget(self, stream: str) -> None:
        """Drop the position and skip records: retention no longer keeps anything for this follower."""
        self._op("forget", stream, START)

    def skip(self, stream: str) -> Skip | None:
        """The newest skip retention recorded for this follower in ``stream``, if any."""
        return Skip.parse(self.client.hget(self.keys.follow, f"{self.name}|{stream}|skip"))


# -- retention's side (streamgrp.services.retention) ------------------------------------------------------


def unread_age(client: redis.Redis, stream: str, key: str, position: str, now: float) -> float:
    """Seconds since the oldest entry past ``position`` was written (0 when there is none): ids tell the
    server time of their entry, a step's (explicit ids) is in its manifest."""
    first = range_reply(client.xrange(key, f"({position}", "+", count=1))
    if not first:
        return 0.0
    entry_id, fields = entry_id_str(first[0][0]), first[0][1]
    if stream == "steps":
        try:
            manifest = codec.decode(fields)
        except DecodeError:
            return 0.0
        written = manifest.created_at if isinstance(manifest, StepManifest) else now
    else:
        written = entry_time(entry_id)
    return max(0.0, now - written)


def follower_bounds(
    client: redis.Redis, keys: RunKeys, streams: Mapping[str, str], max_lag_s: float, now: float
) -> tuple[list[tuple[str, IdKey, str]], list[Position]]:
    """What retention keeps for followers: (stream, lowest id to keep, why) per follower within its bound,
    and the followers further behind than ``max_lag_s`` (0: no bound), whose unread entries may go."""
    keep: list[tuple[str, IdKey, str]] = []
    over: list[Position] = []
    for follower in positions(client, keys):
        if follower.stream not in streams:
            continue
        if (
            max_lag_s
            and unread_age(client, follower.stream, streams[follower.stream], follower.position, now) > max_lag_s
        ):
            over.append(follower)
            continue
        ms, seq = id_key(follower.position)
        keep.append((follower.stream, (ms, seq + 1), f"follower {follower.name}"))
    return keep, over


def _count_between(client: redis.Redis, key: str, after: str, before: IdKey) -> int:
    """Entries of ``key`` after ``after`` and before ``before``."""
    count, start = 0, f"({after}"
    end = f"({before[0]}-{before[1]}"
    while True:
        page = range_reply(client.xrange(key, start, end, count=_COUNT_PAGE))
        count += len(page)
        if len(page) < _COUNT_PAGE:
            return count
        start = "(" + entry_id_str(page[-1][0])


def record_skips(
    client: redis.Redis,
    keys: RunKeys,
    streams: Mapping[str, str],
    over: Iterable[Position],
    floors: Mapping[str, IdKey],
) -> list[tuple[Position, Skip]]:
    """Before a trim to ``floors``: record, for each follower past its bound, the unread entries the trim
    removes (merged with a skip it has not read past yet). Recorded first, so a crash between the two
    never trims what no record names."""
    recorded = []
    for follower in over:
        floor = floors.get(follower.stream)
        if floor is None or floor <= (id_key(follower.position)[0], id_key(follower.position)[1] + 1):
            continue
        count = _count_between(client, streams[follower.stream], follower.position, floor)
        if not count:
            continue
        before = f"{floor[0]}-{floor[1]}"
        previous = follower.skip
        if previous is not None and previous.after == follower.position:
            skip = Skip(follower.position, before, previous.count + count)
        else:
            skip = Skip(follower.position, before, count)
        field = f"{follower.name}|{follower.stream}"
        client.hset(
            keys.follow, mapping={field + "|skip": skip.text(), field + "|skipped": str(follower.skipped + count)}
        )
        log.warning(
            "retention trims %d entries of %s that follower %s has not read (it is over --max-follow-lag-s "
            "behind); recorded as a skip it will see",
            count,
            follower.stream,
            follower.name,
        )
        recorded.append((follower, skip))
    return recorded

"""Independent consumers: a named reader of one run's decisions, slot results or steps, with a durable position.

    from streamgrp.store.follower import Follower

    follower = Follower(client, run, "eval", stream="decisions")
    for item in follower.entries(stop=stop, until_finished=True):
        if isinstance(item, Followed):      # item.entry_id, item.event (a GroupDecided here)
            handle(item)                    # handle it idempotently by item.entry_id
        else:                               # a Skipped: retention trimmed entries it had not read
            note(item)

Owns reading a stream from the follower's position and recording that position: the entries after it,
in stream order (per partition in a partitioned run, whose ``decisions`` are ``decisions@0``..), each
yielded once per life of the process. The position is recorded (`streamgrp.store.follow`, forward only)
once the loop asks for more after the last entry of a read, so what the follower has handled is what it
recorded, give or take the entries of one read: a follower killed mid-read gets those again when it
restarts. Delivery is therefore at least once, and exactly once for a handler that is idempotent by
entry id (what `streamgrp export --follow` and the live evaluation example do).

A follower reads with XRANGE and writes only its own position, so it cannot change what any role of
the run reads or writes: the trainer gets the same steps with or without it. Retention keeps what a
follower has not handled (`streamgrp.services.retention`), unless the archiver's
``--max-follow-lag-s`` says it fell too far behind; then what was trimmed unread comes here as one
`Skipped` before the entries after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from streamgrp.core import codec
from streamgrp.errors import ConfigError, DecodeError
from streamgrp.store.follow import START, FollowPositions, previous_id
from streamgrp.store.keys import id_key
from streamgrp.store.runs import Run, server_time
from streamgrp.store.streams import entry_id_str, entry_time, range_reply

__all__ = ["FOLLOWABLE", "Followed", "Follower", "Skipped"]

log = logging.getLogger(__name__)

#: The streams a follower may follow (a partitioned run: every partition's of the first two).
FOLLOWABLE = ("decisions", "slots", "steps")


@dataclass(frozen=True)
class Followed:
    """One entry: its stream (``decisions``, ``decisions@2``), id, and event (None when it does not decode:
    ``error`` says why; skip it)."""

    stream: str
    entry_id: str
    event: Any
    error: str | None = None


@dataclass(frozen=True)
class Skipped:
    """Entries of ``stream`` after ``after`` and before ``before`` that retention trimmed before this follower
    read them (about ``count``; it fell further behind than the archiver's --max-follow-lag-s)."""

    stream: str
    after: str
    before: str
    count: int


class Follower:
    """A named consumer of one run's ``stream`` (`FOLLOWABLE`) that resumes where it stopped.

    ``start`` is where a follower new to the stream begins: ``first`` (what the server holds) or ``now``
    (entries written from now on); a follower with a recorded position always resumes from it.
    ``batch`` entries are read at once and recorded together; ``metrics`` (`streamgrp.cli.metrics.Metrics`
    of the ``follower`` role) gets entries, skips and lag."""

    def __init__(
        self,
        client: redis.Redis,
        run: Run,
        name: str,
        stream: str = "decisions",
        *,
        start: str = "first",
        batch: int = 256,
        poll_s: float = 0.2,
        metrics: Any = None,
    ) -> None:
        if stream not in FOLLOWABLE:
            raise ConfigError(f"a follower follows one of {', '.join(FOLLOWABLE)}, not {stream!r}")
        if start not in ("first", "now"):
            raise ConfigError(f"--start is first or now, not {start!r}")
        if batch < 1:
            raise ConfigError("a follower reads at least one entry at a time")
        self.client = client
        self.run = run
        self.stream = stream
        self.batch = batch
        self.poll_s = poll_s
        self.metrics = metrics
        self.positions = FollowPositions(client, run.keys, name)
        self.name = self.positions.name
        names = [n for n in run.streams() if n.partition("@")[0] == stream]
        self.streams = {n: run.stream_key(n) for n in sorted(names, key=lambda n: int(n.partition("@")[2] or 0))}
        self.cursor = {n: self.positions.register(n, self._start(key, start)) for n, key in self.streams.items()}
        self._unrecorded: dict[str, str] = {}

    def _start(self, key: str, start: str) -> str:
        if start == "first":
            return START
        last = range_reply(self.client.xrevrange(key, "+", "-", count=1))
        return entry_id_str(last[0][0]) if last else START

    def entries(
        self, stop: threading.Event | None = None, *, until_finished: bool = False, idle_s: float = 2.0
    ) -> Iterator[Followed | Skipped]:
        """Entries past the recorded position, in order, until ``stop`` is set (or, ``until_finished``, once the
        run ended and nothing new came for ``idle_s``: decisions of open groups may follow the run's end).

        An item counts as handled when the loop asks for the next one; the handled ones are recorded after
        each read and when the loop ends by ``stop`` (one it breaks out of is not: it comes again)."""
        stop = stop or threading.Event()
        idle_since = None
        while not stop.is_set():
            items = self.poll()
            for item in items:
                yield item
                self.handled(item)
                if stop.is_set():
                    break
            self.record()
            if stop.is_set():
                return
            if items:
                idle_since = None
                continue
            idle_since = idle_since if idle_since is not None else time.monotonic()
            if until_finished and self.run_ended() and time.monotonic() - idle_since >= idle_s:
                return
            stop.wait(self.poll_s)

    def poll(self) -> list[Followed | Skipped]:
        """One read of every stream past this process's cursor (at most ``batch`` entries each), without
        waiting; each stream's items begin with a `Skipped` when retention trimmed entries it had not read.
        Mark what is handled with `handled` and make it durable with `record` (`entries` does both)."""
        items: list[Followed | Skipped] = []
        for name, key in self.streams.items():
            skip = self.positions.skip(name)
            here = id_key(self.cursor[name])
            if skip is not None and id_key(skip.before) > (here[0], here[1] + 1):
                self.cursor[name] = previous_id(skip.before)
                if self.metrics is not None:
                    self.metrics.follow_skipped.labels(self.name, name).inc(skip.count)
                items.append(Skipped(name, f"{here[0]}-{here[1]}", skip.before, skip.count))
            page = range_reply(self.client.xrange(key, f"({self.cursor[name]}", "+", count=self.batch))
            for raw_id, fields in page:
                entry_id = entry_id_str(raw_id)
                self.cursor[name] = entry_id
                try:
                    items.append(Followed(name, entry_id, codec.decode(fields)))
                except DecodeError as exc:
                    items.append(Followed(name, entry_id, None, f"{exc.reason}: {exc.detail}"))
            self._observe(name, page)
        return items

    def handled(self, item: Followed | Skipped) -> None:
        """``item`` is handled: `record` makes its position durable."""
        self._unrecorded[item.stream] = item.entry_id if isinstance(item, Followed) else previous_id(item.before)

    def record(self) -> None:
        """Record the position of every item marked `handled` (forward only: an older one changes nothing)."""
        for name, entry_id in list(self._unrecorded.items()):
            self.positions.ack(name, entry_id)
            del self._unrecorded[name]

    def run_ended(self) -> bool:
        """The batcher recorded the run's finished or terminal event."""
        return any(self.client.hmget(self.run.keys.batcher_state, "finished", "terminal"))

    def lag_s(self) -> dict[str, float]:
        """Seconds since the oldest entry this follower has not read was written, per stream (0: caught up)."""
        from streamgrp.store.follow import unread_age

        now = server_time(self.client)
        return {
            name: unread_age(self.client, name.partition("@")[0], key, self.cursor[name], now)
            for name, key in self.streams.items()
        }

    def _observe(self, name: str, page: list) -> None:
        if self.metrics is None:
            return
        if page:
            self.metrics.follow_entries.labels(self.name, name).inc(len(page))
        if len(page) < self.batch:
            self.metrics.follow_lag.labels(self.name, name).set(0.0)
        elif self.stream != "steps":  # a full read: more wait; how old is the newest read one
            self.metrics.follow_lag.labels(self.name, name).set(
                max(0.0, time.time() - entry_time(entry_id_str(page[-1][0])))
            )

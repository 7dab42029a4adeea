"""`RunEndWatch`: whether a run has ended, for roles that would otherwise wait for work forever.

The batcher ends a run with `RunFinished` (every step written) or `RunTerminated` (failed) on the run's
control stream, which only the batcher and the trainers may write and every role may read. A worker or
assembler idle after that has nothing more to do: it asks this watch, which reads the control stream
from where it last stopped at most every ``interval_s`` (a few entries per version, so a read is small).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from streamgrp.core import codec
from streamgrp.core.events import RunFinished, RunTerminated
from streamgrp.errors import DecodeError
from streamgrp.store.keys import RunKeys
from streamgrp.store.streams import entry_id_str, range_reply

#: Control entries read per call; a run's control stream grows by about one entry per step.
PAGE = 512


class RunEndWatch:
    """``ended()``: ``finished`` or ``failed`` once the run's terminal event is on its control stream, else None."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        *,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.keys = keys
        self.interval_s = interval_s
        self.clock = clock
        self._after = "-"
        self._read_at: float | None = None
        self._outcome: str | None = None

    def ended(self) -> str | None:
        if self._outcome is not None:
            return self._outcome
        now = self.clock()
        if self._read_at is not None and now - self._read_at < self.interval_s:
            return None
        self._read_at = now
        while self._outcome is None:
            entries = range_reply(self.client.xrange(self.keys.control, self._after, "+", count=PAGE))
            for raw_id, fields in entries:
                self._after = "(" + entry_id_str(raw_id)
                try:
                    event = codec.decode(fields)
                except DecodeError:
                    continue  # the batcher dead-letters what it cannot read; nothing here ends a run
                if isinstance(event, RunFinished):
                    self._outcome = "finished"
                elif isinstance(event, RunTerminated):
                    self._outcome = "failed"
            if len(entries) < PAGE:
                break
        return self._outcome

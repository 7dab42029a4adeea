"""Reading the run's policy version, which only `trainer_commit.lua` sets, as whatever a GET returns.

Owns parsing it. The version is one plain string key a trainer's credential may ``SET``: a value
that is not a non-negative integer was not written by streamgrp, so a reader logs it once and keeps
the last good version instead of crashing (a batcher or worker that exited on ``int("x")`` stopped
the run; SPEC 5: a foreign value never stops a service). The next commit writes a good one again.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from streamgrp.store.keys import RunKeys

log = logging.getLogger(__name__)


class VersionReader:
    """One reader's view of the run's version: the last good value, and whether it said so about a bad one."""

    def __init__(self, keys: RunKeys) -> None:
        self.keys = keys
        self.last = 0
        self._reported: Any = None

    def read(self, client: redis.Redis) -> int:
        return self.parse(client.get(self.keys.version))

    def parse(self, raw: bytes | str | None) -> int:
        """The version ``raw`` (a GET's reply) names, or the last good one when it names none."""
        if raw is None:
            return self.last
        try:
            value = int(raw)
        except (TypeError, ValueError):
            value = -1
        if value < 0:
            if raw != self._reported:
                self._reported = raw
                log.error(
                    "run %s: the policy version key holds %r, which streamgrp never writes (only trainer commits "
                    "set it, to integers); keeping version %d until the next commit writes one. Check who "
                    "else holds a credential that may SET %s",
                    self.keys.run,
                    raw,
                    self.last,
                    self.keys.version,
                )
            return self.last
        self.last = value
        return value

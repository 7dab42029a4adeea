"""Every Redis key and stream name streamgrp uses, and nothing else.

All of a run's keys share the hash tag ``{run}``, so in Redis Cluster they live in one slot and
the assembler's commit script (which touches several of them) stays legal. The only key outside a
run is the registry of runs, which no multi-key command touches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "sg"
RUNS = f"{PREFIX}:runs"  # sorted set: run name -> start time (server clock)

#: Consumer group names, one per reading role.
WORKERS_GROUP = "workers"
ASSEMBLER_GROUP = "assembler"
ASSEMBLER_CONSUMER = "assembler"

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_run_name(run: str) -> str:
    if not _RUN_NAME.match(run):
        raise ValueError(
            f"run name {run!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return run


@dataclass(frozen=True)
class RunKeys:
    """The names of one run's streams and keys."""

    run: str

    def __post_init__(self) -> None:
        check_run_name(self.run)

    def _key(self, name: str) -> str:
        return f"{PREFIX}:{{{self.run}}}:{name}"

    @property
    def control(self) -> str:
        """Run-level events: the recorded configuration first, then version advances and terminal events."""
        return self._key("control")

    @property
    def tasks(self) -> str:
        """The work queue workers take tasks from (consumer group `workers`)."""
        return self._key("tasks")

    @property
    def slots(self) -> str:
        """The group log the assembler folds, in order: task issued, slot results, ticks."""
        return self._key("slots")

    @property
    def decisions(self) -> str:
        """One `GroupDecided` entry per task."""
        return self._key("decisions")

    @property
    def deadletter(self) -> str:
        return self._key("deadletter")

    @property
    def decided(self) -> str:
        """Hash task id -> decision entry id: the "already decided" marker written with the decision."""
        return self._key("decided")

    @property
    def counts(self) -> str:
        """Hash of durable accounting counters, updated atomically with the acknowledgements they count."""
        return self._key("counts")

    @property
    def assembler_lease(self) -> str:
        return self._key("assembler:lease")

    @property
    def worker_seq(self) -> str:
        """Counter handing out worker identities."""
        return self._key("worker:ids")

    def all_streams(self) -> dict[str, str]:
        return {"control": self.control, "tasks": self.tasks, "slots": self.slots,
                "decisions": self.decisions, "deadletter": self.deadletter}

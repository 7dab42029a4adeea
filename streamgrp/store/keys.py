"""Every Redis key and stream name streamgrp uses, and nothing else.

All of a run's keys share the hash tag ``{run}``, so in Redis Cluster they live in one slot and
the assembler's commit script (which touches several of them) stays legal. The only key outside a
run is the registry of runs, which no multi-key command touches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from streamgrp.errors import ConfigError

PREFIX = "sg"
RUNS = f"{PREFIX}:runs"  # sorted set: run name -> start time (server clock)

#: Consumer group names, one per reading role.
WORKERS_GROUP = "workers"
ASSEMBLER_GROUP = "assembler"
ASSEMBLER_CONSUMER = "assembler"
BATCHER_GROUP = "batcher"
BATCHER_CONSUMER = "batcher"

#: ``\Z``, not ``$``: ``$`` also matches before a trailing newline, and a run name is part of every key
#: name and of the ACL key patterns (`streamgrp.store.acl`), so it must be exactly these characters.
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


def check_run_name(run: str) -> str:
    """``run`` if it is a valid run name; `ConfigError` (also a ValueError) naming the rule otherwise."""
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise ConfigError(
            f"run name {run!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
            "digit (fix --run / STREAMGRP_RUN)"
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
    def payloads(self) -> str:
        """`SamplePayload` entries: each sample's tensors, at the entry id of its slot result in ``slots``
        (written by the same script call), read only by trainer ranks and replay."""
        return self._key("payloads")

    @property
    def decisions(self) -> str:
        """One `GroupDecided` entry per task."""
        return self._key("decisions")

    @property
    def deadletter(self) -> str:
        return self._key("deadletter")

    @property
    def deadlettered(self) -> str:
        """Hash ``stream entry-id`` -> 1 for entries of streams without a consumer group (control)
        that were dead-lettered: each is dead-lettered and counted once, whoever reads it first."""
        return self._key("deadlettered")

    @property
    def decided(self) -> str:
        """Hash task id -> decision entry id: the "already decided" marker written with the decision."""
        return self._key("decided")

    @property
    def counts(self) -> str:
        """Hash of durable accounting counters, updated atomically with the acknowledgements they count."""
        return self._key("counts")

    @property
    def steps(self) -> str:
        """One `StepManifest` per step, at entry id ``{step}-1`` so a step can be written only once."""
        return self._key("steps")

    @property
    def discarded(self) -> str:
        """`GroupDiscarded` entries: trainable groups the batcher dropped as stale or filtered."""
        return self._key("discarded")

    @property
    def commits(self) -> str:
        """`StepCommitted` and `StepFailed` entries from trainer ranks."""
        return self._key("commits")

    @property
    def committed(self) -> str:
        """Hash rank -> last committed step."""
        return self._key("committed")

    @property
    def version(self) -> str:
        """The current policy version (steps every rank committed)."""
        return self._key("version")

    @property
    def trainer_metrics(self) -> str:
        """Hash step -> JSON of the reference trainer's per-step metrics (reward, loss, wait)."""
        return self._key("trainer:metrics")

    @property
    def batcher_state(self) -> str:
        """Hash: next step number, feeder cursor and the tasks it issued."""
        return self._key("batcher")

    @property
    def batcher_lease(self) -> str:
        return self._key("batcher:lease")

    @property
    def assembler_lease(self) -> str:
        return self._key("assembler:lease")

    @property
    def archive(self) -> str:
        """Hash stream name -> last entry id the archiver wrote and fsynced (and ``archive_id``, whose
        archive that is): retention never trims past it."""
        return self._key("archive")

    def weights(self, version: int | str) -> str:
        """Policy weights of ``version`` (``latest``: the newest version's number; ``*``: the ACL pattern of all)."""
        return self._key(f"control:weights:{version}")

    @property
    def pattern(self) -> str:
        """Every key of the run, as an ACL key pattern (run names hold no glob characters)."""
        return self._key("*")

    @property
    def worker_seq(self) -> str:
        """Counter handing out worker identities."""
        return self._key("worker:ids")

    def all_streams(self) -> dict[str, str]:
        return {"control": self.control, "tasks": self.tasks, "slots": self.slots, "payloads": self.payloads,
                "decisions": self.decisions,
                "steps": self.steps, "discarded": self.discarded, "commits": self.commits,
                "deadletter": self.deadletter}


def step_entry_id(step: int) -> str:
    """The steps-stream entry id of a step: explicit ids make a second write of a step fail."""
    return f"{step}-1"


#: An entry id as a sortable pair (milliseconds, sequence).
IdKey = tuple[int, int]


def id_key(entry_id: str) -> IdKey:
    """Stream order of an entry id (``ms-seq``), for sorting ids taken from different places."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)

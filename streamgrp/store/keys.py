"""Every Redis key and stream name streamgrp uses, and nothing else.

All of a run's keys share the hash tag ``{run}``, so in Redis Cluster they live in one slot and
the assembler's commit script (which touches several of them) stays legal. The only key outside a
run is the registry of runs, which no multi-key command touches.

A partitioned run (``partitions`` > 1) moves what one assembler folds (tasks, slot log, payloads,
decisions, dead letters and their counters) into one key set per partition, each under its own hash
tag (`PartitionKeys`), so each partition can live on another cluster node; the run-wide keys (control,
steps, commits, the batcher's state) keep ``{run}``. A task's partition is a stable hash of its id
(`task_partition`). With one partition, partition 0's keys are the run's own: the layout of an
unpartitioned run.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from streamgrp.errors import ConfigError
from streamgrp.store import payloads

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


#: A session id: its task's partition, then 16 random hex digits (`streamgrp.store.sessions.new_session_id`).
#: It is part of a key name, so exactly these characters.
_SESSION_ID = re.compile(r"p([0-9]{1,2})-[0-9a-f]{16}\Z")


def check_session_id(session_id: str) -> str:
    """``session_id`` if it is a session id streamgrp makes; `ConfigError` (also a ValueError) otherwise."""
    if not isinstance(session_id, str) or not _SESSION_ID.match(session_id):
        raise ConfigError(f"{str(session_id)[:80]!r} is not a session id (p<partition>-<16 hex digits>)")
    return session_id


def session_partition(session_id: str) -> int:
    """The partition of the task a session belongs to, from its id."""
    return int(_SESSION_ID.match(check_session_id(session_id)).group(1))  # type: ignore[union-attr]


#: A follower's name (`streamgrp.store.follower`): part of its position fields, so exactly these characters.
_CONSUMER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


def check_consumer_name(name: str) -> str:
    """``name`` if it is a valid follower name; `ConfigError` (also a ValueError) naming the rule otherwise."""
    if not isinstance(name, str) or not _CONSUMER_NAME.match(name):
        raise ConfigError(
            f"consumer name {str(name)[:80]!r} is not allowed: use 1-64 letters, digits, '.', '_' or "
            "'-', starting with a letter or digit"
        )
    return name


def check_run_name(run: str) -> str:
    """``run`` if it is a valid run name; `ConfigError` (also a ValueError) naming the rule otherwise."""
    if not isinstance(run, str) or not _RUN_NAME.match(run):
        raise ConfigError(
            f"run name {run!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
            "digit (fix --run / STREAMGRP_RUN)"
        )
    return run


class _FoldLayout:
    """The keys one assembler's fold reads and writes, under ``_key``'s hash tag: a run's own (an
    unpartitioned run, `RunKeys`) or one partition's (`PartitionKeys`)."""

    def _key(self, name: str) -> str:
        raise NotImplementedError

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
        (written by the same script call), read only by trainer ranks and replay. In a ``keys``-layout run
        the stream stays empty and its name prefixes the payload keys (`streamgrp.store.payloads`)."""
        return self._key("payloads")

    @property
    def payload_keys(self) -> str:
        """Every payload key (``payloads:<slot entry id>``) and staging key of a ``keys``-layout run, as an
        ACL key pattern (`streamgrp.store.payloads`; never the payloads stream itself)."""
        return payloads.pattern(self.payloads)

    @property
    def payload_staging(self) -> str:
        """The staging keys of payloads not published yet, as an ACL key pattern (`streamgrp.store.payloads`)."""
        return payloads.staged_pattern(self.payloads)

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
    def issued(self) -> str:
        """Hash task id -> 1 of the tasks a partitioned run's feeder issued here (each issued once)."""
        return self._key("issued")

    @property
    def counts(self) -> str:
        """Hash of durable accounting counters, updated atomically with the acknowledgements they count;
        written by the assembler and the batcher only (the feeder's window depends on them)."""
        return self._key("counts")

    @property
    def deadletter_counts(self) -> str:
        """Hash of the counters of `streamgrp.store.deadletter.DeadLetters` (``invalid:*``,
        ``deadletter:*``): kept apart from ``counts`` so that roles which only dead-letter (workers,
        trainers) never hold a right to the counters the run's accounting and feeder read."""
        return self._key("deadletter:counts")

    @property
    def assembler_lease(self) -> str:
        return self._key("assembler:lease")

    # -- agent sessions (streamgrp.services.gateway): under the task's partition tag, like its slot results

    @property
    def sessions(self) -> str:
        """Agent sessions' events in order (`SessionOpened`, `TurnRecorded`, `SessionEnded`): every turn of
        every session of the partition's tasks, token-exact; written only by the gateway's functions."""
        return self._key("sessions")

    def session(self, session_id: str) -> str:
        """Hash: one session's state (task, slot, deadline, status, its turns' entry ids, its key's digest)."""
        return self._key(f"session:{check_session_id(session_id)}")

    @property
    def session_pattern(self) -> str:
        """Every session hash, as an ACL key pattern (``session:*`` never matches ``sessions``)."""
        return self._key("session:*")

    @property
    def segments(self) -> str:
        """`SlotSegment` entries: slots' generations in progress, durable before their results, so a worker
        that takes a task over continues each slot from them; written only through ``segment.lua`` by the
        worker holding the task, never folded as results (`streamgrp.store.segments`)."""
        return self._key("segments")

    @property
    def session_deadlines(self) -> str:
        """Sorted set: each open session's id scored by its group's deadline (server clock), so a gateway
        finds the sessions to end as timed out without scanning."""
        return self._key("sessions:deadlines")


@dataclass(frozen=True)
class RunKeys(_FoldLayout):
    """The names of one run's streams and keys (an unpartitioned run's fold keys are its own)."""

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
        """The current policy version (grows by one per step every rank committed; see `TrainingResumed`)."""
        return self._key("version")

    @property
    def attempt(self) -> str:
        """Hash: the trainer group's current attempt (number, first step, version base, the steps it may
        have handed out, each rank's process token); `streamgrp.train.attempt` owns it."""
        return self._key("trainer:attempt")

    @property
    def checkpoint(self) -> str:
        """Hash: the newest `CheckpointSaved` by step (``step``, ``h``); never trimmed, unlike ``commits``."""
        return self._key("trainer:checkpoint")

    @property
    def trainer_metrics(self) -> str:
        """Hash step -> JSON of the reference trainer's per-step metrics (reward, loss, wait)."""
        return self._key("trainer:metrics")

    @property
    def batcher_state(self) -> str:
        """Hash: next step number, feeder cursor and the tasks it issued."""
        return self._key("batcher")

    @property
    def batcher_unacked(self) -> str:
        """Hash of decisions a partitioned run's batcher used (``entry@partition``) and has yet to
        acknowledge in their partition: written with the step or discard that used them."""
        return self._key("batcher:unacked")

    @property
    def batcher_settled(self) -> str:
        """Hash task id -> 1 of the tasks a partitioned run's steps and discards used: a second decision
        of one (its partition's server lost its last writes and the task was decided again) is dropped."""
        return self._key("batcher:settled")

    @property
    def batcher_lease(self) -> str:
        return self._key("batcher:lease")

    @property
    def archive(self) -> str:
        """Hash stream name -> last entry id the archiver wrote and fsynced (and ``archive_id``, whose
        archive that is): retention never trims past it."""
        return self._key("archive")

    @property
    def follow(self) -> str:
        """Hash of the followers' durable positions (`streamgrp.store.follow`): ``NAME|STREAM`` -> the last
        entry id that follower handled, and the skips retention recorded for it; retention keeps what each
        has not read."""
        return self._key("follow")

    def weights(self, version: int | str) -> str:
        """Policy weights of ``version`` (``latest``: the newest version's number; ``*``: the ACL pattern of all)."""
        return self._key(f"control:weights:{version}")

    @property
    def pattern(self) -> str:
        """Every key of the run but its partitions', as an ACL key pattern (run names hold no glob characters)."""
        return self._key("*")

    @property
    def partition_pattern(self) -> str:
        """Every key of the run's partitions (a partitioned run's), as an ACL key pattern."""
        return f"{PREFIX}:{{{self.run}/*}}:*"

    @property
    def worker_seq(self) -> str:
        """Counter handing out worker identities."""
        return self._key("worker:ids")

    def partition(self, index: int, partitions: int) -> PartitionKeys:
        """Partition ``index`` of a run of ``partitions``; partition 0 of one is these keys' own layout."""
        return PartitionKeys(self.run, index, partition_tag(self.run, index, partitions))

    def partitions(self, count: int) -> tuple[PartitionKeys, ...]:
        """Every partition of a run of ``count`` partitions, in order."""
        return tuple(self.partition(index, count) for index in range(count))

    def all_streams(self) -> dict[str, str]:
        return {
            "control": self.control,
            "tasks": self.tasks,
            "slots": self.slots,
            "payloads": self.payloads,
            "decisions": self.decisions,
            "steps": self.steps,
            "discarded": self.discarded,
            "commits": self.commits,
            "deadletter": self.deadletter,
            "sessions": self.sessions,
            "segments": self.segments,
        }


#: The most partitions a run may have: each has its own assembler process and key set.
MAX_PARTITIONS = 64


@dataclass(frozen=True)
class PartitionKeys(_FoldLayout):
    """The names of one partition's streams and keys: what its assembler folds and writes."""

    run: str
    index: int
    #: The hash tag of every key here: the run's name for an unpartitioned run, else the run's name,
    #: the partition and a salt that puts the partition's slot in its share of the cluster's slots.
    tag: str

    def _key(self, name: str) -> str:
        return f"{PREFIX}:{{{self.tag}}}:{name}"

    def all_streams(self) -> dict[str, str]:
        return {
            "tasks": self.tasks,
            "slots": self.slots,
            "payloads": self.payloads,
            "decisions": self.decisions,
            "deadletter": self.deadletter,
            "sessions": self.sessions,
            "segments": self.segments,
        }


#: Redis Cluster's hash slots; a key's slot is the CRC16 (XMODEM) of its hash tag modulo this.
CLUSTER_SLOTS = 16384


def tag_slot(tag: str) -> int:
    """The cluster slot of every key whose hash tag is ``tag`` (what ``CLUSTER KEYSLOT`` answers)."""
    crc = 0
    for byte in tag.encode():
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc % CLUSTER_SLOTS


def partition_tag(run: str, index: int, partitions: int) -> str:
    """The hash tag of partition ``index`` of ``partitions``: ``run`` itself when there is one.

    Otherwise ``run/index.salt`` with the smallest salt whose slot falls in the partition's equal share
    of the 16384 cluster slots, so P partitions land on P different nodes of a cluster whose nodes own
    equal slot ranges (what ``redis-cli --cluster create`` makes) with P at most the node count. ``/``
    is not allowed in run names, so no run's tag is another's partition tag."""
    check_run_name(run)
    if not 0 <= index < partitions <= MAX_PARTITIONS:
        raise ConfigError(
            f"partition {index} of {partitions}: a run has 1 to {MAX_PARTITIONS} partitions, numbered from 0"
        )
    if partitions == 1:
        return run
    low, high = CLUSTER_SLOTS * index // partitions, CLUSTER_SLOTS * (index + 1) // partitions
    salt = 0
    while not low <= tag_slot(f"{run}/{index}.{salt}") < high:
        salt += 1  # about `partitions` tries on average
    return f"{run}/{index}.{salt}"


def task_partition(task_id: str, partitions: int) -> int:
    """The partition a task belongs to: a stable hash of its id (the same in every process and version)."""
    if partitions == 1:
        return 0
    digest = hashlib.blake2b(task_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


#: Streams every partition has its own of; in a partitioned run the run's own are unused.
PARTITION_STREAMS = ("tasks", "slots", "payloads", "decisions", "sessions", "segments")


def run_streams(
    keys: RunKeys, partitions: Sequence[PartitionKeys], only: Sequence[int] | None = None
) -> dict[str, str]:
    """Stream name -> key of every stream of a run with these ``partitions`` (of ``only`` those, when
    given), named as `stream_key` reads them: ``slots`` unpartitioned, ``slots@2`` partitioned."""
    count = len(partitions)
    out = {name: key for name, key in keys.all_streams().items() if count == 1 or name not in PARTITION_STREAMS}
    for index in range(count) if only is None else only:
        suffix = f"@{index}" if count > 1 else ""
        out.update({name + suffix: key for name, key in partitions[index].all_streams().items()})
    return out


def canonical_stream(name: str, partitions: int) -> str:
    """``name`` as `run_streams` names it: in a partitioned run a bare partition stream name
    (``payloads``, what a loader asks for partition 0) is ``payloads@0``."""
    return f"{name}@0" if partitions > 1 and name in PARTITION_STREAMS else name


def stream_key(keys: RunKeys, partitions: Sequence[PartitionKeys], name: str) -> str:
    """The key of a run's stream by name: ``steps`` (run-wide), ``slots@2`` (partition 2's); a bare
    partition stream name is partition 0's. ValueError for a name the run does not have."""
    base, at, index = name.partition("@")
    try:
        if at:
            return partitions[int(index)].all_streams()[base]
        if name in PARTITION_STREAMS:
            return partitions[0].all_streams()[name]
        return keys.all_streams()[name]
    except (KeyError, IndexError, ValueError):
        raise ValueError(
            f"unknown stream {name!r}; expected one of {sorted(keys.all_streams())}, or a partition's "
            f"{', '.join(PARTITION_STREAMS)}, deadletter as NAME@0 to NAME@{len(partitions) - 1}"
        ) from None


def step_entry_id(step: int) -> str:
    """The steps-stream entry id of a step: explicit ids make a second write of a step fail."""
    return f"{step}-1"


#: An entry id as a sortable pair (milliseconds, sequence).
IdKey = tuple[int, int]


def id_key(entry_id: str) -> IdKey:
    """Stream order of an entry id (``ms-seq``), for sorting ids taken from different places."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)

"""The batch fold's records (`streamgrp.core.batch_fold`): the events it folds (a decision read, the policy
version, a round's end, the dataset's end, the staleness window) and the outputs it hands the batcher (entries to
acknowledge, discarded groups and why, a step that is due, the run's end or failure, a stall warning).

Owns only their shapes; what each means for the run, and when each is emitted, is the fold's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from streamgrp.core.events import GroupDecided

#: A trainable group in the fold's buffer: its decision entry's id and the decision.
Buffered = tuple[str, GroupDecided]

# Why a trainable group was discarded instead of trained.
DiscardReason = Literal["stale", "filtered", "leftover"]
STALE: DiscardReason = "stale"
FILTERED: DiscardReason = "filtered"
LEFTOVER: DiscardReason = "leftover"


# -- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decided:
    """A decision entry read from the decisions stream; ``decision`` is None when its fields are gone."""

    entry_id: str
    decision: GroupDecided | None


@dataclass(frozen=True, slots=True)
class VersionSet:
    """The policy version now (read from the server before steps may be due)."""

    version: int


@dataclass(frozen=True, slots=True)
class RoundEnded:
    """A collection round ended at ``now`` (the driver's monotonic clock).

    ``window_full``: the feeder had no room to issue; ``lowest_committed``: the lowest step every
    rank has committed (-1 when some rank has none); together they say whether the round waited for
    trainers (SPEC section 4). ``server_away``: the server was unreachable during the round, so the
    round says nothing about rollouts; its ``duration`` is not stall time.
    """

    now: float
    window_full: bool = False
    lowest_committed: int = -1
    server_away: bool = False
    duration: float = 0.0


@dataclass(frozen=True, slots=True)
class DatasetEnded:
    """The feeder issued the whole dataset and every issued task is decided and read."""


@dataclass(frozen=True, slots=True)
class WindowSet:
    """What ``staleness="wait"`` holds steps by: ``oldest_in_flight``, the oldest version a task still
    undecided was issued at (None: none is), and ``lowest_committed``, the last step every rank has
    committed (-1: none). Folding it writes the steps it lets through."""

    oldest_in_flight: int | None
    lowest_committed: int = -1


Event = Decided | VersionSet | RoundEnded | DatasetEnded | WindowSet


# -- outputs ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Acked:
    """Decision entries that need only an acknowledgement (groups the assembler dropped)."""

    entry_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Discarded:
    """A trainable group that will not train, and why (``stale``, ``filtered``, ``leftover``)."""

    entry_id: str
    decision: GroupDecided
    reason: DiscardReason
    detail: str
    current_version: int | None = None


@dataclass(frozen=True, slots=True)
class StepDue:
    """Step ``step`` is due with ``groups`` (decision entry, decision), at policy ``version``."""

    step: int
    version: int
    groups: tuple[Buffered, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    steps: int


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str
    message: str
    step: int


@dataclass(frozen=True, slots=True)
class Stalling:
    """Rounds without a trainable group, the run not stalled for good yet: at most one a minute, for
    the driver to warn with (the streak itself is `BatchState.stall`)."""

    empty_rounds: int
    stall_seconds: float


Output = Acked | Discarded | StepDue | Finished | Failed | Stalling

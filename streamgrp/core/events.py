"""Events: every fact streamgrp records is one of these frozen msgspec Structs, defined once.

Owns the schema (which events exist, their fields with their bounds as msgspec ``Meta``, invariants
between fields in ``__post_init__``, the schema version): msgspec checks a header against it in compiled
code as it decodes it, and the codec checks an event built in Python the same way as it encodes it.
Nothing about bytes: `streamgrp.core.codec` is the only code that turns events into stream entries and
back. The bases and bounded types live in `streamgrp.core.wire`, tensors and samples in
`streamgrp.core.values`, group members and statistics in `streamgrp.core.members`; steps and discarded
groups in `streamgrp.core.step_events`, events of training progress and of generation in
`streamgrp.core.training_events` and `streamgrp.core.generation_events` (registered here). Pure: no I/O.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from streamgrp.core import wire
from streamgrp.core.event_base import READABLE_SCHEMAS, SCHEMA_VERSION
from streamgrp.core.fresh_tokens import Freshness, check_freshness, group_freshness, version_fields
from streamgrp.core.generation_events import (
    SessionEnded,
    SessionOpened,
    SlotSegment,
    TurnRecorded,
)
from streamgrp.core.members import (
    DecidedMember,
    GroupStats,
    Member,
    RowRewards,
    check_columns,
    columns_of,
    records_of,
)
from streamgrp.core.policy import GroupPolicy
from streamgrp.core.step_events import GroupDiscarded, Shard, ShardGroup, StepManifest
from streamgrp.core.training_events import (
    CheckpointSaved,
    RunFinished,
    StepCommitted,
    StepFailed,
    StepRowsTrained,
    TrainingResumed,
    VersionAdvanced,
    WeightsServed,
)
from streamgrp.core.values import Outcome, RawArray, Sample
from streamgrp.core.wire import Record, WireEvent, as_tuples, check_free_form

#: The most rows a reward may name (a sample's rows; more is not a reward streamgrp wrote).
MAX_REWARD_ROWS = 4096

__all__ = [
    "EVENT_TYPES",
    "READABLE_SCHEMAS",
    "SCHEMA_VERSION",
    "CheckpointSaved",
    "DecidedMember",
    "GroupDecided",
    "GroupDiscarded",
    "GroupStats",
    "Member",
    "RawArray",
    "RunFinished",
    "RunStarted",
    "RunTerminated",
    "Sample",
    "SamplePayload",
    "SampleSummary",
    "SessionEnded",
    "SessionOpened",
    "Shard",
    "ShardGroup",
    "SlotResult",
    "SlotRewarded",
    "SlotSegment",
    "StepCommitted",
    "StepFailed",
    "StepManifest",
    "StepRowsTrained",
    "TaskIssued",
    "Tick",
    "TrainingResumed",
    "TurnRecorded",
    "VersionAdvanced",
    "WeightsServed",
]


class RunStarted(WireEvent, frozen=True, kw_only=True):
    """The run's first event: its recorded configuration, which every later process must match."""

    kind: Literal["run_started"] = "run_started"

    run: str
    policy: GroupPolicy
    settings: dict[str, Any] = msgspec.field(default_factory=dict)
    started_at: wire.Float

    def __post_init__(self) -> None:
        check_free_form(self.settings, "settings")


class TaskIssued(WireEvent, frozen=True, kw_only=True):
    """A prompt to sample ``n_samples`` times; ``issued_at`` is in the server's clock (seconds)."""

    kind: Literal["task_issued"] = "task_issued"

    task_id: Annotated[str, Meta(min_length=1, max_length=256)]
    prompt: dict[str, Any] = msgspec.field(default_factory=dict)
    version: wire.NonNegInt = 0
    issued_at: wire.Float

    def __post_init__(self) -> None:
        check_free_form(self.prompt, "prompt")


def check_outcome(outcome: str, sample: object, error: str | None) -> None:
    """The rule of every slot result, whatever its schema: a sample exactly when the outcome says so,
    and a failure's text."""
    if (outcome == "sample") != (sample is not None):
        raise ValueError(f"outcome {outcome!r} {'needs' if outcome == 'sample' else 'forbids'} a sample")
    if outcome == "failed" and not error:
        raise ValueError("a failed slot carries its error text")


class SampleSummary(Record, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the group log keeps of a sample: what folding, filtering and the rank split need.

    ``tokens`` are the valid loss tokens (the partition weight), ``reward`` the mean over rows, and
    ``digest`` the digest of the sample's payload entry (`streamgrp.core.codec.entry_digest`),
    computed once, by the publisher; replay and verify check the payload against it.
    """

    rows: wire.PosInt
    tokens: wire.NonNegInt
    version: wire.NonNegInt
    reward: wire.Float
    digest: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    #: The newest policy version among the sample's tokens, when its per-token versions (``meta.token_versions``,
    #: a generation continued across weight updates) reach past ``version`` (the oldest); left out otherwise,
    #: so such a result is written as before. What ``staleness="mask"`` needs to tell a group that would train
    #: nothing (every token older than the window) from one with tokens to train.
    newest: wire.NonNegInt | UnsetType = UNSET
    #: With ``newest``: what the sample still trains under ``staleness="mask"`` at any window
    #: (`streamgrp.core.fresh_tokens.Freshness`: ``whole_version`` and ``fresh_tokens``).
    whole_version: wire.NonNegInt | UnsetType = UNSET
    fresh_tokens: tuple[tuple[wire.NonNegInt, wire.NonNegInt], ...] | UnsetType = UNSET

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):  # the mean of finite rewards can still overflow
            raise ValueError(f"reward {self.reward!r} is not a finite number; rewards must be finite")
        if self.newest is not UNSET and self.newest <= self.version:
            raise ValueError(
                f"newest version {self.newest} is not past the sample's version {self.version}; leave it out"
            )
        check_freshness(self, self.newest, self.tokens)

    @classmethod
    def of(cls, sample: Sample, digest: str) -> SampleSummary:
        return cls(
            rows=sample.rows,
            tokens=sample.valid_tokens,
            version=sample.version,
            reward=sum(sample.rewards) / sample.rows,
            digest=digest,
            **version_fields(sample.meta, sample.row_lengths, sample.version, sample.loss_mask.data),
        )

    @property
    def freshness(self) -> Freshness:
        """What the sample trains under ``staleness="mask"``: recorded, or all its tokens at its version."""
        if self.whole_version is UNSET or self.fresh_tokens is UNSET:
            return Freshness.flat(self.version, self.tokens)
        return Freshness(self.whole_version, self.fresh_tokens)


class SlotResult(WireEvent, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What a worker published for one slot: a sample (its summary), a rejection, or a failure with its text."""

    kind: Literal["slot_result"] = "slot_result"

    task_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    slot: wire.NonNegInt
    outcome: Outcome
    sample: SampleSummary | None = None
    error: str | None = None
    #: The sample's rewards come later, in a `SlotRewarded` event: until it arrives the slot is not
    #: usable, and the sample's own rewards (and the summary's) are placeholders it replaces. Written
    #: only when set (the codec leaves it out otherwise), so a result with its reward is written as it
    #: always was; it must stay the last field.
    reward_pending: bool = False

    def __post_init__(self) -> None:
        check_outcome(self.outcome, self.sample, self.error)
        if self.reward_pending and self.outcome != "sample":
            raise ValueError(f"only a sample can wait for its reward, not a {self.outcome!r} slot")

    def wire_fields(self) -> dict[str, Any]:
        fields = super().wire_fields()
        if not self.reward_pending:
            del fields["reward_pending"]
        return fields


class SlotRewarded(WireEvent, frozen=True, kw_only=True):
    """The reward of a slot whose result was published with ``reward_pending``: one value per row of
    its sample, or one for all its rows (``rewards``), a rejection (``reason``: the scorer refused the
    sample; the slot becomes ``rejected``) or a failure (``error``: scoring raised for good; the slot
    becomes ``failed``).
    ``scorer`` names who scored it. Written to the group log after the result; the first reward of a
    slot wins, a second is counted as a duplicate, one for a slot that is not waiting (an unknown
    task, a decided group, a slot whose result carried its reward) as late."""

    kind: Literal["slot_rewarded"] = "slot_rewarded"

    task_id: Annotated[str, Meta(min_length=1, max_length=256)]
    slot: wire.NonNegInt
    rewards: Annotated[tuple[wire.Float, ...], Meta(min_length=1, max_length=MAX_REWARD_ROWS)] | None = None
    reason: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None
    error: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    scorer: Annotated[str, Meta(max_length=256)] = ""

    def __post_init__(self) -> None:
        given = [name for name in ("rewards", "reason", "error") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "a reward carries exactly one of rewards (one per row, finite: `Float`), a rejection "
                f"reason or an error, got {given or 'none'}"
            )
        as_tuples(self, "rewards")

    @property
    def outcome(self) -> Outcome:
        """What the reward makes of its slot: a sample, rejected or failed."""
        return "sample" if self.rewards is not None else "rejected" if self.reason is not None else "failed"


class SamplePayload(WireEvent, frozen=True, kw_only=True):
    """A sample's tensors and per-row values, in the payloads stream at the entry id of its slot result.

    Written once, with its slot result, by the publish script; read by trainer ranks and replay only."""

    kind: Literal["sample_payload"] = "sample_payload"
    task_id: Annotated[str, Meta(min_length=1, max_length=256)]
    slot: wire.NonNegInt
    sample: Sample


class Tick(WireEvent, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Time passing, in the server's clock; closes groups whose deadline is at or before ``now``."""

    kind: Literal["tick"] = "tick"

    now: wire.Float

    def __post_init__(self) -> None:
        if self.now.__class__ is int:  # a float field takes ints and holds floats, as on the wire
            msgspec.structs.force_setattr(self, "now", float(self.now))


class GroupDecided(WireEvent, frozen=True, kw_only=True, dict=True):
    """The one decision for a task; ``members`` are its usable slots in slot order (`DecidedMember`
    records), written as columns right after ``reason``: ``slots`` (written as ``members``),
    ``member_entries`` and so on (`streamgrp.core.members`). Build one from records with `of`.

    ``slot_outcomes`` maps each slot index (as a string) to sample / rejected / failed / timeout.
    """

    kind: Literal["group_decided"] = "group_decided"

    task_id: str
    decision: Literal["complete", "partial", "dropped"]
    reason: str | None = None
    slots: tuple[wire.NonNegInt, ...] = msgspec.field(name="members")
    member_entries: tuple[str, ...]
    member_digests: tuple[str, ...] = ()
    member_rows: tuple[wire.Int, ...]
    member_tokens: tuple[wire.Int, ...]
    member_versions: tuple[wire.Int, ...]
    member_rewards: tuple[wire.Float | None, ...] = ()
    member_row_rewards: RowRewards = UNSET
    slot_outcomes: dict[str, str]
    stats: GroupStats
    error: str | None = None
    closed_by: Literal["all_slots", "deadline"]
    issued_at: wire.Float | None = None
    decided_at: wire.Float | None = None
    #: The newest policy version among the members' tokens, when a member's per-token versions reach past
    #: every member's version (`SampleSummary.newest`); left out otherwise. See `newest_version`.
    newest_token_version: wire.NonNegInt | UnsetType = UNSET
    #: What the group still trains under ``staleness="mask"`` at any window (`freshness`), when a member recorded
    #: its own (`SampleSummary.fresh_tokens`: its tokens span versions); left out otherwise.
    whole_version: wire.NonNegInt | UnsetType = UNSET
    fresh_tokens: tuple[tuple[wire.NonNegInt, wire.NonNegInt], ...] | UnsetType = UNSET

    def __post_init__(self) -> None:
        check_columns(self)
        if self.whole_version is not UNSET or self.fresh_tokens is not UNSET:
            newest = self.newest_version
            check_freshness(self, UNSET if newest is None else newest, max(self.member_tokens, default=0))

    @classmethod
    def of(cls, *, members: Sequence[DecidedMember], **fields: Any) -> GroupDecided:
        """A decision of ``members`` (records) and the other ``fields``."""
        return cls(**columns_of(members, DecidedMember), **fields)

    def with_members(self, members: Sequence[DecidedMember]) -> GroupDecided:
        """A copy whose members are ``members``."""
        return self.replace(**columns_of(members, DecidedMember))

    @functools.cached_property
    def members(self) -> tuple[DecidedMember, ...]:
        return records_of(self, DecidedMember)

    @property
    def version(self) -> int | None:
        """The group's policy version: the oldest among its members (SPEC section 4)."""
        return min(self.member_versions) if self.slots else None

    @property
    def newest_version(self) -> int | None:
        """The newest policy version among its members' tokens (their versions, or the recorded
        ``newest_token_version`` past them): no token of the group is newer."""
        if not self.slots:
            return None
        newest = max(self.member_versions)
        return newest if self.newest_token_version is UNSET else max(newest, self.newest_token_version)

    @property
    def valid_tokens(self) -> int:
        return sum(self.member_tokens)

    @functools.cached_property
    def freshness(self) -> Freshness:
        """What the group still trains under ``staleness="mask"``: recorded, else its members' tokens each at its
        version (a decision recorded before freshness was, with ``newest_token_version``, counts as whole up to
        that version: kept while any token is inside the window, as it was batched then)."""
        if self.whole_version is not UNSET and self.fresh_tokens is not UNSET:
            return Freshness(self.whole_version, self.fresh_tokens)
        flat = group_freshness([Freshness.flat(v, t) for v, t in zip(self.member_versions, self.member_tokens)])
        newest = self.newest_version
        return flat if newest is None else Freshness(newest, flat.tokens)


class RunTerminated(WireEvent, frozen=True, kw_only=True):
    """The run failed for good (contract violation, stall bound): every trainer rank raises ``message``."""

    kind: Literal["run_failed"] = "run_failed"

    reason: str
    message: str
    task_id: str | None = None
    step: wire.Int | None = None


_EVENT_MODELS = (
    RunStarted,
    TaskIssued,
    SlotResult,
    SlotRewarded,
    SamplePayload,
    Tick,
    GroupDecided,
    RunTerminated,
    StepManifest,
    GroupDiscarded,
    StepCommitted,
    StepFailed,
    StepRowsTrained,
    VersionAdvanced,
    RunFinished,
    WeightsServed,
    TrainingResumed,
    CheckpointSaved,
    SessionOpened,
    TurnRecorded,
    SessionEnded,
    SlotSegment,
)


def _kind_of(model: Any) -> str:
    return next(info.default for info in msgspec.structs.fields(model) if info.name == "kind")


EVENT_TYPES: dict[str, type[Any]] = {_kind_of(model): model for model in _EVENT_MODELS}

"""Event models: every fact streamgrp records is one of these frozen pydantic models.

Owns the schema (which events exist, their fields, invariants between fields, the schema version)
and nothing about bytes: `streamgrp.core.codec` is the only code that turns events into stream
entries and back. Field value types live in `streamgrp.core.values`, group members and statistics
in `streamgrp.core.members`. Pure: no I/O.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from pydantic import Field, model_validator

from streamgrp.core import wire
from streamgrp.core.event_base import READABLE_SCHEMAS, SCHEMA_VERSION, _Event
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
    from_columns,
    member_columns,
)
from streamgrp.core.policy import GroupPolicy
from streamgrp.core.values import (
    Float,
    Frozen,
    Int,
    NonNegInt,
    Outcome,
    RawArray,
    Sample,
)
from streamgrp.core.wire import Record, WireEvent, as_tuples, check_free_form

#: The most rows a reward may name (a sample's rows; more is not a reward streamgrp wrote).
MAX_REWARD_ROWS = 4096

__all__ = ["EVENT_TYPES", "READABLE_SCHEMAS", "SCHEMA_VERSION", "CheckpointSaved", "DecidedMember", "GroupDecided",
           "GroupDiscarded", "GroupStats", "Member", "RawArray", "RunFinished", "RunStarted", "RunTerminated",
           "Sample", "SamplePayload", "SampleSummary", "SessionEnded", "SessionOpened", "Shard", "ShardGroup",
           "SlotResult", "SlotRewarded", "SlotSegment", "StepCommitted", "StepFailed", "StepManifest",
           "StepRowsTrained", "TaskIssued", "Tick", "TrainingResumed", "TurnRecorded", "VersionAdvanced",
           "WeightsServed"]


class RunStarted(WireEvent, frozen=True, kw_only=True, tag="run_started"):
    """The run's first event: its recorded configuration, which every later process must match."""

    run: str
    policy: GroupPolicy
    settings: dict[str, Any] = msgspec.field(default_factory=dict)
    started_at: wire.Float

    def __post_init__(self) -> None:
        check_free_form(self.settings, "settings")


class TaskIssued(WireEvent, frozen=True, kw_only=True, tag="task_issued"):
    """A prompt to sample ``n_samples`` times; ``issued_at`` is in the server's clock (seconds)."""

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
    """What the group log keeps of a sample: what folding, filtering and partitioning need.

    ``tokens`` are the valid loss tokens (the partition weight), ``reward`` the mean over rows, and
    ``digest`` the digest of the sample's payload entry (`streamgrp.core.codec.entry_digest`),
    computed once, by the publisher; replay and verify check the payload against it.
    """

    rows: wire.PosInt
    tokens: wire.NonNegInt
    version: wire.NonNegInt
    reward: wire.Float
    digest: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):  # the mean of finite rewards can still overflow
            raise ValueError(f"reward {self.reward!r} is not a finite number; rewards must be finite")

    @classmethod
    def of(cls, sample: Sample, digest: str) -> SampleSummary:
        return cls(rows=sample.rows, tokens=sample.valid_tokens, version=sample.version,
                   reward=sum(sample.rewards) / sample.rows, digest=digest)


class SlotResult(WireEvent, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="slot_result"):
    """What a worker published for one slot: a sample (its summary), a rejection, or a failure with its text."""

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
        """The fields as written (the header's keys and values but ``kind``)."""
        fields = msgspec.structs.asdict(self)
        if not self.reward_pending:
            del fields["reward_pending"]
        return fields


class SlotRewarded(WireEvent, frozen=True, kw_only=True, tag="slot_rewarded"):
    """The reward of a slot whose result was published with ``reward_pending``: one value per row of
    its sample, or one for all its rows (``rewards``), a rejection (``reason``: the scorer refused the
    sample; the slot becomes ``rejected``) or a failure (``error``: scoring raised for good; the slot
    becomes ``failed``).
    ``scorer`` names who scored it. Written to the group log after the result; the first reward of a
    slot wins, a second is counted as a duplicate, one for a slot that is not waiting (an unknown
    task, a decided group, a slot whose result carried its reward) as late."""

    task_id: Annotated[str, Meta(min_length=1, max_length=256)]
    slot: wire.NonNegInt
    rewards: Annotated[tuple[wire.Float, ...], Meta(min_length=1, max_length=MAX_REWARD_ROWS)] | None = None
    reason: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None
    error: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    scorer: Annotated[str, Meta(max_length=256)] = ""

    def __post_init__(self) -> None:
        given = [name for name in ("rewards", "reason", "error") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("a reward carries exactly one of rewards (one per row, finite: `Float`), a rejection "
                             f"reason or an error, got {given or 'none'}")
        as_tuples(self, "rewards")

    @property
    def outcome(self) -> Outcome:
        """What the reward makes of its slot: a sample, rejected or failed."""
        return "sample" if self.rewards is not None else "rejected" if self.reason is not None else "failed"


class SamplePayload(_Event):
    """A sample's tensors and per-row values, in the payloads stream at the entry id of its slot result.

    Written once, with its slot result, by the publish script; read by trainer ranks and replay only."""

    kind: Literal["sample_payload"] = "sample_payload"
    task_id: str = Field(min_length=1, max_length=256)
    slot: NonNegInt
    sample: Sample


class Tick(WireEvent, frozen=True, forbid_unknown_fields=True, kw_only=True, tag="tick"):
    """Time passing, in the server's clock; closes groups whose deadline is at or before ``now``."""

    now: wire.Float

    def __post_init__(self) -> None:
        if self.now.__class__ is int:  # a float field takes ints and holds floats, as on the wire
            msgspec.structs.force_setattr(self, "now", float(self.now))


class GroupDecided(_Event):
    """The one decision for a task; ``members`` are its usable slots in slot order.

    ``slot_outcomes`` maps each slot index (as a string) to sample / rejected / failed / timeout.
    """

    kind: Literal["group_decided"] = "group_decided"
    task_id: str
    decision: Literal["complete", "partial", "dropped"]
    reason: str | None = None
    members: tuple[DecidedMember, ...]
    slot_outcomes: dict[str, str]
    stats: GroupStats
    error: str | None = None
    closed_by: Literal["all_slots", "deadline"]
    issued_at: Float | None = None
    decided_at: Float | None = None

    @model_validator(mode="before")
    @classmethod
    def _members_from_columns(cls, data: Any) -> Any:
        return from_columns(data, DecidedMember)

    def wire_fields(self) -> dict[str, Any]:
        """The fields as schema 1 writes them: members as columns, right after ``reason``."""
        fields = self.__dict__
        wire: dict[str, Any] = {}
        for name, value in fields.items():
            if name != "members":
                wire[name] = value
            if name == "reason":
                wire.update(member_columns(fields["members"], DecidedMember))
        return wire

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(member.slot for member in self.members)

    @property
    def version(self) -> int | None:
        """The group's policy version: the oldest among its members (SPEC section 4)."""
        return min(member.version for member in self.members) if self.members else None

    @property
    def valid_tokens(self) -> int:
        return sum(member.tokens for member in self.members)


class RunTerminated(WireEvent, frozen=True, kw_only=True, tag="run_failed"):
    """The run failed for good (contract violation, stall bound): every trainer rank raises ``message``."""

    reason: str
    message: str
    task_id: str | None = None
    step: wire.Int | None = None


class ShardGroup(Frozen):
    """One group as a step uses it: where its members are and what their bytes hash to."""

    task_id: str
    decision_entry: str
    members: tuple[Member, ...]
    digest: str
    #: The run partition whose streams hold the decision and the members' entries (0 unpartitioned).
    partition: NonNegInt = 0

    @model_validator(mode="before")
    @classmethod
    def _members_from_columns(cls, data: Any) -> Any:
        return from_columns(data, Member)

    def wire_fields(self) -> dict[str, Any]:
        """The fields as schema 1 writes them: members as columns; the partition only when not 0, so an
        unpartitioned run's manifests are what they always were."""
        partition = {"partition": self.partition} if self.partition else {}
        return {"task_id": self.task_id, "decision_entry": self.decision_entry,
                **member_columns(self.members, Member), "digest": self.digest, **partition}

    @property
    def valid_tokens(self) -> int:
        return sum(member.tokens for member in self.members)

    @property
    def rows(self) -> int:
        return sum(member.rows for member in self.members)


class Shard(Frozen):
    """What one DP rank trains at a step: whole groups, and a digest over their members' bytes."""

    rank: Int
    groups: tuple[ShardGroup, ...]
    tokens: Int
    digest: str


class StepManifest(_Event):
    """One optimizer step: its number, the policy version it was batched at, one shard per rank."""

    kind: Literal["step"] = "step"
    step: NonNegInt
    version: Int
    shards: tuple[Shard, ...]
    imbalance: Float
    created_at: Float


class GroupDiscarded(WireEvent, frozen=True, kw_only=True, tag="group_discarded"):
    """A decided, trainable group the batcher did not train: ``stale``, ``filtered``, or ``leftover``
    (fewer than dp_size groups remained when the dataset ran out)."""

    task_id: str
    reason: Literal["stale", "filtered", "leftover"]
    #: The decision's entry id; in a partitioned run `streamgrp.core.manifest.decision_ref`'s ``ID@P``.
    decision_entry: str
    group_version: wire.Int | None = None
    current_version: wire.Int | None = None
    detail: str = ""


class StepCommitted(WireEvent, frozen=True, kw_only=True, tag="step_committed"):
    """A trainer rank finished a step, in ``attempt`` of its trainer group (0: written before attempts)."""

    step: wire.Int
    rank: wire.Int
    world_size: wire.Int
    attempt: wire.NonNegInt = 0


class StepFailed(WireEvent, frozen=True, kw_only=True, tag="step_failed"):
    """A trainer rank's step raised; ``error`` is the exception text."""

    step: wire.Int
    rank: wire.Int
    error: str


class StepRowsTrained(WireEvent, frozen=True, kw_only=True, tag="step_rows_trained"):
    """Part of a rank's next step is trained: ``rows`` (indices into its shard of ``step``) were in a completed
    optimizer step of ``attempt``, the rest not yet. Written by trainers whose optimizer steps do not line up
    with streamgrp's steps (`streamgrp.train.trl_async`), which commit a step only once all of its rows were
    trained; a restart hands the other rows. Each record lists every trained row of the step so far."""

    step: wire.NonNegInt
    rank: wire.NonNegInt
    attempt: wire.NonNegInt
    rows: tuple[wire.NonNegInt, ...]
    #: The rows of the rank's shard of the step.
    total: wire.NonNegInt

    def __post_init__(self) -> None:
        as_tuples(self, "rows")
        if list(self.rows) != sorted(set(self.rows)) or (self.rows and self.rows[-1] >= self.total):
            raise ValueError(f"rows must be distinct, ascending and below total={self.total}")


class VersionAdvanced(WireEvent, frozen=True, kw_only=True, tag="version"):
    """Every rank committed ``step``: the policy is now at ``version``. Versions only grow: ``step + 1``
    until a trainer group rolls back, and after that beyond every version the lost weights may have used."""

    version: wire.Int
    step: wire.Int


class TrainingResumed(WireEvent, frozen=True, kw_only=True, tag="training_resumed"):
    """A trainer group started attempt ``attempt`` at ``step``, every rank's position set to ``step - 1``.

    ``reason`` says where ``step`` came from: ``checkpoint`` (the weights hold every step before it, a
    ``CheckpointSaved`` or the trainer's own ``resume_after``), ``lowest_rank`` (the lowest rank's next
    step, without a checkpoint) or ``start`` (nothing committed yet). Steps ``step..retrain_through``
    had been committed by some rank before and are trained again (the restarted weights lost them).
    The steps of this attempt publish versions from ``base_version + 1`` on, above any version a lost
    attempt may have handed out."""

    attempt: wire.NonNegInt
    step: wire.NonNegInt
    world_size: wire.Int
    base_version: wire.NonNegInt
    reason: Literal["checkpoint", "lowest_rank", "start"]
    retrain_through: wire.Int = -1
    #: The rank whose start created the attempt.
    rank: wire.NonNegInt = 0


class CheckpointSaved(WireEvent, frozen=True, kw_only=True, tag="checkpoint_saved"):
    """A trainer group's checkpoint of the weights after ``step`` (and the optimizer's state) is durable
    at ``path``: written by ``ranks`` (each rank that wrote a part), recorded only once every part is
    on disk, so a checkpoint killed mid-write is never recorded. ``version`` is the policy version
    those weights were published as; ``files`` maps each file (relative to ``path``) to its size in
    bytes, checked before loading."""

    step: wire.NonNegInt
    version: wire.NonNegInt
    path: str
    ranks: tuple[wire.NonNegInt, ...]
    world_size: wire.Int
    attempt: wire.NonNegInt = 0
    files: dict[str, wire.NonNegInt] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        as_tuples(self, "ranks")


class RunFinished(WireEvent, frozen=True, kw_only=True, tag="run_finished"):
    """The dataset is exhausted and every accepted group was batched: ``steps`` is the last step + 1."""

    steps: wire.Int


class WeightsServed(WireEvent, frozen=True, kw_only=True, tag="weights_served"):
    """An inference server was told to serve policy ``version`` (written by `streamgrp weight-sync` to the
    control stream): ``ok`` says whether it answered that it does, ``detail`` what it said or why not."""

    server: str
    version: wire.NonNegInt
    dialect: str
    ok: bool
    detail: str = ""
    seconds: wire.Float = 0.0
    at: wire.Float = 0.0


_EVENT_MODELS = (RunStarted, TaskIssued, SlotResult, SlotRewarded, SamplePayload, Tick, GroupDecided, RunTerminated,
                 StepManifest, GroupDiscarded, StepCommitted, StepFailed, StepRowsTrained, VersionAdvanced, RunFinished, WeightsServed,
                 TrainingResumed, CheckpointSaved, SessionOpened, TurnRecorded, SessionEnded, SlotSegment)


def _kind_of(model: Any) -> str:
    return model.__struct_config__.tag if issubclass(model, WireEvent) else model.model_fields["kind"].default


EVENT_TYPES: dict[str, type[Any]] = {_kind_of(model): model for model in _EVENT_MODELS}

"""Event models: every fact streamgrp records is one of these frozen pydantic models.

Owns the schema (which events exist, their fields, invariants between fields, the schema version)
and nothing about bytes: `streamgrp.core.codec` is the only code that turns events into stream
entries and back. Field value types live in `streamgrp.core.values`, group members and statistics
in `streamgrp.core.members`. Pure: no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictBool, field_validator, model_validator

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
    FreeForm,
    Frozen,
    Int,
    NonNegInt,
    Outcome,
    RawArray,
    Sample,
    check_strict_numbers,
)

#: The most rows a reward may name (a sample's rows; more is not a reward streamgrp wrote).
MAX_REWARD_ROWS = 4096

__all__ = ["EVENT_TYPES", "READABLE_SCHEMAS", "SCHEMA_VERSION", "CheckpointSaved", "DecidedMember", "GroupDecided",
           "GroupDiscarded", "GroupStats", "Member", "RawArray", "RunFinished", "RunStarted", "RunTerminated",
           "Sample", "SamplePayload", "SampleSummary", "SessionEnded", "SessionOpened", "Shard", "ShardGroup",
           "SlotResult", "SlotRewarded", "SlotSegment", "StepCommitted", "StepFailed", "StepManifest",
           "StepRowsTrained", "TaskIssued", "Tick", "TrainingResumed", "TurnRecorded", "VersionAdvanced",
           "WeightsServed"]


class RunStarted(_Event):
    """The run's first event: its recorded configuration, which every later process must match."""

    kind: Literal["run_started"] = "run_started"
    run: str
    policy: GroupPolicy
    settings: FreeForm = Field(default_factory=dict)
    started_at: Float

    @field_validator("policy", mode="before")
    @classmethod
    def _strict_policy_numbers(cls, value: Any) -> Any:
        # GroupPolicy's own fields are lax (``true`` would pass as n_samples=1); a recorded
        # policy is read as strictly as every other event field.
        if isinstance(value, dict):
            check_strict_numbers(GroupPolicy, value, "")
        return value


class TaskIssued(_Event):
    """A prompt to sample ``n_samples`` times; ``issued_at`` is in the server's clock (seconds)."""

    kind: Literal["task_issued"] = "task_issued"
    task_id: str = Field(min_length=1, max_length=256)
    prompt: FreeForm = Field(default_factory=dict)
    version: NonNegInt = 0
    issued_at: Float


def check_outcome(outcome: str, sample: object, error: str | None) -> None:
    """The rule of every slot result, whatever its schema: a sample exactly when the outcome says so,
    and a failure's text."""
    if (outcome == "sample") != (sample is not None):
        raise ValueError(f"outcome {outcome!r} {'needs' if outcome == 'sample' else 'forbids'} a sample")
    if outcome == "failed" and not error:
        raise ValueError("a failed slot carries its error text")


class SampleSummary(Frozen):
    """What the group log keeps of a sample: what folding, filtering and partitioning need.

    ``tokens`` are the valid loss tokens (the partition weight), ``reward`` the mean over rows, and
    ``digest`` the digest of the sample's payload entry (`streamgrp.core.codec.entry_digest`),
    computed once, by the publisher; replay and verify check the payload against it.
    """

    rows: Annotated[Int, Field(ge=1)]
    tokens: NonNegInt
    version: NonNegInt
    reward: Float
    digest: str = Field(min_length=1, max_length=128)

    @classmethod
    def of(cls, sample: Sample, digest: str) -> SampleSummary:
        return cls(rows=sample.rows, tokens=sample.valid_tokens, version=sample.version,
                   reward=sum(sample.rewards) / sample.rows, digest=digest)


class SlotResult(_Event):
    """What a worker published for one slot: a sample (its summary), a rejection, or a failure with its text."""

    kind: Literal["slot_result"] = "slot_result"
    task_id: str = Field(min_length=1, max_length=256)
    slot: NonNegInt
    outcome: Outcome
    sample: SampleSummary | None = None
    error: str | None = None
    #: The sample's rewards come later, in a `SlotRewarded` event: until it arrives the slot is not
    #: usable, and the sample's own rewards (and the summary's) are placeholders it replaces.
    reward_pending: StrictBool = False

    @model_validator(mode="after")
    def _check_outcome(self) -> SlotResult:
        check_outcome(self.outcome, self.sample, self.error)
        if self.reward_pending and self.outcome != "sample":
            raise ValueError(f"only a sample can wait for its reward, not a {self.outcome!r} slot")
        return self

    def wire_fields(self) -> dict[str, Any]:
        """The fields as written: ``reward_pending`` only when set, so a result with its reward is
        written as it always was."""
        if self.reward_pending:
            return self.__dict__
        return {name: value for name, value in self.__dict__.items() if name != "reward_pending"}


class SlotRewarded(_Event):
    """The reward of a slot whose result was published with ``reward_pending``: one value per row of
    its sample, or one for all its rows (``rewards``), a rejection (``reason``: the scorer refused the
    sample; the slot becomes ``rejected``) or a failure (``error``: scoring raised for good; the slot
    becomes ``failed``).
    ``scorer`` names who scored it. Written to the group log after the result; the first reward of a
    slot wins, a second is counted as a duplicate, one for a slot that is not waiting (an unknown
    task, a decided group, a slot whose result carried its reward) as late."""

    kind: Literal["slot_rewarded"] = "slot_rewarded"
    task_id: str = Field(min_length=1, max_length=256)
    slot: NonNegInt
    rewards: tuple[Float, ...] | None = Field(default=None, min_length=1, max_length=MAX_REWARD_ROWS)
    reason: str | None = Field(default=None, min_length=1, max_length=1024)
    error: str | None = Field(default=None, min_length=1, max_length=4096)
    scorer: str = Field(default="", max_length=256)

    @model_validator(mode="after")
    def _check_reward(self) -> SlotRewarded:
        given = [name for name in ("rewards", "reason", "error") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("a reward carries exactly one of rewards (one per row, finite: `Float`), a rejection "
                             f"reason or an error, got {given or 'none'}")
        return self

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


class Tick(_Event):
    """Time passing, in the server's clock; closes groups whose deadline is at or before ``now``."""

    kind: Literal["tick"] = "tick"
    now: Float


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


class RunTerminated(_Event):
    """The run failed for good (contract violation, stall bound): every trainer rank raises ``message``."""

    kind: Literal["run_failed"] = "run_failed"
    reason: str
    message: str
    task_id: str | None = None
    step: Int | None = None


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


class GroupDiscarded(_Event):
    """A decided, trainable group the batcher did not train: ``stale``, ``filtered``, or ``leftover``
    (fewer than dp_size groups remained when the dataset ran out)."""

    kind: Literal["group_discarded"] = "group_discarded"
    task_id: str
    reason: Literal["stale", "filtered", "leftover"]
    #: The decision's entry id; in a partitioned run `streamgrp.core.manifest.decision_ref`'s ``ID@P``.
    decision_entry: str
    group_version: Int | None = None
    current_version: Int | None = None
    detail: str = ""


class StepCommitted(_Event):
    """A trainer rank finished a step, in ``attempt`` of its trainer group (0: written before attempts)."""

    kind: Literal["step_committed"] = "step_committed"
    step: Int
    rank: Int
    world_size: Int
    attempt: NonNegInt = 0


class StepFailed(_Event):
    """A trainer rank's step raised; ``error`` is the exception text."""

    kind: Literal["step_failed"] = "step_failed"
    step: Int
    rank: Int
    error: str


class StepRowsTrained(_Event):
    """Part of a rank's next step is trained: ``rows`` (indices into its shard of ``step``) were in a completed
    optimizer step of ``attempt``, the rest not yet. Written by trainers whose optimizer steps do not line up
    with streamgrp's steps (`streamgrp.train.trl_async`), which commit a step only once all of its rows were
    trained; a restart hands the other rows. Each record lists every trained row of the step so far."""

    kind: Literal["step_rows_trained"] = "step_rows_trained"
    step: NonNegInt
    rank: NonNegInt
    attempt: NonNegInt
    rows: tuple[NonNegInt, ...]
    #: The rows of the rank's shard of the step.
    total: NonNegInt

    @model_validator(mode="after")
    def _rows_in_shard(self) -> StepRowsTrained:
        if list(self.rows) != sorted(set(self.rows)) or (self.rows and self.rows[-1] >= self.total):
            raise ValueError(f"rows must be distinct, ascending and below total={self.total}")
        return self


class VersionAdvanced(_Event):
    """Every rank committed ``step``: the policy is now at ``version``. Versions only grow: ``step + 1``
    until a trainer group rolls back, and after that beyond every version the lost weights may have used."""

    kind: Literal["version"] = "version"
    version: Int
    step: Int


class TrainingResumed(_Event):
    """A trainer group started attempt ``attempt`` at ``step``, every rank's position set to ``step - 1``.

    ``reason`` says where ``step`` came from: ``checkpoint`` (the weights hold every step before it, a
    ``CheckpointSaved`` or the trainer's own ``resume_after``), ``lowest_rank`` (the lowest rank's next
    step, without a checkpoint) or ``start`` (nothing committed yet). Steps ``step..retrain_through``
    had been committed by some rank before and are trained again (the restarted weights lost them).
    The steps of this attempt publish versions from ``base_version + 1`` on, above any version a lost
    attempt may have handed out."""

    kind: Literal["training_resumed"] = "training_resumed"
    attempt: NonNegInt
    step: NonNegInt
    world_size: Int
    base_version: NonNegInt
    reason: Literal["checkpoint", "lowest_rank", "start"]
    retrain_through: Int = -1
    #: The rank whose start created the attempt.
    rank: NonNegInt = 0


class CheckpointSaved(_Event):
    """A trainer group's checkpoint of the weights after ``step`` (and the optimizer's state) is durable
    at ``path``: written by ``ranks`` (each rank that wrote a part), recorded only once every part is
    on disk, so a checkpoint killed mid-write is never recorded. ``version`` is the policy version
    those weights were published as; ``files`` maps each file (relative to ``path``) to its size in
    bytes, checked before loading."""

    kind: Literal["checkpoint_saved"] = "checkpoint_saved"
    step: NonNegInt
    version: NonNegInt
    path: str
    ranks: tuple[NonNegInt, ...]
    world_size: Int
    attempt: NonNegInt = 0
    files: dict[str, NonNegInt] = Field(default_factory=dict)


class RunFinished(_Event):
    """The dataset is exhausted and every accepted group was batched: ``steps`` is the last step + 1."""

    kind: Literal["run_finished"] = "run_finished"
    steps: Int


class WeightsServed(_Event):
    """An inference server was told to serve policy ``version`` (written by `streamgrp weight-sync` to the
    control stream): ``ok`` says whether it answered that it does, ``detail`` what it said or why not."""

    kind: Literal["weights_served"] = "weights_served"
    server: str
    version: NonNegInt
    dialect: str
    ok: StrictBool
    detail: str = ""
    seconds: Float = 0.0
    at: Float = 0.0


_EVENT_MODELS = (RunStarted, TaskIssued, SlotResult, SlotRewarded, SamplePayload, Tick, GroupDecided, RunTerminated,
                 StepManifest, GroupDiscarded, StepCommitted, StepFailed, StepRowsTrained, VersionAdvanced, RunFinished, WeightsServed,
                 TrainingResumed, CheckpointSaved, SessionOpened, TurnRecorded, SessionEnded, SlotSegment)
EVENT_TYPES: dict[str, type[BaseModel]] = {model.model_fields["kind"].default: model for model in _EVENT_MODELS}

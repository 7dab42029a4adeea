"""Event models: every fact streamgrp records is one of these frozen pydantic models.

Owns the schema (fields, invariants between fields, the schema version) and nothing about bytes:
`streamgrp.core.codec` is the only code that turns events into stream entries and back. Tensors are
`RawArray` values: a dtype, a shape and little-endian bytes, so neither this module nor the fold
needs torch. Pure: no I/O.

Numbers are strict, because a decoded header must mean exactly what its producer wrote: every
integer field is `Int` (a JSON integer within the signed 64-bit range; ``true`` is not 1, ``2.0``
is not 2, ``"2"`` is not 2) and every float field is `Float` (a finite JSON number: integers are
accepted and become floats, as before; booleans and strings are not); flags are strict booleans.
Free-form dicts (``prompt``, ``meta``, ``settings``) nest at most `FREE_FORM_DEPTH` levels, so
every event an encoder can write stays inside the codec's header depth bound.

A group's members are typed records (`Member`, `DecidedMember`) in Python and columns on the wire
(``members`` for slot indices, ``member_entries``, ``member_rows``, ...): one list per field is
what schema 1 records and the most compact form. `member_columns` and the models' ``_from_columns``
validators are the only code that converts, so nothing else aligns lists by position.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, PydanticUndefined

from streamgrp.core.policy import GroupPolicy

SCHEMA_VERSION = 1

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: An integer field: an int (not a bool, not a float, not a string) within the signed 64-bit range.
Int = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
#: A count, index, step or version: a non-negative `Int`.
NonNegInt = Annotated[Int, Field(ge=0)]
#: A float field: a finite int or float (not a bool, not a string); ints become floats.
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
#: How deep a free-form dict may nest, the dict itself being level 1. The deepest free-form field
#: (``SlotResult.sample.meta``) sits at level 3 of a header, so headers stay within 3 + 24 - 1 = 26
#: levels, inside the codec's bound of 32.
FREE_FORM_DEPTH = 24


def _check_free_form_depth(value: dict[str, Any]) -> dict[str, Any]:
    if not value:
        return value  # the common case (an empty meta) costs nothing
    # An explicit stack, not recursion: a hostile value must not reach Python's recursion limit.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > FREE_FORM_DEPTH:
            raise ValueError(f"nested deeper than {FREE_FORM_DEPTH} levels; flatten it")
        for child in (item.values() if isinstance(item, dict) else item):
            if isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1))
    return value


#: A free-form JSON object (prompt, meta, settings), at most `FREE_FORM_DEPTH` levels deep.
FreeForm = Annotated[dict[str, Any], AfterValidator(_check_free_form_depth)]

#: The one dtype table. name (also torch's attribute name) -> (item size in bytes, `array` typecode
#: for building from Python values or None, safetensors code). `streamgrp.train.dtypes` derives the
#: torch dtypes from it.
DTYPES: dict[str, tuple[int, str | None, str]] = {
    "bool": (1, "B", "BOOL"),
    "uint8": (1, "B", "U8"),
    "int32": (4, "i", "I32"),
    "int64": (8, "q", "I64"),
    "float16": (2, None, "F16"),
    "bfloat16": (2, None, "BF16"),
    "float32": (4, "f", "F32"),
    "float64": (8, "d", "F64"),
}

Outcome = Literal["sample", "rejected", "failed"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RawArray(_Frozen):
    """A tensor as raw little-endian bytes with its dtype and shape."""

    dtype: str
    shape: tuple[NonNegInt, ...]
    data: Annotated[bytes, Strict()]  # bytes only: a tensor never comes from header text

    @model_validator(mode="after")
    def _check_size(self) -> RawArray:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        expected = math.prod(self.shape) * DTYPES[self.dtype][0]
        if len(self.data) != expected:
            raise ValueError(
                f"{self.dtype} array of shape {list(self.shape)} needs {expected} bytes, got {len(self.data)}"
            )
        return self

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_values(cls, values: Sequence[int | float | bool], dtype: str) -> RawArray:
        """Build a 1-D array from Python numbers (no torch needed)."""
        typecode = DTYPES.get(dtype, (0, None))[1]
        if typecode is None:
            raise ValueError(f"cannot build {dtype!r} from Python values; pass bytes with RawArray(...)")
        packed = array(typecode, values)
        if sys.byteorder != "little":
            packed.byteswap()
        return cls(dtype=dtype, shape=(len(packed),), data=packed.tobytes())

    def to_list(self) -> list[Any]:
        typecode = DTYPES[self.dtype][1]
        if typecode is None:
            raise ValueError(f"{self.dtype} arrays are read with torch, not as Python lists")
        unpacked = array(typecode)
        unpacked.frombytes(self.data)
        if sys.byteorder != "little":
            unpacked.byteswap()
        return unpacked.tolist()


class Sample(_Frozen):
    """One slot's trajectory: one or more rows, stored flat with the length of each row.

    ``token_ids``, ``loss_mask`` and ``logprobs`` are 1-D and span all rows back to back;
    ``rewards`` has one value per row; ``version`` is the policy version that generated it.
    """

    token_ids: RawArray
    loss_mask: RawArray
    logprobs: RawArray
    row_lengths: tuple[Int, ...]
    rewards: tuple[Float, ...]
    version: NonNegInt
    meta: FreeForm = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_rows(self) -> Sample:
        if not self.row_lengths:
            raise ValueError("a sample needs at least one row")
        if any(length < 1 for length in self.row_lengths):
            raise ValueError(f"every row needs at least one token, got row_lengths {list(self.row_lengths)}")
        if len(self.rewards) != len(self.row_lengths):
            raise ValueError(f"{len(self.row_lengths)} rows but {len(self.rewards)} rewards; give one reward per row")
        if not all(math.isfinite(reward) for reward in self.rewards):
            raise ValueError(f"rewards must be finite, got {list(self.rewards)}")
        total = sum(self.row_lengths)
        for name, allowed in (("token_ids", ("int32", "int64")), ("loss_mask", ("bool", "uint8")),
                              ("logprobs", ("float32", "float16", "bfloat16", "float64"))):
            tensor: RawArray = getattr(self, name)
            if tensor.dtype not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {tensor.dtype}")
            if tensor.shape != (total,):
                raise ValueError(f"{name} has shape {list(tensor.shape)}, expected [{total}] (sum of row_lengths)")
        return self

    @property
    def rows(self) -> int:
        return len(self.row_lengths)

    @property
    def valid_tokens(self) -> int:
        """Tokens whose loss mask is set: the group's weight in partitioning and in the loss."""
        return len(self.loss_mask.data) - self.loss_mask.data.count(0)

    @classmethod
    def from_rows(
        cls,
        *,
        token_ids: Sequence[Sequence[int]],
        loss_mask: Sequence[Sequence[int | bool]],
        logprobs: Sequence[Sequence[float]],
        rewards: Sequence[float],
        version: int,
        meta: dict[str, Any] | None = None,
    ) -> Sample:
        """Build a sample from per-row Python lists (int32 tokens, uint8 mask, float32 logprobs)."""
        lengths = tuple(len(row) for row in token_ids)
        for name, rows in (("loss_mask", loss_mask), ("logprobs", logprobs)):
            if tuple(len(row) for row in rows) != lengths:
                raise ValueError(f"{name} rows have lengths {[len(r) for r in rows]}, token_ids {list(lengths)}")
        return cls(
            token_ids=RawArray.from_values([t for row in token_ids for t in row], "int32"),
            loss_mask=RawArray.from_values([1 if m else 0 for row in loss_mask for m in row], "uint8"),
            logprobs=RawArray.from_values([p for row in logprobs for p in row], "float32"),
            row_lengths=lengths,
            rewards=tuple(float(r) for r in rewards),
            version=version,
            meta=meta or {},
        )


class _Event(_Frozen):
    """Fields every event carries: schema version, and the producer's identity and sequence number."""

    schema_version: Int = SCHEMA_VERSION
    producer: str = ""
    seq: NonNegInt = 0


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
            _check_strict_numbers(GroupPolicy, value, "")
        return value


class TaskIssued(_Event):
    """A prompt to sample ``n_samples`` times; ``issued_at`` is in the server's clock (seconds)."""

    kind: Literal["task_issued"] = "task_issued"
    task_id: str = Field(min_length=1, max_length=256)
    prompt: FreeForm = Field(default_factory=dict)
    version: NonNegInt = 0
    issued_at: Float


class SlotResult(_Event):
    """What a worker published for one slot: a sample, a rejection, or a failure with its text."""

    kind: Literal["slot_result"] = "slot_result"
    task_id: str = Field(min_length=1, max_length=256)
    slot: NonNegInt
    outcome: Outcome
    sample: Sample | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _check_outcome(self) -> SlotResult:
        if (self.outcome == "sample") != (self.sample is not None):
            raise ValueError(f"outcome {self.outcome!r} {'needs' if self.outcome == 'sample' else 'forbids'} a sample")
        if self.outcome == "failed" and not self.error:
            raise ValueError("a failed slot carries its error text")
        return self


class Tick(_Event):
    """Time passing, in the server's clock; closes groups whose deadline is at or before ``now``."""

    kind: Literal["tick"] = "tick"
    now: Float


class Member(_Frozen):
    """One usable slot of a group as a step trains it: where its entry is and what it weighs.

    ``entry`` is the slot stream entry id replay reads; ``rows`` the sample's rows; ``tokens`` its
    valid loss tokens (the partition weight); ``version`` the policy version that generated it.
    """

    slot: NonNegInt
    entry: str
    rows: Int
    tokens: Int
    version: Int


class DecidedMember(Member):
    """A member as the decision records it: also the ``digest`` of its entry's bytes
    (`streamgrp.core.codec.entry_digest`, empty when not recorded) and its mean ``reward`` over its
    rows (what group filters look at; None when not recorded)."""

    digest: str = ""
    reward: Float | None = None

    def placed(self) -> Member:
        """The member as a step's shard records it (without digest and reward)."""
        # Every field was validated when this record was; constructing again would only repeat it.
        return Member.model_construct(slot=self.slot, entry=self.entry, rows=self.rows, tokens=self.tokens,
                                      version=self.version)


#: Wire column -> member field, in the order the columns are written.
_COLUMNS = {"members": "slot", "member_entries": "entry", "member_digests": "digest", "member_rows": "rows",
            "member_tokens": "tokens", "member_versions": "version", "member_rewards": "reward"}


def _from_columns(data: Any, record: type[Member]) -> Any:
    """Turn a header's member columns into records, checking that every column has one item per member.

    Data already given as records (a model built in Python) passes through unchanged."""
    if not isinstance(data, dict) or "member_entries" not in data:
        return data
    fields = {name: field for name, field in _COLUMNS.items() if field in record.model_fields}
    data = dict(data)
    columns = {}
    for name in fields:
        column = data.pop(name, ())
        if not isinstance(column, (list, tuple)):
            raise ValueError(f"{name} is a {type(column).__name__}, not a list")
        columns[name] = column
    count = len(columns["members"])
    for name, column in columns.items():
        optional = record.model_fields[fields[name]].default is not PydanticUndefined
        if len(column) != count and not (optional and not column):
            raise ValueError(f"{name} has {len(column)} items for {count} members; give one per member")
    present = {name: column for name, column in columns.items() if column}
    data["members"] = [{fields[name]: column[i] for name, column in present.items()} for i in range(count)]
    return data


def member_columns(members: Sequence[Member], record: type[Member]) -> dict[str, list[Any]]:
    """The wire columns of ``members`` (the inverse of ``_from_columns``); an optional field that no
    member recorded is written as an empty column, as schema 1 allows."""
    columns: dict[str, list[Any]] = {}
    for name, field in _COLUMNS.items():
        info = record.model_fields.get(field)
        if info is None:
            continue
        values = [getattr(member, field) for member in members]
        if info.default is not PydanticUndefined and all(value == info.default for value in values):
            values = []
        columns[name] = values
    return columns


class GroupStats(_Frozen):
    """The per-group statistics SPEC section 3 names, all derived from three slot counts (`of`)."""

    target_slot_count: NonNegInt
    usable_slot_count: NonNegInt
    trainable_slot_count: NonNegInt
    fully_masked_group: StrictBool
    singleton_slot_group: StrictBool
    pre_filter_usable_slot_yield: Float
    pre_filter_trainable_slot_yield: Float

    @classmethod
    def of(cls, target: int, usable: int, trainable: int) -> GroupStats:
        return cls(target_slot_count=target, usable_slot_count=usable, trainable_slot_count=trainable,
                   fully_masked_group=usable == 0, singleton_slot_group=usable == 1,
                   pre_filter_usable_slot_yield=usable / target if target else 0.0,
                   pre_filter_trainable_slot_yield=trainable / target if target else 0.0)


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
        return _from_columns(data, DecidedMember)

    def wire_fields(self) -> dict[str, Any]:
        """The fields as schema 1 writes them: members as columns."""
        fields = dict(self.__dict__)
        members = fields.pop("members")
        at = list(fields).index("reason") + 1
        items = list(fields.items())
        return dict(items[:at] + list(member_columns(members, DecidedMember).items()) + items[at:])

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


def _check_strict_numbers(model: type[BaseModel], data: dict[Any, Any], where: str) -> None:
    """Reject what lax validation would coerce in ``model``'s scalar fields: bools as numbers,
    numbers as bools, floats and strings as ints. Nested models given as dicts are checked too."""
    for name, value in data.items():
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            continue  # an unknown name: the model's own validation reports it
        args = _annotation_args(field.annotation)
        nested = [arg for arg in args if isinstance(arg, type) and issubclass(arg, BaseModel)]
        if nested and isinstance(value, dict):
            _check_strict_numbers(nested[0], value, f"{where}{name}.")
            continue
        if not args <= {int, float, bool, type(None)} or not args & {int, float, bool}:
            continue  # not a numeric scalar field
        kind = type(value)
        if kind is bool:
            ok = bool in args
        elif kind is int:
            ok = int in args or float in args
        elif kind is float:
            ok = float in args
        else:
            ok = value is None and type(None) in args
        if not ok:
            expected = " or ".join(sorted(arg.__name__ for arg in args if arg is not type(None)))
            raise PydanticCustomError("strict_type", "{where} must be {expected}, not {got}",
                                      {"where": f"{where}{name}", "expected": expected, "got": kind.__name__})


def _annotation_args(annotation: Any) -> set[Any]:
    if get_origin(annotation) in (Union, UnionType):
        return {arg for part in get_args(annotation) for arg in _annotation_args(part)}
    return {annotation}


class ShardGroup(_Frozen):
    """One group as a step uses it: where its members are and what their bytes hash to."""

    task_id: str
    decision_entry: str
    members: tuple[Member, ...]
    digest: str

    @model_validator(mode="before")
    @classmethod
    def _members_from_columns(cls, data: Any) -> Any:
        return _from_columns(data, Member)

    def wire_fields(self) -> dict[str, Any]:
        """The fields as schema 1 writes them: members as columns."""
        return {"task_id": self.task_id, "decision_entry": self.decision_entry,
                **member_columns(self.members, Member), "digest": self.digest}

    @property
    def valid_tokens(self) -> int:
        return sum(member.tokens for member in self.members)

    @property
    def rows(self) -> int:
        return sum(member.rows for member in self.members)


class Shard(_Frozen):
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
    decision_entry: str
    group_version: Int | None = None
    current_version: Int | None = None
    detail: str = ""


class StepCommitted(_Event):
    """A trainer rank finished a step."""

    kind: Literal["step_committed"] = "step_committed"
    step: Int
    rank: Int
    world_size: Int


class StepFailed(_Event):
    """A trainer rank's step raised; ``error`` is the exception text."""

    kind: Literal["step_failed"] = "step_failed"
    step: Int
    rank: Int
    error: str


class VersionAdvanced(_Event):
    """Every rank committed ``step``: the policy is now at ``version`` (= steps fully committed)."""

    kind: Literal["version"] = "version"
    version: Int
    step: Int


class RunFinished(_Event):
    """The dataset is exhausted and every accepted group was batched: ``steps`` is the last step + 1."""

    kind: Literal["run_finished"] = "run_finished"
    steps: Int


_EVENT_MODELS = (RunStarted, TaskIssued, SlotResult, Tick, GroupDecided, RunTerminated, StepManifest, GroupDiscarded,
                 StepCommitted, StepFailed, VersionAdvanced, RunFinished)
EVENT_TYPES: dict[str, type[BaseModel]] = {model.model_fields["kind"].default: model for model in _EVENT_MODELS}

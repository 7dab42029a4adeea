"""The value types every event is built from: strict numbers, bounded free-form dicts, tensors.

Numbers are strict, because a decoded header must mean exactly what its producer wrote: every
integer field is `Int` (a JSON integer within the signed 64-bit range; ``true`` is not 1, ``2.0``
is not 2, ``"2"`` is not 2) and every float field is `Float` (a finite JSON number: integers are
accepted and become floats; booleans and strings are not); flags are strict booleans.
Free-form dicts (``prompt``, ``meta``, ``settings``) nest at most `FREE_FORM_DEPTH` levels, so
every event an encoder can write stays inside the codec's header depth bound. Tensors are
`RawArray` values: a dtype from `DTYPES` (the one dtype table), a shape and little-endian bytes,
so neither the events nor the folds need torch. Pure: no I/O.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from streamgrp.core import wire
from streamgrp.core.value_checks import (
    LOGPROB_TOLERANCE,
    logprob_problem,
    loss_mask_problem,
    reward_problem,
    token_id_problem,
)
from streamgrp.core.wire import (  # noqa: F401 - the value types' names, importable from here as before
    FREE_FORM_DEPTH,
    INT64_MAX,
    INT64_MIN,
    Float,
    Int,
    NonNegInt,
    Record,
    as_tuples,
    check_free_form,
    check_free_form_depth,
)

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


class RawArray(Record, frozen=True, kw_only=True):
    """A tensor as raw little-endian bytes with its dtype and shape (on the wire: a descriptor in the header
    and the bytes beside it, `streamgrp.core.tensor_header`)."""

    dtype: str
    shape: tuple[wire.NonNegInt, ...]
    data: bytes

    def __post_init__(self) -> None:
        as_tuples(self, "shape")
        if self.data.__class__ is not bytes:  # bytes only: a tensor never comes from header text
            raise ValueError(f"a tensor's data is bytes, not {type(self.data).__name__}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        expected = math.prod(self.shape) * DTYPES[self.dtype][0]
        if len(self.data) != expected:
            raise ValueError(
                f"{self.dtype} array of shape {list(self.shape)} needs {expected} bytes, got {len(self.data)}"
            )

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


#: A sample's tensors, in the order `layout_problem` takes them, with the dtypes each may have.
SAMPLE_TENSORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("token_ids", ("int32", "int64")),
    ("loss_mask", ("bool", "uint8")),
    ("logprobs", ("float32", "float16", "bfloat16", "float64")),
)


class Shaped(Protocol):
    """A tensor's dtype and shape: a `RawArray`, or a header's descriptor of one (`streamgrp.core.tensor_header`)."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def layout_problem(
    row_lengths: Sequence[int], rewards: Sequence[float], token_ids: Shaped, loss_mask: Shaped, logprobs: Shaped
) -> str | None:
    """None when a sample's rows, rewards and tensors fit together, else what does not: at least one row, each of
    at least one token, one reward per row, and each tensor of an allowed dtype (`SAMPLE_TENSORS`) and 1-D over
    all rows. The rules `Sample` is built by, and those of a payload read without rebuilding it (the
    assembler's check, `streamgrp.core.payload_check`, and the loader): one definition for all. It runs for
    every sample in every one of them, so it is written as plain loops."""
    if not row_lengths:
        return "a sample needs at least one row"
    total = 0
    for length in row_lengths:
        if length < 1:
            return f"every row needs at least one token, got row_lengths {list(row_lengths)}"
        total += length
    if len(rewards) != len(row_lengths):
        return f"{len(row_lengths)} rows but {len(rewards)} rewards; give one reward per row"
    expected = (total,)
    for (name, allowed), tensor in zip(SAMPLE_TENSORS, (token_ids, loss_mask, logprobs)):
        if tensor.dtype not in allowed:
            return f"{name} must be one of {list(allowed)}, got {tensor.dtype}"
        if tensor.shape != expected:
            return f"{name} has shape {list(tensor.shape)}, expected [{total}] (sum of row_lengths)"
    return None


def values_problem(
    token_ids: tuple[str, bytes],
    loss_mask: tuple[str, bytes],
    logprobs: tuple[str, bytes],
    rewards: Sequence[float],
    vocab_size: int | None = None,
    tolerance: float = LOGPROB_TOLERANCE,
) -> str | None:
    """None when every value of a sample (each tensor as ``(dtype, little-endian bytes)``) can train, else the
    first problem (`streamgrp.core.value_checks`, in this order)."""
    return (
        logprob_problem(logprobs[0], logprobs[1], tolerance)
        or token_id_problem(token_ids[0], token_ids[1], vocab_size)
        or loss_mask_problem(loss_mask[0], loss_mask[1])
        or reward_problem(rewards)
    )


class Sample(Record, frozen=True, kw_only=True):
    """One slot's trajectory: one or more rows, stored flat with the length of each row.

    ``token_ids``, ``loss_mask`` and ``logprobs`` are 1-D and span all rows back to back;
    ``rewards`` has one value per row; ``version`` is the policy version that generated it. Its values
    must be able to train (`value_problem`): finite logprobs at most `LOGPROB_TOLERANCE`, token ids at
    least 0, a 0/1 loss mask with a 1 somewhere, finite rewards; building one that cannot raises.
    """

    token_ids: RawArray
    loss_mask: RawArray
    logprobs: RawArray
    row_lengths: tuple[wire.Int, ...]
    rewards: tuple[wire.Float, ...]
    version: wire.NonNegInt
    meta: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        as_tuples(self, "row_lengths", "rewards")
        check_free_form(self.meta, "meta")
        problem = layout_problem(self.row_lengths, self.rewards, self.token_ids, self.loss_mask, self.logprobs)
        problem = problem or self.value_problem()
        if problem is not None:
            raise ValueError(problem)

    def value_problem(self, vocab_size: int | None = None, tolerance: float = LOGPROB_TOLERANCE) -> str | None:
        """None when every value can train (`streamgrp.core.value_checks`), else what is wrong: building a
        sample checks this without a vocabulary; a worker checks it again, with the run's ``vocab_size``."""
        return values_problem(
            (self.token_ids.dtype, self.token_ids.data),
            (self.loss_mask.dtype, self.loss_mask.data),
            (self.logprobs.dtype, self.logprobs.data),
            self.rewards,
            vocab_size,
            tolerance,
        )

    @property
    def rows(self) -> int:
        return len(self.row_lengths)

    @property
    def valid_tokens(self) -> int:
        """Tokens whose loss mask is set: the group's weight in the rank split and in the loss."""
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


@dataclass(frozen=True, slots=True)
class RewardLater:
    """What a rollout returns for a sample whose reward comes later (`streamgrp.core.events.SlotRewarded`,
    from ``streamgrp rewarder`` or `streamgrp.store.rewards.post_reward`): the slot waits for it until
    its group's deadline. The sample's own rewards are placeholders (zeros are fine); the reward's
    values replace them in decisions, steps and replay."""

    sample: Sample

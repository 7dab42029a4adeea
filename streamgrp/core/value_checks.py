"""Whether a sample's values can train: checks over the raw little-endian bytes of its tensors.

Owns the rules for values (SPEC section 5: values that cannot train are refused where they enter):

    logprobs    finite, and not above 0 by more than `LOGPROB_TOLERANCE` (a log-probability is at
                most 0; the tolerance lets an engine's rounding through)
    token_ids   at least 0, and below the run's vocabulary size when it recorded one
    loss_mask   every value 0 or 1, and at least one 1 (a sample no token of which trains would
                put a zero into the loss's divisor, and weighs nothing in the rank split)
    rewards     finite

Each check returns None when the values are fine, else a sentence naming the first offending
position and value and saying what to change. Shapes, dtypes and row lengths are the models'
business (`streamgrp.core.values.Sample`); this module deliberately ignores them.

The checks run on every sample a worker publishes and every payload the assembler reads, so they
look at whole byte strings in C, not at one Python number per token: a float's sign and exponent
sit in its last byte, so which values a last byte allows is worked out once per dtype and
tolerance, and one ``translate`` over the last bytes answers for a whole tensor; only when it
finds a doubtful byte (a value near the tolerance, an extreme exponent) are the values read one
by one, to decide exactly and to name the first bad one. Token ids against the vocabulary are
compared all at once, in numpy (`_any_outside`). Pure: no I/O.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from functools import cache, lru_cache
from typing import Any

#: How far above 0 a log-probability may be and still train: engines compute log-softmax in float32,
#: whose rounding leaves a probability-1 token's logprob up to a few 1e-7 above 0. Anything larger is a
#: bug upstream (logits or probabilities where logprobs belong). The inference adapters' float-noise
#: bound (`streamgrp.services.inference.dialect`) is the same number.
LOGPROB_TOLERANCE = 1e-4

#: dtype name -> (item size in bytes, struct format of one item or None for bfloat16).
_FLOATS: dict[str, tuple[int, str | None]] = {
    "float16": (2, "e"),
    "bfloat16": (2, None),
    "float32": (4, "f"),
    "float64": (8, "d"),
}
_INTS: dict[str, tuple[int, str]] = {"int32": (4, "i"), "int64": (8, "q")}
_MASKS = ("bool", "uint8")
#: Last bytes of a non-negative integer (sign bit clear).
_NON_NEGATIVE_TOP = bytes(range(0x80))
_ZERO_ONE = b"\x00\x01"


def logprob_problem(dtype: str, data: bytes, tolerance: float = LOGPROB_TOLERANCE) -> str | None:
    """None when every value of ``data`` (a ``dtype`` float tensor) is finite and at most ``tolerance``."""
    size = _FLOATS[dtype][0]
    if not data[size - 1 :: size].translate(None, _allowed_last_bytes(dtype, tolerance)):
        return None  # every value's sign and exponent allow it
    for index, value in enumerate(_floats(dtype, data)):
        if not value <= tolerance or value == -math.inf:  # NaN fails every comparison
            return (
                f"logprobs[{index}] is {value!r}: log-probabilities must be finite and at most {tolerance} "
                "(the log of a probability is at most 0); check the logprobs the inference engine returns"
            )
    return None


def token_id_problem(dtype: str, data: bytes, vocab_size: int | None = None) -> str | None:
    """None when every id of ``data`` (a ``dtype`` integer tensor) is at least 0 and below ``vocab_size``
    (when given)."""
    size, _ = _INTS[dtype]
    if vocab_size is None:
        if not data[size - 1 :: size].translate(None, _NON_NEGATIVE_TOP):
            return None
    elif not _any_outside(data, size, min(vocab_size, 2 ** (8 * size - 1)) - 1):
        return None
    for index, value in enumerate(_ints(dtype, data)):
        if value < 0:
            return f"token_ids[{index}] is {value}: token ids are at least 0; check the tokenizer's output"
        if vocab_size is not None and value >= vocab_size:
            return (
                f"token_ids[{index}] is {value}, not below the run's vocab_size {vocab_size}: the trainer's "
                "embedding has no row for it; check the tokenizer, or the run's --vocab-size"
            )
    return None


def loss_mask_problem(dtype: str, data: bytes) -> str | None:
    """None when every value of ``data`` (a bool or uint8 mask) is 0 or 1 and at least one is 1."""
    if dtype not in _MASKS:
        raise ValueError(f"loss mask dtype {dtype!r} is not one of {list(_MASKS)}")
    if data.translate(None, _ZERO_ONE):
        index = next(at for at, value in enumerate(data) if value > 1)
        return f"loss_mask[{index}] is {data[index]}: a loss mask holds 0 (not trained) or 1 (trained)"
    if b"\x01" not in data:
        return (
            "the loss mask is 0 everywhere: no token of the sample would train; set it to 1 on the tokens "
            "the policy generated, or reject the slot (return None)"
        )
    return None


def reward_problem(rewards: Iterable[float]) -> str | None:
    """None when every reward is finite."""
    for index, reward in enumerate(rewards):
        if not math.isfinite(reward):
            return f"rewards[{index}] is {reward!r}: rewards must be finite; check the reward function"
    return None


# -- the byte-level parts ---------------------------------------------------------------------------


@lru_cache(maxsize=32)
def _allowed_last_bytes(dtype: str, tolerance: float) -> bytes:
    """The last bytes (sign and high exponent bits) every value with which is finite and at most
    ``tolerance``. Within one last byte the values are ordered like their bit patterns, so checking
    the two extremes (the other bytes all 0, all 1) decides for every value in between."""
    size, _ = _FLOATS[dtype]
    allowed = []
    for last in range(256):
        extremes = (bytes(size - 1) + bytes([last]), b"\xff" * (size - 1) + bytes([last]))
        if all(value <= tolerance and value != -math.inf for value in (_floats(dtype, item)[0] for item in extremes)):
            allowed.append(last)
    return bytes(allowed)


def _floats(dtype: str, data: bytes) -> tuple[float, ...]:
    size, fmt = _FLOATS[dtype]
    if fmt is None:  # bfloat16: the high half of a float32
        widened = bytearray(2 * len(data))
        widened[2::4] = data[0::2]
        widened[3::4] = data[1::2]
        return struct.unpack(f"<{len(data) // 2}f", widened)
    return struct.unpack(f"<{len(data) // size}{fmt}", data)


def _ints(dtype: str, data: bytes) -> tuple[int, ...]:
    size, fmt = _INTS[dtype]
    return struct.unpack(f"<{len(data) // size}{fmt}", data)


def _any_outside(data: bytes, size: int, limit: int) -> bool:
    """Whether any ``size``-byte little-endian signed integer of ``data`` is negative or above ``limit`` (0 <=
    limit < 2^(8 size - 1)): read as unsigned, a negative one is at least 2^(8 size - 1), so one maximum in
    numpy answers both (1.0 µs for 1,024 int32 ids and 1.3 for 8,192; reading them as one big Python integer,
    as this did before, took 4.5 and 30)."""
    return bool(data) and int(_numpy().frombuffer(data, dtype=f"<u{size}").max()) > limit


@cache
def _numpy() -> Any:
    """numpy, imported on the first check that needs it: commands that check no sample start without it."""
    import numpy

    return numpy

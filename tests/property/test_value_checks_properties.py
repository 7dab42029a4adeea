"""The byte-level value checks decide exactly what reading every value one by one decides."""

from __future__ import annotations

import math
import struct

from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from streamgrp.core.value_checks import LOGPROB_TOLERANCE, logprob_problem, token_id_problem

_FLOAT_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
#: Values near every boundary the last-byte table draws: 0, the tolerance, the largest finite, inf, NaN.
_EDGES = [
    0.0,
    -0.0,
    LOGPROB_TOLERANCE,
    math.nextafter(LOGPROB_TOLERANCE, 1),
    1e-30,
    -1e-30,
    65504.0,
    -65504.0,
    3.4e38,
    -3.4e38,
    1.7e308,
    math.inf,
    -math.inf,
    math.nan,
]


def _values(dtype: str, data: bytes) -> list[float]:
    if dtype == "bfloat16":
        return [struct.unpack("<f", b"\0\0" + data[at : at + 2])[0] for at in range(0, len(data), 2)]
    fmt = {"float16": "e", "float32": "f", "float64": "d"}[dtype]
    return [value for (value,) in struct.iter_unpack(f"<{fmt}", data)]


@st.composite
def _float_tensor(draw) -> tuple[str, bytes]:
    dtype = draw(st.sampled_from(sorted(_FLOAT_SIZES)))
    size = _FLOAT_SIZES[dtype]
    items = draw(st.lists(st.one_of(st.binary(min_size=size, max_size=size), st.sampled_from(_EDGES)), max_size=40))
    data = b""
    for item in items:
        if isinstance(item, float):
            fmt = {"float16": "e", "bfloat16": "f", "float32": "f", "float64": "d"}[dtype]
            try:
                packed = struct.pack(f"<{fmt}", item)
            except OverflowError:
                continue  # not representable in this dtype
            item = packed[2:] if dtype == "bfloat16" else packed
        data += item
    return dtype, data


@settings(max_examples=examples(1500), deadline=None)
@given(tensor=_float_tensor(), tolerance=st.sampled_from([0.0, LOGPROB_TOLERANCE, 0.5, 1e-40]))
def test_a_logprob_tensor_is_refused_exactly_when_some_value_is_not_finite_or_above_the_tolerance(tensor, tolerance):
    dtype, data = tensor
    values = _values(dtype, data)
    bad = [at for at, value in enumerate(values) if not (math.isfinite(value) and value <= tolerance)]
    problem = logprob_problem(dtype, data, tolerance)
    assert (problem is None) == (not bad)
    if bad:
        assert problem.startswith(f"logprobs[{bad[0]}] is ")


@settings(max_examples=examples(1500), deadline=None)
@given(
    dtype=st.sampled_from(["int32", "int64"]),
    data=st.data(),
    vocab_size=st.one_of(st.none(), st.integers(1, 2**31 - 1), st.sampled_from([1, 2, 255, 256, 257, 65536, 151936])),
)
def test_token_ids_are_refused_exactly_when_one_is_negative_or_not_below_the_vocabulary(dtype, data, vocab_size):
    bits = 32 if dtype == "int32" else 64
    near = [0, 1, -1, 2 ** (bits - 1) - 1, -(2 ** (bits - 1))]
    if vocab_size is not None:
        near += [vocab_size - 1, vocab_size, vocab_size + 1]
    ids = data.draw(
        st.lists(st.one_of(st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1), st.sampled_from(near)), max_size=40)
    )
    ids = [value for value in ids if -(2 ** (bits - 1)) <= value < 2 ** (bits - 1)]
    raw = struct.pack(f"<{len(ids)}{'i' if dtype == 'int32' else 'q'}", *ids)
    bad = [at for at, value in enumerate(ids) if value < 0 or (vocab_size is not None and value >= vocab_size)]
    problem = token_id_problem(dtype, raw, vocab_size)
    assert (problem is None) == (not bad)
    if bad:
        assert problem.startswith(f"token_ids[{bad[0]}] is {ids[bad[0]]}")

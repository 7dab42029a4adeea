"""`codec.encode_sample`, what a publisher writes, reads back as the very sample and a summary that agrees with
it, or refuses what it cannot write with a ValueError."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from streamgrp.core import codec
from streamgrp.core.values import INT64_MAX, RawArray, Sample

_MASK_DTYPES = ("bool", "uint8")
_LOGPROB_DTYPES = ("float32", "float16", "bfloat16", "float64")
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=4)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def _samples(draw) -> Sample:
    row_lengths = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    total = sum(row_lengths)

    def tensor(dtype: str, fmt: str, values) -> RawArray:
        data = struct.pack(f"<{total}{fmt}", *draw(st.lists(values, min_size=total, max_size=total)))
        if dtype == "bfloat16":  # a float32's high half: as negative and finite as the float32
            data = b"".join(data[at + 2 : at + 4] for at in range(0, len(data), 4))
        return RawArray(dtype=dtype, shape=(total,), data=data)

    # Any values a sample can train on: ids of every size, a 0/1 mask with a 1, logprobs from -max to 0.
    ids = draw(st.sampled_from([("int32", "i", 2**31 - 1), ("int64", "q", 2**63 - 1)]))
    mask = tensor(draw(st.sampled_from(_MASK_DTYPES)), "B", st.integers(0, 1))
    at = draw(st.integers(0, total - 1))
    mask = mask.replace(data=mask.data[:at] + b"\x01" + mask.data[at + 1 :])
    logprobs = draw(st.sampled_from(_LOGPROB_DTYPES))
    width = {"float32": 32, "float16": 16, "bfloat16": 32, "float64": 64}[logprobs]
    fmt = {"float32": "f", "float16": "e", "bfloat16": "f", "float64": "d"}[logprobs]
    return Sample(
        token_ids=tensor(ids[0], ids[1], st.integers(0, ids[2])),
        loss_mask=mask,
        logprobs=tensor(logprobs, fmt, st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=width)),
        row_lengths=row_lengths,
        rewards=tuple(
            draw(
                st.lists(
                    st.floats(allow_nan=False, allow_infinity=False),
                    min_size=len(row_lengths),
                    max_size=len(row_lengths),
                )
            )
        ),
        version=draw(st.integers(0, INT64_MAX)),
        meta=draw(st.dictionaries(st.text(max_size=4), _JSON, max_size=3)),
    )


_ODD_INTS = st.one_of(st.integers(-2, 3), st.sampled_from([INT64_MAX, INT64_MAX + 1]), st.booleans(), st.just(1.0))


@settings(max_examples=examples(400), deadline=None)
@given(
    sample=_samples(),
    task_id=st.one_of(st.text(min_size=1, max_size=8), st.sampled_from(["", "t" * 256, "t" * 257]), st.integers(0, 3)),
    slot=_ODD_INTS,
    producer=st.one_of(st.text(max_size=6), st.none()),
    seq=_ODD_INTS,
)
def test_an_encoded_sample_reads_back_as_itself_or_is_refused(sample, task_id, slot, producer, seq):
    try:
        slot_header, payload_header, blob = codec.encode_sample(task_id, slot, sample, producer=producer, seq=seq)
    except ValueError:
        assert not (
            isinstance(task_id, str)
            and 1 <= len(task_id) <= 256
            and isinstance(producer, str)
            and all(type(n) is int and 0 <= n <= INT64_MAX for n in (slot, seq))
            and math.isfinite(sum(sample.rewards) / sample.rows)
        ), "a valid sample was refused"
        return
    result = codec.decode({codec.HEADER: slot_header})
    payload = codec.decode({codec.HEADER: payload_header, codec.BLOB: blob})
    assert payload.sample == sample and (payload.task_id, payload.slot) == (result.task_id, result.slot) == (
        task_id,
        slot,
    )
    assert codec.payload_problem({codec.HEADER: payload_header, codec.BLOB: blob}, result) is None


def test_a_sample_whose_mean_reward_overflows_is_refused_naming_it():
    sample = Sample(
        token_ids=RawArray.from_values([1, 2], "int32"),
        loss_mask=RawArray.from_values([0, 1], "uint8"),
        logprobs=RawArray.from_values([-0.5, -0.25], "float32"),
        row_lengths=(1, 1),
        rewards=(1.5e308, 1.5e308),
        version=0,
    )
    # The mean of two finite rewards overflows: the summary refuses it, with its message.
    with pytest.raises(ValueError, match="finite"):
        codec.encode_sample("t", 0, sample, producer="w", seq=1)

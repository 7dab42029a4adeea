"""The `SlotSegment` event refuses what cannot be a generated part of a slot, and `check_sample` says what
differs between a sample and the segments it names."""

from __future__ import annotations

import pytest

from streamgrp.core.events import RawArray, Sample, SlotSegment
from streamgrp.store.segments import chain_of, check_sample


def _segment(ids, logprobs, *, dtype="int32", index=0, start=0, cause="chunk"):
    return SlotSegment(
        task_id="t",
        slot=0,
        index=index,
        start=start,
        token_ids=RawArray.from_values(ids, dtype),
        logprobs=RawArray.from_values(logprobs, "float32"),
        version=0,
        cause=cause,
    )


@pytest.mark.parametrize(
    "ids, logprobs, dtype, match",
    [
        ([], [], "int32", "non-empty"),
        ([1, 2], [-0.5], "int32", "one value per generated token"),
        ([1, -2], [-0.5, -0.5], "int32", "token ids are at least 0"),
        ([1, 2], [-0.5, 0.5], "int32", "above|positive|at most"),
        ([1, 2], [-0.5, float("nan")], "int32", "finite|nan|NaN"),
        ([1.0, 2.0], [-0.5, -0.5], "float32", "int32 or int64"),
    ],
)
def test_a_segment_that_cannot_be_generated_tokens_is_refused(ids, logprobs, dtype, match):
    with pytest.raises(ValueError, match=match):
        _segment(ids, logprobs, dtype=dtype)


def test_check_sample_names_what_differs():
    chain = chain_of([_segment([7, 8], [-0.5, -0.25]), _segment([9], [-1.0], index=1, start=2, cause="stop")])

    def sample(ids, logprobs, count=2, tokens=3):
        return Sample.from_rows(
            token_ids=[[1, *ids]],
            loss_mask=[[0] + [1] * len(ids)],
            logprobs=[[0.0, *logprobs]],
            rewards=[1.0],
            version=0,
            meta={"segments": {"count": count, "tokens": tokens}},
        )

    assert check_sample(sample([7, 8, 9], [-0.5, -0.25, -1.0]), chain) is None
    assert "not its segments' concatenation" in check_sample(sample([7, 9, 8], [-0.5, -0.25, -1.0]), chain)
    assert "log-probabilities" in check_sample(sample([7, 8, 9], [-0.5, -0.5, -1.0]), chain)
    assert "generated 2 tokens" in check_sample(sample([7, 8], [-0.5, -0.25]), chain)
    assert "names 3 segments" in check_sample(sample([7, 8, 9], [-0.5, -0.25, -1.0], count=3), chain)
    assert (
        check_sample(
            Sample.from_rows(token_ids=[[1, 2]], loss_mask=[[0, 1]], logprobs=[[0.0, -1.0]], rewards=[1.0], version=0),
            chain,
        )
        is None
    )  # not built on segments

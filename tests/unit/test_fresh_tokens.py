"""What a sample or group still trains under ``staleness="mask"`` (`streamgrp.core.fresh_tokens`): the batch
fold's reading of it agrees with what the loader's mask (`mask_stale`) leaves, for every window and every
``mask_min_tokens``, so the fold discards exactly the groups the mask would empty."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from msgspec import UNSET
from test_token_versions import _batch, _sample

from streamgrp.core import codec
from streamgrp.core.events import SampleSummary
from streamgrp.core.fresh_tokens import Freshness, group_freshness, rows_freshness, sample_runs
from streamgrp.train.shard_tensors import StaleMask, mask_stale

SAMPLES = {
    "one row across 2..4": _sample([8], prompt=2, version=2, runs=[[2, 3], [3, 1], [4, 2]]),
    "runs cover the last tokens only": _sample([9], prompt=2, version=1, runs=[[3, 2], [5, 2]]),
    "two turns, the second all newer": _sample([6, 5], prompt=2, version=1, runs=[[1, 4], [2, 2], [4, 5]]),
    "a short newer row beside a long older one": _sample([10, 3], prompt=1, version=1, runs=[[1, 10], [3, 3]]),
    "a prompt spanning versions": _sample([7], prompt=4, version=1, runs=[[1, 2], [2, 3], [3, 2]]),
}


def _trains(sample, oldest: int, min_tokens: int) -> bool:
    batch = _batch([sample], version=9)
    mask_stale(batch, StaleMask(oldest=oldest, min_tokens=min_tokens))
    return bool(batch.loss_mask.any())


@pytest.mark.parametrize("name", SAMPLES)
def test_a_samples_freshness_says_what_the_loaders_mask_leaves_at_every_window_and_minimum(name):
    sample = SAMPLES[name]
    runs = sample_runs(sample)
    assert runs is not None
    fresh = rows_freshness(sample.row_lengths, sample.version, sample.loss_mask.data, runs)
    for oldest, min_tokens in itertools.product(range(7), range(1, 12)):
        assert fresh.trains_at(oldest, min_tokens) == _trains(sample, oldest, min_tokens), (oldest, min_tokens, fresh)


def test_the_profile_counts_one_rows_loss_tokens_and_the_newest_uncut_row():
    sample = SAMPLES["two turns, the second all newer"]
    fresh = rows_freshness(sample.row_lengths, sample.version, sample.loss_mask.data, sample_runs(sample) or ())
    # row 0: prompt 2 (v1), generated 2 of v1 and 2 of v2; row 1: prompt 2 and 3 generated, all v4
    assert fresh == Freshness(whole=4, tokens=((1, 4), (2, 3), (4, 3)))
    assert fresh.tokens_at(3) == 3 and fresh.tokens_at(5) == 0


def test_a_groups_freshness_is_its_best_row_and_members_without_versions_count_flat():
    spanning = Freshness(whole=2, tokens=((2, 6), (3, 2)))
    merged = group_freshness([spanning, Freshness.flat(1, 5)])
    assert merged == Freshness(whole=2, tokens=((1, 6), (2, 6), (3, 2)))
    assert merged.trains_at(3, 2) and not merged.trains_at(3, 3) and not merged.trains_at(4, 1)


def test_a_summary_records_its_freshness_only_when_its_tokens_span_versions_and_refuses_one_that_lies():
    header = codec.decode(codec.encode(codec.sample_result("t1", 0, SAMPLES["one row across 2..4"])[0]))
    spanning = header.sample
    assert spanning.newest == 4 and spanning.freshness == Freshness(2, ((2, 6), (3, 3), (4, 2)))
    plain = SampleSummary.of(_sample([4], prompt=1, version=3), "d")
    assert plain.fresh_tokens is UNSET and plain.freshness == Freshness.flat(3, 3)
    for whole, tokens in (
        (2, ((2, 7), (4, 2))),  # more loss tokens than the sample has
        (2, ((2, 2), (3, 3))),  # a newer version counting more than an older one
        (3, ((2, 6), (4, 2))),  # whole at a version no loss token has
        (2, ((2, 6), (5, 2))),  # past the newest version
    ):
        with pytest.raises(ValueError, match="freshness"):
            SampleSummary(**{**msgspec.structs.asdict(spanning), "whole_version": whole, "fresh_tokens": tokens})
    with pytest.raises(ValueError, match="together"):
        SampleSummary(**{**msgspec.structs.asdict(spanning), "whole_version": UNSET})

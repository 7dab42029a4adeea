"""Per-token versions in a shard (a sample's ``meta["token_versions"]`` runs, else its version) and the
staleness mask the loader applies under ``staleness="mask"``."""

from __future__ import annotations

import pytest
import torch

from streamgrp.core.events import Sample
from streamgrp.train.batch import Batch
from streamgrp.core.fresh_tokens import version_runs
from streamgrp.train.loader import sample_rows
from streamgrp.train.shard_tensors import StaleMask, mask_stale, row_runs, shard_tensors


def _sample(rows: list[int], *, prompt: int, version: int, runs=None) -> Sample:
    """``rows`` row lengths; each row's first ``prompt`` tokens are the prompt (loss mask 0)."""
    return Sample.from_rows(
        token_ids=[[1] * n for n in rows],
        loss_mask=[[i >= prompt for i in range(n)] for n in rows],
        logprobs=[[-0.5] * n for n in rows],
        rewards=[1.0] * len(rows),
        version=version,
        meta={"token_versions": runs} if runs is not None else None,
    )


def _batch(samples: list[Sample], version: int = 5) -> Batch:
    rows = [sample_rows(s) for s in samples]
    return Batch(
        step=0,
        rank=0,
        world_size=1,
        version=version,
        task_ids=["t"] * len(rows),
        group_sizes=torch.ones(len(rows), dtype=torch.int64),
        step_loss_tokens=0,
        digest="",
        version_runs=row_runs(rows),
        **shard_tensors(rows),
    )


def test_each_token_has_its_run_version_and_the_prompt_the_samples_version():
    spanning = _sample([7], prompt=2, version=3, runs=[[3, 2], [4, 3]])  # 5 generated tokens: 2 of v3, 3 of v4
    plain = _sample([4], prompt=1, version=4)
    batch = _batch([spanning, plain])
    assert batch.token_versions.tolist() == [[3, 3, 3, 3, 4, 4, 4], [4, 4, 4, 4, 0, 0, 0]]  # padding 0
    assert batch.versions.tolist() == [3, 4]  # the per-row version stays the oldest
    assert batch.version_spans.tolist() == [1, 0]
    assert batch.token_versions is batch.token_versions  # made once, on first use


def test_a_samples_runs_are_cut_into_its_rows():
    sample = _sample([3, 4], prompt=0, version=1, runs=[[1, 2], [2, 4], [3, 1]])
    assert _batch([sample]).token_versions.tolist() == [[1, 1, 2, 0], [2, 2, 2, 3]]


def test_without_any_per_token_versions_rows_are_their_version_throughout():
    batch = _batch([_sample([2], prompt=0, version=2), _sample([3], prompt=0, version=1)])
    assert batch.version_runs is None
    assert batch.token_versions.tolist() == [[2, 2, 0], [1, 1, 1]]


@pytest.mark.parametrize(
    "value", [None, [], "x", [[1]], [[1, 0]], [[-1, 2]], [[1.5, 2]], [[1, 2], [2, 99]], [[True, 2]]]
)
def test_runs_that_are_not_streamgrps_mean_no_per_token_versions(value):
    assert version_runs(value, 10) is None


def test_the_mask_clears_tokens_older_than_the_window_and_counts_them():
    mixed = _sample([6], prompt=2, version=2, runs=[[2, 2], [4, 2]])  # 2 old generated tokens, 2 fresh
    old = _sample([5], prompt=1, version=2, runs=[[2, 4]])  # every generated token old
    fresh = _sample([4], prompt=1, version=4)
    batch = _batch([mixed, old, fresh], version=5)
    assert mask_stale(batch, StaleMask(oldest=3)) == 2 + 4
    assert batch.loss_mask.tolist() == [
        [False, False, False, False, True, True],
        [False] * 6,
        [False, True, True, True, False, False],
    ]


def test_a_row_left_with_fewer_than_min_tokens_loses_them_all():
    mixed = _sample([6], prompt=2, version=2, runs=[[2, 2], [4, 2]])
    batch = _batch([mixed], version=5)
    assert mask_stale(batch, StaleMask(oldest=3, min_tokens=3)) == 4
    assert not batch.loss_mask.any()


def test_the_mask_is_what_the_run_records():
    class Drop:
        staleness, max_staleness, mask_min_tokens = "drop", 1, 1

    class Mask:
        staleness, max_staleness, mask_min_tokens = "mask", 2, 4

    assert StaleMask.of(Drop, 9) is None and StaleMask.of(None, 9) is None
    assert StaleMask.of(Mask, 9) == StaleMask(oldest=7, min_tokens=4)

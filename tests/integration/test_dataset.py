"""`StepDataset` under a real ``DataLoader`` on a real server: one item per step, commit on advance,
advantages over the actual group sizes, failures recorded, and the DataLoader settings it refuses."""

from __future__ import annotations

import pytest
import redis
import torch
from made_steps import make_steps, rollout
from torch.utils.data import DataLoader

from streamgrp.core import codec
from streamgrp.core.events import StepCommitted, StepFailed, TrainingResumed
from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError
from streamgrp.train.advantages import normalize
from streamgrp.train.dataset import ITEM_TENSORS, StepDataset
from streamgrp.train.trainer import TrainerClient

GROUP = NormSpec("group", "group")


def committed(client, run, rank: int = 0) -> int | None:
    last = client.hget(run.keys.committed, str(rank))
    return None if last is None else int(last)


def test_a_dataloader_yields_each_step_once_and_commits_on_advance(client, redis_url, make_run, issuer):
    run = make_run(n_samples=3, dp_size=1, batch_size=2, reward_norm=GROUP)
    make_steps(client, run, groups=4, steps=2)
    dataset = StepDataset(TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.1), advantages="run")

    seen = []
    for item in DataLoader(dataset, batch_size=None):
        # The previous step was committed when this one was asked for; this one is not yet.
        assert committed(client, run) == (item["step"] - 1 if item["step"] else None)
        assert set(item) == {
            *ITEM_TENSORS,
            "advantages",
            "step",
            "rank",
            "version",
            "step_loss_tokens",
            "stale_masked_tokens",
            "task_ids",
        }
        rows, longest = item["token_ids"].shape
        assert item["attention_mask"].shape == item["loss_mask"].shape == item["logprobs"].shape == (rows, longest)
        assert item["token_versions"].shape == (rows, longest)
        assert item["rewards"].shape == item["versions"].shape == item["advantages"].shape == (rows,)
        assert item["version_spans"].shape == (rows,)
        assert int(item["group_sizes"].sum()) == rows and len(item["task_ids"]) == len(item["group_sizes"])
        assert torch.equal(item["advantages"], normalize(item["rewards"], item["group_sizes"], GROUP))
        assert item["step_loss_tokens"] == int(item["loss_mask"].sum())  # one rank: the step is this shard
        seen.append((item["step"], item["group_sizes"].tolist()))
    assert [step for step, _ in seen] == [0, 1]
    assert any(2 in sizes for _, sizes in seen), "expected a partial group of the rejected slot"
    assert committed(client, run) == 1 and int(client.get(run.keys.version)) == 2
    commits = [codec.decode(f) for _, f in client.xrange(run.keys.commits)]
    assert [(type(e), e.step) for e in commits] == [(TrainingResumed, 0), (StepCommitted, 0), (StepCommitted, 1)]


def test_each_rank_gets_its_shard_and_the_step_wide_loss_tokens(client, redis_url, make_run, issuer):
    run = make_run(n_samples=3, dp_size=2, batch_size=3)
    make_steps(client, run, groups=3, steps=1)
    items = [
        next(
            iter(
                StepDataset(
                    TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.1), rank=rank, world_size=2
                ).loader()
            )
        )
        for rank in (0, 1)
    ]
    assert [item["rank"] for item in items] == [0, 1]
    assert sorted(len(item["task_ids"]) for item in items) == [1, 2]
    total = sum(int(item["loss_mask"].sum()) for item in items)
    assert [item["step_loss_tokens"] for item in items] == [total, total]


def test_an_exception_in_the_loop_records_a_failed_step(client, redis_url, make_run, issuer):
    run = make_run(n_samples=2, dp_size=1, batch_size=1)
    make_steps(client, run, groups=1, steps=1)
    dataset = StepDataset(TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.1))
    with pytest.raises(FloatingPointError):
        with dataset:
            for item in dataset.loader():
                raise FloatingPointError(f"loss is nan at step {item['step']}")
    [_, failed] = [codec.decode(f) for _, f in client.xrange(run.keys.commits)]
    assert isinstance(failed, StepFailed) and failed.error == "FloatingPointError: loss is nan at step 0"
    assert committed(client, run) is None


def test_what_the_dataset_refuses(client, make_run, issuer):
    run = make_run(n_samples=2, dp_size=1, batch_size=1)
    dataset = StepDataset(TrainerClient(client, run, poll_s=0.1))
    with pytest.raises(ConfigError, match="batch_size=None"):
        dataset.loader(batch_size=4)
    with pytest.raises(ConfigError, match="num_workers=0"):
        dataset.loader(num_workers=2)
    with pytest.raises(ConfigError, match="records neither adv_norm nor reward_norm"):
        StepDataset(TrainerClient(client, run), advantages="run")
    with pytest.raises(ConfigError, match="world_size=2 but run"):
        StepDataset(TrainerClient(client, run), rank=0, world_size=2)
    # A DataLoader worker process would iterate (and commit) on its own: refused inside the worker.
    with pytest.raises(ConfigError, match="use num_workers=0"):
        next(iter(DataLoader(dataset, batch_size=None, num_workers=1)))


def spanning_rollout(request):
    """A sample whose last two tokens were generated two versions after the rest (a resumed generation)."""
    sample = rollout(request)
    if sample is None:
        return None
    runs = [[request.version, sum(sample.row_lengths) - 3], [request.version + 2, 2]]
    return sample.replace(meta={"token_versions": runs})


@pytest.mark.one_server_kind  # the loader's tensors
def test_a_dataloader_item_carries_each_tokens_version(client, redis_url, make_run, issuer):
    run = make_run(n_samples=3, dp_size=1, batch_size=2, max_staleness=5)
    make_steps(client, run, groups=2, steps=1, rollout=spanning_rollout)
    dataset = StepDataset(TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.1))
    [item] = list(DataLoader(dataset, batch_size=None))
    lengths = item["attention_mask"].sum(1).tolist()
    for row, length in enumerate(lengths):
        versions = item["token_versions"][row].tolist()
        # the prompt token and the first generated ones at the sample's version, the last two two versions on
        assert versions[:length] == [0] * (length - 2) + [2, 2] and versions[length:] == [0] * (len(versions) - length)
    assert item["versions"].tolist() == [0] * len(lengths) and item["version_spans"].tolist() == [2] * len(lengths)

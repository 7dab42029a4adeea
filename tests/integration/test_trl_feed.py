"""`StreamgrpRollouts`, TRL's rollout-worker protocol, driven the way TRL's dataset drives it (real server,
real trl ``RolloutSample``s, no TRL trainer): what each sample holds, commit when a step's last sample is
taken and not before, at most ``ahead_steps`` in the buffer, and the health checks."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import redis
from made_steps import make_steps
from processes import wait_until

from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError, RunEnded
from streamgrp.replay.steps import replay_step
from streamgrp.train.advantages import normalize
from streamgrp.train.trainer import TrainerClient
from streamgrp.train.trl_async import StreamgrpRollouts

GROUP = NormSpec("group", "group")


@pytest.fixture
def rolloutsample(monkeypatch):
    if importlib.util.find_spec("trl") is None:
        if os.environ.get("STREAMGRP_TEST_REQUIRE_TRL"):
            pytest.fail("trl is not installed but STREAMGRP_TEST_REQUIRE_TRL is set: pip install -e '.[trl]'")
        pytest.skip("trl is not installed (pip install -e '.[trl]')")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    return RolloutSample


def committed(client, run) -> int | None:
    last = client.hget(run.keys.committed, "0")
    return None if last is None else int(last)


def take(feed: StreamgrpRollouts, count: int) -> list:
    return [feed.rollout_buffer.get(timeout=5) for _ in range(count)]


def test_samples_are_the_step_rows_and_a_step_commits_when_its_last_sample_is_taken(rolloutsample, client, redis_url,
                                                                                   make_run):
    run = make_run(n_samples=3, dp_size=1, batch_size=2, reward_norm=GROUP, max_batch_size=16)
    make_steps(client, run, groups=4, steps=2)
    steps = [replay_step(client, run.keys, step, 0) for step in (0, 1)]
    feed = StreamgrpRollouts(TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.05), ahead_steps=1)
    feed.update_model_version(7)
    feed.start()
    try:
        for step, batch in enumerate(steps):
            # Only this step is in the buffer (ahead_steps=1), none of its rows taken yet.
            wait_until(lambda: feed.rollout_buffer.qsize() == batch.rows, timeout=5, message=f"step {step} pushed")
            samples = take(feed, batch.rows - 1)
            time.sleep(0.3)  # several feed polls: a step with a sample left in the buffer stays uncommitted
            assert committed(client, run) == (step - 1 if step else None)
            samples += take(feed, 1)
            wait_until(lambda: committed(client, run) == step, timeout=5, message=f"step {step} committed")

            advantages = normalize(batch.rewards, batch.group_sizes, GROUP).tolist()
            lengths = batch.attention_mask.sum(1).tolist()
            group_of_row = [g for g, size in enumerate(batch.group_sizes.tolist()) for _ in range(size)]
            for row, sample in enumerate(samples):
                assert isinstance(sample, rolloutsample)
                assert sample.input_ids.tolist() == batch.token_ids[row, :lengths[row]].tolist()
                assert sample.completion_mask.tolist() == batch.loss_mask[row, :lengths[row]].long().tolist()
                assert sample.old_log_probs.tolist() == batch.logprobs[row, :lengths[row]].tolist()
                assert sample.advantage == pytest.approx(advantages[row])
                assert (sample.model_version, sample.group_id) == (7, step * 16 + group_of_row[row])
                assert sample.metrics == {"reward": batch.rewards[row].item()}
        assert int(client.get(run.keys.version)) == 2
        # The run wrote its two steps and TRL took everything: asking for more is an error that says so.
        wait_until(lambda: not feed._thread.is_alive(), timeout=5, message="the feed to finish")
        with pytest.raises(RunEnded, match="finished after 2 steps .* lower AsyncGRPOConfig.max_steps"):
            feed.check_health(300)
        metrics = [feed.metrics_queue.get_nowait() for _ in range(2)]
        assert [m["streamgrp/step"] for m in metrics] == [0.0, 1.0]
        assert [m["streamgrp/rows_per_step"] for m in metrics] == [float(b.rows) for b in steps]
    finally:
        feed.stop()
    assert feed.committed_steps == 2


def test_stop_commits_only_steps_fully_taken(rolloutsample, client, redis_url, make_run):
    run = make_run(n_samples=2, dp_size=1, batch_size=1)
    make_steps(client, run, groups=2, steps=2)
    feed = StreamgrpRollouts(TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.05))
    feed.start()
    wait_until(lambda: feed.rollout_buffer.qsize() == 4, timeout=5, message="both steps pushed")
    take(feed, 3)  # all of step 0, half of step 1
    feed.stop()
    assert committed(client, run) == 0


def test_what_the_feed_refuses_and_reports(client, make_run):
    with pytest.raises(ConfigError, match="start the run with --dp-size 1"):
        StreamgrpRollouts(TrainerClient(client, make_run(n_samples=2, dp_size=2, batch_size=2)))


def test_health_before_start(client, make_run):
    feed = StreamgrpRollouts(TrainerClient(client, make_run(n_samples=2, dp_size=1, batch_size=1)))
    with pytest.raises(RuntimeError, match="call start"):
        feed.check_health(300)

"""`StreamgrpRollouts`, TRL's rollout-worker protocol, driven the way TRL's dataset drives it (real server,
real trl ``RolloutSample``s, no TRL trainer; its collator and optimizer steps are the calls `StreamgrpProgress`
makes): what each sample holds, a step commits once every row of it was in a completed optimizer step and
not when taken, the trained rows of the next step are recorded and a new start hands only the others, a
TRL checkpoint's position resumes the run there, and the health checks."""

from __future__ import annotations

import importlib.util
import os
import time
from types import SimpleNamespace

import pytest
import redis
from made_steps import make_steps
from processes import wait_until

from pipeline import events

from streamgrp.core.events import StepCommitted, StepRowsTrained, TrainingResumed
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


def started(redis_url, run, *, checkpoint: dict | None = None, **kwargs) -> StreamgrpRollouts:
    """A feed started the way TRL starts it: its callback's train begin (a collator to watch), then ``start``."""
    feed = StreamgrpRollouts(TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.05), **kwargs)
    feed.train_begins(SimpleNamespace(collate_fn=lambda examples: examples), checkpoint=checkpoint)
    feed.start()
    return feed


def train(feed: StreamgrpRollouts, *microbatches: list) -> None:
    """TRL packs these micro-batches of taken samples, then one optimizer step trains them all."""
    for samples in microbatches:
        feed.collated([{"input_ids": s.input_ids, "metrics": s.metrics} for s in samples])
    feed.optimizer_step(len(microbatches))


def rows_of(batch) -> list[list[int]]:
    return [ids[:n] for ids, n in zip(batch.token_ids.tolist(), batch.attention_mask.sum(1).tolist())]


def test_samples_are_the_step_rows_and_a_step_commits_once_every_row_was_trained(
    rolloutsample, client, redis_url, make_run
):
    run = make_run(n_samples=3, dp_size=1, batch_size=2, reward_norm=GROUP, max_batch_size=16)
    make_steps(client, run, groups=4, steps=2)
    steps = [replay_step(client, run.keys, step, 0) for step in (0, 1)]
    feed = started(redis_url, run, ahead_steps=1)
    feed.update_model_version(7)
    try:
        wait_until(lambda: feed.rollout_buffer.qsize() == steps[0].rows, timeout=5, message="step 0 pushed")
        first = take(feed, steps[0].rows)  # all of step 0 taken: not trained yet, not committed
        wait_until(lambda: feed.rollout_buffer.qsize() == steps[1].rows, timeout=5, message="step 1 pushed")
        time.sleep(0.3)
        assert committed(client, run) is None
        second = take(feed, steps[1].rows)
        train(feed, first[:2])  # an optimizer step over part of step 0: recorded, not committed
        assert committed(client, run) is None
        train(feed, first[2:] + second[:1], second[1:2])  # the rest of step 0 and two rows of step 1
        assert committed(client, run) == 0 and int(client.get(run.keys.version)) == 1
        train(feed, second[2:])
        assert committed(client, run) == 1 and int(client.get(run.keys.version)) == 2
        records = events(client, run.keys.commits, StepRowsTrained)
        assert [(r.step, r.rows, r.total) for r in records] == [(0, (0, 1), steps[0].rows), (1, (0, 1), steps[1].rows)]

        for step, (batch, samples) in enumerate(zip(steps, (first, second))):
            advantages = normalize(batch.rewards, batch.group_sizes, GROUP).tolist()
            lengths = batch.attention_mask.sum(1).tolist()
            group_of_row = [g for g, size in enumerate(batch.group_sizes.tolist()) for _ in range(size)]
            for row, sample in enumerate(samples):
                assert isinstance(sample, rolloutsample)
                assert sample.input_ids.tolist() == batch.token_ids[row, : lengths[row]].tolist()
                assert sample.completion_mask.tolist() == batch.loss_mask[row, : lengths[row]].long().tolist()
                assert sample.old_log_probs.tolist() == batch.logprobs[row, : lengths[row]].tolist()
                assert sample.advantage == pytest.approx(advantages[row])
                # Stamped with TRL's version as taken: TRL's own staleness check never drops a row.
                assert (sample.model_version, sample.group_id) == (7, step * 16 + group_of_row[row])
                assert sample.metrics == {
                    "reward": batch.rewards[row].item(),
                    "version_oldest": float(batch.versions[row]),
                    "version_newest": float(batch.versions[row] + batch.version_spans[row]),
                }
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


def test_a_new_start_hands_only_the_rows_not_trained(rolloutsample, client, redis_url, make_run):
    run = make_run(n_samples=2, dp_size=1, batch_size=2)
    make_steps(client, run, groups=6, steps=3)
    steps = [rows_of(replay_step(client, run.keys, step, 0)) for step in range(3)]
    assert [len(rows) for rows in steps] == [4, 4, 4]
    feed = started(redis_url, run)
    taken = take(feed, 7)
    train(feed, taken[:3])
    train(feed, taken[3:6])  # step 0 and rows 0, 1 of step 1 trained; row 2 of step 1 taken, packed, not trained
    feed.collated([{"metrics": taken[6].metrics}])
    feed.stop()  # TRL reached max_steps
    assert committed(client, run) == 0
    assert feed.position() == {"run": run.keys.run, "step": 1, "rows": [0, 1]}

    again = started(redis_url, run)  # no checkpoint: the run's next step, past its recorded rows
    try:
        rest = take(again, 6)
        assert [s.input_ids.tolist() for s in rest] == steps[1][2:] + steps[2]
        train(again, rest)
        assert committed(client, run) == 2 and again.retrained_rows == 0
        trained = [s.input_ids.tolist() for s in taken[:6] + rest]
        assert sorted(trained) == sorted(steps[0] + steps[1] + steps[2]), "each row trained exactly once"
    finally:
        again.stop()
    resumed = events(client, run.keys.commits, TrainingResumed)
    assert [(e.step, e.reason) for e in resumed] == [(0, "start"), (1, "lowest_rank")]


def test_a_trl_checkpoint_resumes_the_run_after_the_rows_it_holds(rolloutsample, client, redis_url, make_run):
    run = make_run(n_samples=2, dp_size=1, batch_size=2)
    make_steps(client, run, groups=6, steps=3)
    steps = [rows_of(replay_step(client, run.keys, step, 0)) for step in range(3)]
    feed = started(redis_url, run)
    taken = take(feed, 8)
    train(feed, taken[:3])
    saved = feed.position()  # what TRL writes into checkpoint-1: step 0, rows 0..2
    assert saved == {"run": run.keys.run, "step": 0, "rows": [0, 1, 2]}
    train(feed, taken[3:6])  # step 0 committed, rows 0, 1 of step 1 recorded: then the machine is lost
    feed.stop()
    assert committed(client, run) == 0

    with pytest.raises(ConfigError, match="holds run 'other'"):
        started(redis_url, run, checkpoint={**saved, "run": "other"})
    again = started(redis_url, run, checkpoint=saved)  # train(resume_from_checkpoint=".../checkpoint-1")
    try:
        rest = take(again, 9)
        assert [s.input_ids.tolist() for s in rest] == steps[0][3:] + steps[1] + steps[2]
        train(again, rest)
        assert committed(client, run) == 2
        # Row 3 of step 0 and rows 0, 1 of step 1 were trained after checkpoint-1: trained again, as retrained.
        assert again.retrained_rows == 3
    finally:
        again.stop()
    resumed = events(client, run.keys.commits, TrainingResumed)
    assert [(e.step, e.reason, e.retrain_through) for e in resumed][-1] == (0, "checkpoint", 0)
    assert [(e.step, e.attempt) for e in events(client, run.keys.commits, StepCommitted)] == [
        (0, 1),
        (0, 2),
        (1, 2),
        (2, 2),
    ]


def test_what_the_feed_refuses_and_reports(client, make_run):
    with pytest.raises(ConfigError, match="start the run with --dp-size 1"):
        StreamgrpRollouts(TrainerClient(client, make_run(n_samples=2, dp_size=2, batch_size=2)))


def test_start_needs_the_callback_and_health_before_start(rolloutsample, client, make_run):
    feed = StreamgrpRollouts(TrainerClient(client, make_run(n_samples=2, dp_size=1, batch_size=1)))
    with pytest.raises(RuntimeError, match="call start"):
        feed.check_health(300)
    with pytest.raises(ConfigError, match=r"callbacks=\[rollouts.callback\]"):
        feed.start()


def test_the_rows_record_checks_its_whole_input_before_writing(client, make_run):
    from streamgrp.store import scripts
    from streamgrp.train.trl_progress import Position, recorded_rows

    run = make_run(n_samples=2, dp_size=1, batch_size=1)
    record = scripts.register(client, "trainer_rows.lua")
    keys = [run.keys.committed, run.keys.commits, run.keys.attempt]
    header = b"h"
    for args, code in (
        ([0, -1, 0, header], "BAD_INPUT"),
        ([0, 0, "x", header], "BAD_INPUT"),
        ([0, 0, 0, ""], "BAD_INPUT"),
        ([0, 0, 3, header], "STALE_ATTEMPT"),
        ([0, 2, 0, header], "OUT_OF_ORDER"),
    ):
        with pytest.raises(redis.ResponseError, match=code):
            record(keys=keys, args=args)
    assert client.xlen(run.keys.commits) == 0 and client.hget(run.keys.attempt, "rows:0") is None
    assert recorded_rows(client, run.keys, 0) is None
    from streamgrp.core import codec
    from streamgrp.core.events import StepRowsTrained

    record(
        keys=keys,
        args=[0, 0, 0, codec.encode(StepRowsTrained(step=0, rank=0, attempt=0, rows=(1,), total=2))[codec.HEADER]],
    )
    assert recorded_rows(client, run.keys, 0) == Position(0, frozenset({1}))


def test_health_says_when_an_optimizer_step_needs_more_rows_than_the_window_holds(
    rolloutsample, client, redis_url, make_run
):
    run = make_run(n_samples=2, dp_size=1, batch_size=1, max_staleness=0)
    make_steps(client, run, groups=1, steps=5)  # one step formed, the run not finished; the window: one step
    feed = started(redis_url, run, ahead_steps=1)
    try:
        take(feed, 2)  # TRL holds every row of it, untrained, and waits for more
        wait_until(lambda: not feed._pending, timeout=5, message="the feed to see both rows taken")
        feed.check_health(0.2)  # TRL's poll: waiting, not yet for long
        time.sleep(0.3)
        with pytest.raises(ConfigError, match=r"max_staleness \+ 1 = 1.*Raise the run's --max-staleness"):
            feed.check_health(0.2)
    finally:
        feed.stop()

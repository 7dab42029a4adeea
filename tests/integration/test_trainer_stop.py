"""Data-parallel ranks leave a run at the same step (real server; the ranks are threads whose ``agree`` is
`thread_ranks.ThreadGroup`): a rank stopped while it waits for a step must not leave its peer inside that step."""

from __future__ import annotations

import threading

import redis
from made_steps import make_steps
from thread_ranks import ThreadGroup

from streamgrp.train.trainer import TrainerClient


def test_a_rank_stopped_between_steps_takes_its_peer_out_before_the_next_step(client, redis_url, make_run):
    run = make_run(n_samples=3, dp_size=2, batch_size=2)
    make_steps(client, run, groups=6, steps=3)
    vote = ThreadGroup()
    stops = [threading.Event(), threading.Event()]
    trained: dict[int, list[int]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def rank_loop(rank: int) -> None:
        try:
            trainer = TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.1, stop=stops[rank])
            with trainer.batches(rank=rank, world_size=2, agree=vote.for_rank(rank)) as batches:
                for batch in batches:
                    trained[rank].append(batch.step)
                    if rank == 0 and batch.step == 0:
                        stops[0].set()  # only rank 0 is stopped, in its first step; rank 1 never is
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=rank_loop, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank was left waiting for its peer"
    assert errors == []
    # Step 1's manifest was there for rank 1, but rank 0 voted to leave before it: neither trained it.
    assert trained == {0: [0], 1: [0]}
    assert vote.votes == {0: [False, True], 1: [False, False]}
    assert {rank: int(client.hget(run.keys.committed, str(rank))) for rank in (0, 1)} == {0: 0, 1: 0}
    # A restart resumes both ranks at step 1.
    assert TrainerClient(client, run).next_step(0) == TrainerClient(client, run).next_step(1) == 1


def test_ranks_that_reach_the_end_of_the_run_leave_after_the_last_step(client, redis_url, make_run):
    run = make_run(n_samples=3, dp_size=2, batch_size=2)
    make_steps(client, run, groups=4, steps=2)
    vote = ThreadGroup()
    trained: dict[int, list[int]] = {0: [], 1: []}

    def rank_loop(rank: int) -> None:
        trainer = TrainerClient(redis.Redis.from_url(redis_url), run, poll_s=0.1)
        with trainer.batches(rank=rank, world_size=2, agree=vote.for_rank(rank)) as batches:
            for batch in batches:
                trained[rank].append(batch.step)

    threads = [threading.Thread(target=rank_loop, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert trained == {0: [0, 1], 1: [0, 1]}
    assert vote.votes == {0: [False, False, True], 1: [False, False, True]}  # the third: the run finished

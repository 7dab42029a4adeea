"""A damaged step manifest (an entry at a step's id that does not decode; only the batcher should write
steps) fails every rank at that step with one clear error, and `verify` names the entry (real server)."""

from __future__ import annotations

import pytest
from made_steps import make_steps
from stored_payloads import delete_payload

from streamgrp.errors import RunFailed
from streamgrp.replay.verifier import verify
from streamgrp.store.keys import step_entry_id
from streamgrp.train.trainer import TrainerClient


def test_a_damaged_manifest_fails_the_rank_there_with_a_message_and_verify_names_it(client, make_run):
    run = make_run(n_samples=3, dp_size=1, batch_size=2)
    make_steps(client, run, groups=3, steps=1)
    client.xadd(run.keys.steps, {"h": b'{"kind": "step", "step": "one"}'}, id=step_entry_id(1))

    trained = []
    with pytest.raises(RunFailed, match=r"step 1's manifest \(steps entry 1-1\) does not decode"):
        with TrainerClient(client, run, poll_s=0.1).batches(rank=0, world_size=1) as batches:
            for batch in batches:
                trained.append(batch.step)
    assert trained == [0]
    assert int(client.hget(run.keys.committed, "0")) == 0  # step 0 committed; nothing of step 1
    kinds = [(d.kind, d.subject) for d in verify(client, run.keys).differences]
    assert ("step_undecodable", f"steps entry {step_entry_id(1)}") in kinds


def test_a_step_whose_sample_was_deleted_fails_every_rank_with_one_message(client, make_run):
    """A payload deleted under a written step (a credential that may XDEL payloads): the rank whose shard
    holds it cannot load the step, and both ranks of the group leave there with a RunFailed that says
    why, instead of one dying with a DigestMismatch and the other waiting in the step's collectives."""
    import threading

    from streamgrp.core import codec

    run = make_run(n_samples=3, dp_size=2, batch_size=2)
    make_steps(client, run, groups=4, steps=2)
    manifest = codec.decode(client.xrange(run.keys.steps, step_entry_id(1), step_entry_id(1))[0][1])
    victim = manifest.shards[1].groups[0].members[0].entry
    delete_payload(client, run.keys, victim)

    barrier = threading.Barrier(2)
    votes: list[list[int]] = [[], []]

    def reduce_max(rank):
        def reduce(values):  # an element-wise maximum over the two threads' ranks
            votes[rank] = list(values)
            barrier.wait(timeout=30)
            out = [max(a, b) for a, b in zip(*votes)]
            barrier.wait(timeout=30)
            return out

        return reduce

    outcomes: dict[int, object] = {}

    def rank(r):
        trained = []
        try:
            with TrainerClient(client, run, poll_s=0.1).batches(rank=r, world_size=2, agree=reduce_max(r)) as batches:
                for batch in batches:
                    trained.append(batch.step)
            outcomes[r] = trained
        except RunFailed as exc:
            outcomes[r] = (trained, str(exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert outcomes[1][0] == [0] and "step 1 cannot be trained as it was recorded" in outcomes[1][1]
    assert victim in outcomes[1][1]
    assert outcomes[0][0] == [0] and "another rank of the trainer group cannot train step 1" in outcomes[0][1]
    kinds = [(d.kind, d.field) for d in verify(client, run.keys).differences]
    assert ("payload_missing", f"payload {victim}") in kinds


def test_a_trainer_records_its_step_figures_for_the_report_and_a_replay_cannot(client, make_run):
    import orjson

    from streamgrp.errors import ReadOnlyBatch
    from streamgrp.replay.report_series import trainer_metrics
    from streamgrp.replay.steps import replay_step

    run = make_run(n_samples=3, dp_size=1, batch_size=2)
    make_steps(client, run, groups=4, steps=2)
    with TrainerClient(client, run, poll_s=0.1).batches(rank=0, world_size=1) as batches:
        for batch in batches:
            with pytest.raises(ValueError, match="'loss' is nan"):
                batch.record_metrics(loss=float("nan"))
            batch.record_metrics({"loss": 1.0 / (batch.step + 1)}, logprob_abs_diff_mean=0.01, note="ok")
            if batch.step == 1:
                break
    recorded = trainer_metrics(client.hgetall(run.keys.trainer_metrics))
    assert recorded == {
        0: {"loss": 1.0, "logprob_abs_diff_mean": 0.01, "note": "ok", "step": 0},
        1: {"loss": 0.5, "logprob_abs_diff_mean": 0.01, "note": "ok", "step": 1},
    }
    assert orjson.loads(client.hget(run.keys.trainer_metrics, "1"))["loss"] == 0.5
    with pytest.raises(ReadOnlyBatch, match="cannot record metrics of step 0"):
        replay_step(client, run.keys, 0, 0).record_metrics(loss=2.0)

"""A damaged step manifest (an entry at a step's id that does not decode; only the batcher should write
steps) fails every rank at that step with one clear error, and `verify` names the entry (real server)."""

from __future__ import annotations

import pytest
from made_steps import make_steps

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

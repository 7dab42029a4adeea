"""The checkpoint files (`streamgrp.train.checkpoint`): a model whose output layer is tied to its embedding
round-trips with its optimizer's state bit for bit (the shared tensor stored once, no pickle), and
retention keeps the newest K checkpoints up to the recorded one and removes what a lost attempt left."""

from __future__ import annotations

import orjson
import pytest
import torch

from streamgrp.core.events import CheckpointSaved
from streamgrp.train.checkpoint import (
    MODEL_FILE,
    checkpoint_name,
    load_training_state,
    prune_checkpoints,
    save_training_state,
)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # one tensor, two names, as SmolLM2's lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def _trained(steps: int) -> tuple[Tied, torch.optim.Adam]:
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.tensor([1, 2, 3])).logsumexp(-1).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def _saved(path, files, step=0) -> CheckpointSaved:
    return CheckpointSaved(
        step=step,
        version=step + 1,
        path=str(path),
        ranks=(0,),
        world_size=1,
        attempt=1,
        files=files,
        producer="test",
        seq=1,
    )


def test_a_tied_model_and_its_adam_state_round_trip_bit_for_bit(tmp_path):
    model, optimizer = _trained(3)
    path, files = save_training_state(tmp_path, step=2, attempt=1, model=model, optimizer=optimizer)
    from safetensors.torch import load_file

    assert len(load_file(path / MODEL_FILE)) == 1  # the shared tensor once
    fresh, fresh_optimizer = _trained(0)
    load_training_state(_saved(path, files, 2), fresh, fresh_optimizer)
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)
    expected, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert orjson.dumps(loaded["param_groups"]) == orjson.dumps(expected["param_groups"])  # betas: a list now
    for param, entries in expected["state"].items():
        assert all(torch.equal(loaded["state"][param][name], value) for name, value in entries.items())
    # and training goes on identically from there
    for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
        loss = m(torch.tensor([4, 5])).logsumexp(-1).sum()
        o.zero_grad()
        loss.backward()
        o.step()
    assert torch.equal(fresh.embed.weight, model.embed.weight)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_retention_keeps_the_newest_k_up_to_the_recorded_one_and_drops_a_lost_attempts(tmp_path, keep):
    names = [
        checkpoint_name(1, 1),
        checkpoint_name(3, 1),
        checkpoint_name(5, 1),  # recorded by attempt 1
        checkpoint_name(7, 1),  # written by attempt 1, killed before recording it
        checkpoint_name(7, 2),  # the step trained again by attempt 2, recorded
        checkpoint_name(9, 1),
    ]  # attempt 1's, never recorded, after it
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    removed = prune_checkpoints(tmp_path, newest=_saved(tmp_path / checkpoint_name(7, 2), {}, 7), keep=keep)
    kept = sorted(path.name for path in tmp_path.iterdir())
    expected = [checkpoint_name(s, 1) for s in (1, 3, 5)][3 - (keep - 1) :] if keep > 1 else []
    assert kept == sorted([*expected, checkpoint_name(7, 2), "notes"])
    assert {path.name for path in removed} == set(names) - set(kept)
    with pytest.raises(ValueError, match="at least the newest"):
        prune_checkpoints(tmp_path, newest=_saved(tmp_path / checkpoint_name(7, 2), {}, 7), keep=0)

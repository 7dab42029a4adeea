"""A version names one weight state (issue 38, item 5): publishing another state under a version that
already has one is refused, in Redis and on disk, and TRL's weight transfer, which syncs after every
optimizer step whether or not the run's version moved, never puts two states under one version."""

from __future__ import annotations

import pytest
import torch

from streamgrp.errors import WeightsConflict
from streamgrp.train.trl_async import StreamgrpWeights
from streamgrp.train.weights import WeightCache, decode_state, latest_key, publish, weights_key


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 2), value), "b": torch.arange(4, dtype=torch.float32) * value}


def test_publishing_another_state_under_a_version_is_refused(client, make_run):
    run = make_run()
    assert publish(client, run.keys, 0, _state(1.0)) is True
    assert publish(client, run.keys, 0, _state(1.0)) is False  # the same state again: nothing written
    with pytest.raises(WeightsConflict, match="already names another weight state"):
        publish(client, run.keys, 0, _state(2.0))
    assert publish(client, run.keys, 1, _state(2.0)) is True
    with pytest.raises(WeightsConflict, match="the latest published is 1"):
        publish(client, run.keys, 0, _state(3.0))  # a trainer retraining step 0 differently after a restart
    for version in range(2, 6):
        publish(client, run.keys, version, _state(float(version)))
    assert client.get(weights_key(run.keys, 0)) is None  # older than the last four: dropped
    assert publish(client, run.keys, 0, _state(7.0)) is False  # nothing to compare with, never served again
    assert int(client.get(latest_key(run.keys))) == 5


def test_two_syncs_with_different_weights_never_share_a_version(client, make_run):
    """TRL syncs after each optimizer step; the run's version moves when a step commits. Four syncs over
    two run versions (what published versions [0, 0, 0, 1] before): each published version holds the
    weights of the first sync at that version, and no version was written twice."""
    run = make_run()
    weights = StreamgrpWeights(client, run.keys)
    sent: list[tuple[int, dict[str, torch.Tensor]]] = []  # (run version at the sync, the weights sent)
    for sync, run_version in enumerate([0, 0, 0, 1, 1, 2]):
        client.set(run.keys.version, run_version)
        state = _state(float(sync + 1))  # every optimizer step changes the weights
        weights.send_weights(iter(state.items()))
        sent.append((run_version, state))
    assert weights.published == [0, 1, 2] and weights.skipped == 3
    for version in weights.published:
        first = next(state for at, state in sent if at == version)
        stored = decode_state(client.get(weights_key(run.keys, version)))
        assert all(torch.equal(stored[name], first[name]) for name in first)
    digests = {version: client.get(weights_key(run.keys, version)) for version in weights.published}
    assert len(set(digests.values())) == len(digests), "two versions hold one state, or one version two"
    cache = WeightCache(client, run.keys)
    assert torch.equal(cache.get(5)[1]["w"], _state(6.0)["w"])  # version 2: the sixth sync's weights

    restarted = StreamgrpWeights(client, run.keys)  # a restarted TRL at run version 2, other weights
    restarted.send_weights(iter(_state(9.0).items()))
    assert restarted.published == [] and restarted.skipped == 1
    assert torch.equal(decode_state(client.get(weights_key(run.keys, 2)))["w"], _state(6.0)["w"])

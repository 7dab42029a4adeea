"""`StreamgrpWeights`: TRL's weight-transfer protocol (``WeightTransferProtocol`` in
``trl/experimental/async_grpo/async_grpo_trainer.py``) publishing each weight sync to a streamgrp run
(`streamgrp.train.weights`, for small models), for workers using ``WeightCache``; imported with
`StreamgrpRollouts` from `streamgrp.train.trl_async`.

Owns which syncs are published: a version names one weight state, so a sync is published only when
the run's version moved since the last one. `StreamgrpRollouts` commits a step on the optimizer step
that completed it, before TRL's sync of that optimizer step, so version ``v`` holds the weights of
TRL's first sync after the optimizer step that completed the run's step ``v - 1``; the syncs in
between are not published (workers keep sampling the weights their samples are labelled with).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis
import torch

from streamgrp.errors import WeightsConflict
from streamgrp.store.keys import RunKeys
from streamgrp.train.weights import publish

__all__ = ["StreamgrpWeights"]

log = logging.getLogger(__name__)


class StreamgrpWeights:
    """TRL's weight-transfer protocol: each sync publishes the policy to the run, under its current version."""

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        self.client = client
        self.keys = keys
        self.published: list[int] = []  # the versions this process published, each once
        self.skipped = 0  # syncs whose version already named a weight state

    def init_weight_transfer(self) -> None:
        """Nothing to set up: the weights go through the run's server."""

    def pause(self) -> None:
        """Workers keep sampling from the weights they hold; nothing to pause."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        # Labelled with the steps TRL has taken so far (the run's version): workers asking for that
        # version get these weights. TRL's cold sync, before any step, publishes version 0. A sync
        # at a version already published (several optimizer steps in one run step, or a restarted
        # TRL) leaves that version's weights as they are: one version, one weight state.
        version = int(self.client.get(self.keys.version) or 0)
        if self.published and self.published[-1] >= version:
            self.skipped += 1
            return
        try:
            publish(self.client, self.keys, version, {name: tensor.detach().cpu() for name, tensor in iterator})
        except WeightsConflict as exc:
            self.skipped += 1
            log.info("TRL's weights not published: %s", exc)
            return
        self.published.append(version)

    def resume(self) -> None:
        """Nothing was paused."""

    def destroy(self) -> None:
        """Nothing to release."""

"""TRL's asynchronous GRPO trainer (``trl.experimental.async_grpo``) training from a streamgrp run.

    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from streamgrp.train.trl_async import StreamgrpRollouts, StreamgrpWeights

    trainer = TrainerClient(client, run)            # a run with dp_size 1 (TRL splits micro-batches itself)
    AsyncGRPOTrainer(model=path, args=AsyncGRPOConfig(max_steps=..., ...), train_dataset=placeholder,
                     processing_class=tokenizer, rollout_worker=StreamgrpRollouts(trainer),
                     weight_transfer=StreamgrpWeights(client, run.keys)).train()

`StreamgrpRollouts` implements TRL's ``RolloutWorkerProtocol`` (read in
``trl/experimental/async_grpo/async_grpo_trainer.py``): ``rollout_buffer`` (TRL's dataset drains it
with ``get``/``qsize``; we fill it), ``metrics_queue`` (dicts TRL merges into its logs), ``start``,
``stop``, ``update_model_version`` and ``check_health``. So generation, grouping, staleness and
replay stay streamgrp's: workers sample, the assembler decides groups, the batcher drops stale
groups and forms steps, and every step can be replayed. TRL only trains.

Owns, on one background thread started by ``start``: reading the run's steps in order as rank 0
of 1, turning each row into TRL's ``RolloutSample`` (whole row as ``input_ids``, ``loss_mask`` as
``completion_mask``, ``logprobs`` as ``old_log_probs``, one advantage per row by
`streamgrp.normalize` over the actual group sizes, ``group_id`` unique per group of the run), and
committing. A step commits once TRL has taken its last sample from the buffer: commit on advance,
as the trainer API does. Committing then, not at TRL's optimizer step, is what keeps the two from
waiting on each other: TRL's planner may need more samples than the run's staleness window lets
the feeder issue before a commit. TRL's planner and accelerate's dispatcher hold at most a
micro-batch or two taken but not yet trained; a crash loses those, as it loses TRL's own queue.
At most ``ahead_steps`` steps sit in the buffer not fully taken.

TRL's own staleness check sees each sample stamped with the live TRL version when it was put in
the buffer, so it only bounds how long a sample waits there: streamgrp already dropped groups
older than the run's ``max_staleness`` when it formed the step (``streamgrp/staleness_max`` in
TRL's logs shows what was trained). Set TRL's ``max_steps``: the prompts live in the run, so an
epoch over ``train_dataset`` means nothing, and when the run finishes with TRL wanting more,
``check_health`` raises `RunEnded`.

`StreamgrpWeights` implements TRL's ``WeightTransferProtocol`` by publishing the weights to the run
(`streamgrp.train.weights`, for small models) under the run's current version, so workers using
``WeightCache`` sample from them. TRL syncs after every optimizer step, which need not line up with
the run's steps; a version names one weight state, so a sync is published only when the run's
version has moved since the last one: version ``v`` is the weights of TRL's first sync after the run
reached ``v``, and the syncs between two versions are not published (workers keep sampling the
weights their samples are labelled with). For large models keep TRL's own transfer (NCCL to vLLM) and
point the workers' rollout function at that vLLM server instead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import torch

from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError, RunEnded, StreamgrpError, WeightsConflict
from streamgrp.store.keys import RunKeys
from streamgrp.train.advantages import normalize
from streamgrp.train.batch import Batch
from streamgrp.train.trainer import TrainerClient
from streamgrp.train.weights import publish

__all__ = ["StreamgrpRollouts", "StreamgrpWeights", "TakenCounter"]

log = logging.getLogger(__name__)

GRPO_NORM = NormSpec("group", "group")


class TakenCounter(queue.Queue):
    """The rollout buffer: a ``queue.Queue`` (what TRL drains) that counts the items taken from it."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0

    def _get(self) -> Any:
        # Queue calls _get under its own lock, once per item handed out: the count cannot race.
        item = super()._get()
        self.taken += 1
        return item


@dataclass
class _Pushed:
    """A step whose samples are in the buffer: committed once ``taken`` reaches ``end``."""

    batch: Batch
    end: int


class StreamgrpRollouts:
    """TRL's rollout worker, fed by a streamgrp run's steps (see the module docstring)."""

    def __init__(self, trainer: TrainerClient, *, advantages: NormSpec | None = None, ahead_steps: int = 2,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        if trainer.run_.config.dp_size != 1:
            raise ConfigError(f"run {trainer.keys.run!r} batches for dp_size={trainer.run_.config.dp_size}, but TRL's "
                              "async GRPO trainer reads every sample on its main process and splits micro-batches "
                              "over its own ranks: start the run with --dp-size 1")
        if ahead_steps < 1:
            raise ConfigError(f"ahead_steps={ahead_steps}: at least one step must be in the buffer")
        config = trainer.run_.config
        self.trainer = trainer
        self.spec = advantages or config.adv_norm or config.reward_norm or GRPO_NORM
        self.ahead_steps = ahead_steps
        self.decode = decode
        self.rollout_buffer = TakenCounter()
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=4096)
        self._group_stride = config.max_batch_size  # group ids step * stride + index never collide
        self._live_version = 0
        self._pushed_rows = 0
        self._pending: deque[_Pushed] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ended_at: int | None = None  # the run's step count once it finished
        self._beat = time.time()
        self.committed_steps = 0

    # -- TRL's RolloutWorkerProtocol ------------------------------------------------------------------

    def start(self) -> None:
        """Start feeding the buffer (TRL calls this once, after its first weight sync)."""
        if self._thread is not None:
            return
        self._sample_type = _rollout_sample_type()
        self._beat = time.time()
        self._thread = threading.Thread(target=self._run, name="streamgrp-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop feeding; steps already fully taken are committed first. TRL calls this at train end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def update_model_version(self, model_version: int) -> None:
        """TRL's live policy version, stamped on samples put in the buffer from now on."""
        self._live_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise when feeding failed (the run failed, the server is gone), ended, or stopped moving."""
        if self._error is not None:
            if isinstance(self._error, StreamgrpError):
                raise self._error
            raise RuntimeError(f"streamgrp rollout feed failed: {self._error!r}") from self._error
        if self._ended_at is not None and not self._pending and self.rollout_buffer.qsize() == 0:
            raise RunEnded(f"streamgrp run {self.trainer.keys.run!r} finished after {self._ended_at} steps and TRL "
                           "has taken every sample, but it asks for more: lower AsyncGRPOConfig.max_steps, or let the "
                           "batcher write more steps (--max-steps)")
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the streamgrp rollout feed is not running: call start() (TRL does on train begin)")
        age = time.time() - self._beat
        if age > stale_after_s:
            raise RuntimeError(f"the streamgrp rollout feed has not moved for {age:.0f}s > {stale_after_s:.0f}s; "
                               "is the server reachable?")

    # -- the feeding thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            step = self.trainer.next_step(0)
            while not self._stop.is_set():
                self._commit_taken()
                if self._ended_at is not None and not self._pending:
                    return
                if self._ended_at is not None or len(self._pending) >= self.ahead_steps:
                    self._stop.wait(self.trainer.poll_ms / 1000)  # until TRL takes more
                    self._beat = time.time()
                    continue
                manifest = self.trainer.wait_for_step(step, stop_check=self._interrupted)
                self._beat = time.time()
                if manifest is None:
                    if not self._interrupted():
                        self._ended_at = step  # the run finished: feed nothing more, commit what TRL takes
                    continue
                self._push(self.trainer.load(manifest, 0, 1))
                step += 1
            self._commit_taken()
        except BaseException as exc:  # surfaced to TRL by check_health, on its own thread
            log.error("streamgrp rollout feed stopped: %s", exc)
            self._error = exc

    def _interrupted(self) -> bool:
        self._beat = time.time()
        return self._stop.is_set() or self._commit_due()

    def _commit_due(self) -> bool:
        with self.rollout_buffer.mutex:
            taken = self.rollout_buffer.taken
        return bool(self._pending) and self._pending[0].end <= taken

    def _commit_taken(self) -> None:
        while self._commit_due():
            self._pending.popleft().batch.commit()
            self.committed_steps += 1

    def _push(self, batch: Batch) -> None:
        samples = list(self._samples(batch))
        self._pushed_rows += len(samples)
        self._pending.append(_Pushed(batch, self._pushed_rows))
        for sample in samples:
            sample.enqueued_at = time.time()
            self.rollout_buffer.put(sample)
        staleness = int(batch.version - batch.versions.min()) if batch.rows else 0
        try:
            self.metrics_queue.put_nowait({"streamgrp/step": float(batch.step), "streamgrp/staleness_max": staleness,
                                           "streamgrp/rows_per_step": float(batch.rows),
                                           "streamgrp/groups_per_step": float(len(batch.task_ids))})
        except queue.Full:
            pass  # TRL stopped logging; never block the feed for a metric

    def _samples(self, batch: Batch) -> Iterator[Any]:
        """One TRL ``RolloutSample`` per row, unpadded, in group order."""
        advantages = normalize(batch.rewards, batch.group_sizes, self.spec).tolist()
        lengths = batch.attention_mask.sum(dim=1).tolist()
        group_of_row = torch.repeat_interleave(torch.arange(len(batch.task_ids)), batch.group_sizes).tolist()
        rewards = batch.rewards.tolist()
        for row, (length, group) in enumerate(zip(lengths, group_of_row)):
            ids = batch.token_ids[row, :length].numpy().astype(np.int64)
            mask = batch.loss_mask[row, :length].numpy().astype(np.int64)
            prompt, completion = self._messages(ids, mask, batch.task_ids[group])
            yield self._sample_type(
                prompt=prompt, completion=completion, input_ids=ids, completion_mask=mask,
                old_log_probs=batch.logprobs[row, :length].numpy().astype(np.float32), advantage=advantages[row],
                model_version=self._live_version, group_id=batch.step * self._group_stride + group,
                metrics={"reward": rewards[row]})

    def _messages(self, ids: np.ndarray, mask: np.ndarray, task_id: str) -> tuple[list[dict], list[dict]]:
        """What TRL shows in its traces: the decoded prompt and completion, or the task id."""
        if self.decode is None:
            return [{"role": "user", "content": task_id}], []
        first = int(mask.argmax()) if mask.any() else len(ids)
        return ([{"role": "user", "content": self.decode(ids[:first].tolist())}],
                [{"role": "assistant", "content": self.decode(ids[first:].tolist())}])


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


def _rollout_sample_type() -> type:
    try:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
    except ImportError as exc:
        raise ConfigError(f"TRL's async GRPO trainer is not importable ({exc}); install it with "
                          "pip install 'streamgrp[trl]'") from None
    return RolloutSample

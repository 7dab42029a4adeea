"""What `StreamgrpRollouts` hands TRL: a step's rows as TRL's ``RolloutSample`` and the buffer TRL drains.

Owns the translation of one loaded `Batch` into TRL's terms (`streamgrp.train.trl_async` says why each
field is what it is): `rollout_samples`, one ``RolloutSample`` per row, unpadded, in group order (the whole
row as ``input_ids``, ``loss_mask`` as ``completion_mask``, ``logprobs`` as ``old_log_probs``, one
advantage per row by `streamgrp.normalize` over the actual group sizes, ``group_id`` unique per group of
the run); `step_logs`, the values TRL merges into its logs for the step; and `TakenCounter`, the
``rollout_buffer`` that counts what TRL took and stamps each sample with TRL's live version. Deliberately
ignores which rows to hand and when a step commits: that is the feed's (`StreamgrpRollouts`).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError
from streamgrp.train.advantages import normalize
from streamgrp.train.batch import Batch

#: The advantages when neither the feed nor the run names a normalization: GRPO's, over each group.
GRPO_NORM = NormSpec("group", "group")


class TakenCounter(queue.Queue):
    """The rollout buffer: a ``queue.Queue`` (what TRL drains) that counts the items taken from it and stamps
    each with TRL's live version as it is taken."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0
        self.version = 0

    def _get(self) -> Any:
        # Queue calls _get under its own lock, once per item handed out: the count cannot race. The stamp
        # makes TRL's own staleness check pass: streamgrp already dropped what was too old when it formed
        # the step, and a sample TRL dropped here would never be trained, so its step never committed.
        item = super()._get()
        item.model_version = self.version
        self.taken += 1
        return item


def rollout_samples(
    batch: Batch,
    sample_type: type,
    *,
    spec: NormSpec,
    group_stride: int,
    buffer: TakenCounter,
    decode: Callable[[list[int]], str] | None,
) -> Iterator[Any]:
    """One TRL ``RolloutSample`` per row, unpadded, in group order (``sample_type``: `rollout_sample_type`)."""
    advantages = normalize(batch.rewards, batch.group_sizes, spec).tolist()
    lengths = batch.attention_mask.sum(dim=1).tolist()
    group_of_row = torch.repeat_interleave(torch.arange(len(batch.task_ids)), batch.group_sizes).tolist()
    rewards = batch.rewards.tolist()
    # TRL's RolloutSample has no per-token versions: each row's oldest and newest ride in its metrics,
    # and the staleness mask is already in the loss mask it takes as ``completion_mask``.
    oldest = batch.versions.tolist()
    spans = batch.version_spans.tolist() if batch.version_spans is not None else [0] * len(oldest)
    for row, (length, group) in enumerate(zip(lengths, group_of_row)):
        ids = batch.token_ids[row, :length].numpy().astype(np.int64)
        mask = batch.loss_mask[row, :length].numpy().astype(np.int64)
        prompt, completion = _messages(ids, mask, batch.task_ids[group], decode)
        yield sample_type(
            prompt=prompt,
            completion=completion,
            input_ids=ids,
            completion_mask=mask,
            old_log_probs=batch.logprobs[row, :length].numpy().astype(np.float32),
            advantage=advantages[row],
            model_version=buffer.version,
            group_id=batch.step * group_stride + group,
            metrics={
                "reward": rewards[row],
                "version_oldest": float(oldest[row]),
                "version_newest": float(oldest[row] + spans[row]),
            },
        )


def _messages(
    ids: np.ndarray, mask: np.ndarray, task_id: str, decode: Callable[[list[int]], str] | None
) -> tuple[list[dict], list[dict]]:
    """What TRL shows in its traces: the decoded prompt and completion, or the task id."""
    if decode is None:
        return [{"role": "user", "content": task_id}], []
    first = int(mask.argmax()) if mask.any() else len(ids)
    return (
        [{"role": "user", "content": decode(ids[:first].tolist())}],
        [{"role": "assistant", "content": decode(ids[first:].tolist())}],
    )


def step_logs(batch: Batch) -> dict[str, float]:
    """The step's values TRL merges into its logs (``streamgrp/staleness_max`` shows what was trained)."""
    staleness = int(batch.version - batch.versions.min()) if batch.rows else 0
    spans = batch.version_spans
    return {
        "streamgrp/step": float(batch.step),
        "streamgrp/staleness_max": staleness,
        "streamgrp/version_span_max": float(spans.max()) if spans is not None and batch.rows else 0.0,
        "streamgrp/stale_masked_tokens": float(batch.stale_masked_tokens),
        "streamgrp/rows_per_step": float(batch.rows),
        "streamgrp/groups_per_step": float(len(batch.task_ids)),
    }


def rollout_sample_type() -> type:
    """TRL's ``RolloutSample``; `ConfigError` saying how to install TRL when it is missing."""
    try:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
    except ImportError as exc:
        raise ConfigError(
            f"TRL's async GRPO trainer is not importable ({exc}); install it with pip install 'streamgrp[trl]'"
        ) from None
    return RolloutSample

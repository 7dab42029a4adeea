"""A trainer rank's batches as a PyTorch ``IterableDataset``, for loops that take a ``DataLoader``.

    dataset = StepDataset(TrainerClient(client, run), advantages="run")   # rank from torchrun or flags
    with dataset:                                  # optional: an exception records a failed step
        for item in dataset.loader():              # DataLoader(dataset, batch_size=None)
            loss = my_step(item["token_ids"], item["loss_mask"], item["advantages"], ...)

Owns turning each `Batch` of `TrainerClient.batches` into one item (a dict of tensors, one per
step), and nothing about delivery: the item is this rank's shard of one step, and moving on to the
next item commits the step, as the trainer API does (a loop that stops early leaves its step for
the next start). So a step commits after the loop body that trained on it, optimizer step
included: take the optimizer step in the body of the item it trained on, since gradients
accumulated over several items would commit the earlier items' steps before their optimizer step. The DataLoader
must not batch (``batch_size=None``: an item already is a batch)
and must not use worker processes (``num_workers=0``: only the training process may commit).

An item's keys, and what TRL, verl and OpenRLHF call the same tensors (streamgrp's rows are whole
sequences, prompt and completion, right-padded to the longest row; ``loss_mask`` marks the
completion tokens the loss counts):

==================  =================  ===============================  ==================  ===================
streamgrp key       shape, dtype       TRL (GRPOTrainer)                verl (DataProto)    OpenRLHF
==================  =================  ===============================  ==================  ===================
token_ids           [R, T] int64       prompt_ids + completion_ids      input_ids           sequences
attention_mask      [R, T] bool        prompt_mask + completion_mask    attention_mask      attention_mask
loss_mask           [R, T] bool        completion_mask                  response_mask       action_mask
logprobs            [R, T] float32     old_per_token_logps              old_log_probs       action_log_probs
advantages          [R] float32        advantages                       advantages          advantages
rewards             [R] float32        rewards (functions summed)       token_level_scores  rewards
versions            [R] int64          (none)                           (none)              (none)
token_versions      [R, T] int64       (none)                           (none)              (none)
version_spans       [R] int64          (none)                           (none)              (none)
group_sizes         [G] int64          (fixed num_generations)          uid (per row)       (fixed n_samples)
==================  =================  ===============================  ==================  ===================

Plus ``step``, ``rank``, ``version``, ``step_loss_tokens`` and ``stale_masked_tokens`` (ints) and
``task_ids`` (one str per group). ``versions`` is each row's version (its sample's oldest),
``token_versions`` each token's (0 in the padding; AReaL's per-token ``versions``), ``version_spans``
each row's newest minus oldest; under ``--staleness mask`` the ``loss_mask`` no longer counts the
tokens older than the window (``stale_masked_tokens`` of them). TRL's, verl's and OpenRLHF's response-side tensors
start where the prompt ends; slice a
row with its ``loss_mask`` to get them. ``advantages`` is present when asked for: one value per row
(GRPO's), ``streamgrp.normalize`` over the actual group sizes; broadcast it over ``loss_mask`` for
per-token advantages (verl's token_level_scores put the reward on the last response token). Divide
summed token losses by ``step_loss_tokens`` (all ranks' loss tokens) so that ragged shards do not
bias the gradient. The README's "Using streamgrp from your trainer" has the table with AReaL's names
and TRL's async ``RolloutSample`` fields too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError
from streamgrp.train.advantages import BatchReduce, normalize
from streamgrp.train.batch import Batch
from streamgrp.train.distributed import resolve
from streamgrp.train.trainer import BatchStream, TrainerClient

__all__ = ["ITEM_TENSORS", "StepDataset", "batch_item"]

#: The tensor keys of every item, in the order of the table above (``advantages`` only when asked for).
ITEM_TENSORS = (
    "token_ids",
    "attention_mask",
    "loss_mask",
    "logprobs",
    "rewards",
    "versions",
    "token_versions",
    "version_spans",
    "group_sizes",
)


class StepDataset(IterableDataset):
    """One item per step: this rank's shard as a dict of tensors; the previous step commits on advance.

    ``rank`` and ``world_size`` default to torchrun's ``RANK``/``WORLD_SIZE`` (else 0 and 1).
    ``advantages`` adds per-row advantages: a `NormSpec`, or ``"run"`` for the run's recorded
    ``adv_norm`` (else ``reward_norm``). Batch statistics over several ranks need ``batch_reduce``
    (sum over ranks), by default ``torch.distributed.all_reduce`` once the process group is up.
    """

    def __init__(
        self,
        trainer: TrainerClient,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        advantages: NormSpec | Literal["run"] | None = None,
        batch_reduce: BatchReduce | None = None,
    ) -> None:
        super().__init__()
        ranks = resolve(rank=rank, world_size=world_size)
        self.trainer = trainer
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.spec = _advantage_spec(trainer, advantages)
        self.batch_reduce = batch_reduce or _all_ranks_sum(self.world_size)
        self._stream: BatchStream | None = None
        trainer.batches(rank=self.rank, world_size=self.world_size)  # refuse a bad rank or world size now

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if get_worker_info() is not None:
            raise ConfigError(
                "StepDataset runs in a DataLoader worker process; use num_workers=0 (the default): "
                "only the training process may commit its steps, and each item is already a batch"
            )
        self._stream = self.trainer.batches(rank=self.rank, world_size=self.world_size)
        for batch in self._stream:
            yield batch_item(batch, self.spec, self.batch_reduce)

    def loader(self, **kwargs: Any) -> DataLoader:
        """A ``DataLoader`` over the steps: ``batch_size=None`` and ``num_workers=0``, other options passed on."""
        for name, required in (("batch_size", None), ("num_workers", 0)):
            if kwargs.get(name, required) != required:
                raise ConfigError(
                    f"StepDataset.loader needs {name}={required!r}, got {kwargs[name]!r}: each item is "
                    "already one step's batch, committed by the training process itself"
                )
        return DataLoader(self, batch_size=None, num_workers=0, **kwargs)

    @property
    def current(self) -> Batch | None:
        """The `Batch` behind the item being trained on (to commit or fail it explicitly)."""
        return self._stream.current if self._stream is not None else None

    def __enter__(self) -> StepDataset:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._stream is not None:
            self._stream.__exit__(exc_type, exc, tb)  # records StepFailed for the step being trained


def batch_item(batch: Batch, spec: NormSpec | None = None, batch_reduce: BatchReduce | None = None) -> dict[str, Any]:
    """One `Batch` as a dataset item: the `ITEM_TENSORS`, ``advantages`` when ``spec`` is given, and the scalars."""
    item: dict[str, Any] = {name: getattr(batch, name) for name in ITEM_TENSORS}
    if spec is not None:
        item["advantages"] = normalize(batch.rewards, batch.group_sizes, spec, batch_reduce=batch_reduce)
    item.update(
        step=batch.step,
        rank=batch.rank,
        version=batch.version,
        step_loss_tokens=batch.step_loss_tokens,
        stale_masked_tokens=batch.stale_masked_tokens,
        task_ids=list(batch.task_ids),
    )
    return item


def _advantage_spec(trainer: TrainerClient, advantages: NormSpec | str | None) -> NormSpec | None:
    if advantages is None or isinstance(advantages, NormSpec):
        return advantages
    if advantages != "run":
        raise ConfigError(
            f"advantages={advantages!r}: pass a NormSpec, 'run' (the run's recorded normalization) or None"
        )
    recorded = trainer.joined_run.config.adv_norm or trainer.joined_run.config.reward_norm
    if recorded is None:
        raise ConfigError(
            f"advantages='run' but run {trainer.keys.run!r} records neither adv_norm nor reward_norm; "
            "pass a NormSpec, e.g. NormSpec('group', 'group')"
        )
    return recorded


def _all_ranks_sum(world_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        if world_size == 1:
            return tensor
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError(
                f"batch-level normalization over {world_size} ranks needs their sums: initialise "
                "torch.distributed (e.g. under torchrun) or pass batch_reduce="
            )
        dist.all_reduce(tensor)
        return tensor

    return reduce

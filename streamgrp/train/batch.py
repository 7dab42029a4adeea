"""`Batch`: one rank's shard of one step as padded tensors, and committing or failing it.

A batch from `TrainerClient.batches` records progress through its owner; a replayed or loaded batch
has no owner and refuses to (`ReadOnlyBatch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

import torch

from streamgrp.errors import ReadOnlyBatch


class BatchOwner(Protocol):
    """What records a live batch's outcome (the `TrainerClient` that loaded it)."""

    def _commit(self, batch: Batch) -> None: ...

    def _fail(self, batch: Batch, exc: BaseException | str) -> None: ...

    def _record_metrics(self, batch: Batch, values: Mapping[str, float | int | bool | str]) -> None: ...


class ShardTensors(TypedDict):
    """The tensors of a `Batch` made from its samples (`streamgrp.train.shard_tensors.shard_tensors`), by field name."""

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    attention_mask: torch.Tensor
    rewards: torch.Tensor
    versions: torch.Tensor
    version_spans: torch.Tensor


@dataclass
class Batch:
    """One rank's shard of one step, as padded tensors (rows x longest row), in group order.

    ``group_sizes`` are the actual usable rows per group (use them with `streamgrp.normalize`);
    ``step_loss_tokens`` counts the valid loss tokens of the whole step across all ranks, the
    denominator of the globally token-weighted loss.
    """

    step: int
    rank: int
    world_size: int
    version: int
    task_ids: list[str]
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    attention_mask: torch.Tensor
    rewards: torch.Tensor
    versions: torch.Tensor
    group_sizes: torch.Tensor
    step_loss_tokens: int
    digest: str
    run: str = ""
    #: The trainer group's attempt this batch is trained in, and the policy version committing it publishes
    #: (`streamgrp.train.attempt`): ``step + 1`` until a group rolls back, above every earlier version after.
    attempt: int = 0
    next_version: int = 0
    #: Whether some rank committed this step in an earlier attempt whose weights were lost.
    retrained: bool = False
    #: Per row: the newest minus the oldest version among its sample's tokens, [rows] int64.
    version_spans: torch.Tensor | None = None
    #: Per row, its tokens' ``(version, count)`` runs (None: the row's version throughout); None when no
    #: sample has per-token versions. What `token_versions` is made from (`streamgrp.train.shard_tensors.row_runs`).
    version_runs: tuple[tuple[tuple[int, int], ...] | None, ...] | None = field(default=None, repr=False)
    #: Loss tokens the run's ``staleness="mask"`` cleared from this shard (their version was older than
    #: ``version - max_staleness``); ``step_loss_tokens`` counts the tokens as published, before it.
    stale_masked_tokens: int = 0
    _client: BatchOwner | None = field(repr=False, default=None)
    settled: bool = field(default=False, repr=False)
    _token_versions: torch.Tensor | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def token_versions(self) -> torch.Tensor:
        """Each token's policy version, [rows, T] int64 (0 in the padding): the sample's per-token
        versions (``meta["token_versions"]``) where it has them, else its version. ``versions`` stays
        the per-row one (the sample's oldest). Made on first use: a loop that never asks pays nothing."""
        if self._token_versions is None:
            from streamgrp.train.shard_tensors import token_versions  # that module imports this one

            self._token_versions = token_versions(self.versions, self.attention_mask, self.version_runs)
        return self._token_versions

    def commit(self) -> None:
        """Record this rank's step as done (idempotent)."""
        owner = self._owner("commit")
        if not self.settled:
            owner._commit(self)
            self.settled = True

    def fail(self, exc: BaseException | str) -> None:
        """Record a failed-step event with the exception text; the step stays uncommitted."""
        owner = self._owner("fail")
        if not self.settled:
            owner._fail(self, exc)
            self.settled = True

    def record_metrics(
        self, values: Mapping[str, float | int | bool | str] | None = None, /, **more: float | int | bool | str
    ) -> None:
        """Record this step's figures (loss, logprob mismatch, anything) for the report, ``streamgrp export``
        and the summary: ``batch.record_metrics(loss=0.31, logprob_abs_diff_mean=0.012)``. The report charts
        ``loss`` and ``logprob_abs_diff_mean``; every key is kept. One record per step: call it on one rank
        (rank 0), or the last rank's record stands. Values are finite numbers, booleans or short text;
        anything else raises ValueError, before anything is written."""
        self._owner("record metrics of")._record_metrics(self, {**(values or {}), **more})

    def _owner(self, action: str) -> BatchOwner:
        """The trainer rank that records this batch's progress; raises `ReadOnlyBatch` for a replayed or loaded one."""
        if self._client is None:
            raise ReadOnlyBatch(
                f"cannot {action} step {self.step} rank {self.rank}: this batch is a replay (or was loaded from a "
                "file), not a trainer rank's live batch; only batches from TrainerClient.batches() record progress"
            )
        return self._client

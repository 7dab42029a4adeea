"""`RunConfig`: the run-wide semantics recorded as the run's first event."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from streamgrp.config.base import _Settings
from streamgrp.core.policy import GroupPolicy, NormSpec


class RunConfig(_Settings):
    """Run-wide semantics, recorded once as the run's first event."""

    n_samples: int = Field(4, description="slots per task (samples per prompt)")
    min_usable_group_size: int | None = Field(None, description="explicit minimum usable slots per group")
    drop_incomplete_group: bool = Field(False, description="drop any group with an unusable slot")
    reward_norm: NormSpec | None = Field(
        None, description="reward normalization: 'group,group', 'batch,batch', JSON, or none"
    )
    adv_norm: NormSpec | None = Field(None, description="advantage normalization, same forms as --reward-norm")
    group_timeout_s: float | None = Field(
        600.0, gt=0, description="seconds after issue when missing slots count as timeout"
    )
    dp_size: int = Field(1, ge=1, description="data-parallel trainer ranks; every step has one shard per rank")
    batch_size: int = Field(8, ge=1, description="groups per step (fixed mode) and the feeder's window unit")
    batch_mode: Literal["fixed", "dynamic"] = Field(
        "fixed",
        description="fixed: batch_size groups per step; dynamic: the trainable groups of a round, at least dp_size",
    )
    max_batch_size: int = Field(
        4096,
        ge=1,
        description="most groups one step may hold (dynamic mode takes at most "
        "this many per step; fixed mode's batch_size may not exceed it)",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="the staleness window: groups more than this many policy versions "
        "old are dropped (or, per --staleness, waited for or masked)",
    )
    staleness: Literal["drop", "wait", "mask"] = Field(
        "drop",
        description="what happens to work older than max_staleness: drop (the whole group, reason stale); "
        "wait (the feeder and the batcher hold tasks and steps that would let pending work turn stale, so none "
        "is dropped); mask (groups are kept; tokens older than the window get loss mask 0)",
    )
    mask_min_tokens: int = Field(
        1,
        ge=1,
        description="staleness mask: a row keeps its loss only while at least this "
        "many of its generated tokens are inside the window (else its whole row is masked)",
    )
    max_empty_rounds: int = Field(8, ge=1, description="stall bound: consecutive rounds without a trainable group")
    stall_timeout_s: float = Field(1800.0, ge=0, description="stall bound: seconds without progress (both must hold)")
    partitions: int = Field(
        1,
        ge=1,
        le=64,
        description="task partitions, each with its own streams (under its own hash "
        "tag, so on its own Redis Cluster node) and its own assembler (`assembler --partition`)",
    )
    vocab_size: int | None = Field(
        None,
        ge=1,
        le=2**31 - 1,
        description="the model's vocabulary size: workers and "
        "assemblers refuse a sample with a token id at or above it (unset: ids are only "
        "checked to be at least 0)",
    )
    payload_layout: Literal["keys", "stream"] = Field(
        "keys",
        description="where a new run keeps sample payloads: keys (one key per sample, written without "
        "passing through Lua) or stream (the payloads stream, which streamgrp versions before the layout existed "
        "read); a run recorded without it is a stream run",
    )

    @model_validator(mode="after")
    def _check_batching(self) -> RunConfig:
        if self.batch_mode == "fixed" and self.batch_size < self.dp_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) is smaller than dp_size ({self.dp_size}): every rank "
                "needs at least one group per step; raise batch_size or lower dp_size"
            )
        if self.batch_mode == "fixed" and self.batch_size > self.max_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) is over max_batch_size ({self.max_batch_size}); lower "
                "batch_size or raise max_batch_size"
            )
        if self.max_batch_size < self.dp_size:
            raise ValueError(
                f"max_batch_size ({self.max_batch_size}) is smaller than dp_size ({self.dp_size}); "
                "every rank needs at least one group per step"
            )
        return self

    @model_serializer(mode="wrap")
    def _omit_unset_vocab(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A run without a vocabulary records what runs recorded before the field existed, so streamgrp
        # versions without it (which refuse unknown fields) still open the run.
        settings = handler(self)
        if settings.get("vocab_size", 0) is None:
            del settings["vocab_size"]
        # Likewise the staleness policy at its defaults: runs that drop record what they always recorded.
        if settings.get("staleness") == "drop":
            del settings["staleness"]
        if settings.get("mask_min_tokens") == 1:
            del settings["mask_min_tokens"]
        return settings

    def policy(self) -> GroupPolicy:
        return GroupPolicy(
            n_samples=self.n_samples,
            min_usable_group_size=self.min_usable_group_size,
            drop_incomplete_group=self.drop_incomplete_group,
            reward_norm=self.reward_norm,
            adv_norm=self.adv_norm,
        )

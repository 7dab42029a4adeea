"""Group policy: how many slots a task has and when a group of them is usable (SPEC section 2).

Owns the configuration (`GroupPolicy`, `NormSpec`), the derivation of the resolved minimum usable
group size, and the validation of inconsistent settings. Deciding an actual group lives in
`streamgrp.core.decision`; normalizing values lives in `streamgrp.train.advantages`. Pure: no I/O, no torch.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Level = Literal["group", "batch"] | None


class NormSpec(BaseModel):
    """How rewards or advantages are centered and scaled.

    A level is ``"group"`` (statistics over the members of one group), ``"batch"`` (over the whole
    step, all DP ranks) or ``None`` (no centering for the mean; std 1 and eps 0 for the std).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mean_level: Level
    std_level: Level
    leave_one_out: bool = False
    unbiased: bool = True
    eps: float = Field(default=1e-5, ge=0.0)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # SPEC writes NormSpec(mean_level, std_level, leave_one_out, unbiased, eps): accept positions.
        names = ("mean_level", "std_level", "leave_one_out", "unbiased", "eps")
        if len(args) > len(names):
            raise TypeError(f"NormSpec takes at most {len(names)} positional arguments ({', '.join(names)})")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"NormSpec got two values for {name!r}")
            kwargs[name] = value
        super().__init__(**kwargs)

    @property
    def uses_group_statistics(self) -> bool:
        return self.mean_level == "group" or self.std_level == "group"


class GroupPolicy(BaseModel):
    """The run-wide rule for groups: target size, minimum usable size, normalization specs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_samples: int
    min_usable_group_size: int | None = None
    drop_incomplete_group: bool = False
    reward_norm: NormSpec | None = None
    adv_norm: NormSpec | None = None

    @property
    def uses_group_statistics(self) -> bool:
        return any(spec is not None and spec.uses_group_statistics for spec in (self.reward_norm, self.adv_norm))

    @property
    def minimum_usable_group_size(self) -> int:
        """The resolved minimum: explicit value, else min(2, n_samples) under group statistics, else 1."""
        if self.min_usable_group_size is not None:
            return self.min_usable_group_size
        if self.uses_group_statistics:
            return min(2, self.n_samples)
        return 1

    @property
    def one_sample_per_slot(self) -> bool:
        """Whether the one-sample-per-slot contract is armed (resolved minimum >= 2 and n_samples >= 2)."""
        return self.minimum_usable_group_size >= 2 and self.n_samples >= 2

    @model_validator(mode="after")
    def _check_consistency(self) -> GroupPolicy:
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1 (got {self.n_samples}): sample each prompt at least once")
        explicit = self.min_usable_group_size
        if explicit is not None:
            if explicit < 1:
                raise ValueError(
                    f"min_usable_group_size must be >= 1 (got {explicit}): set it to 1 or more, "
                    "or leave it unset to derive it from the normalization"
                )
            if explicit > self.n_samples:
                raise ValueError(
                    f"min_usable_group_size ({explicit}) is larger than n_samples ({self.n_samples}): "
                    "no group could ever be kept; lower it to at most n_samples or raise n_samples"
                )
            if explicit < 2 and self.uses_group_statistics:
                raise ValueError(
                    f"min_usable_group_size={explicit} is below 2 while reward_norm or adv_norm uses group "
                    "statistics: a lone surviving sample has no group peers to normalize against; set it to "
                    "2 or more, leave it unset, or use batch-level mean_level/std_level"
                )
        group_mean = any(spec is not None and spec.mean_level == "group" for spec in (self.reward_norm, self.adv_norm))
        if group_mean and self.n_samples == 1:
            warnings.warn(
                "a group mean with n_samples=1 centers every singleton group to zero and erases the reward; "
                "use mean_level='batch' or sample each prompt more than once",
                UserWarning,
                stacklevel=2,
            )
        return self

    def differences(self, other: GroupPolicy) -> list[str]:
        """Names of the fields whose values differ from ``other`` (dotted for nested specs)."""
        mine, theirs = self.model_dump(), other.model_dump()
        return sorted(_diff_paths(mine, theirs, prefix=""))


def _diff_paths(a: Any, b: Any, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            out.extend(_diff_paths(a.get(key), b.get(key), f"{prefix}{key}."))
        return out
    return [] if a == b else [prefix.rstrip(".")]

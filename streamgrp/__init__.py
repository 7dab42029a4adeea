"""streamgrp: an event-sourced rollout queue for asynchronous RL post-training.

The public surface is curated here. Torch-backed helpers (`normalize`, the policy loss and group
metrics) load on first use, so importing the fold, the rank split or the codec stays free of
torch, redis and prometheus_client.
"""

from __future__ import annotations

from typing import Any

from streamgrp._version import __version__
from streamgrp.core.decision import Decision, decide_group
from streamgrp.core.events import (
    GroupDecided,
    RawArray,
    Sample,
    SampleSummary,
    SlotResult,
    SlotRewarded,
    TaskIssued,
    Tick,
)
from streamgrp.core.policy import GroupPolicy, NormSpec
from streamgrp.core.rank_split import balanced_partition
from streamgrp.core.values import RewardLater
from streamgrp.errors import (
    ConfigError,
    DecodeError,
    RunFailed,
    ServerError,
    StreamgrpError,
)

_LAZY = {
    "normalize": "streamgrp.train.advantages",
    "token_weighted_policy_loss": "streamgrp.train.advantages",
    "group_metrics": "streamgrp.train.advantages",
}

__all__ = [
    "ConfigError",
    "Decision",
    "DecodeError",
    "GroupDecided",
    "GroupPolicy",
    "NormSpec",
    "RawArray",
    "RewardLater",
    "RunFailed",
    "Sample",
    "SampleSummary",
    "ServerError",
    "SlotResult",
    "SlotRewarded",
    "StreamgrpError",
    "TaskIssued",
    "Tick",
    "__version__",
    "balanced_partition",
    "decide_group",
    # the lazily imported names (_LAZY)
    "group_metrics",
    "normalize",
    "token_weighted_policy_loss",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'streamgrp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

"""Read-only history, and the replay API (SPEC section 6).

Modules: `steps` (list steps, rebuild a rank's batch), `task_timeline` (inspect a task), `verifier` (re-fold and
re-batch the log, report every difference), `summary` (one run's totals), `report_series` (the
per-step series of the timeline), `report` (the timeline as an HTML page or PNG) and `charts` (its
inline SVG). Importing this package loads no torch: the names that need it (`replay_step`,
`load_batch`, `save_batch`, ...) are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "list_steps": "steps",
    "format_steps": "steps",
    "read_manifest": "steps",
    "replay_step": "steps",
    "format_batch": "steps",
    "inspect_task": "task_timeline",
    "format_timeline": "task_timeline",
    "RankStatus": "steps",
    "StepStatus": "steps",
    "TimelineEvent": "task_timeline",
    "verify": "verifier",
    "format_report": "verifier",
    "VerifyReport": "verifier",
    "Difference": "verifier",
    "run_summary": "summary",
    "format_summary": "summary",
}
#: Names that live in other layers, re-exported because the replay API has always offered them.
_ELSEWHERE = {
    "load_batch": "streamgrp.train.batchfile",
    "save_batch": "streamgrp.train.batchfile",
    "BATCH_FORMAT": "streamgrp.train.batchfile",
    "TENSOR_FIELDS": "streamgrp.train.batchfile",
    "EntrySource": "streamgrp.store.sources",
    "RedisSource": "streamgrp.store.sources",
    "ArchiveSource": "streamgrp.store.sources",
}

# Built from the two tables, so a name is exported exactly when __getattr__ resolves it (no second copy to drift).
__all__ = sorted([*_API, *_ELSEWHERE])  # noqa: PLE0605


def __getattr__(name: str) -> Any:
    if name in _API:
        module = f"{__name__}.{_API[name]}"
    elif name in _ELSEWHERE:
        module = _ELSEWHERE[name]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

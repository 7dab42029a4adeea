"""A trainer's per-step figures (`Batch.record_metrics`): what may be recorded, checked before it is written.

Owns the rules of one step's record in the run's trainer-metrics hash (step number -> JSON object),
which the report, the run summary and ``streamgrp export`` read: at most `MAX_KEYS` keys of at most
`MAX_KEY_CHARS` characters, each value a finite number, a boolean or text of at most
`MAX_TEXT_CHARS`. What the report charts (``loss``, ``logprob_abs_diff_mean``) is the report's
business; this module ignores which keys mean what.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_KEYS", "MAX_KEY_CHARS", "MAX_TEXT_CHARS", "checked_metrics", "observe_versions"]

MAX_KEYS = 64
MAX_KEY_CHARS = 64
MAX_TEXT_CHARS = 256


def checked_metrics(values: Mapping[str, Any]) -> dict[str, float | int | bool | str]:
    """``values`` as they are recorded; ValueError naming the first key that cannot be."""
    if len(values) > MAX_KEYS:
        raise ValueError(f"{len(values)} metrics for one step; record at most {MAX_KEYS}")
    out: dict[str, float | int | bool | str] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise ValueError(f"metric name {key!r:.80}: give text of 1 to {MAX_KEY_CHARS} characters")
        if key == "step":
            raise ValueError("'step' is recorded with every step's metrics; choose another name")
        if hasattr(value, "item") and callable(value.item):  # a one-element tensor or numpy scalar
            value = value.item()
        if isinstance(value, bool) or (isinstance(value, int) and abs(value) < 2**63):
            out[key] = value
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(
                    f"metric {key!r} is {value!r}: record finite numbers (a NaN loss is worth a "
                    "StepFailed: batch.fail(...))"
                )
            out[key] = value
        elif isinstance(value, str) and len(value) <= MAX_TEXT_CHARS:
            out[key] = value
        else:
            raise ValueError(
                f"metric {key!r} is {type(value).__name__} {value!r:.80}: record a finite number, a "
                f"boolean or text of at most {MAX_TEXT_CHARS} characters"
            )
    return out


def observe_versions(metrics: Any, batch: Any) -> None:
    """A loaded batch's per-token versions into a trainer's metrics (`streamgrp.cli.metrics`): each row's
    version span, each loss token's staleness (its step's version minus its own), and the loss tokens
    the staleness mask cleared. Counted per distinct value, not per token."""
    import torch  # the trainer's: this module is imported without torch elsewhere

    if batch.version_spans is not None:
        for span, count in zip(*torch.unique(batch.version_spans, return_counts=True)):
            metrics.observe_many(metrics.version_span, int(span), int(count))
    behind = (batch.version - batch.token_versions)[batch.loss_mask]
    for value, count in zip(*torch.unique(behind.clamp(min=0), return_counts=True)):
        metrics.observe_many(metrics.token_staleness, int(value), int(count))
    if batch.stale_masked_tokens:
        metrics.stale_masked_tokens.inc(batch.stale_masked_tokens)

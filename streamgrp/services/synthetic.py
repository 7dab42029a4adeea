"""Synthetic samples and a built-in rollout function, for tests, benchmarks and smoke runs.

Deterministic given its inputs (a seeded `random.Random`), so two processes produce identical
samples for the same task and slot. No torch.
"""

from __future__ import annotations

import random
import time
from typing import Any

from streamgrp.core.events import RawArray, Sample


def make_sample(
    *, tokens: int = 8, rows: int = 1, version: int = 0, reward: float = 1.0, seed: int = 0, prompt_tokens: int = 0
) -> Sample:
    """A sample of ``rows`` rows of ``tokens`` tokens each; the first ``prompt_tokens`` are unmasked."""
    rng = random.Random(seed)
    total = tokens * rows
    token_ids = [rng.randrange(32_000) for _ in range(total)]
    mask = [0 if (i % tokens) < prompt_tokens else 1 for i in range(total)]
    logprobs = [-rng.random() for _ in range(total)]
    return Sample(
        token_ids=RawArray.from_values(token_ids, "int32"),
        loss_mask=RawArray.from_values(mask, "uint8"),
        logprobs=RawArray.from_values(logprobs, "float32"),
        row_lengths=(tokens,) * rows,
        rewards=(float(reward),) * rows,
        version=version,
    )


def synthetic_rollout(request: Any) -> Sample | None:
    """The built-in rollout: a sample sized by the prompt, rejected or failed at the prompt's rates.

    ``request`` is a `streamgrp.services.worker.SlotRequest`. Prompt keys (all optional): ``tokens``
    (default 64), ``reject_rate`` and ``fail_rate`` (default 0), ``seed``, ``sleep_s`` (time a
    slot takes). The outcome depends only on (seed, task id, slot).
    """
    prompt = request.prompt
    slot = request.slot
    version = request.version
    rng = random.Random(f"{prompt.get('seed', 0)}:{request.task_id}:{slot}")
    if prompt.get("sleep_s"):
        time.sleep(float(prompt["sleep_s"]))
    draw = rng.random()
    if draw < float(prompt.get("fail_rate", 0.0)):
        raise RuntimeError(f"synthetic failure in slot {slot}")
    if draw < float(prompt.get("fail_rate", 0.0)) + float(prompt.get("reject_rate", 0.0)):
        return None
    return make_sample(
        tokens=int(prompt.get("tokens", 64)), version=version, reward=rng.random(), seed=rng.randrange(2**31)
    )

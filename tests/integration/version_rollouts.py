"""Rollouts for the staleness-policy tests (`streamgrp worker --rollout version_rollouts:NAME`)."""

from __future__ import annotations

import random
import time

from streamgrp.core.events import Sample

PROMPT_TOKENS = 4
GENERATED = 8


def spanning(request):
    """A generation resumed across weight updates, as partial rollouts make them: its first half sampled
    three versions before the one the worker was asked for (or at 0), its second half at that one."""
    now = request.version
    old = max(0, now - 3)
    rng = random.Random(f"{request.task_id}:{request.slot}")
    time.sleep(0.02)
    total = PROMPT_TOKENS + GENERATED
    return Sample.from_rows(
        token_ids=[[rng.randrange(1, 1000) for _ in range(total)]],
        loss_mask=[[0] * PROMPT_TOKENS + [1] * GENERATED],
        logprobs=[[-0.5] * total],
        rewards=[rng.random()],
        version=old,
        meta={"token_versions": [[old, GENERATED // 2], [now, GENERATED // 2]]},
    )

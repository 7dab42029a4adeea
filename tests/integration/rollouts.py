"""Rollout functions that crash tests load into worker processes by ``module:function``."""

import time

from streamgrp.services.synthetic import synthetic_rollout


def stalls_at_slot_two(request):
    """The synthetic rollout, except slot 2 hangs: a SIGKILL then lands mid-group for sure."""
    if request.slot == 2:
        time.sleep(60)
    return synthetic_rollout(request)


# -- a rollout for TRL's tiny test model (tests/integration/trl_train.py) ----------------------------

TINY_VOCAB = 64  # the tiny model's vocabulary: ids 0..2 are pad, eos and bos
_weights = None


def tiny_vocab_rollout(request):
    """Prompt tokens then a completion over the tiny model's vocabulary; a fifth of the slots rejected.

    The sample's version is the newest published weights version at most the one the worker asked
    for (what a real sampler would load), or the asked version before any was published.
    """
    import random

    from streamgrp.core.events import Sample
    from streamgrp.train.weights import WeightCache

    global _weights
    rng = random.Random(f"{request.task_id}:{request.slot}")
    if rng.random() < 0.2:
        return None
    if _weights is None:
        _weights = WeightCache.from_env()
    found = _weights.get(request.version)
    version = found[0] if found is not None else request.version
    prompt = [3 + (int(request.prompt["p"]) + i) % (TINY_VOCAB - 3) for i in range(4)]
    completion = [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(4, 9))]
    reward = sum(1 for t in completion if t % 2 == 0) / len(completion)
    return Sample.from_rows(
        token_ids=[prompt + completion],
        loss_mask=[[0] * 4 + [1] * len(completion)],
        logprobs=[[0.0] * 4 + [-4.1] * len(completion)],
        rewards=[reward],
        version=version,
    )


def credential_free_toy(request):
    """The demo's toy rollout, after checking that the worker gave rollout code no credential to pass on."""
    import os
    from urllib.parse import urlsplit

    from streamgrp.consumers.toy_task import rollout

    seen = [
        name
        for name in ("STREAMGRP_PASSWORD", "STREAMGRP_PASSWORD_FILE", "STREAMGRP_TLS_KEY_FILE")
        if name in os.environ
    ]
    if urlsplit(os.environ.get("STREAMGRP_REDIS_URL", "")).password is not None:
        seen.append("the password in STREAMGRP_REDIS_URL")
    if seen:
        raise RuntimeError(f"the rollout sees credentials: {', '.join(seen)}")
    return rollout(request)


# -- rewards that come later (tests/integration/test_rewarder.py) ---------------------------------------


def synthetic_reward_later(request):
    """The synthetic rollout, its reward left to a rewarder: the same sample with a placeholder reward."""
    from streamgrp import RewardLater, Sample

    result = synthetic_rollout(request)
    if result is None:
        return None
    placeholder = Sample(
        token_ids=result.token_ids,
        loss_mask=result.loss_mask,
        logprobs=result.logprobs,
        row_lengths=result.row_lengths,
        rewards=(0.0,) * result.rows,
        version=result.version,
        meta=result.meta,
    )
    return RewardLater(placeholder)


def slow_synthetic_score(request):
    """What the synthetic rollout would have rewarded inline, after 0.2 to 2 s of "scoring" (a sandbox, a
    reward model): the same value, from the same (seed, task, slot)."""
    import random

    from streamgrp.services.worker import SlotRequest

    time.sleep(random.uniform(0.2, 2.0))
    again = synthetic_rollout(SlotRequest(request.task_id, request.slot, 4, request.prompt, request.sample.version))
    return list(again.rewards)

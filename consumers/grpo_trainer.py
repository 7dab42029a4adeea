"""The reference GRPO-style trainer: one process per DP rank, gloo all-reduce, streamgrp batches.

Per step: group-normalized advantages over the actual group sizes (`streamgrp.normalize`), the
globally token-weighted clipped policy loss (each rank divides by the whole step's loss tokens, so
summing gradients across ranks gives the step's gradient whatever the shard sizes), one gradient
all-reduce and one metrics all-reduce on every rank every step, then rank 0 publishes the new
weights for the workers (under the batch's ``next_version``) before committing. Trains the demo's toy
policy (`streamgrp.consumers.toy_task`).

With ``--checkpoint-dir`` rank 0 writes a checkpoint (weights and Adam state, safetensors) every
``--checkpoint-every`` steps once every rank committed the step, records it and keeps the newest
``--keep-checkpoints`` (`streamgrp.train.checkpoint.Checkpoints`); a restarted group
loads the newest recorded one and resumes after it (``resume_after``), training the steps since
again with their recorded data, so a crash leaves the weights as if it never happened (bit for bit
on the CPU). Without it a restart continues from the weights published for the run's version,
without the optimizer's state.

Rank, world size and rendezvous follow torchrun's conventions (`streamgrp.train.distributed`), so
either of these starts two ranks (flags as for ``streamgrp trainer``):

    torchrun --nproc-per-node 2 -m streamgrp.consumers.grpo_trainer --redis-url redis://... --run RUN
    streamgrp trainer --rank 0 --world-size 2 ... & streamgrp trainer --rank 1 --world-size 2 ...

Every collective goes through one `Collectives` object and each step's calls are logged with the
step, so the log shows every rank made the same calls whatever its shard held.

Rank 0 records each step in the run's trainer-metrics hash (`streamgrp report` charts them):
``loss`` (the step's loss, all ranks summed), ``reward_mean`` (over the step's rows),
``logprob_abs_diff_mean`` (mean |rollout - trainer| log-probability per loss token of the whole step,
before the update), the group metrics of `streamgrp.train.advantages.group_metrics`, ``wait_s``, ``step``.
"""

from __future__ import annotations

import logging
import sys
import time

import redis
import torch

from streamgrp.config import TrainerConfig
from streamgrp.consumers import toy_task
from streamgrp.core.policy import NormSpec
from streamgrp.errors import ConfigError
from streamgrp.services import heap
from streamgrp.store.runs import Run
from streamgrp.train.advantages import (
    group_metrics,
    normalize,
    token_weighted_policy_loss,
)
from streamgrp.train.checkpoint import Checkpoints
from streamgrp.train.distributed import Collectives, process_group, resolve_config
from streamgrp.train.faults import crash, crash_point
from streamgrp.train.step_metrics import observe_versions
from streamgrp.train.trainer import TrainerClient
from streamgrp.train.weights import publish, save_version

log = logging.getLogger(__name__)

DEFAULT_ADV_NORM = NormSpec("group", "group")


def train(client: redis.Redis, run: Run, config: TrainerConfig, *, metrics=None) -> int:
    """Train until the run finishes; returns the number of steps this rank committed."""
    ranks = resolve_config(config)
    with process_group(ranks, backend="gloo", peer_wait_s=config.peer_wait_s):
        return _train(client, run, config, ranks.rank, ranks.world_size, metrics)


def _train(client: redis.Redis, run: Run, config: TrainerConfig, rank: int, world: int, metrics) -> int:
    torch.manual_seed(0)
    policy = toy_task.initial_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.lr)
    spec = run.config.adv_norm or run.config.reward_norm or DEFAULT_ADV_NORM
    trainer = TrainerClient(client, run)
    checkpoints = (
        Checkpoints(trainer, config.checkpoint_dir, every=config.checkpoint_every, keep=config.keep_checkpoints)
        if config.checkpoint_dir is not None
        else None
    )
    resume_after = _restore(client, run, checkpoints, policy, optimizer)
    if rank == 0 and resume_after in (None, -1) and int(client.get(run.keys.version) or 0) == 0:
        publish(client, run.keys, 0, policy.state_dict())
        if config.weights_dir is not None:
            save_version(config.weights_dir, 0, policy.state_dict())
    crash_at = crash_point(config.crash_at)
    steps = 0
    collectives = Collectives(world)
    heap.settle()  # imports, the policy and its optimizer: out of the collector's way while steps load
    waited_at = time.monotonic()
    try:
        with trainer.batches(rank=rank, world_size=world, agree=collectives, resume_after=resume_after) as batches:
            for batch in batches:
                wait_s = time.monotonic() - waited_at
                if metrics is not None:
                    metrics.batch_wait.observe(wait_s)
                    observe_versions(metrics, batch)
                if config.fail_at_step is not None and batch.step == config.fail_at_step:
                    raise FloatingPointError(f"injected fault: loss is NaN at step {batch.step} on rank {rank}")
                step_metrics = _step(policy, optimizer, batch, spec, collectives)
                if rank == 0:
                    publish(client, run.keys, batch.next_version, policy.state_dict())
                    if config.weights_dir is not None:  # for inference servers (streamgrp weight-sync)
                        save_version(config.weights_dir, batch.next_version, policy.state_dict())
                    batch.record_metrics(step_metrics, wait_s=round(wait_s, 4))
                if crash_at == ("train", batch.step) and not batch.retrained:
                    crash(f"after training step {batch.step}, before committing it")
                batch.commit()
                if checkpoints is not None and checkpoints.due(batch):
                    _checkpoint(checkpoints, batch, policy, optimizer, collectives, crash_at)
                steps += 1
                if metrics is not None:
                    metrics.step_committed(batch.step, version=batch.next_version, retrained=batch.retrained)
                log.info(
                    "rank %d step %d: reward %.3f loss %.4f (%d rows, waited %.3fs) collectives %s",
                    rank,
                    batch.step,
                    step_metrics["reward_mean"],
                    step_metrics["loss"],
                    batch.rows,
                    wait_s,
                    collectives.take(),
                )
                waited_at = time.monotonic()
    except Exception:
        if metrics is not None:
            metrics.step_failures.inc()
        raise
    return steps


def _step(policy, optimizer, batch, spec: NormSpec, collectives: Collectives) -> dict:
    problem = toy_task.batch_problem(batch.token_ids)
    if problem is not None:
        raise ConfigError(
            f"step {batch.step} is not the demo's toy task ({problem}): the reference trainer trains "
            "only streamgrp.consumers.toy_task's policy. Train other rollouts with a function of your "
            "own: streamgrp trainer --train-fn module:function (docs: guides/own-trainer.md)"
        )
    advantages = normalize(batch.rewards, batch.group_sizes, spec)
    token_adv = advantages[:, None].expand_as(batch.logprobs) * batch.loss_mask
    new_logprobs = toy_task.token_logprobs(policy, batch.token_ids)
    loss = token_weighted_policy_loss(
        new_logprobs, batch.logprobs, token_adv, batch.loss_mask, total_loss_tokens=batch.step_loss_tokens
    )
    optimizer.zero_grad()
    loss.backward()
    # How far the rollout's log-probabilities are from this policy's, summed here and divided by the
    # step's loss tokens below: staleness and sampling numerics both show in it.
    abs_diff = float(((new_logprobs.detach() - batch.logprobs).abs() * batch.loss_mask).sum())
    # Every rank makes exactly these two collectives per step, whatever its shard size.
    stats = torch.tensor(
        [float(loss.detach()), float(batch.rewards.sum()), float(batch.rows), abs_diff], dtype=torch.float64
    )
    grads = [p.grad for p in policy.parameters()]
    flat = collectives.all_reduce(torch.cat([g.reshape(-1) for g in grads]))
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    collectives.all_reduce(stats)
    optimizer.step()
    tokens_per_group = _tokens_per_group(batch)
    metrics = {
        "loss": stats[0].item(),
        "reward_mean": stats[1].item() / max(stats[2].item(), 1.0),
        "logprob_abs_diff_mean": stats[3].item() / max(batch.step_loss_tokens, 1),
    }
    metrics.update(group_metrics(batch.group_sizes.tolist(), tokens_per_group))
    return metrics


def _tokens_per_group(batch) -> list[int]:
    per_row = batch.loss_mask.sum(dim=1).tolist()
    out, offset = [], 0
    for size in batch.group_sizes.tolist():
        out.append(int(sum(per_row[offset : offset + size])))
        offset += size
    return out


def _restore(client: redis.Redis, run: Run, checkpoints: Checkpoints | None, policy, optimizer) -> int | None:
    """Load what a restarted rank continues from; returns the step its weights hold (``resume_after``):
    the newest recorded checkpoint's, -1 for the initial weights when checkpoints are kept but none is
    recorded yet, or None without checkpoints (the group resumes at the lowest rank's next step, from
    the weights published for the run's version)."""
    if checkpoints is not None:
        return checkpoints.restore(policy, optimizer)
    from streamgrp.train.weights import WeightCache

    version = int(client.get(run.keys.version) or 0)
    found = WeightCache(client, run.keys).get(version) if version > 0 else None
    if found is not None:
        policy.load_state_dict(found[1])
        log.info(
            "resuming from the weights of version %d (no --checkpoint-dir: the optimizer's state starts afresh)",
            found[0],
        )
    return None


def _checkpoint(
    checkpoints: Checkpoints, batch, policy, optimizer, collectives: Collectives, crash_at: tuple[str, int] | None
) -> None:
    """Every rank committed ``batch``'s step once all pass the barrier; then rank 0 writes and records."""
    collectives.barrier()
    if batch.rank != 0:
        return
    halfway = (
        (lambda: crash(f"halfway through the checkpoint of step {batch.step}"))
        if crash_at == ("checkpoint", batch.step) and not batch.retrained
        else None
    )
    checkpoints.save(batch, policy, optimizer, ranks=(0,), halfway=halfway)


if __name__ == "__main__":
    # ``python -m streamgrp.consumers.grpo_trainer FLAGS`` (what torchrun's ``-m`` runs) is ``streamgrp trainer FLAGS``.
    from streamgrp.cli.main import main

    sys.exit(main(["trainer", *sys.argv[1:]]))

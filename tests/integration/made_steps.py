"""Steps written in-process on a real server: tasks issued, every slot published, groups decided, steps formed."""

from __future__ import annotations

import random

from streamgrp.config import AssemblerConfig, BatcherConfig
from streamgrp.consumers import toy_task
from streamgrp.core.events import Sample
from streamgrp.services.assembler import Assembler
from streamgrp.services.batcher import Batcher
from streamgrp.services.synthetic import make_sample
from streamgrp.services.worker import WorkerClient
from streamgrp.store.tasks import TaskIssuer


def rollout(request):
    """Slot 2 of every odd task is rejected, so groups are partial and shards ragged."""
    if request.slot == 2 and request.prompt["i"] % 2:
        return None
    return make_sample(
        tokens=4 + request.slot,
        prompt_tokens=1,
        reward=float(request.slot),
        version=request.version,
        seed=hash((request.task_id, request.slot)) % 10_000,
    )


def toy_rollout(request):
    """A toy-task sample (prompt token, LENGTH tokens of the toy vocabulary), a few rejected."""
    rng = random.Random(f"{request.task_id}:{request.slot}")
    if rng.random() < 0.1:
        return None
    p = rng.randrange(toy_task.VOCAB)
    generated = [rng.randrange(toy_task.VOCAB) for _ in range(toy_task.LENGTH)]
    logprobs = [-rng.uniform(1.5, 2.5) for _ in generated]
    return Sample.from_rows(
        token_ids=[[p, *generated]],
        loss_mask=[[0] + [1] * toy_task.LENGTH],
        logprobs=[[0.0, *logprobs]],
        rewards=[toy_task.reward(p, generated)],
        version=0,
    )


def make_steps(client, run, *, groups: int, steps: int, rollout=rollout) -> None:
    """Issue ``groups`` tasks, publish every slot (``rollout(request)``: a sample or None), decide every
    group and write ``steps`` steps."""
    TaskIssuer(client, run.keys).issue([{"i": i} for i in range(groups)])
    worker = WorkerClient(client, run.keys)
    while tasks := worker.take(100, block_ms=None):
        for task in tasks:
            worker.publish_many([(r.task_id, r.slot, rollout(r)) for r in task.requests(run.config.n_samples, 0)])
            worker.done(task)
    Assembler(client, run, AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)).run(burst=True)
    batcher = Batcher(client, run, BatcherConfig(round_s=0.05, lease_ttl_s=5, max_steps=steps))
    assert batcher.lease.acquire()
    batcher._activate()
    batcher.round()

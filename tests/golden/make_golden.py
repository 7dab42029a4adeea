"""Write a golden run log of what this version writes (`run_<name>.jsonl`) and what replaying it must give
(`expected_<name>.json`). A golden log is never rewritten: each keeps what one version wrote, so every later
version is checked reading it. Checked in: `run_v1` (schema 1: samples inline in the slot log), `run_v2`
(payloads in their own stream, untagged BLAKE2b digests), `run_v3` (payloads in keys, ``sha256:`` digests,
written by the version before ``blake3:``). Add a new name to `test_golden.GOLDENS` when the wire changes.

    python tests/golden/make_golden.py NAME [REDIS_URL]

Runs the real pipeline in-process on a fresh run (the bundled server in a temp dir unless a URL is
given): a `TaskIssuer`, a `WorkerClient` publishing deterministic `make_sample` samples (with a
rejection, a failure, a dropped group, a duplicate, a deadline close and a late result), an
`Assembler` burst, a `Batcher` burst, and two trainer ranks that commit step 0, split on step 1
(rank 1 records a `StepFailed`) and leave step 2 unconsumed. Then it dumps every stream of the run.
The expected tensors come from `TrainerClient.load`, the path the live trainer took, so the test
checks replay against what training consumed, not against replay itself.

Entry ids are the server's clock, so each regeneration gives a different (equally valid) file;
regenerate only when the event schema changes, and check both files in together.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from runlog import dump_run  # noqa: E402

from streamgrp.cli.server import EmbeddedServer  # noqa: E402
from streamgrp.cli.server_binary import bundled_binary  # noqa: E402
from streamgrp.config import AssemblerConfig, BatcherConfig, RunConfig  # noqa: E402
from streamgrp.core.policy import NormSpec  # noqa: E402
from streamgrp.services.assembler import Assembler  # noqa: E402
from streamgrp.services.batcher import Batcher  # noqa: E402
from streamgrp.services.synthetic import make_sample  # noqa: E402
from streamgrp.services.worker import WorkerClient  # noqa: E402
from streamgrp.store.runs import Run, connect, join_run  # noqa: E402
from streamgrp.store.tasks import TaskIssuer  # noqa: E402
from streamgrp.train.trainer import TrainerClient  # noqa: E402

RUN = "golden"
N_TASKS = 13
TIMEOUT_S = 1.0
FAILED_STEP, FAILED_RANK = 1, 1
FAULT = "FloatingPointError: golden: injected fault at step 1 on rank 1"
CONFIG = RunConfig(
    n_samples=4,
    reward_norm=NormSpec("group", "group"),
    group_timeout_s=TIMEOUT_S,
    dp_size=2,
    batch_size=4,
    max_staleness=1,
)


def outcome(task: int, slot: int):
    """What slot ``slot`` of task ``task`` publishes: a sample, None (rejected) or an exception (failed)."""
    if (task, slot) == (1, 2):
        return None
    if (task, slot) == (2, 0):
        return RuntimeError("golden: rollout failed in slot 0")
    if task == 3:  # one usable slot under group statistics: dropped below_minimum
        return make_sample(tokens=5, seed=300 + slot) if slot == 3 else (None if slot < 2 else ValueError("bad"))
    return make_sample(
        tokens=3 + (task * 7 + slot * 3) % 6,
        version=0,
        reward=((task + slot) % 3) / 2,
        seed=task * 100 + slot,
        prompt_tokens=1,
    )


def build(client) -> Run:
    run = join_run(client, RUN, CONFIG)
    keys = run.keys
    TaskIssuer(client, keys, producer="issuer-golden").issue(
        ({"i": i, "text": f"prompt {i}"} for i in range(N_TASKS)), task_ids=[f"g{i:02d}" for i in range(N_TASKS)]
    )
    worker = WorkerClient(client, keys, name="worker-golden")
    for task in range(N_TASKS):
        for slot in range(4):
            if (task, slot) == (5, 3):
                continue  # never arrives in time: the deadline closes g05
            worker.publish(f"g{task:02d}", slot, outcome(task, slot))
            if (task, slot) == (4, 1):
                worker.publish("g04", 1, outcome(4, 1))  # a redelivered task: a duplicate
    time.sleep(TIMEOUT_S + 0.3)
    assembler_config = AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)
    Assembler(client, run, assembler_config, name="assembler-golden").run(burst=True)
    worker.publish("g05", 3, make_sample(tokens=4, seed=503))  # after the deadline closed it: late
    Assembler(client, run, assembler_config, name="assembler-golden").run(burst=True)
    Batcher(client, run, BatcherConfig(round_s=0.05, lease_ttl_s=2), name="batcher-golden").run(burst=True)
    trainers = [TrainerClient(client, run, name=f"trainer-golden-{rank}") for rank in range(2)]
    for step in (0, 1):
        manifest = trainers[0].manifest(step)
        for rank, trainer in enumerate(trainers):
            batch = trainer.load(manifest, rank, 2)
            if (step, rank) == (FAILED_STEP, FAILED_RANK):
                batch.fail(FAULT)
            else:
                batch.commit()
    return run


def expected(client, run: Run) -> dict:
    """What each rank consumed, read through the live trainer path."""
    trainer = TrainerClient(client, run, name="golden-reader")
    steps = []
    step = 0
    while (manifest := trainer.manifest(step)) is not None:
        ranks = []
        for rank in range(len(manifest.shards)):
            batch = trainer.load(manifest, rank, len(manifest.shards))
            ranks.append(
                {
                    "rank": rank,
                    "digest": batch.digest,
                    "task_ids": batch.task_ids,
                    "group_sizes": batch.group_sizes.tolist(),
                    "shape": list(batch.token_ids.shape),
                    "token_ids_sum": int(batch.token_ids.sum()),
                    "loss_mask_sum": int(batch.loss_mask.sum()),
                    "attention_mask_sum": int(batch.attention_mask.sum()),
                    "logprobs_sum": float(batch.logprobs.double().sum()),
                    "rewards": batch.rewards.tolist(),
                    "first_row": batch.token_ids[0].tolist(),
                    "step_loss_tokens": batch.step_loss_tokens,
                }
            )
        steps.append({"step": step, "version": manifest.version, "ranks": ranks})
        step += 1
    return {
        "run": RUN,
        "steps": steps,
        "rank_states": {
            "0": {"0": "committed", "1": "committed"},
            "1": {"0": "committed", "1": "failed"},
            "2": {"0": "in_progress", "1": "pending"},
        },
        "failure": FAULT,
        "decisions": {
            "g03": ["dropped", "below_minimum"],
            "g05": ["partial", None],
            "g01": ["partial", None],
            "g02": ["partial", None],
            "g00": ["complete", None],
        },
    }


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: make_golden.py NAME [REDIS_URL]  (NAME: a new golden's name, e.g. v4)")
    name = sys.argv[1]
    log, want = HERE / f"run_{name}.jsonl", HERE / f"expected_{name}.json"
    if log.exists() or want.exists():
        sys.exit(f"{log.name} or {want.name} exists: a golden log keeps what its version wrote; pick a new name")
    url = sys.argv[2] if len(sys.argv) > 2 else None
    server = None
    if url is None:
        server = EmbeddedServer(Path(tempfile.mkdtemp(prefix="golden-")), binary=bundled_binary())
        url = server.start()
    try:
        client = connect(url)
        if client.exists(f"sg:{{{RUN}}}:control"):
            raise SystemExit(f"run {RUN!r} already exists on {url}; use a fresh server")
        run = build(client)
        lines = dump_run(client, run.keys, log)
        want.write_text(json.dumps(expected(client, run), indent=1, sort_keys=True) + "\n")
        print(f"wrote {lines} lines to {log} and {want}")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

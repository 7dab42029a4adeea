"""Batch balance and trainer wait on real runs.

1. Groups of a real run: tasks with heavy-tailed response lengths go through the real pipeline
   (issuer, worker, assembler on the embedded server); the decided groups are then cut into
   batches of ``--batch-size`` in decision order, as the batcher does, and each batch is split
   over 2, 4 and 8 ranks by `balanced_partition`, by round-robin, and by greedy longest-first.
   Printed: mean and worst imbalance (largest shard tokens / mean shard tokens).
2. The time a trainer rank waits for its next batch, from a `streamgrp demo` run (per-step waits
   the reference trainer records), p50 / p90 / max.

    python bench/bench_batches.py [--groups 2048] [--batch-size 32] [--demo-steps 30]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson  # noqa: E402

from streamgrp.cli.server import EmbeddedServer  # noqa: E402
from streamgrp.config import (  # noqa: E402
    AssemblerConfig,
    ConnectionConfig,
    DemoConfig,
    RunConfig,
    WorkerConfig,
)
from streamgrp.core import codec  # noqa: E402
from streamgrp.core.policy import NormSpec  # noqa: E402
from streamgrp.core.rank_split import balanced_partition, greedy_split, max_load  # noqa: E402
from streamgrp.services.assembler import Assembler  # noqa: E402
from streamgrp.services.synthetic import synthetic_rollout  # noqa: E402
from streamgrp.services.worker import WorkerClient, WorkerProcess  # noqa: E402
from streamgrp.store.runs import connect, join_run  # noqa: E402
from streamgrp.store.tasks import TaskIssuer  # noqa: E402


def round_robin(weights, k):
    return [list(range(rank, len(weights), k)) for rank in range(k)]


def imbalance(weights, shards):
    total = sum(weights)
    return max_load(weights, shards) * len(shards) / total if total else 1.0


def real_groups(args) -> list[int]:
    """Valid tokens of each trainable group decided by the real pipeline."""
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp)) as server:
        client = connect(server.url)
        run = join_run(client, "bench-batches", RunConfig(n_samples=4, group_timeout_s=600.0))
        prompts = [
            {
                "tokens": max(16, min(4096, int(rng.lognormvariate(5.5, 0.9)))),
                "reject_rate": 0.15,
                "seed": rng.randrange(10**6),
            }
            for _ in range(args.groups)
        ]
        TaskIssuer(client, run.keys).issue(prompts)
        WorkerProcess(
            WorkerClient(client, run.keys), synthetic_rollout, WorkerConfig(burst=True, concurrency=4), n_samples=4
        ).run()
        Assembler(client, run, AssemblerConfig()).run(burst=True)
        weights = []
        for _, fields in client.xrange(run.keys.decisions):
            decision = codec.decode(fields)
            if decision.decision != "dropped":
                weights.append(decision.valid_tokens)
        client.close()
    return weights


def balance_table(weights: list[int], batch_size: int) -> None:
    batches = [weights[i : i + batch_size] for i in range(0, len(weights) - batch_size + 1, batch_size)]
    print(
        f"1. shard imbalance over {len(batches)} batches of {batch_size} real groups "
        f"(group tokens: median {statistics.median(weights):.0f}, max {max(weights)})"
    )
    print(f"   {'ranks':>5} {'method':<12} {'mean':>8} {'worst':>8}   {'vs round-robin':>14} {'vs greedy':>10}")
    for ranks in (2, 4, 8):
        results = {}
        for name, method in (("balanced", balanced_partition), ("round-robin", round_robin), ("greedy", greedy_split)):
            values = [imbalance(batch, method(batch, ranks)) for batch in batches]
            results[name] = (statistics.fmean(values), max(values))
        for name, (mean, worst) in results.items():
            excess = mean - 1
            vs_rr = f"{excess / (results['round-robin'][0] - 1):.2f}x" if name == "balanced" else ""
            vs_greedy = (
                f"{excess / (results['greedy'][0] - 1):.2f}x" if name == "balanced" and results["greedy"][0] > 1 else ""
            )
            print(f"   {ranks:>5} {name:<12} {mean:>8.4f} {worst:>8.4f}   {vs_rr:>14} {vs_greedy:>10}")
    print("   (the 'vs' columns compare the excess over perfect balance, mean - 1)")


def demo_waits(steps: int) -> None:
    from streamgrp.cli.demo import run_demo

    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        devnull = open("/dev/null", "w")
        summary = run_demo(
            ConnectionConfig(data_dir=Path(tmp)),
            RunConfig(
                n_samples=6,
                batch_size=8,
                max_staleness=1,
                group_timeout_s=30.0,
                reward_norm=NormSpec("group", "group"),
                stall_timeout_s=120.0,
            ),
            DemoConfig(steps=steps),
            out=devnull,
            err=devnull,
        )
        server = EmbeddedServer(Path(tmp))
        url = server.start()
        client = connect(url)
        from streamgrp.store.keys import RunKeys

        by_step = {
            int(k): orjson.loads(v)["wait_s"]
            for k, v in client.hgetall(RunKeys(summary["run"]).trainer_metrics).items()
        }
        waits = [by_step[step] for step in sorted(by_step)]
        client.close()
        server.stop()
    cut = sorted(waits[1:])  # the first wait includes process start-up and the first rollouts
    print(
        f"2. trainer rank 0 wait for its next batch, demo with {steps} steps, 2 ranks, 3 workers "
        f"({time.monotonic() - started:.0f}s):"
    )
    print(
        f"   step 0 {waits[0] if waits else float('nan'):.3f}s (rank start-up overlaps the first rollouts); "
        f"later steps p50 {statistics.median(cut):.3f}s, "
        f"p90 {cut[int(0.9 * (len(cut) - 1))]:.3f}s, max {max(cut):.3f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--demo-steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    balance_table(real_groups(args), args.batch_size)
    demo_waits(args.demo_steps)


if __name__ == "__main__":
    main()

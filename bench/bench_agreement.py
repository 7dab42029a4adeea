"""What the per-step agreement of a trainer group costs: two gloo ranks on this machine.

Per step a `BatchStream` makes one vote (`streamgrp.train.agreement.GroupVote.step`: one int64[7] MAX
all-reduce carrying leaving, attempt, step and the manifest digest). Measured against the baseline of
the same process group's cheapest collective, the one-int32 MAX vote on leaving the batch stream made
before (`Collectives.any_rank`), and for scale the toy policy's gradient all-reduce (float32[648]).
Also the vote's Python side: `manifest_digest` of a manifest of 64 groups of 8 samples.

    python bench/bench_agreement.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(call, calls: int) -> list[float]:
    for _ in range(100):  # warm-up: connections, allocator
        call()
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        out.append((time.perf_counter() - started) * 1e6)
    return out


def _rank(rank: int, port: int, calls: int, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from streamgrp.train.agreement import GroupVote
    from streamgrp.train.distributed import Collectives

    collectives = Collectives(2)
    vote = GroupVote(collectives.max_over_ranks, rank)
    gradient = torch.zeros(648)
    figures = {
        "baseline: any_rank (int32[1] MAX)": _timed(lambda: collectives.any_rank(False), calls),
        "agreement: GroupVote.step (int64[7] MAX, checked)": _timed(
            lambda: vote.step(leaving=False, attempt=3, step=41, digest=123456789), calls
        ),
        "for scale: toy gradient (float32[648] SUM)": _timed(lambda: dist.all_reduce(gradient), calls),
    }
    if rank == 0:
        results.update(figures)
    dist.destroy_process_group()


def _digest_cost(calls: int) -> list[float]:
    from streamgrp.core.events import Shard, ShardGroup, StepManifest
    from streamgrp.core.members import Member
    from streamgrp.train.agreement import manifest_digest

    def group(i: int) -> ShardGroup:
        members = tuple(
            Member(slot=s, entry=f"{1700000000000 + i}-{s}", rows=1, tokens=512, version=41) for s in range(8)
        )
        return ShardGroup(
            task_id=f"task-{i}", decision_entry=f"{1700000000000 + i}-0", members=members, digest="0" * 32
        )

    shards = tuple(
        Shard(rank=r, groups=tuple(group(32 * r + i) for i in range(32)), tokens=131072, digest="1" * 32)
        for r in range(2)
    )
    manifest = StepManifest(step=41, version=42, shards=shards, imbalance=1.0, created_at=0.0, producer="bench", seq=1)
    return _timed(lambda: manifest_digest(manifest), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_port(), args.calls, results), nprocs=2, join=True)
        figures = dict(results)
    figures["python side: manifest_digest (64 groups)"] = _digest_cost(args.calls)
    baseline = statistics.median(figures["baseline: any_rank (int32[1] MAX)"])
    print(f"two gloo ranks on 127.0.0.1, {args.calls} calls each, microseconds per call")
    print(f"{'':52} {'median':>8} {'p99':>8} {'vs baseline':>12}")
    for name, values in figures.items():
        values = sorted(values)
        median, p99 = statistics.median(values), values[int(0.99 * (len(values) - 1))]
        print(f"{name:52} {median:8.1f} {p99:8.1f} {median / baseline:11.2f}x")


if __name__ == "__main__":
    main()

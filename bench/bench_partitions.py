"""Publish-to-decision throughput of a partitioned run: P = 1, 2 and 3 on a local 3-node Redis Cluster,
beside P = 1 on one server, with the CPU every role and server spent per sample.

Each case: a run with ``n_samples=8`` and ``partitions=P``; all G tasks issued up front (`TaskIssuer`,
to their partitions); P assembler processes (`Assembler(partition=p)`) and W worker processes
(`WorkerClient.take`, 8 tasks at a time, `publish_many` of a pre-built sample per slot, `done`),
every role its own OS process (multiprocessing 'spawn'). The clock starts when every process is
ready and stops when every task has a decision (the bench polls the partitions' ``decided`` hashes
every 20 ms). Rate = 8G samples / that time. CPU = utime + stime deltas of /proc/<pid>/stat over
the window, per role and for the servers (the three nodes together on the cluster).

The cluster is Debian's redis-server (7.0) in cluster mode, three primaries, AOF with ``appendfsync
everysec``, started by ``tests/cluster.py`` (the test fixture's cluster); the single server is the
embedded Valkey (`streamgrp.cli.server.EmbeddedServer`). On a 2-core machine every case shares the
same two cores, so P > 1 shows what partitioning costs, not what it gains on more cores; the
per-role CPU columns are what the scaling estimate in bench/README.md is made from.

    python bench/bench_partitions.py [--groups 1200] [--tokens 256] [--workers 2] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import _harness
from _harness import CTX, collect, cpu_seconds, join, spawn, wait_ready

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the cluster the test fixture starts

N_SAMPLES = 8
TAKE = 8
TIMEOUT_S = 600.0


def _worker(url: str, cluster: bool, run_name: str, index: int, tokens: int, ready, start, stop, results) -> None:
    from streamgrp.services.synthetic import make_sample
    from streamgrp.services.worker import WorkerClient
    from streamgrp.store.runs import connect, open_run

    client = connect(url, cluster=cluster)
    run = open_run(client, run_name)
    worker = WorkerClient(client, run.keys, partitions=run.partitions)
    samples = [make_sample(tokens=tokens, seed=i, reward=i / 8) for i in range(8)]
    ready.put((f"worker{index}", os.getpid()))
    start.wait()
    published = 0
    while not stop.is_set():
        tasks = worker.take(TAKE, block_ms=200)
        if not tasks:
            continue
        slots = [
            (task.event.task_id, slot, samples[(published + slot) % 8]) for task in tasks for slot in range(N_SAMPLES)
        ]
        worker.publish_many(slots, done=tasks)
        published += len(slots)
    results.put(("worker", published))


def _assembler(url: str, cluster: bool, run_name: str, partition: int, ready, stop, results) -> None:
    from streamgrp.config import AssemblerConfig
    from streamgrp.services.assembler import Assembler
    from streamgrp.store.runs import connect, open_run

    client = connect(url, cluster=cluster)
    assembler = Assembler(client, open_run(client, run_name), AssemblerConfig(), partition=partition)
    ready.put((f"assembler{partition}", os.getpid()))
    results.put(("assembler", assembler.run(stop)))


def run_case(
    url: str, cluster: bool, server_pids: list[int], partitions: int, groups: int, tokens: int, workers: int
) -> dict:
    from streamgrp.config import RunConfig
    from streamgrp.store.connection import connect
    from streamgrp.store.run_admin import delete_run
    from streamgrp.store.runs import join_run
    from streamgrp.store.tasks import TaskIssuer

    client = connect(url, cluster=cluster)
    run = join_run(
        client,
        f"bench-p{partitions}-{os.getpid()}-{time.monotonic_ns()}",
        RunConfig(n_samples=N_SAMPLES, group_timeout_s=3600.0, partitions=partitions),
    )
    issuer = TaskIssuer(client, run.keys, producer="bench", partitions=run.partitions)
    for at in range(0, groups, 500):
        issuer.issue([{}] * min(500, groups - at), task_ids=[f"t{i:07d}" for i in range(at, min(groups, at + 500))])
    ready, start, stop, results = CTX.Queue(), CTX.Event(), CTX.Event(), CTX.Queue()
    procs = [spawn(_assembler, url, cluster, run.name, p, ready, stop, results) for p in range(partitions)]
    procs += [spawn(_worker, url, cluster, run.name, i, tokens, ready, start, stop, results) for i in range(workers)]
    try:
        pids = dict(wait_ready(ready, procs, len(procs), 120))
        before = {role: cpu_seconds(pid) for role, pid in pids.items()}
        servers_before = sum(cpu_seconds(pid) for pid in server_pids)
        bench_before = cpu_seconds(os.getpid())
        began = time.monotonic()
        start.set()
        deadline = began + TIMEOUT_S
        while sum(client.hlen(part.decided) for part in run.partitions) < groups:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every task decided within {TIMEOUT_S:g}s")
            time.sleep(0.02)
        seconds = time.monotonic() - began
        cpu = {role: cpu_seconds(pid) - before[role] for role, pid in pids.items()}
        cpu["server"] = sum(cpu_seconds(pid) for pid in server_pids) - servers_before
        cpu["bench"] = cpu_seconds(os.getpid()) - bench_before
    finally:
        stop.set()
        collect(results, procs, len(procs), 60)
        join(procs)
    delete_run(client, run.keys, force=True)
    client.close()
    samples = groups * N_SAMPLES
    per_sample = {role: seconds_used / samples * 1e6 for role, seconds_used in cpu.items()}
    return {"rate": samples / seconds, "seconds": seconds, "us": per_sample}


def _summary(us: dict[str, float]) -> dict[str, float]:
    assemblers = sum(v for k, v in us.items() if k.startswith("assembler"))
    workers = sum(v for k, v in us.items() if k.startswith("worker"))
    return {
        "worker": workers,
        "assemblers": assemblers,
        "server": us.get("server", 0.0),
        "per assembler": assemblers / max(1, sum(k.startswith("assembler") for k in us)),
        "total": sum(v for k, v in us.items() if k != "bench"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=1200)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    from cluster import LocalCluster, cluster_binaries

    binaries = cluster_binaries()
    if binaries is None:
        sys.exit("bench_partitions: needs Debian's redis-server and redis-cli (apt-get install redis-server)")
    import tempfile

    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="sg-bench-cluster-") as root:
        cluster = LocalCluster(Path(root), *binaries)
        print(f"starting a local 3-node cluster in {root} ...", flush=True)
        cluster.start()
        single = _harness.start_server()
        try:
            cases = [("one server, P=1", single.url, False, [single.pid], 1)]
            cases += [
                (f"cluster, P={p}", cluster.url, True, [proc.pid for proc in cluster.processes], p) for p in (1, 2, 3)
            ]
            for repeat in range(args.repeat):
                for name, url, is_cluster, pids, partitions in cases:
                    print(
                        f"  [{repeat + 1}/{args.repeat}] {name}: {args.groups} groups x {N_SAMPLES} slots of "
                        f"{args.tokens} tokens, {args.workers} workers ...",
                        flush=True,
                    )
                    rows.setdefault(name, []).append(
                        run_case(url, is_cluster, pids, partitions, args.groups, args.tokens, args.workers)
                    )
        finally:
            _harness.stop_server(single)
            cluster.stop()

    print(
        f"\npublish -> decision, {args.groups} groups of {N_SAMPLES}, {args.tokens} tokens, {args.workers} "
        f"worker processes, {os.cpu_count()} cores (median of {args.repeat}); CPU microseconds per sample"
    )
    header = (
        f"  {'case':<18} {'samples/s':>10} {'workers':>7} {'assemblers':>10} {'per asm':>8} {'servers':>8} {'total':>7}"
    )
    print(header)
    for name, results in rows.items():
        rate = statistics.median(r["rate"] for r in results)
        us = {
            key: statistics.median(_summary(r["us"])[key] for r in results)
            for key in ("worker", "assemblers", "per assembler", "server", "total")
        }
        print(
            f"  {name:<18} {rate:>10,.0f} {us['worker']:>7.1f} {us['assemblers']:>10.1f} {us['per assembler']:>8.1f} "
            f"{us['server']:>8.1f} {us['total']:>7.1f}"
        )


if __name__ == "__main__":
    main()

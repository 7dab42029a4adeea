"""Benchmark the staleness policies: ``wait`` against ``drop`` with a slow trainer and long generations.

One run per policy, the same dataset, every role a real process (``streamgrp batcher`` feeding the
dataset, one assembler, ``--workers`` workers with the synthetic rollout, one trainer rank that sleeps
``--step-s`` per step) on a local Valkey. Generation lengths are drawn log-normally (32 to 4,096
tokens) and a slot sleeps in proportion to its length (``--ms-per-token``), so long generations take
longer: under ``drop`` the trainer moves the version on while they run and they arrive stale.

Reported per policy: groups decided, trained and discarded as stale, by length bucket (short < 256
tokens, medium < 1,024, long); the share of the trained groups that are long against the share of the
decided ones; the run's wall time; and the trainer's busy share (steps x step time / wall time).

    python bench/bench_staleness.py [--prompts 160] [--step-s 0.5] [--ms-per-token 1.5] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import drop_run, server_name, start_server, stop_server

TRAINER = """
import sys, time
from streamgrp.store.runs import connect, open_run
from streamgrp.train.trainer import TrainerClient

url, run_name, step_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
client = connect(url)
trainer = TrainerClient(client, open_run(client, run_name), poll_s=0.05)
with trainer.batches(rank=0, world_size=1) as batches:
    for batch in batches:
        time.sleep(step_s)
        batch.commit()
"""

BUCKETS = (("short", 256), ("medium", 1024), ("long", None))


def bucket(tokens: int) -> str:
    return next(name for name, bound in BUCKETS if bound is None or tokens < bound)


def prompts(n: int, ms_per_token: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = int(min(4096, max(32, rng.lognormvariate(5.5, 1.1))))
        out.append({"seed": i, "tokens": tokens, "sleep_s": round(tokens * ms_per_token / 1000, 4)})
    return out


def one_run(url: str, staleness: str, dataset: Path, args, tmp: Path) -> dict:
    import orjson

    from streamgrp.config import RunConfig
    from streamgrp.core import codec
    from streamgrp.core.events import GroupDecided, GroupDiscarded, RunFinished, StepManifest
    from streamgrp.store.runs import connect, join_run

    client = connect(url)
    name = f"bench-staleness-{staleness}-{os.getpid()}"
    settings = {
        "n_samples": 2,
        "batch_size": args.batch_size,
        "max_staleness": 1,
        "staleness": staleness,
        "group_timeout_s": 600,
    }
    run = join_run(client, name, RunConfig(**settings))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])
        ),
    }
    common = ["--redis-url", url, "--run", name]
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in settings.items()]
    commands = [
        ["batcher", *common, *flags, "--dataset", str(dataset), "--round-s", "0.1"],
        ["assembler", *common, "--tick-interval-s", "0.1"],
        *(["worker", *common, "--concurrency", str(args.concurrency)] for _ in range(args.workers)),
    ]
    logs = []
    procs = []
    started = time.monotonic()
    for i, command in enumerate(commands):
        log = open(tmp / f"{staleness}-{i}-{command[0]}.log", "wb")  # closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "streamgrp", command[0], *command[1:]],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
    script = tmp / "trainer.py"
    script.write_text(TRAINER)
    trainer = subprocess.Popen([sys.executable, str(script), url, name, str(args.step_s)], env=env)

    def events(stream, kind):
        return [e for e in (codec.decode(f) for _, f in client.xrange(stream)) if isinstance(e, kind)]

    try:
        while not (events(run.keys.control, RunFinished) and trainer.poll() is not None):
            if any(p.poll() not in (None, 0) for p in procs):
                raise SystemExit(f"a role of the {staleness} run failed; see {tmp}")
            time.sleep(0.5)
        wall = time.monotonic() - started
    finally:
        for proc in (*procs, trainer):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        for log in logs:
            log.close()
    tokens_of = {
        f"t{i:08d}": p["tokens"] for i, p in enumerate(orjson.loads(line) for line in dataset.read_bytes().splitlines())
    }
    decided = [d for d in events(run.keys.decisions, GroupDecided) if d.decision != "dropped"]
    manifests = events(run.keys.steps, StepManifest)
    trained = {g.task_id for m in manifests for s in m.shards for g in s.groups}
    stale = {d.task_id for d in events(run.keys.discarded, GroupDiscarded) if d.reason == "stale"}
    result = {"wall": wall, "steps": len(manifests), "busy": len(manifests) * args.step_s / wall}
    for label, tasks in (("decided", {d.task_id for d in decided}), ("trained", trained), ("stale", stale)):
        result[label] = Counter(bucket(tokens_of[task]) for task in tasks)
    drop_run(client, run)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--step-s", type=float, default=0.5, help="the trainer's time per step")
    parser.add_argument("--ms-per-token", type=float, default=1.5, help="a slot's time per generated token")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    server = start_server()
    try:
        url = server.url
        import redis

        print(
            f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} cores, "
            f"{server_name(redis.Redis.from_url(url))}"
        )
        with tempfile.TemporaryDirectory() as directory:
            tmp = Path(directory)
            dataset = tmp / "prompts.jsonl"
            data = prompts(args.prompts, args.ms_per_token, args.seed)
            import orjson

            dataset.write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in data))
            counts = Counter(bucket(p["tokens"]) for p in data)
            print(
                f"{args.prompts} prompts (short {counts['short']}, medium {counts['medium']}, long "
                f"{counts['long']}), 2 slots each, batch_size {args.batch_size}, max_staleness 1, trainer "
                f"{args.step_s} s/step, {args.ms_per_token} ms/token, {args.workers} workers x {args.concurrency}"
            )
            results = {mode: one_run(url, mode, dataset, args, tmp) for mode in ("drop", "wait")}
    finally:
        stop_server(server)
    print(
        "\n| policy | decided (s/m/l) | trained (s/m/l) | stale-dropped (s/m/l) | long share: decided -> trained "
        "| wall s | steps | trainer busy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():

        def triple(c: Counter) -> str:
            return f"{sum(c.values())} ({c['short']}/{c['medium']}/{c['long']})"

        decided_long = r["decided"]["long"] / max(1, sum(r["decided"].values()))
        trained_long = r["trained"]["long"] / max(1, sum(r["trained"].values()))
        print(
            f"| {mode} | {triple(r['decided'])} | {triple(r['trained'])} | {triple(r['stale'])} | "
            f"{decided_long:.1%} -> {trained_long:.1%} | {r['wall']:.1f} | {r['steps']} | {r['busy']:.0%} |"
        )


if __name__ == "__main__":
    main()

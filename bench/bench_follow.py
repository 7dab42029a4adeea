"""Follower overhead: the trainer's throughput with two followers attached against none.

One run per case on a local embedded server, every role a real OS process (`python -m streamgrp ...`):
a batcher feeding a dataset, an assembler, ``--workers`` workers (the built-in synthetic rollout,
``--tokens`` tokens per sample) and one trainer rank that loads every step's batch (tensors) and
commits it. With followers, two more processes follow the run from its start: the live evaluation
example (`streamgrp.consumers.live_eval`, writing its state file after every decision) and `streamgrp
export --follow` (a Parquet file every second). Both read the decisions as they are written.

The trainer's step takes ``--step-s`` (default 50 ms) that its process waits out, as a trainer waits for
its accelerator; ``--step-s 0`` instead runs the pipeline flat out, every core busy, where whatever
CPU a follower takes comes straight out of the run's (the worst case on a small machine).

The trainer's throughput is steps per second from its ``--warmup``-th step to its last, as the trainer
itself times them (so the runs' start-up, identical in both cases, is left out), and rows per second
likewise. Cases alternate (none, followers, none, ...) ``--repeat`` times each and the medians are
compared; on a small shared machine the spread between repeats of one case is printed beside it, since
it bounds what the comparison can tell. Also printed: the followers' CPU seconds, and that they read
every decision.

    python bench/bench_follow.py [--steps 300] [--repeat 3] [--workers 2] [--tokens 256] [--step-s 0.05]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
from _harness import server_name, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

TRAINER = """
import sys, time
from streamgrp.store.runs import await_run, connect
from streamgrp.train.trainer import TrainerClient
import threading

url, run_name, out, step_s = sys.argv[1:5]
client = connect(url)
run = await_run(client, run_name, stop=threading.Event())
times, rows = [], []
with TrainerClient(client, run, poll_s=0.02).batches(rank=0, world_size=1) as batches:
    for batch in batches:
        (batch.token_ids.float() * batch.loss_mask).sum()  # touch the tensors
        time.sleep(float(step_s))  # the step on the accelerator: the trainer's process waits
        times.append(time.monotonic())
        rows.append(int(batch.token_ids.shape[0]))
open(out, "w").write(repr((times, rows)))
"""


def _streamgrp(role: str, *args: str, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "streamgrp", "--log-level", "WARNING", role, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=ENV,
        )


def _wait_usage(process: subprocess.Popen, timeout: float) -> tuple[int, float]:
    """Reap ``process``: its exit code and the CPU seconds it used (user + system, from wait4)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return process.returncode, usage.ru_utime + usage.ru_stime
        time.sleep(0.05)
    raise RuntimeError(f"pid {process.pid} did not exit within {timeout:g}s")


def one_case(
    url: str,
    run: str,
    directory: Path,
    *,
    steps: int,
    workers: int,
    tokens: int,
    followers: bool,
    warmup: int,
    step_s: float,
) -> dict:
    directory.mkdir()
    dataset = directory / "prompts.jsonl"
    dataset.write_bytes(
        b"".join(
            orjson.dumps({"tokens": tokens, "seed": i, "reject_rate": 0.1, "difficulty": str(i % 3)}) + b"\n"
            for i in range(steps * 8 + 64)
        )
    )
    common = ["--redis-url", url, "--run", run]
    procs = [
        _streamgrp(
            "batcher",
            *common,
            "--n-samples",
            "4",
            "--batch-size",
            "8",
            "--max-steps",
            str(steps),
            "--max-staleness",
            "2",
            "--dataset",
            str(dataset),
            "--round-s",
            "0.05",
            log=directory / "batcher.log",
        ),
        _streamgrp("assembler", *common, "--tick-interval-s", "0.1", log=directory / "assembler.log"),
    ]
    procs += [
        _streamgrp("worker", *common, "--concurrency", "8", log=directory / f"worker{i}.log") for i in range(workers)
    ]
    (directory / "trainer.py").write_text(TRAINER)
    trained = directory / "trained.txt"
    with open(directory / "trainer.log", "wb") as log:
        trainer = subprocess.Popen(
            [sys.executable, str(directory / "trainer.py"), url, run, str(trained), str(step_s)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=ENV,
        )
    attached: list[subprocess.Popen] = []
    if followers:
        with open(directory / "eval.log", "wb") as log:
            attached.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "streamgrp.consumers.live_eval",
                        "--redis-url",
                        url,
                        "--run",
                        run,
                        "--state",
                        str(directory / "eval.json"),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=ENV,
                )
            )
        attached.append(
            _streamgrp(
                "export",
                run,
                "--redis-url",
                url,
                "--follow",
                "true",
                "--flush-s",
                "1",
                "--out",
                str(directory / "export"),
                log=directory / "export.log",
            )
        )
    try:
        trainer.wait(timeout=600)
        if trainer.returncode != 0:
            raise RuntimeError((directory / "trainer.log").read_text()[-2000:])
        follower_cpu = 0.0
        for process in attached:  # they exit once the run has ended and they read everything
            code, cpu = _wait_usage(process, timeout=120)
            follower_cpu += cpu
            if code != 0:
                raise RuntimeError(f"a follower failed: see {directory}")
    finally:
        for process in [*procs, *attached]:
            if process.poll() is None:
                process.terminate()
        for process in [*procs, *attached]:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    times, rows = eval(trained.read_text())  # noqa: S307 - our own child's repr of two lists of numbers
    span = times[-1] - times[warmup - 1]
    out = {"steps_per_s": (len(times) - warmup) / span, "rows_per_s": sum(rows[warmup:]) / span, "steps": len(times)}
    if followers:
        state = orjson.loads((directory / "eval.json").read_bytes())
        import pyarrow.dataset as ds

        exported = ds.dataset(directory / "export" / "decisions", format="parquet").count_rows()
        out["evaluated"] = sum(1 for _ in state["prompts"])
        out["exported"] = exported
        out["follower_cpu_s"] = follower_cpu
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--step-s",
        type=float,
        default=0.05,
        help="the trainer's step on its accelerator, which "
        "its process waits out (0: the pipeline runs flat out, every core busy)",
    )
    args = parser.parse_args()
    server = start_server()
    import redis

    client = redis.Redis.from_url(server.url)
    print(
        f"server {server_name(client)}, {os.cpu_count()} cores, {args.steps} steps of 8 groups x 4 samples of "
        f"{args.tokens} tokens, trainer step {args.step_s}s, {args.workers} workers, {args.repeat} repeats per case"
    )
    results: dict[bool, list[dict]] = {False: [], True: []}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-follow-") as tmp:
            for repeat in range(args.repeat):
                for followers in (False, True):
                    run = f"bench-follow-{repeat}-{'on' if followers else 'off'}-{int(time.time())}"
                    result = one_case(
                        server.url,
                        run,
                        Path(tmp) / run,
                        steps=args.steps,
                        workers=args.workers,
                        tokens=args.tokens,
                        followers=followers,
                        warmup=args.warmup,
                        step_s=args.step_s,
                    )
                    results[followers].append(result)
                    print(
                        f"  {'2 followers' if followers else 'none       '} repeat {repeat}: "
                        f"{result['steps_per_s']:.2f} steps/s, {result['rows_per_s']:.0f} rows/s"
                        + (
                            f"; evaluated {result['evaluated']} prompts, exported {result['exported']} decisions, "
                            f"followers' CPU {result['follower_cpu_s']:.1f}s"
                            if followers
                            else ""
                        )
                    )
    finally:
        client.close()
        stop_server(server)
    base = [r["steps_per_s"] for r in results[False]]
    followed = [r["steps_per_s"] for r in results[True]]
    ratio = statistics.median(followed) / statistics.median(base)
    print(
        f"trainer steps/s, median: none {statistics.median(base):.2f} (range {min(base):.2f}-{max(base):.2f}), "
        f"2 followers {statistics.median(followed):.2f} (range {min(followed):.2f}-{max(followed):.2f})"
    )
    print(f"with followers / without: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%; target within 5%)")
    pairs = ", ".join(f"{f / b:.3f}" for b, f in zip(base, followed))
    print(f"each repeat's pair (followers / none, run one after the other): {pairs}")


if __name__ == "__main__":
    main()

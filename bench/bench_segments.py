"""Benchmark partial rollouts: what recording a slot's segments costs the worker's CPU.

A worker (a child process: `WorkerProcess` with the llama.cpp adapter) generates ``--tasks`` tasks of 4 slots,
``--max-tokens`` tokens each, against the fake llama-server of ``tests/inference_fakes.py`` (in this
process, answering at once, so the worker's CPU is all the worker's work), on a local Valkey. Five ways:

- *off*: ``segment_tokens`` 0, one request per slot, not streamed;
- *streamed, no writes*: one streamed request per slot (an event per token, as llama-server sends them),
  but no segment made or written (`SlotSegments.record` a no-op: what streaming alone costs);
- *streamed segments*: the same, every segment recorded as a `SlotSegment` (``segment.lua``);
- *chunks only* and *chunked segments* (``segment_stream`` off): the generation asked for in requests of 64
  tokens, without and with the writes (the way before streaming, for comparison).

Reported: the worker's CPU seconds (process time, all threads, over its run: not its start and imports) per
run, per sample and per 1,000 generated tokens, and the share of the worker's CPU the segment writes take
(segments less no writes, over segments). A real server's generation is orders of magnitude slower than this
fake, so the worker's CPU per token (parsing) is what it is here; the share is an upper bound as far as the
fake's speed goes.

    python bench/bench_segments.py [--tasks 64] [--max-tokens 512] [--repeat 3] [--no-chunks] [--token-delay 0.002]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _harness import CTX, drop_run, get, join, server_name, spawn, start_server, stop_server

N_SAMPLES = 4


def _worker(url: str, run_name: str, server_url: str, max_tokens: int, segment_tokens: int, write: bool,
            stream: bool, results) -> None:
    from streamgrp.config import InferenceConfig, WorkerConfig
    from streamgrp.services.inference import build_rollout
    from streamgrp.services.worker import WorkerClient, WorkerProcess
    from streamgrp.store import segments
    from streamgrp.store.runs import connect, open_run

    if not write:  # streamed or in chunks, but no segment made or written
        from streamgrp.services.inference.segments import SlotSegments

        segments.SegmentStore.record = lambda self, partition, task_entry, segment: ""
        SlotSegments.record = lambda self, token_ids, logprobs, version, cause: None
    client = connect(url)
    run = open_run(client, run_name)
    config = InferenceConfig(server_url=server_url, max_tokens=max_tokens, segment_tokens=segment_tokens,
                             segment_stream=stream)
    process = WorkerProcess(WorkerClient(client, run.keys), build_rollout("llamacpp", config),
                            WorkerConfig(burst=True, concurrency=8), n_samples=N_SAMPLES)
    started, cpu = time.monotonic(), time.process_time()  # the run only: not the interpreter's start and imports
    done = process.run()
    results.put((done, time.monotonic() - started, time.process_time() - cpu))


def measure(server, client, fake, tasks: int, max_tokens: int, segment_tokens: int, write: bool,
            stream: bool) -> dict:
    from streamgrp.config import RunConfig
    from streamgrp.store.runs import join_run
    from streamgrp.store.tasks import TaskIssuer

    run = join_run(client, f"bench-seg-{time.monotonic_ns()}", RunConfig(n_samples=N_SAMPLES))
    try:
        TaskIssuer(client, run.keys).issue([{"prompt_ids": [5, 6, 7, 8]}] * tasks)
        generated = len(fake.generated)
        results = CTX.Queue()
        proc = spawn(_worker, server.url, run.name, fake.url, max_tokens, segment_tokens, write, stream, results)
        done, seconds, cpu = get(results, [proc], 600)
        join([proc])
        tokens = len(fake.generated) - generated
        return {"done": done, "seconds": seconds, "cpu": cpu, "tokens": tokens,
                "segments": client.xlen(run.keys.segments)}
    finally:
        drop_run(client, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--segment-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-chunks", action="store_true", help="leave out the two chunked ways")
    parser.add_argument("--token-delay", type=float, default=0.0,
                        help="seconds the fake takes per streamed token (0: at once; the worker is then CPU-bound, "
                             "its threads contend for the GIL, the worst case; a delay paces it like a real server)")
    args = parser.parse_args()
    from inference_fakes import Action, start

    from streamgrp.store.runs import connect

    server = start_server()
    fake, stop_fake = start("llamacpp")
    fake.default = Action(token_delay=args.token_delay)
    try:
        client = connect(server.url)
        print(f"{platform.machine()}, CPython {platform.python_version()}, {server_name(client)}; "
              f"{args.tasks} tasks x {N_SAMPLES} slots x {args.max_tokens} tokens, a segment per "
              f"{args.segment_tokens} tokens; streamed tokens {args.token_delay * 1000:g} ms apart")
        ways = {"off": (0, True, False), "streamed, no writes": (args.segment_tokens, False, True),
                "streamed segments": (args.segment_tokens, True, True)}
        if not args.no_chunks:
            ways.update({"chunks only": (args.segment_tokens, False, False),
                         "chunked segments": (args.segment_tokens, True, False)})
        cpu: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeat):
            for name, (segment_tokens, write, stream) in ways.items():  # interleaved: drift hits every way alike
                row = measure(server, client, fake, args.tasks, args.max_tokens, segment_tokens, write, stream)
                assert row["done"] == args.tasks, row
                cpu[name].append(row["cpu"])
                print(f"  {name:20s} cpu {row['cpu']:.2f} s  wall {row['seconds']:.2f} s  tokens {row['tokens']}  "
                      f"segments {row['segments']}")
        tokens = args.tasks * N_SAMPLES * args.max_tokens
        samples = args.tasks * N_SAMPLES
        print("\n| way | worker CPU (s, median) | per sample (ms) | per 1,000 tokens (ms) |\n|---|---|---|---|")
        medians = {name: statistics.median(values) for name, values in cpu.items()}
        for name, value in medians.items():
            print(f"| {name} | {value:.2f} | {1000 * value / samples:.2f} | {1000 * value / tokens * 1000:.1f} |")
        for way, base in (("streamed segments", "streamed, no writes"), ("chunked segments", "chunks only")):
            if way in medians:
                writes = medians[way] - medians[base]
                per_segment = writes / (tokens / args.segment_tokens)
                print(f"\n{way}: the writes are {100 * writes / medians[way]:.1f}% of the worker's CPU "
                      f"({1e6 * per_segment:.0f} us per segment); against no segments at all (off): "
                      f"+{100 * (medians[way] - medians['off']) / medians['off']:.0f}%")
    finally:
        stop_fake()
        stop_server(server)


if __name__ == "__main__":
    main()

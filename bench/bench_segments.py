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
(segments less no writes, over segments); for the streamed segments also that share counted where it is
spent (the CPU time of every `SlotSegments.record` and `SegmentStore.write_now` call, on whichever thread:
no second run to subtract, so less moved by a busy machine) and the segments per pipeline. A real server's
generation is orders of magnitude slower than this fake, so the worker's CPU per token (parsing) is what it
is here; the share is an upper bound as far as the fake's speed goes.

    python bench/bench_segments.py [--tasks 64] [--max-tokens 512] [--repeat 3] [--no-chunks] [--token-delay 0.002]
                                   [--concurrency 8]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _harness import CTX, drop_run, get, join, server_name, spawn, start_server, stop_server

N_SAMPLES = 4


def _worker(
    url: str,
    run_name: str,
    server_url: str,
    max_tokens: int,
    segment_tokens: int,
    write: bool,
    stream: bool,
    concurrency: int,
    results,
) -> None:
    from streamgrp.config import InferenceConfig, WorkerConfig
    from streamgrp.services.inference import build_rollout
    from streamgrp.services.worker import WorkerClient, WorkerProcess
    from streamgrp.store import segments
    from streamgrp.store.runs import connect, open_run

    if not write:  # streamed or in chunks, but no segment made or written
        from streamgrp.services.inference.segments import SlotSegments

        segments.SegmentStore.record = lambda self, partition, task_entry, segment: ""
        SlotSegments.record = lambda self, token_ids, logprobs, version, cause: None
    spent = [0.0]
    if write and stream:  # the writes' own CPU, on whichever thread: a segment built and queued, a batch sent
        from streamgrp.services.inference.segments import SlotSegments

        SlotSegments.record = _timed(SlotSegments.record, spent)
        if hasattr(segments.SegmentStore, "write_now"):  # where the batches are sent (whichever thread sends)
            segments.SegmentStore.write_now = _timed(segments.SegmentStore.write_now, spent)
    client = connect(url)
    run = open_run(client, run_name)
    config = InferenceConfig(
        server_url=server_url, max_tokens=max_tokens, segment_tokens=segment_tokens, segment_stream=stream
    )
    process = WorkerProcess(
        WorkerClient(client, run.keys),
        build_rollout("llamacpp", config),
        WorkerConfig(burst=True, concurrency=concurrency),
        n_samples=N_SAMPLES,
    )
    started, cpu = time.monotonic(), time.process_time()  # the run only: not the interpreter's start and imports
    done = process.run()
    store = getattr(process.rollout, "segments", None)
    batches = getattr(store, "batches", 0) if write else 0
    results.put((done, time.monotonic() - started, time.process_time() - cpu, batches, spent[0]))


_depth = threading.local()


def _timed(method, spent: list[float]):
    """``method``, adding the CPU time its calls take on their thread to ``spent[0]`` (under the GIL: no lock).
    A timed call inside another (a slot's `record` that sends the queue itself) is counted once, by the outer."""

    def timed(*args, **kwargs):
        outer = not getattr(_depth, "inside", False)
        _depth.inside = True
        started = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            if outer:
                _depth.inside = False
                spent[0] += time.thread_time() - started

    return timed


def measure(
    server,
    client,
    fake,
    tasks: int,
    max_tokens: int,
    segment_tokens: int,
    write: bool,
    stream: bool,
    concurrency: int = 8,
) -> dict:
    from streamgrp.config import RunConfig
    from streamgrp.store.runs import join_run
    from streamgrp.store.tasks import TaskIssuer

    run = join_run(client, f"bench-seg-{time.monotonic_ns()}", RunConfig(n_samples=N_SAMPLES))
    try:
        TaskIssuer(client, run.keys).issue([{"prompt_ids": [5, 6, 7, 8]}] * tasks)
        generated = len(fake.generated)
        results = CTX.Queue()
        proc = spawn(
            _worker, server.url, run.name, fake.url, max_tokens, segment_tokens, write, stream, concurrency, results
        )
        done, seconds, cpu, batches, spent = get(results, [proc], 600)
        join([proc])
        tokens = len(fake.generated) - generated
        return {
            "done": done,
            "seconds": seconds,
            "cpu": cpu,
            "tokens": tokens,
            "segments": client.xlen(run.keys.segments),
            "batches": batches,
            "spent": spent,
        }
    finally:
        drop_run(client, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--segment-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="the worker's slots at once")
    parser.add_argument("--no-chunks", action="store_true", help="leave out the two chunked ways")
    parser.add_argument(
        "--token-delay",
        type=float,
        default=0.0,
        help="seconds the fake takes per streamed token (0: at once; the worker is then CPU-bound, "
        "its threads contend for the GIL, the worst case; a delay paces it like a real server)",
    )
    args = parser.parse_args()
    from inference_fakes import Action, start

    from streamgrp.store.runs import connect

    server = start_server()
    fake, stop_fake = start("llamacpp")
    fake.default = Action(token_delay=args.token_delay)
    try:
        client = connect(server.url)
        print(
            f"{platform.machine()}, CPython {platform.python_version()}, {server_name(client)}; "
            f"{args.tasks} tasks x {N_SAMPLES} slots x {args.max_tokens} tokens, a segment per "
            f"{args.segment_tokens} tokens; streamed tokens {args.token_delay * 1000:g} ms apart"
        )
        ways = {
            "off": (0, True, False),
            "streamed, no writes": (args.segment_tokens, False, True),
            "streamed segments": (args.segment_tokens, True, True),
        }
        if not args.no_chunks:
            ways.update(
                {
                    "chunks only": (args.segment_tokens, False, False),
                    "chunked segments": (args.segment_tokens, True, False),
                }
            )
        cpu: dict[str, list[float]] = {name: [] for name in ways}
        own: list[tuple[float, float, int]] = []  # streamed segments: (the writes' own CPU, the worker's, pipelines)
        for _ in range(args.repeat):
            for name, (segment_tokens, write, stream) in ways.items():  # interleaved: drift hits every way alike
                row = measure(
                    server, client, fake, args.tasks, args.max_tokens, segment_tokens, write, stream, args.concurrency
                )
                assert row["done"] == args.tasks, row
                cpu[name].append(row["cpu"])
                if row["spent"]:
                    own.append((row["spent"], row["cpu"], row["batches"]))
                print(
                    f"  {name:20s} cpu {row['cpu']:.2f} s  wall {row['seconds']:.2f} s  tokens {row['tokens']}  "
                    f"segments {row['segments']}" + (f" in {row['batches']} pipelines" if row["batches"] else "")
                )
        tokens = args.tasks * N_SAMPLES * args.max_tokens
        print(f"load average at the end: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
        samples = args.tasks * N_SAMPLES
        print("\n| way | worker CPU (s, median) | per sample (ms) | per 1,000 tokens (ms) |\n|---|---|---|---|")
        medians = {name: statistics.median(values) for name, values in cpu.items()}
        for name, value in medians.items():
            print(f"| {name} | {value:.2f} | {1000 * value / samples:.2f} | {1000 * value / tokens * 1000:.1f} |")
        for way, base in (("streamed segments", "streamed, no writes"), ("chunked segments", "chunks only")):
            if way in medians:
                writes = medians[way] - medians[base]
                per_segment = writes / (tokens / args.segment_tokens)
                # each repeat's pair (run back to back) on its own too: the spread says how far to trust it
                paired = sorted(100 * (w - b) / w for w, b in zip(cpu[way], cpu[base]))
                print(
                    f"\n{way}: the writes are {100 * writes / medians[way]:.1f}% of the worker's CPU "
                    f"({1e6 * per_segment:.0f} us per segment); against no segments at all (off): "
                    f"+{100 * (medians[way] - medians['off']) / medians['off']:.0f}%; "
                    f"each repeat's pair: {', '.join(f'{share:.1f}%' for share in paired)}"
                )
        if own and all(
            batches for _, _, batches in own
        ):  # the writes' own CPU, counted on the threads that spent it: no baseline run to subtract
            segments = tokens / args.segment_tokens
            share = statistics.median(spent / total for spent, total, _ in own)
            per_segment = statistics.median(spent for spent, _, _ in own) / segments
            pipelines = statistics.median(batches for _, _, batches in own)
            print(
                f"streamed segments, counted where they run (building, queueing, encoding, sending, the replies): "
                f"{100 * share:.1f}% of the worker's CPU ({1e6 * per_segment:.0f} us per segment), "
                f"{segments / pipelines:.1f} segments per pipeline"
            )
    finally:
        stop_fake()
        stop_server(server)


if __name__ == "__main__":
    main()

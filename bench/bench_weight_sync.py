"""Benchmark a weight sync on llama.cpp: how long generation stops when `streamgrp weight-sync` moves
llama-server to a new version, whether any generation fails because of it, and what writing the
version's GGUF costs the trainer.

- **Export**: SmolLM2-135M loaded in torch as the lm trainer loads it, written as ``model.gguf`` in F32
  and in F16 (`streamgrp.train.gguf_export`, what ``streamgrp.consumers.lm_trainer`` does per version),
  median of ``--exports`` writes each, page cache warm, fsync included.
- **Gap per sync**: four client threads (llama-server's four slots, as a worker at ``--concurrency 4``)
  generate ``--max-tokens`` tokens at a time through the llama.cpp adapter (`InferenceRollout.complete`:
  its retries, backoff and version from the alias, as a worker), while ``LlamaServerProcess.serve``
  moves the server to the next version every ``--every-s`` seconds, ``--syncs`` times. The *gap* of a
  sync is the time from the end of the last generation by the old version to the start of the first
  by the new one (the start of its successful attempt, after any retry pause; 0 when they overlap):
  the issue's "last token from the old weights to the first from the new", give or take one
  generation's prompt. *Idle* is the longest time in which no generation finished, from the sync's
  start to 3 s after it returned (it includes one generation's length); *failed* counts generations
  that failed, which would be failed slots. Mechanisms: ``before`` (weight-sync and the adapter before
  issue 38: SIGTERM, wait up to 10 s, SIGKILL, start, wait for /health; retries after a blind backoff),
  ``restart`` (now: SIGKILL at once, start, wait; the adapter waits for /health to answer again and
  sends once more, an attempt not counted) and
  ``handover`` (the new server starts beside the old on the same port, ``--reuse-port``, and the old
  one is killed once the new one answers under its alias).

Every version is the same F16 file (the lm trainer's default) under another alias (the weights do not
change how long a sync takes; the file is in the page cache, as one the trainer just wrote is).

    eval "$(ops/llama-server.sh)"; python bench/bench_weight_sync.py [--mechanisms before,restart,handover]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streamgrp.cli.children import free_port  # noqa: E402
from streamgrp.config import InferenceConfig  # noqa: E402
from streamgrp.services.inference import make_dialect  # noqa: E402
from streamgrp.services.inference.adapter import InferenceRollout  # noqa: E402
from streamgrp.services.inference.dialect import Sampling  # noqa: E402
from streamgrp.services.inference.http import InferenceError  # noqa: E402
from streamgrp.services.inference.pool import ServerPool  # noqa: E402
from streamgrp.services.inference.weight_sync import LlamaServerProcess  # noqa: E402

PROMPT = "<|im_start|>user\nWrite a short sentence about the sea.<|im_end|>\n<|im_start|>assistant\n"
MECHANISMS = {
    "before": {"handover": False, "restart_grace_s": 10.0},
    "restart": {"handover": False, "restart_grace_s": 0.0},
    "handover": {"handover": True},
}


class BlindRetries(InferenceRollout):
    """The adapter as it was before issue 38: every failure is an attempt, followed by a blind pause."""

    def _await_restart(self, url: str, budget_s: float) -> tuple[bool, float]:
        return False, 0.0


def export_times(source: Path, directory: Path, repeats: int) -> tuple[dict[str, float], Path]:
    """Median seconds per GGUF write, by outtype; and the F16 file (the served versions)."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    from streamgrp.consumers.lm_trainer import load_policy
    from streamgrp.train.gguf_export import GgufTemplate

    started = time.monotonic()
    state = load_policy(source).state_dict()
    template = GgufTemplate.read(source)
    print(f"model and template loaded in {time.monotonic() - started:.1f}s", file=sys.stderr)
    times = {}
    for outtype in ("f32", "f16"):
        runs = []
        for _ in range(repeats):
            path = directory / f"model-{outtype}.gguf"
            started = time.monotonic()
            template.write(path, state, outtype=outtype)
            runs.append(time.monotonic() - started)
        times[outtype] = statistics.median(runs)
    (directory / "model-f32.gguf").unlink()
    return times, directory / "model-f16.gguf"


class Load:
    """Client threads generating through the adapter; records (started, finished, version) and failures."""

    def __init__(self, url: str, threads: int, max_tokens: int, *, blind: bool) -> None:
        self.slept_until = threading.local()
        self.rollout = (BlindRetries if blind else InferenceRollout)(
            make_dialect("llamacpp", InferenceConfig()),
            ServerPool([url]),
            Sampling(max_tokens=max_tokens, temperature=1.0),
            lambda prompt, completion, text: 0.0,
            sleep=self._sleep,
        )
        self.done: list[tuple[float, float, int | None]] = []
        self.failed: list[tuple[float, str]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        self.slept_until.at = time.monotonic()

    def start(self) -> None:
        self.prompt_ids = self.rollout.prompt_ids({"text": PROMPT})
        for thread in self.threads:
            thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            started = self.slept_until.at = time.monotonic()
            try:
                completion = self.rollout.complete(self.prompt_ids)
                # The successful attempt began after the last pause (a retry's), or when the call did.
                begun = self.slept_until.at if completion.attempts > 1 else started
                with self.lock:
                    self.done.append((begun, time.monotonic(), min(v for v in completion.versions if v is not None)))
            except InferenceError as exc:
                with self.lock:
                    self.failed.append((time.monotonic(), str(exc)[:200]))

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def measure(
    binary: str, model: Path, mechanism: str, syncs: int, every_s: float, max_tokens: int, log_dir: Path
) -> dict:
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    command = f"{binary} --host 127.0.0.1 --port {port} -c 4096 -np 4 -t 2 --no-webui"
    llama = LlamaServerProcess(
        command, url, alias="bench", log_path=log_dir / f"llama-{mechanism}.log", **MECHANISMS[mechanism]
    )
    llama.serve(model, 0)
    load = Load(url, 4, max_tokens, blind=mechanism == "before")
    load.start()
    windows = []
    try:
        time.sleep(every_s)
        for version in range(1, syncs + 1):
            started = time.monotonic()
            llama.serve(model, version)
            windows.append((version, started, time.monotonic()))
            time.sleep(every_s)
    finally:
        load.finish()
        llama.stop(0)
    rows = []
    for version, started, ended in windows:
        finished = sorted(end for _, end, _ in load.done if started - 5 <= end <= ended + 3)
        before = [end for end in finished if end < started] or [started]
        marks = [before[-1], *[end for end in finished if end >= started], ended + 3]
        old = [end for _, end, v in load.done if v == version - 1]
        new = [begun for begun, _, v in load.done if v == version]
        rows.append(
            {
                "version": version,
                "sync_s": ended - started,
                "idle_s": max(b - a for a, b in zip(marks, marks[1:])),
                "gap_s": max(0.0, min(new) - max(old)) if old and new else float("nan"),
                "failed": sum(1 for at, _ in load.failed if started <= at <= ended + 3),
            }
        )
    return {
        "mechanism": mechanism,
        "rows": rows,
        "generations": len(load.done),
        "failed": len(load.failed),
        "errors": sorted({error for _, error in load.failed})[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mechanisms", default="before,restart,handover")
    parser.add_argument("--syncs", type=int, default=10)
    parser.add_argument("--every-s", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--exports", type=int, default=3)
    args = parser.parse_args()
    binary, source = os.environ.get("LLAMA_SERVER"), os.environ.get("SMOLLM2_GGUF")
    if not binary or not source:
        sys.exit('set LLAMA_SERVER and SMOLLM2_GGUF: eval "$(ops/llama-server.sh)"')
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        # In a process of its own: torch's threads stay out of the generation measured next.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            times, model = pool.submit(export_times, Path(source), directory, args.exports).result()
        size = model.stat().st_size / 1e6
        print(
            f"GGUF export (median of {args.exports}): f32 {times['f32']:.2f}s ({2 * size:.0f} MB), "
            f"f16 {times['f16']:.2f}s ({size:.0f} MB)"
        )
        print(
            "| mechanism | gap per sync, median | max | idle per sync, median | max | sync took, median | "
            "failed | generations |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for mechanism in args.mechanisms.split(","):
            result = measure(binary, model, mechanism, args.syncs, args.every_s, args.max_tokens, directory)
            rows = result["rows"]
            gaps = [row["gap_s"] for row in rows if row["gap_s"] == row["gap_s"]]  # nan: a version never served
            idles = [row["idle_s"] for row in rows]
            print(
                f"| {mechanism} | {statistics.median(gaps):.2f}s | {max(gaps):.2f}s | "
                f"{statistics.median(idles):.2f}s | {max(idles):.2f}s | "
                f"{statistics.median(row['sync_s'] for row in rows):.2f}s | {result['failed']} | "
                f"{result['generations']} |",
                flush=True,
            )
            if result["errors"]:
                print(f"  failures: {result['errors']}", file=sys.stderr)


if __name__ == "__main__":
    main()

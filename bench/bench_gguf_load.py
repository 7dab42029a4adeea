"""Benchmark how long the LM trainer takes to load its policy from a GGUF file: `streamgrp.train.gguf_model`
(the trainer's path for a plain Llama file) against transformers' own GGUF loader
(``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``, the trainer's path before, and still its path
for any other file), each in a fresh process so imports are counted once and nothing is cached between runs.

Per loader, ``--runs`` alternating runs: *load* is the call alone, *process* the whole child (interpreter,
imports of torch and transformers, the load). The two models are compared once, weight for weight.

    eval "$(ops/llama-server.sh)"; python bench/bench_gguf_load.py [--gguf FILE] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TQDM_DISABLE", "1")
import torch
from pathlib import Path
path, loader, dump = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
started = time.perf_counter()
if loader == "streamgrp":
    from streamgrp.train.gguf_model import load_llama
    model = load_llama(path)
else:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
seconds = time.perf_counter() - started
if dump:
    torch.save(model.state_dict(), dump)
print(json.dumps({"load_s": seconds}))
"""


def _run(gguf: str, loader: str, dump: str = "") -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, gguf, loader, dump], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{loader} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=os.environ.get("SMOLLM2_GGUF"), help="the GGUF file (default $SMOLLM2_GGUF)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if not args.gguf:
        raise SystemExit('give --gguf FILE, or eval "$(ops/llama-server.sh)" for $SMOLLM2_GGUF')
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as scratch:
        dumps = {loader: os.path.join(scratch, f"{loader}.pt") for loader in ("streamgrp", "transformers")}
        for loader, dump in dumps.items():
            _run(args.gguf, loader, dump)
        ours, theirs = (torch.load(dumps[name]) for name in ("streamgrp", "transformers"))
        same = list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    print(f"{os.path.basename(args.gguf)}: {len(theirs)} tensors; the same weights bit for bit: {same}")
    results: dict[str, list[dict]] = {"streamgrp": [], "transformers": []}
    for _ in range(args.runs):
        for loader in results:
            results[loader].append(_run(args.gguf, loader))
    print(f"{'loader':<14}{'load s (min / median / max)':>32}{'process s (median)':>22}")
    for loader, runs in results.items():
        loads = sorted(run["load_s"] for run in runs)
        process = statistics.median(run["process_s"] for run in runs)
        print(f"{loader:<14}{loads[0]:>12.2f} /{statistics.median(loads):>7.2f} /{loads[-1]:>7.2f}{process:>22.2f}")
    ratio = statistics.median(r["load_s"] for r in results["transformers"]) / statistics.median(
        r["load_s"] for r in results["streamgrp"]
    )
    print(f"transformers / streamgrp, load: {ratio:.1f}x")


if __name__ == "__main__":
    main()

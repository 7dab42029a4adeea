"""Benchmark balanced_partition against greedy longest-first (SPEC section 4).

Quality: on a mixed set of inputs (uniform, lognormal, pareto and bimodal token counts; ragged and
divisible group counts; 2..16 ranks; 16..1024 groups) it prints how often balanced_partition's largest
shard load is lower, higher (must be never) or equal to greedy's, broken down by distribution and by
ragged/divisible, plus the mean ratio max_load / (sum / k) for both.
Speed: mean and p99 milliseconds per call at 1024 groups on 8 ranks, for both, per distribution.

    python bench/bench_rank_split.py [--seed 0] [--cases 800] [--reps 100]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from streamgrp.core.rank_split import balanced_partition, greedy_split, max_load  # noqa: E402

MAX_TOKENS = 32768


def _uniform(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(50, 8000) for _ in range(n)]


def _lognormal(rng: random.Random, n: int) -> list[int]:
    return [max(16, min(MAX_TOKENS, int(rng.lognormvariate(6.8, 1.0)))) for _ in range(n)]


def _pareto(rng: random.Random, n: int) -> list[int]:
    return [min(MAX_TOKENS, int(100 * rng.paretovariate(1.2))) for _ in range(n)]


def _bimodal(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(50, 400) if rng.random() < 0.7 else rng.randint(3000, 8000) for _ in range(n)]


DISTRIBUTIONS: dict[str, Callable[[random.Random, int], list[int]]] = {
    "uniform": _uniform,
    "lognormal": _lognormal,
    "pareto": _pareto,
    "bimodal": _bimodal,
}


def _case(rng: random.Random, number: int) -> tuple[str, bool, list[int], int]:
    dist = list(DISTRIBUTIONS)[number % len(DISTRIBUTIONS)]
    ragged = (number // len(DISTRIBUTIONS)) % 2 == 0
    k = rng.randint(2, 16)
    n = int(round(math.exp(rng.uniform(math.log(16), math.log(1024)))))
    n = max(n, k)
    if ragged:
        if n % k == 0:
            n = n + 1 if n < 1024 else n - 1
    else:
        n = max(k, (n // k) * k)
        if n < 16:
            n = k * math.ceil(16 / k)
    return dist, ragged, DISTRIBUTIONS[dist](rng, n), k


def _timings(fn: Callable[[list[int], int], object], ws: list[int], k: int, reps: int) -> tuple[float, float]:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(ws, k)
        samples.append((time.perf_counter() - t0) * 1000.0)
    samples.sort()
    return sum(samples) / reps, samples[min(reps - 1, math.ceil(0.99 * reps) - 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of random.Random for inputs (default 0)")
    parser.add_argument("--cases", type=int, default=800, help="number of mixed quality cases (default 800)")
    parser.add_argument("--reps", type=int, default=100, help="timed calls per distribution at 1024x8")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    started = time.perf_counter()

    # outcome counters: key -> [lower, higher, equal]
    outcome: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    ratio_ours: list[float] = []
    ratio_greedy: list[float] = []
    worst_slow = 0.0
    for number in range(args.cases):
        dist, ragged, ws, k = _case(rng, number)
        t0 = time.perf_counter()
        ours = max_load(ws, balanced_partition(ws, k))
        worst_slow = max(worst_slow, (time.perf_counter() - t0) * 1000.0)
        theirs = max_load(ws, greedy_split(ws, k))
        slot = 0 if ours < theirs else 1 if ours > theirs else 2
        for key in ("all", dist, "ragged" if ragged else "divisible"):
            outcome[key][slot] += 1
        ideal = sum(ws) / k
        ratio_ours.append(ours / ideal)
        ratio_greedy.append(theirs / ideal)

    print(f"balanced_partition vs greedy longest-first: {args.cases} cases, seed {args.seed}")
    print(f"{'inputs':<12}{'cases':>7}{'lower':>9}{'higher':>9}{'equal':>9}")
    for key in ("all", *DISTRIBUTIONS, "ragged", "divisible"):
        lo, hi, eq = outcome[key]
        total = lo + hi + eq
        if total:
            print(f"{key:<12}{total:>7}{lo / total:>9.1%}{hi / total:>9.1%}{eq / total:>9.1%}")
    print(
        f"mean max_load / (sum/k): balanced {sum(ratio_ours) / len(ratio_ours):.6f}   "
        f"greedy {sum(ratio_greedy) / len(ratio_greedy):.6f}"
    )
    print(f"slowest balanced_partition call among the cases: {worst_slow:.2f} ms")
    print()
    print(f"ms per call at 1024 groups on 8 ranks ({args.reps} calls each)")
    print(f"{'weights':<12}{'balanced mean':>15}{'p99':>9}{'greedy mean':>13}{'p99':>9}")
    for dist, make in DISTRIBUTIONS.items():
        ws = make(rng, 1024)
        mean_b, p99_b = _timings(balanced_partition, ws, 8, args.reps)
        mean_g, p99_g = _timings(greedy_split, ws, 8, args.reps)
        print(f"{dist:<12}{mean_b:>15.2f}{p99_b:>9.2f}{mean_g:>13.2f}{p99_g:>9.2f}")
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    return 1 if outcome["all"][1] else 0


if __name__ == "__main__":
    raise SystemExit(main())

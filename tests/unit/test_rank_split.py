"""Unit tests of streamgrp.core.rank_split: hand examples, errors, the invariant checker, purity."""

from __future__ import annotations

import ast
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from streamgrp.core.rank_split import (
    balanced_partition,
    check_split_invariants,
    greedy_split,
    max_load,
)

ROOT = Path(__file__).resolve().parents[2]


def _loads(weights, shards):
    return [sum(weights[i] for i in s) for s in shards]


def _fixed_extras_greedy(weights, k):
    """Greedy longest-first where the n % k extra items may only go to the first shards."""
    n = len(weights)
    q, r = divmod(n, k)
    cap = [q + 1 if s < r else q for s in range(k)]
    shards = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(n), key=lambda i: (-weights[i], i)):
        s = min((s for s in range(k) if len(shards[s]) < cap[s]), key=lambda s: (loads[s], s))
        shards[s].append(i)
        loads[s] += weights[i]
    return shards


# ------------------------------------------------------------------------------------ hand examples


def test_five_items_two_ranks_beats_greedy():
    w = [5, 4, 3, 3, 3]
    # greedy: 5 -> A, 4 -> B, 3 -> B (7), 3 -> A (8), 3 -> B (10): loads 8 and 10
    assert greedy_split(w, 2) == [[0, 3], [1, 2, 4]]
    assert max_load(w, greedy_split(w, 2)) == 10
    shards = balanced_partition(w, 2)
    assert shards == [[0, 1], [2, 3, 4]]
    assert _loads(w, shards) == [9, 9]
    check_split_invariants(w, 2, shards)


def test_ragged_flexible_extras_beat_fixed_extras():
    w = [10, 1, 1, 1, 1]  # n=5, k=2: one shard holds 3 items, the other 2
    fixed = _fixed_extras_greedy(w, 2)
    assert max_load(w, fixed) == 12  # the heavy item is stuck in the 3-item shard
    shards = balanced_partition(w, 2)
    assert max_load(w, shards) == 11
    heavy = next(s for s in shards if 0 in s)
    assert len(heavy) == 2, "the heavy group should sit in a floor-size shard"
    assert sorted(len(s) for s in shards) == [2, 3]
    assert max_load(w, greedy_split(w, 2)) == 11


def test_ragged_case_strictly_better_than_greedy():
    w = [10, 9, 3, 6, 10, 8, 11]  # n=7, k=3, sum 57: 19 is a perfect split
    g = greedy_split(w, 3)
    assert max_load(w, g) == 20
    shards = balanced_partition(w, 3)
    assert max_load(w, shards) == 19
    assert sorted(_loads(w, shards)) == [19, 19, 19]
    assert sorted(len(s) for s in shards) == [2, 2, 3]
    check_split_invariants(w, 3, shards)


def test_large_input_strictly_better_than_greedy():
    rng = random.Random(7)
    w = [rng.randint(50, 8000) for _ in range(1000)]
    k = 8
    ours, greedy = max_load(w, balanced_partition(w, k)), max_load(w, greedy_split(w, k))
    assert ours < greedy
    assert ours == math.ceil(sum(w) / k)  # perfectly balanced: nothing can do better
    check_split_invariants(w, k, balanced_partition(w, k))


def test_n_equals_k_gives_one_group_per_rank():
    w = [7, 1, 3, 9]
    assert balanced_partition(w, 4) == [[0], [1], [2], [3]]
    assert greedy_split(w, 4) == [[0], [1], [2], [3]]


def test_k_one_takes_everything():
    w = [3, 1, 2]
    assert balanced_partition(w, 1) == [[0, 1, 2]]
    assert max_load(w, balanced_partition(w, 1)) == 6


def test_all_zero_weights():
    shards = balanced_partition([0] * 7, 3)
    assert sorted(len(s) for s in shards) == [2, 2, 3]
    check_split_invariants([0] * 7, 3, shards)


def test_output_is_canonical_and_deterministic():
    rng = random.Random(1)
    w = [rng.randint(1, 5000) for _ in range(301)]
    first = balanced_partition(w, 6)
    assert balanced_partition(list(w), 6) == first
    assert balanced_partition(tuple(w), 6) == first
    assert all(s == sorted(s) for s in first)
    assert [s[0] for s in first] == sorted(s[0] for s in first)
    assert sorted(len(s) for s in first) == [50] * 5 + [51]


# ----------------------------------------------------------------------------------- int and float


def test_int_loads_are_exact():
    big = 2**60
    w = [big + 1, big, 1, 2]
    shards = balanced_partition(w, 2)
    assert max_load(w, shards) == big + 2  # {big+1, 1} and {big, 2}
    assert isinstance(max_load(w, shards), int)


def test_float_loads_use_fsum():
    w = [0.1] * 10
    assert max_load(w, [list(range(10))]) == 1.0  # plain sum() gives 0.9999999999999999


def test_float_weights():
    rng = random.Random(3)
    w = [rng.lognormvariate(6.8, 1.0) for _ in range(200)]
    shards = balanced_partition(w, 7)
    check_split_invariants(w, 7, shards)
    assert max_load(w, shards) < max_load(w, greedy_split(w, 7))


def test_mixed_int_and_float_weights():
    w = [3, 2.5, 1, 4.0, 2]
    check_split_invariants(w, 2, balanced_partition(w, 2))


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("fn", [balanced_partition, greedy_split])
def test_fewer_groups_than_ranks_says_what_to_change(fn):
    with pytest.raises(ValueError, match=r"need at least k=4 groups.*got 3.*wait for more groups or lower dp_size"):
        fn([1, 2, 3], 4)


@pytest.mark.parametrize("k", [0, -2])
def test_k_below_one(k):
    with pytest.raises(ValueError, match=rf"at least 1, got {k}; set dp_size >= 1"):
        balanced_partition([1, 2, 3], k)


def test_negative_weight():
    with pytest.raises(ValueError, match=r"weight of group 2 is -5; weights must be >= 0"):
        balanced_partition([1, 2, -5, 3], 2)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weight(bad):
    with pytest.raises(ValueError, match=r"weight of group 1 is .*; weights must be finite"):
        balanced_partition([1.0, bad, 2.0], 2)


def test_non_number_weight():
    with pytest.raises(ValueError, match=r"weight of group 0 is 'x'; weights must be numbers"):
        balanced_partition(["x", 1, 2], 2)


# ------------------------------------------------------------------------------ invariant checker


def test_checker_accepts_greedy_without_determinism_source():
    w = [5, 4, 3, 3, 3]
    check_split_invariants(w, 2, greedy_split(w, 2), produced_by=greedy_split)


@pytest.mark.parametrize(
    ("shards", "message"),
    [
        ([[0, 1, 2, 3, 4]], "invariant 1: expected 2 shards"),
        ([[0, 1], [2, 3]], r"invariant 2: indices \[4\] are in no shard"),
        ([[0, 1, 4], [2, 3, 7]], r"invariant 2: indices \[7\] are out of range"),
        ([[0, 1, 1], [2, 3, 4]], "invariant 2: 1 indices appear in more than one shard"),
        ([[1, 0], [2, 3, 4]], "invariant 2: shard 0 is not in ascending order"),
        ([[2, 3, 4], [0, 1]], "invariant 2: shards are not ordered by smallest index"),
        ([[0], [1, 2, 3, 4]], r"invariant 3: sizes \[1, 4\] are not all 2 or 3"),
        ([[0, 2, 3], [1, 4]], "invariant 4: max load 11 is above greedy longest-first's 10"),
    ],
)
def test_checker_names_the_broken_invariant(shards, message):
    with pytest.raises(AssertionError, match=message):
        check_split_invariants([5, 4, 3, 3, 3], 2, shards, produced_by=None)


def test_checker_counts_extra_shards():
    # 6 items on 4 ranks: exactly 2 shards of 2; sizes [1, 1, 2, 2] are fine, [2, 2, 1, 1] too
    with pytest.raises(AssertionError, match="invariant 3"):
        check_split_invariants([1] * 6, 4, [[0], [1], [2], [3, 4, 5]], produced_by=None)


def test_checker_detects_nondeterminism():
    calls = iter(range(100))

    def flaky(weights, k):
        return greedy_split(weights, k) if next(calls) % 2 else balanced_partition(weights, k)

    w = [5, 4, 3, 3, 3]
    with pytest.raises(AssertionError, match="invariant 5: flaky returned a different split"):
        check_split_invariants(w, 2, balanced_partition(w, 2), produced_by=flaky)


# ------------------------------------------------------------------------------------------ purity


def test_the_rank_split_modules_import_only_the_standard_library_and_each_other():
    own = {"streamgrp.core.rank_split_search"}
    for name in ("rank_split.py", "rank_split_search.py"):
        source = (ROOT / "streamgrp" / "core" / name).read_text()
        imported = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module not in own:
                imported.add((node.module or "").split(".")[0])
        assert imported, f"the parse found no imports at all in {name}"
        assert imported <= set(sys.stdlib_module_names), (name, imported - set(sys.stdlib_module_names))


def test_importing_it_loads_no_heavy_dependency():
    code = (
        "import sys, streamgrp.core.rank_split\n"
        "heavy = {'redis', 'torch', 'numpy', 'prometheus_client'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={"PYTHONPATH": str(ROOT)})

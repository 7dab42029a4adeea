"""Ragged, load-balanced split of a batch's groups over data-parallel ranks (SPEC section 4).

Vocabulary: in streamgrp a *partition* is a run shard (`streamgrp.store.keys`, ``--partitions``); what this
module makes is a *split* of one step's groups into per-rank *shards*, and its names say so
(`greedy_split`, `check_split_invariants`). The one exception is `balanced_partition`, which keeps the
old word because SPEC section 4 names it as public API (``streamgrp.balanced_partition``).

Owns: given one weight per group (its valid-token count) and ``k`` DP ranks, which rank trains which
group. Deliberately ignores what a group is, staleness, and how shards reach the ranks: that is the
batcher's job. Pure: standard library only, no I/O, no clock, no randomness.

Invariants of ``balanced_partition`` (``check_split_invariants`` checks exactly this list):

1. There are exactly ``k`` shards.
2. Every index ``0..n-1`` appears in exactly one shard; indices ascend within a shard and shards are
   ordered by their smallest index.
3. Shard cardinalities differ by at most one: each shard holds ``n // k`` or ``n // k + 1`` indices
   (any shards may hold the ``n % k`` extra ones).
4. The largest shard load (sum of its weights) is never above that of ``greedy_split`` on the same
   input.
5. Deterministic: the same input always gives the same output.

How (objective: minimize the largest shard load under the cardinality rule of 3):

- candidate A: balanced Karmarkar-Karp largest differencing. Items sorted by decreasing weight are cut
  into chunks of ``k`` (one item per shard); the ``k - n % k`` padding zeros all sit in the last chunk,
  so no shard gets two and the cardinality rule holds by construction. The two partial splits
  with the largest spread are merged repeatedly, heaviest part of one with lightest of the other.
- candidate B: ``greedy_split`` (longest first, each item to the lightest shard with room).
- both are refined by local search on the heaviest shard: single-item swaps with any other shard
  (cardinalities kept), moves of one item from a ``ceil`` shard to a ``floor`` shard, and
  one-for-two exchanges that turn a heavy ``floor`` shard into a ``ceil`` one. A step is taken only
  if both touched shards end strictly below the old maximum, so refinement never worsens a solution.
- the best of refined A, refined B and plain B wins (ties: the flatter load profile, then that order).

Integer weights are summed exactly as ints; float loads are compared through ``math.fsum`` so a
rounding artefact can never be mistaken for an improvement.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from heapq import heapify, heappop, heappush, heapreplace

from streamgrp.core.rank_split_search import Shards, Weight, refine, total

__all__ = [
    "balanced_partition",
    "check_split_invariants",
    "greedy_split",
    "max_load",
]


# --------------------------------------------------------------------------------------------- inputs


def _validated(weights: Sequence[Weight], k: int) -> tuple[list[Weight], bool]:
    """Return (weights as a list of ints or of floats, all_int) or raise ValueError saying what to change."""
    if isinstance(k, bool) or not isinstance(k, int):
        try:
            k = operator.index(k)
        except TypeError:
            raise TypeError(f"k (the number of DP ranks) must be an int, got {type(k).__name__}") from None
    if k < 1:
        raise ValueError(f"k (the number of DP ranks) must be at least 1, got {k}; set dp_size >= 1")
    ws = list(weights)
    types = set(map(type, ws))
    if types <= {int}:
        all_int = True
    elif types <= {int, float}:
        all_int = False
        for i, w in enumerate(ws):
            if not math.isfinite(w):
                raise ValueError(
                    f"weight of group {i} is {w!r}; weights must be finite token counts "
                    "(check how the group's valid tokens are counted)"
                )
        try:
            ws = [float(w) for w in ws]
        except OverflowError:
            raise ValueError("an int weight is too large to mix with float weights; pass all ints") from None
    else:
        ws, all_int = _coerce_slow(ws)
    if ws and min(ws) < 0:
        i = min(range(len(ws)), key=ws.__getitem__)
        raise ValueError(
            f"weight of group {i} is {ws[i]!r}; weights must be >= 0 token counts "
            "(check how the group's valid tokens are counted)"
        )
    if len(ws) < k:
        raise ValueError(
            f"need at least k={k} groups to give every DP rank one, got {len(ws)}; "
            "wait for more groups or lower dp_size"
        )
    return ws, all_int


def _coerce_slow(ws: Sequence[object]) -> tuple[list[Weight], bool]:
    """Accept other integral types (numpy ints, bools) and real numbers; reject everything else."""
    out: list[Weight] = []
    all_int = True
    for i, w in enumerate(ws):
        try:
            out.append(operator.index(w))  # type: ignore[arg-type]
            continue
        except TypeError:
            pass
        try:
            v = float(w)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"weight of group {i} is {w!r}; weights must be numbers (token counts)") from None
        if not math.isfinite(v):
            raise ValueError(
                f"weight of group {i} is {w!r}; weights must be finite token counts "
                "(check how the group's valid tokens are counted)"
            )
        all_int = False
        out.append(v)
    if not all_int:
        out = [float(w) for w in out]
    return out, all_int


def _canonical(shards: Shards) -> Shards:
    out = [sorted(s) for s in shards]
    out.sort(key=lambda s: s[0] if s else math.inf)
    return out


def _max(ws: Sequence[Weight], shards: Shards, all_int: bool) -> Weight:
    return max(total([ws[i] for i in s], all_int) for s in shards)


def _lower_bound(ws: list[Weight], order: list[int], k: int, all_int: bool) -> Weight:
    """No split obeying the cardinality rule has a smaller largest load than this."""
    n = len(ws)
    q, r = divmod(n, k)
    whole = total(ws, all_int)
    bound = -(-whole // k) if all_int else whole / k
    smallest = [ws[i] for i in reversed(order)]  # ascending
    # the shard holding the heaviest item holds at least q - 1 others, each at least the lightest ones
    bound = max(bound, ws[order[0]] + total(smallest[: q - 1], all_int))
    if r:  # some shard holds q + 1 items
        bound = max(bound, total(smallest[: q + 1], all_int))
    return bound


def _profile(ws: Sequence[Weight], shards: Shards, all_int: bool) -> list[Weight]:
    """Shard loads, heaviest first: the tie-break key between candidates."""
    return sorted((total([ws[i] for i in s], all_int) for s in shards), reverse=True)


# ---------------------------------------------------------------------------------------- public API


def max_load(weights: Sequence[Weight], shards: Sequence[Sequence[int]]) -> Weight:
    """The largest shard load: exact for ints, ``math.fsum`` (order independent) for floats."""
    all_int = all(isinstance(weights[i], int) for s in shards for i in s)
    return max((total([weights[i] for i in s], all_int) for s in shards), default=0)


def greedy_split(weights: Sequence[Weight], k: int) -> Shards:
    """Reference greedy longest-first under the ragged cardinality rule.

    Items in decreasing weight (ties: lower index first) each go to the currently lightest shard
    (ties: lower shard number) that still has room. A shard has room while it holds fewer than
    ``n // k`` items, or exactly ``n // k`` while fewer than ``n % k`` shards have taken an extra item.
    Running out of room is permanent, so full shards simply leave the heap.
    """
    ws, _ = _validated(weights, k)
    return _canonical(_greedy(ws, k))


def balanced_partition(weights: Sequence[Weight], k: int) -> Shards:
    """Split group indices over ``k`` DP ranks: ragged cardinalities, smallest possible largest load.

    Returns ``k`` shards of indices (ascending within a shard, shards ordered by smallest index).
    Raises ValueError when ``k < 1``, a weight is negative or not finite, or ``len(weights) < k``.
    See the module docstring for the invariants and the method.
    """
    ws, all_int = _validated(weights, k)
    n = len(ws)
    q, r = divmod(n, k)
    if k == 1:
        return [list(range(n))]
    if q == 1 and r == 0:
        return [[i] for i in range(n)]
    order = sorted(range(n), key=lambda i: (-ws[i], i))
    greedy = _greedy(ws, k, order)
    kk = _kk(ws, k, order)
    # Refine the better start first; if it reaches a lower bound no split can beat, refining the
    # other start cannot lower the maximum (heavy tails can make one start slow to refine).
    starts = {"kk": kk, "greedy": greedy}
    first, second = ("kk", "greedy") if _max(ws, kk, all_int) <= _max(ws, greedy, all_int) else ("greedy", "kk")
    candidates = {f"refined {first}": refine(ws, starts[first], q, all_int)}
    if _max(ws, candidates[f"refined {first}"], all_int) > _lower_bound(ws, order, k, all_int):
        candidates[f"refined {second}"] = refine(ws, starts[second], q, all_int)
    candidates["greedy"] = greedy
    rank = {"refined kk": 0, "refined greedy": 1, "greedy": 2}
    best = min(candidates, key=lambda c: (_profile(ws, candidates[c], all_int), rank[c]))
    return _canonical(candidates[best])


def check_split_invariants(
    weights: Sequence[Weight],
    k: int,
    shards: Sequence[Sequence[int]],
    *,
    produced_by: Callable[[Sequence[Weight], int], Shards] | None = balanced_partition,
) -> None:
    """Assert the invariants listed in the module docstring; AssertionError names the broken one.

    Invariant 5 (determinism) is checked by calling ``produced_by`` twice more and comparing both
    results with ``shards``; pass ``produced_by=None`` to check a split made some other way.
    """
    n = len(weights)
    q, r = divmod(n, k)
    # 1. k shards
    assert len(shards) == k, f"invariant 1: expected {k} shards, got {len(shards)}"
    # 2. every index exactly once, ascending within a shard, shards ordered by smallest index
    flat = [i for s in shards for i in s]
    missing = sorted(set(range(n)) - set(flat))
    extra = sorted(set(flat) - set(range(n)))
    assert not missing, f"invariant 2: indices {missing[:10]} are in no shard"
    assert not extra, f"invariant 2: indices {extra[:10]} are out of range 0..{n - 1}"
    assert len(flat) == n, f"invariant 2: {len(flat) - n} indices appear in more than one shard"
    for s_no, s in enumerate(shards):
        assert list(s) == sorted(s), f"invariant 2: shard {s_no} is not in ascending order: {list(s)[:10]}"
    firsts = [s[0] for s in shards if s]
    assert firsts == sorted(firsts), f"invariant 2: shards are not ordered by smallest index: {firsts}"
    # 3. cardinalities floor(n/k) or ceil(n/k); exactly n % k shards take the extra one
    sizes = [len(s) for s in shards]
    assert all(z in (q, q + 1) for z in sizes), f"invariant 3: sizes {sizes} are not all {q} or {q + 1}"
    assert sizes.count(q + 1) == r, f"invariant 3: {sizes.count(q + 1)} shards hold {q + 1}, expected {r}"
    # 4. never worse than greedy longest-first
    ours, greedys = max_load(weights, shards), max_load(weights, greedy_split(weights, k))
    assert ours <= greedys, f"invariant 4: max load {ours} is above greedy longest-first's {greedys}"
    # 5. deterministic
    if produced_by is not None:
        again = [produced_by(weights, k), produced_by(list(weights), k)]
        assert all(a == [list(s) for s in shards] for a in again), (
            f"invariant 5: {getattr(produced_by, '__name__', produced_by)} returned a different split "
            "for the same input"
        )


# ------------------------------------------------------------------------------------------- greedy


def _greedy(ws: list[Weight], k: int, order: list[int] | None = None) -> Shards:
    n = len(ws)
    q, r = divmod(n, k)
    if order is None:
        order = sorted(range(n), key=lambda i: (-ws[i], i))
    heap: list[tuple[Weight, int]] = [(0, s) for s in range(k)]
    counts = [0] * k
    shards: Shards = [[] for _ in range(k)]
    extras = 0
    for i in order:
        while True:
            load, s = heap[0]
            c = counts[s]
            if c < q or (c == q and extras < r):
                break
            heappop(heap)  # full for good: at q + 1, or at q with every extra slot taken
        if c == q:
            extras += 1
        counts[s] = c + 1
        shards[s].append(i)
        # the root is the chosen shard: replace it in place; it is re-checked for room when it surfaces
        heapreplace(heap, (load + ws[i], s))
    return shards


# -------------------------------------------------------------------------------- Karmarkar-Karp


def _kk(ws: list[Weight], k: int, order: list[int]) -> Shards:
    """Balanced largest differencing: one item per shard per chunk of k, merge largest spreads first."""
    n = len(ws)
    heap: list[tuple[Weight, int, list[tuple[Weight, list[int]]]]] = []
    for tick, start in enumerate(range(0, n, k)):
        chunk = order[start : start + k]
        # `order` is decreasing, so parts are heaviest first; the zero pads go last
        parts: list[tuple[Weight, list[int]]] = [(ws[i], [i]) for i in chunk]
        parts.extend((0, []) for _ in range(k - len(chunk)))
        heap.append((parts[-1][0] - parts[0][0], tick, parts))
    heapify(heap)
    tick = len(heap)
    while len(heap) > 1:
        _, _, a = heappop(heap)
        _, _, b = heappop(heap)
        merged: list[tuple[Weight, list[int]]] = []
        for (la, ma), (lb, mb) in zip(a, reversed(b)):
            if len(ma) < len(mb):
                ma, mb = mb, ma
            ma.extend(mb)
            merged.append((la + lb, ma))
        merged.sort(key=lambda p: p[0], reverse=True)
        heappush(heap, (merged[-1][0] - merged[0][0], tick, merged))
        tick += 1
    return [members for _, members in heap[0][2]]


# --------------------------------------------------------------------------------- local search

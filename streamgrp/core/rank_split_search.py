"""Local search that lowers a rank split's heaviest shard (the refinement step of `streamgrp.core.rank_split`).

Single-item swaps with any other shard (cardinalities kept), moves of one item from a ``ceil``
shard to a ``floor`` shard, and one-for-two exchanges that turn a heavy ``floor`` shard into a
``ceil`` one. A step is taken only if both touched shards end strictly below the old maximum, so
refinement never worsens a solution. Pure: standard library only.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

Weight = float | int
Shards = list[list[int]]

# Local search stops after this many accepted steps per candidate. Each step strictly lowers the sorted
# load profile, so it terminates anyway; the cap only bounds the worst case latency.
_MAX_REFINE_STEPS = 2000
# 1-for-2 exchanges cost O(shard size ** 2) per shard pair; past this many items per shard, single swaps
# already leave nothing for them to gain.
_ONE_FOR_TWO_MAX_Q = 24


def total(values: Sequence[Weight], all_int: bool) -> Weight:
    return sum(values) if all_int else math.fsum(values)


def refine(ws: list[Weight], shards: Shards, q: int, all_int: bool) -> Shards:
    """Lower the heaviest shard by swaps/moves/1-for-2 exchanges until none helps; returns new lists."""
    idx = [sorted(s, key=lambda i: (ws[i], i)) for s in shards]
    wts = [[ws[i] for i in s] for s in idx]
    loads = [total(w, all_int) for w in wts]
    for _ in range(_MAX_REFINE_STEPS):
        top = max(loads)
        h = loads.index(top)
        step = _best_step(wts, loads, h, q, all_int)
        if step is None:
            break
        s, give, take = step
        old = None if all_int else (list(idx[h]), list(wts[h]), list(idx[s]), list(wts[s]), loads[h], loads[s])
        moved_out = [(wts[h][p], idx[h][p]) for p in give]
        moved_in = [(wts[s][p], idx[s][p]) for p in take]
        for p in sorted(give, reverse=True):
            del wts[h][p], idx[h][p]
        for p in sorted(take, reverse=True):
            del wts[s][p], idx[s][p]
        for w, i in moved_out:
            _insert(wts[s], idx[s], w, i)
        for w, i in moved_in:
            _insert(wts[h], idx[h], w, i)
        if all_int:
            delta = sum(w for w, _ in moved_out) - sum(w for w, _ in moved_in)
            loads[h] -= delta
            loads[s] += delta
        else:
            loads[h], loads[s] = math.fsum(wts[h]), math.fsum(wts[s])
            if not (loads[h] < top and loads[s] < top):  # rounding fooled the estimate: undo, stop
                assert old is not None  # kept whenever the weights are not all ints
                idx[h], wts[h], idx[s], wts[s], loads[h], loads[s] = old
                break
    return idx


def _insert(wl: list[Weight], il: list[int], w: Weight, i: int) -> None:
    p = bisect_left(wl, w)
    while p < len(wl) and wl[p] == w and il[p] < i:
        p += 1
    wl.insert(p, w)
    il.insert(p, i)


def _best_step(
    wts: list[list[Weight]], loads: list[Weight], h: int, q: int, all_int: bool
) -> tuple[int, list[int], list[int]] | None:
    """Best single step lowering shard h: (other shard, positions leaving h, positions leaving it).

    A step that moves net weight d out of h into s (gap = load[h] - load[s]) leaves both strictly
    below the old maximum iff 0 < d < gap; its gain is min(d, gap - d), largest at d = gap / 2.
    Swaps and moves are tried first; 1-for-2 exchanges (quadratic in shard size) only when neither
    helps and shards are small, which is where they matter.
    """
    top = loads[h]
    hw = wts[h]
    best_gain: Weight = 0
    best: tuple[int, list[int], list[int]] | None = None
    others = sorted((loads[s], s) for s in range(len(wts)) if s != h)
    for load_s, s in others:
        gap = top - load_s
        cap = gap // 2 if all_int else gap / 2
        if cap <= best_gain:
            break  # later shards are heavier: smaller gaps, smaller possible gains
        swap = _best_swap(hw, wts[s], gap, cap, best_gain)
        if swap is not None:
            best_gain, pa, pb = swap
            best = (s, [pa], [pb])
        if best_gain < cap and len(hw) == q + 1 and len(wts[s]) == q:
            move = _best_move(hw, gap, best_gain)
            if move is not None:
                best_gain, pa = move
                best = (s, [pa], [])
    if best is None and len(hw) == q and q <= _ONE_FOR_TWO_MAX_Q:
        best = _best_exchange(wts, others, hw, q, top, best_gain)
    return best


def _gain(d: Weight, gap: Weight) -> Weight:
    return d if d < gap - d else gap - d


def _best_swap(
    hw: list[Weight], sw: list[Weight], gap: Weight, cap: Weight, best_gain: Weight
) -> tuple[Weight, int, int] | None:
    """Best single-item swap (take b from s for a from h, d = a - b near gap / 2) beating ``best_gain``."""
    half = gap / 2
    nh, ns = len(hw), len(sw)
    found = None
    prev = None
    lo_b, hi_b = sw[0], sw[-1]
    # only a in (min(s) + best_gain, max(s) + gap - best_gain) can beat the best step so far
    for pa in range(bisect_right(hw, lo_b + best_gain), nh):
        a = hw[pa]
        if a == prev:
            continue
        if a >= hi_b + gap - best_gain:
            break
        prev = a
        p = bisect_left(sw, a - half)
        if p < ns:
            g = _gain(a - sw[p], gap)
            if g > best_gain:
                best_gain, found = g, (pa, p)
        if p > 0:
            g = _gain(a - sw[p - 1], gap)
            if g > best_gain:
                best_gain, found = g, (pa, p - 1)
        if best_gain >= cap:
            break
    return None if found is None else (best_gain, *found)


def _best_move(hw: list[Weight], gap: Weight, best_gain: Weight) -> tuple[Weight, int] | None:
    """Best move of one item from a ceil shard h to a floor shard, beating ``best_gain``."""
    p = bisect_left(hw, gap / 2)
    found = None
    for pa in (p - 1, p):
        if 0 <= pa < len(hw):
            g = _gain(hw[pa], gap)
            if g > best_gain:
                best_gain, found = g, pa
    return None if found is None else (best_gain, found)


def _best_exchange(
    wts: list[list[Weight]], others: list[tuple[Weight, int]], hw: list[Weight], q: int, top: Weight, best_gain: Weight
) -> tuple[int, list[int], list[int]] | None:
    """Best 1-for-2 exchange that turns the heavy floor shard h into a ceil one."""
    best = None
    for load_s, s in others:
        sw = wts[s]
        if len(sw) != q + 1 or len(sw) < 2:
            continue
        gap = top - load_s
        if gap <= 0:
            break
        step = _one_for_two(hw, sw, gap, gap / 2, best_gain)
        if step is not None:
            best_gain, pa, pb = step
            best = (s, [pa], pb)
    return best


def _one_for_two(
    hw: list[Weight], sw: list[Weight], gap: Weight, half: Weight, best_gain: Weight
) -> tuple[Weight, int, list[int]] | None:
    """Best 1-for-2 exchange; pair sums of s searched with two pointers per item of h."""
    ns = len(sw)
    found = None
    if hw[-1] - sw[0] - sw[1] <= best_gain:
        return None  # even the heaviest item against the two lightest gains nothing
    prev = None
    for pa in range(len(hw) - 1, -1, -1):
        a = hw[pa]
        if a == prev:
            continue
        prev = a
        if a - sw[0] - sw[1] <= best_gain:
            break  # items are visited heaviest first
        target = a - half  # wanted b1 + b2
        lo, hi = 0, ns - 1
        while lo < hi:
            pair = sw[lo] + sw[hi]
            d = a - pair
            g = d if d < gap - d else gap - d
            if g > best_gain:
                best_gain, found = g, (pa, [lo, hi])
            if pair < target:
                lo += 1
            elif pair > target:
                hi -= 1
            else:
                break
    if found is None:
        return None
    return best_gain, found[0], found[1]

"""What a sample or a group still trains under ``staleness="mask"``: its *freshness*.

The loader's mask (`streamgrp.train.shard_tensors.mask_stale`) clears the loss of every token older than
the step's window (``oldest`` = the step's version - ``max_staleness``), then the whole loss of every row
it cut that is left with fewer than ``mask_min_tokens`` loss tokens. A row it did not cut (all its loss
tokens inside the window) keeps them however few. So at ``oldest`` a row trains when its oldest loss token
is at ``oldest`` or newer, or when it keeps at least ``mask_min_tokens`` loss tokens.

A sample whose per-token versions span several versions (``meta.token_versions``) records that in its
summary, and a decision of such samples in the group's, as two numbers a step's window is checked
against without reading a payload (`Freshness`): ``whole`` (the newest version at or below which some row
is not cut: the largest, over rows, of a row's oldest loss-token version) and ``tokens`` (for each version
among the loss tokens, ascending, the most loss tokens one row has at that version or newer). The batch
fold discards a group that would train nothing (`trains_at`) instead of giving it a step's place.

A sample without such versions is at its version throughout: ``whole`` is its version and ``tokens`` its
loss tokens (its rows' sum: for a sample of several rows, more than any one row has, so such a group is
kept when in doubt, never dropped when it would train).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET, UnsetType

from streamgrp.core.values import Sample

__all__ = [
    "Freshness",
    "check_freshness",
    "group_freshness",
    "meta_runs",
    "rows_freshness",
    "sample_runs",
    "version_fields",
    "version_runs",
]


@dataclass(frozen=True, slots=True)
class Freshness:
    """``whole``: some row keeps all its loss at a window starting at this version or older; ``tokens``:
    ``((version, most loss tokens one row has at that version or newer), ...)``, ascending versions."""

    whole: int
    tokens: tuple[tuple[int, int], ...]

    def tokens_at(self, oldest: int) -> int:
        """The most loss tokens one row keeps when tokens older than ``oldest`` lose their loss."""
        for version, count in self.tokens:
            if version >= oldest:
                return count
        return 0

    def trains_at(self, oldest: int, min_tokens: int) -> bool:
        """Whether some row still trains when tokens older than ``oldest`` lose their loss (module docstring)."""
        return self.whole >= oldest or self.tokens_at(oldest) >= min_tokens

    @classmethod
    def flat(cls, version: int, tokens: int) -> Freshness:
        """A sample (or member) all of whose ``tokens`` loss tokens are at ``version``."""
        return cls(version, ((version, tokens),))


def version_runs(value: object, total: int) -> tuple[tuple[int, int], ...] | None:
    """``meta["token_versions"]`` as ``(version, tokens)`` runs covering a sample's last tokens (those before
    them are at its version), or None when absent or not runs of at most ``total`` tokens in all (the meta
    is free-form: a value that is not streamgrp's means no per-token versions, never a failed step). The one
    reading of the runs: the loader's per-token versions and a summary's freshness agree by it."""
    if value.__class__ is not list or not value:
        return None
    runs = []
    covered = 0
    for run in value:  # a list, checked above
        if run.__class__ is not list or len(run) != 2:
            return None
        version, count = run
        if version.__class__ is not int or count.__class__ is not int or version < 0 or count < 1:
            return None
        covered += count
        runs.append((version, count))
    return tuple(runs) if covered <= total else None


def sample_runs(sample: Sample) -> tuple[tuple[int, int], ...] | None:
    """`version_runs` of ``sample``'s meta."""
    return meta_runs(sample.meta, sample.row_lengths)


def meta_runs(meta: dict[str, Any], row_lengths: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
    """`version_runs` of a sample's ``meta``, whose rows are ``row_lengths`` long."""
    return version_runs(meta.get("token_versions"), sum(row_lengths)) if meta else None


def rows_freshness(row_lengths: Sequence[int], version: int, mask: bytes, runs: Sequence[tuple[int, int]]) -> Freshness:
    """The `Freshness` of a sample of ``row_lengths`` at ``version`` whose loss mask is ``mask`` (one byte a
    token, bool or uint8: zero is no loss) and per-token versions ``runs``: counted run by run (a slice of the
    mask's bytes each), never token by token."""
    total = sum(row_lengths)
    covered = sum(count for _, count in runs)
    cover = [(version, total - covered), *runs] if covered < total else list(runs)
    rows: list[dict[int, int]] = []  # per row: version -> its loss tokens at that version
    at, used, start = 0, 0, 0
    for length in row_lengths:
        row: dict[int, int] = {}
        left = length
        while left:
            run_version, count = cover[at]
            take = min(left, count - used)
            loss = take - mask[start : start + take].count(0)
            if loss:
                row[run_version] = row.get(run_version, 0) + loss
            start, left, used = start + take, left - take, used + take
            if used == count:
                at, used = at + 1, 0
        rows.append(row)
    versions = sorted({seen for row in rows for seen in row})
    profile = tuple((seen, max(sum(n for v, n in row.items() if v >= seen) for row in rows)) for seen in versions)
    whole = max((min(row) for row in rows if row), default=version)
    return Freshness(whole, profile)


def version_fields(meta: dict[str, Any], row_lengths: Sequence[int], version: int, mask: bytes) -> dict[str, Any]:
    """A summary's ``newest``, ``whole_version`` and ``fresh_tokens`` of a sample (its ``meta``, rows, version
    and loss mask): set when its per-token versions reach past its version, left out (UNSET) otherwise."""
    runs = meta_runs(meta, row_lengths)
    newest = max(seen for seen, _ in runs) if runs else -1
    if runs is None or newest <= version:
        return {"newest": UNSET, "whole_version": UNSET, "fresh_tokens": UNSET}
    fresh = rows_freshness(row_lengths, version, mask, runs)
    return {"newest": newest, "whole_version": fresh.whole, "fresh_tokens": fresh.tokens}


def group_freshness(members: Sequence[Freshness]) -> Freshness:
    """A group's `Freshness` from its members': a row of any member counts."""
    versions = sorted({version for member in members for version, _ in member.tokens})
    return Freshness(
        max(member.whole for member in members),
        tuple((version, max(member.tokens_at(version) for member in members)) for version in versions),
    )


def check_freshness(event: Any, newest: int | UnsetType, tokens: int) -> None:
    """A recorded freshness (an event's ``whole_version`` and ``fresh_tokens``) comes with ``newest``, both or
    neither, and says nothing the sample (or group) cannot: versions ascending up to ``newest``, each count at
    most ``tokens`` and no more than the one before, ``whole_version`` among them. Raises ValueError."""
    whole, fresh = event.whole_version, event.fresh_tokens
    if (whole is UNSET) != (fresh is UNSET) or (whole is not UNSET and newest is UNSET):
        raise ValueError("whole_version and fresh_tokens come together, and only with a newest version")
    if fresh is UNSET:
        return
    versions = [version for version, _ in fresh]
    counts = [count for _, count in fresh]
    if not (
        fresh
        and versions == sorted(set(versions))
        and versions[-1] <= newest
        and counts[0] <= tokens
        and all(later <= earlier for earlier, later in itertools.pairwise(counts))
        and whole in versions
    ):
        raise ValueError(
            f"fresh_tokens {list(fresh)[:8]} with whole_version {whole} is not a freshness of versions up to "
            f"{newest} and {tokens} loss tokens"
        )

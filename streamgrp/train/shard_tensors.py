"""A shard's samples as padded tensors, each token's version, and the staleness mask.

Owns what happens after the loader (`streamgrp.train.loader`) has read and checked a shard's payloads:
`SampleRows` (one sample as views of its entry's bytes), `shard_tensors`, which fills each field of the
padded [rows, longest row] tensors (each row's bytes copied once, from the entry's own bytes into its
place, widened to the batch dtype in the same pass), each row's version runs (`row_runs`) and the
per-token versions made from them on demand (`token_versions`), and the staleness mask
(`StaleMask`, `mask_stale`). Pure tensor work: no fetching, no checking of payloads, no server.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from streamgrp.train import dtypes
from streamgrp.train.batch import Batch, ShardTensors

#: The tensor fields of a sample, each in its batch dtype.
_OUT = {"token_ids": torch.int64, "loss_mask": torch.bool, "logprobs": torch.float32}
#: Where a float32's high 16 bits sit, as two uint16 (a bfloat16 value is exactly those bits).
_HIGH_HALF = 1 if sys.byteorder == "little" else 0
_NUMPY = {name: np.dtype(code) for name, code in dtypes.NUMPY.items()}
#: From how many tokens a shard's rows are wide enough that zeroing only their padding, a row at a time,
#: costs less than zeroing the whole tensor before writing them (measured: bench/bench_loader.py).
_WIDE_ROWS = 4096


@dataclass(frozen=True, slots=True)
class SampleRows:
    """One sample as the loader needs it: each tensor field's raw bytes and dtype, and per-row values.

    ``token_versions``: the sample's ``meta["token_versions"]`` runs (``(version, tokens)``, in order),
    which give the versions of its last tokens (the generated ones: an adapter's row is the prompt then
    the completion); its other tokens have ``version``. None: every token has ``version``."""

    data: dict[str, tuple[memoryview | bytes, str]]  # field -> (raw little-endian bytes, dtype name)
    row_lengths: tuple[int, ...]
    rewards: tuple[float, ...]
    version: int
    token_versions: tuple[tuple[int, int], ...] | None = None

    @property
    def version_span(self) -> int:
        """Newest minus oldest version among the sample's tokens (0 without per-token versions)."""
        runs = self.token_versions
        if not runs:
            return 0
        return max(max(v for v, _ in runs), self.version) - min(min(v for v, _ in runs), self.version)


@dataclass(frozen=True, slots=True)
class StaleMask:
    """The staleness mask (``staleness="mask"``): tokens of versions below ``oldest`` lose their loss; a row
    the mask cut that is left with fewer than ``min_tokens`` loss tokens loses all of them (a row it did not
    cut keeps its loss however short: the rule is the row's own, whatever else the step holds)."""

    oldest: int
    min_tokens: int = 1

    @classmethod
    def of(cls, run_config, version: int) -> StaleMask | None:
        """The mask a step formed at ``version`` gets under the run's settings (None: not ``mask``)."""
        if getattr(run_config, "staleness", "drop") != "mask":
            return None
        return cls(version - run_config.max_staleness, getattr(run_config, "mask_min_tokens", 1))


def shard_tensors(samples: Sequence[SampleRows]) -> ShardTensors:
    """Padded [rows, T] tensors (and per-row rewards, versions and version spans) from samples, in order."""
    with _one_thread():
        return _shard_tensors(samples)


RowRuns = tuple[tuple[int, int], ...]


def row_runs(samples: Sequence[SampleRows]) -> tuple[RowRuns | None, ...] | None:
    """Each row's ``(version, tokens)`` runs, covering the row (None: the row is its sample's version
    throughout); None when no sample has per-token versions. A sample's runs give its last tokens;
    those before have its version. Only per sample and run, never per token: the tensor itself is made
    when a trainer asks for it (`token_versions`)."""
    if not any(s.token_versions for s in samples):
        return None
    rows: list[RowRuns | None] = []
    for sample in samples:
        if not sample.token_versions:
            rows.extend([None] * len(sample.row_lengths))
            continue
        total = sum(sample.row_lengths)
        covered = sum(count for _, count in sample.token_versions)
        runs = [(sample.version, total - covered)] if covered < total else []
        runs.extend(sample.token_versions)
        at = 0  # the run being cut into rows, and how much of it is used
        used = 0
        for n in sample.row_lengths:
            row: list[tuple[int, int]] = []
            while n:
                version, count = runs[at]
                take = min(n, count - used)
                row.append((version, take))
                n -= take
                used += take
                if used == count:
                    at, used = at + 1, 0
            rows.append(tuple(row))
    return tuple(rows)


def token_versions(
    versions: torch.Tensor, attention: torch.Tensor, runs: tuple[RowRuns | None, ...] | None
) -> torch.Tensor:
    """[rows, T] int64: each token's version, 0 in the padding (``runs``: `row_runs`)."""
    with _one_thread():
        out = versions.unsqueeze(1) * attention  # int64 times bool: the version, or 0 in the padding
        if runs is not None:
            # A row's runs cover all its tokens: every run of every such row in one repeat, scattered in
            # row-major order into those rows' tokens.
            cuts = [cut for cut in runs if cut is not None]
            flat = torch.repeat_interleave(
                torch.tensor([v for cut in cuts for v, _ in cut], dtype=torch.int64),
                torch.tensor([n for cut in cuts for _, n in cut], dtype=torch.int64),
            )
            has_runs = torch.tensor([cut is not None for cut in runs])
            out.masked_scatter_(attention & has_runs.unsqueeze(1), flat)
    return out


def mask_stale(batch: Batch, stale: StaleMask) -> int:
    """Clear the loss mask of tokens older than ``stale.oldest`` (and of rows it cut that are left with fewer
    than ``stale.min_tokens`` loss tokens) in place; returns how many loss tokens it cleared. The batch fold
    discards a group this would leave no loss (`streamgrp.core.fresh_tokens`), by the same rule."""
    mask = batch.loss_mask
    if not bool((batch.versions < stale.oldest).any()) and not _runs_older(batch.version_runs, stale.oldest):
        return 0  # every token is inside the window: nothing to look at token by token
    before = int(mask.sum())
    old = batch.token_versions < stale.oldest
    cut = (mask & old).any(dim=1)
    mask &= ~old
    mask[cut & (mask.sum(dim=1) < stale.min_tokens)] = False
    return before - int(mask.sum())


def _runs_older(runs: tuple[RowRuns | None, ...] | None, oldest: int) -> bool:
    return runs is not None and any(cut is not None and any(v < oldest for v, _ in cut) for cut in runs)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch's kernels on this thread alone meanwhile.

    A shard is a few megabytes: an intra-op thread team copies it no faster, and its threads spin
    between kernels, which cost 4x the CPU of the copy itself and the other processes of a busy
    machine their core. The setting is the calling thread's own under OpenMP; restored after."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _shard_tensors(samples: Sequence[SampleRows]) -> ShardTensors:
    row_lengths = [n for s in samples for n in s.row_lengths]
    width = max(row_lengths, default=0)
    padded = len(row_lengths) * width != sum(row_lengths)
    columns = {name: _column(samples, name, len(row_lengths), width, padded) for name in _OUT}
    if padded:  # each row's run of True written in place: a broadcast compare made [rows, T] int64 indices first
        attention = torch.zeros((len(row_lengths), width), dtype=torch.bool)
        mask = attention.numpy()
        for row, n in enumerate(row_lengths):
            mask[row, :n] = True
    else:
        attention = torch.ones((len(row_lengths), width), dtype=torch.bool)
    return ShardTensors(
        token_ids=columns["token_ids"],
        loss_mask=columns["loss_mask"],
        logprobs=columns["logprobs"],
        attention_mask=attention,
        rewards=torch.tensor([r for s in samples for r in s.rewards], dtype=torch.float32),
        versions=torch.tensor([s.version for s in samples for _ in s.row_lengths], dtype=torch.int64),
        version_spans=torch.tensor([s.version_span for s in samples for _ in s.row_lengths], dtype=torch.int64),
    )


def _column(samples: Sequence[SampleRows], name: str, rows: int, width: int, padded: bool) -> torch.Tensor:
    """One field of the shard, [rows, width] in its batch dtype: each row's bytes copied once, straight into
    the tensor at its place, widened in the same pass (a numpy assignment from a view of the entry's bytes:
    int32 to int64, a 0/1 byte to bool, float16 to float32). Joining the rows first, or widening after,
    walked every byte twice. Only the padding is zeroed: after the rows when they are wide (a row's bytes
    are then written once), the whole tensor first when they are narrow (one memset costs less than a
    Python step per row)."""
    parts = [sample.data[name] for sample in samples]
    bfloat16 = any(dtype == "bfloat16" for _, dtype in parts)
    tails = padded and not bfloat16 and width >= _WIDE_ROWS
    # A bfloat16 value is the high half of its float32: the low half is left as it was, zero.
    out = (torch.zeros if (padded and not tails) or bfloat16 else torch.empty)((rows, width), dtype=_OUT[name])
    into = out.numpy()
    halves = into.view(np.uint16).reshape(rows, width, 2)[..., _HIGH_HALF] if bfloat16 else into
    row = 0
    for sample, (data, dtype) in zip(samples, parts):
        source = np.frombuffer(data, _NUMPY[dtype])
        target = halves if dtype == "bfloat16" else into
        lengths = sample.row_lengths
        count = len(lengths)
        if count == 1:
            target[row, : lengths[0]] = source
        elif sum(lengths) == count * width:  # rows as wide as the shard: one block
            target[row : row + count] = source.reshape(count, width)
        else:
            start = 0
            for at, n in enumerate(lengths, row):
                target[at, :n] = source[start : start + n]
                start += n
        row += count
    if tails:
        at = 0
        for sample in samples:
            for n in sample.row_lengths:
                if n < width:
                    into[at, n:] = 0
                at += 1
    return out

"""Advantages over actual group sizes: normalization, the token-weighted loss, group metrics (SPEC section 3).

Owns:
- ``normalize``: centering and scaling of rewards ([R]) or per-token advantages ([R, T]) by group or
  batch statistics, where groups are given by their **actual** sizes (rows per group, in row order),
  never by a fixed stride;
- ``token_weighted_policy_loss``: the PPO-clipped surrogate, divided by the valid loss tokens of the
  whole step so that a group weighs what its tokens weigh, on every DP rank alike;
- ``group_metrics``: the per-step group-size and loss-weight metrics, as plain Python numbers.

Deliberately ignores: where the values come from (rewards, GAE, ...), deciding groups
(``streamgrp.core.decision``), the policy configuration (``streamgrp.core.policy``) and the communication
itself: cross-rank sums come from a ``batch_reduce`` callable the caller supplies, so this module never
imports ``torch.distributed``.

Invariants of ``normalize`` (the unit tests check each one):
1. Every statistic is computed in float64 and the result is float32; masked-out entries are 0.
2. A group whose valid entries are all equal gives exactly 0 (with or without leave-one-out, whatever
   eps): means are refined by a second pass, so the mean of equal values is that value bit for bit.
3. ``std`` is the spread of exactly the values that get divided: ``sqrt(sum(c**2) / (n - 1))``
   (``/ n`` when ``unbiased=False``) with ``c = x - baseline`` over the level's ``n`` valid entries. So
   a zero std implies all ``c`` are 0 and eps never amplifies rounding noise; with ``mean_level=None`` it
   is the root mean square of ``x``. An unbiased std over at most one member is taken as 1.
4. A group's **members** are its rows that have at least one valid entry. Leave-one-out leaves out a
   whole member (row): the baseline of row ``i`` is ``(S - S_i) / (N - N_i)`` where ``S``/``N`` are the
   sum/count of valid entries of its group (or of the batch) and ``S_i``/``N_i`` those of row ``i``. For
   [R] values this is the SPEC's ``(sum - x_i) / (n - 1)``; for [R, T] it is the token-weighted mean of
   the other members, consistent with the token-weighted plain mean, and unbiased because no token of
   row ``i`` enters its own baseline (leaving out a single token would keep the row's other, correlated
   tokens in it). A member with no other member to compare with gets itself as baseline: output 0.
5. ``batch_reduce`` is called ``2`` times when ``mean_level == "batch"`` plus ``1`` time when
   ``std_level == "batch"``, in that order, each with a 1-D float64 tensor of fixed length (2, 1 and 3
   partial sums), whatever the shard holds, including an empty shard. Ranks must therefore call
   ``normalize`` with the same ``spec``; a rank never skips or adds a collective because its shard is
   small.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from streamgrp.core.policy import NormSpec

__all__ = ["BatchReduce", "group_metrics", "normalize", "token_weighted_policy_loss"]

BatchReduce = Callable[[torch.Tensor], torch.Tensor]
"""Takes a 1-D float64 tensor of this rank's partial sums and returns their sum over all DP ranks.

For example ``lambda t: (torch.distributed.all_reduce(t, group=dp_group), t)[1]``.
"""

_F64 = torch.float64


def normalize(
    values: torch.Tensor,
    group_sizes: Sequence[int] | torch.Tensor | None,
    spec: NormSpec,
    mask: torch.Tensor | None = None,
    *,
    batch_reduce: BatchReduce | None = None,
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over actual group sizes, computed in float64, returned float32.

    ``values`` has shape [R] (one value per row) or [R, T] (per token); ``mask`` (bool or 0/1, same shape)
    marks valid entries, and all statistics are masked. ``group_sizes`` lists the rows of each group in
    row order; they must be positive and sum to R. It may be None only when no level is ``"group"``.
    Batch statistics span this tensor, or all DP ranks when ``batch_reduce`` is given (see the module
    docstring for how often it is called). ``mean_level=None`` means mean 0; ``std_level=None`` means std
    1 and eps 0.
    """
    if not isinstance(spec, NormSpec):
        raise TypeError(f"spec must be a streamgrp.core.policy.NormSpec, got {type(spec).__name__}")
    x, valid, squeeze = _as_2d(values, mask)
    n_rows, n_cols = x.shape
    sizes = _check_group_sizes(group_sizes, n_rows, spec)

    # Padding may hold garbage (NaN, -inf): it must not reach any sum.
    x = torch.where(valid, x, torch.zeros((), dtype=_F64, device=x.device))
    layout = _Layout.of(valid, sizes, batch_reduce)
    xf, wf = x.reshape(-1), valid.to(_F64).reshape(-1)
    centered = _centered(xf, wf, spec, layout) * wf
    out = _scaled(centered, wf, spec, layout)
    out = out.reshape(n_rows, n_cols).to(torch.float32)
    return out.reshape(n_rows) if squeeze else out


@dataclass(frozen=True)
class _Layout:
    """Which row each entry belongs to, which group each row belongs to, and how batches reduce."""

    n_rows: int
    row_of_entry: torch.Tensor
    row_valid: torch.Tensor  # 1.0 for a row with at least one valid entry
    group_of_row: torch.Tensor
    n_groups: int
    batch_reduce: BatchReduce | None

    @classmethod
    def of(cls, valid: torch.Tensor, sizes: list[int] | None, batch_reduce: BatchReduce | None) -> _Layout:
        n_rows, n_cols = valid.shape
        device = valid.device
        if sizes is not None:
            group_of_row = torch.arange(len(sizes), device=device).repeat_interleave(
                torch.tensor(sizes, dtype=torch.long, device=device), output_size=n_rows
            )
        else:
            group_of_row = torch.zeros(n_rows, dtype=torch.long, device=device)
        return cls(
            n_rows,
            torch.arange(n_rows, device=device).repeat_interleave(n_cols),
            valid.any(dim=1).to(_F64),
            group_of_row,
            len(sizes) if sizes is not None else 0,
            batch_reduce,
        )

    def segments(self, level: Literal["group", "batch"]) -> tuple[torch.Tensor, int, BatchReduce | None]:
        """(segment of each row, number of segments, reduce) for one level; batch is one segment."""
        if level == "group":
            return self.group_of_row, self.n_groups, None
        return torch.zeros(self.n_rows, dtype=torch.long, device=self.group_of_row.device), 1, self.batch_reduce


def _centered(xf: torch.Tensor, wf: torch.Tensor, spec: NormSpec, layout: _Layout) -> torch.Tensor:
    """Step 1: every entry minus its baseline (the mean at the mean level, or its peers' with leave-one-out)."""
    if spec.mean_level is None:
        return xf
    seg_of_row, n_seg, reduce = layout.segments(spec.mean_level)
    seg_of_entry = seg_of_row[layout.row_of_entry]
    seg_mean, seg_count = _refined_mean(xf, wf, seg_of_entry, n_seg, reduce)
    if not spec.leave_one_out:
        return xf - seg_mean[seg_of_entry]
    # Rows are segments of their own here: local statistics, never reduced.
    row_of_entry = layout.row_of_entry
    row_mean, row_count = _refined_mean(xf, wf, row_of_entry, layout.n_rows, None)
    mean_of_row = seg_mean[seg_of_row]
    others = seg_count[seg_of_row] - row_count
    # (S - S_i) / (N - N_i) rewritten around the refined means, so equal values stay exact.
    shift = row_count * (mean_of_row - row_mean) / torch.where(others > 0, others, 1.0)
    baseline = torch.where(others > 0, mean_of_row + shift, mean_of_row)
    has_peer = (others > 0)[row_of_entry]
    return torch.where(has_peer, xf - baseline[row_of_entry], torch.zeros_like(xf))


def _scaled(centered: torch.Tensor, wf: torch.Tensor, spec: NormSpec, layout: _Layout) -> torch.Tensor:
    """Step 2: the centered values over their spread at the std level, plus eps."""
    if spec.std_level is None:
        return centered
    seg_of_row, n_seg, reduce = layout.segments(spec.std_level)
    seg_of_entry = seg_of_row[layout.row_of_entry]
    sums = torch.stack(
        [
            _segment_sum(centered * centered, seg_of_entry, n_seg),
            _segment_sum(wf, seg_of_entry, n_seg),
            _segment_sum(layout.row_valid, seg_of_row, n_seg),
        ]
    )
    sq, count, members = _reduce(sums, reduce)
    if spec.unbiased:
        std = torch.where(members > 1, (sq / torch.clamp(count - 1, min=1.0)).sqrt(), 1.0)
    else:
        std = torch.where(count > 0, (sq / torch.clamp(count, min=1.0)).sqrt(), 1.0)
    denom = std[seg_of_entry] + spec.eps
    # c == 0 exactly wherever std is 0, so this also avoids 0/0 when eps is 0.
    return torch.where(centered == 0, torch.zeros_like(centered), centered / torch.where(denom > 0, denom, 1.0))


def token_weighted_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    total_loss_tokens: int | float | torch.Tensor | None = None,
    clip_eps: float = 0.2,
) -> torch.Tensor:
    """PPO-clipped surrogate ``-min(r A, clip(r, 1-eps, 1+eps) A)`` summed over valid tokens / total tokens.

    ``total_loss_tokens`` is the number of valid loss tokens of the whole step, all DP ranks together
    (each rank all-reduces its mask sum once per step); by default this call's own mask sum. Dividing by
    the step total, not by groups or rows, keeps the loss globally token-weighted: a partial group with
    more valid tokens carries more weight, and ragged shards do not bias the gradient.
    """
    tensors = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages, "loss_mask": loss_mask}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(
            f"logprobs, old_logprobs, advantages and loss_mask must have one shape, got {shapes}: "
            "pass per-token tensors of the same [rows, tokens] layout"
        )
    if clip_eps < 0:
        raise ValueError(f"clip_eps must be >= 0 (got {clip_eps}); 0.2 is the usual PPO value")
    valid = _as_bool_mask(loss_mask, "loss_mask")
    if total_loss_tokens is None:
        total = float(valid.sum().item())
        if total <= 0:
            raise ValueError(
                "loss_mask has no valid token and total_loss_tokens was not given: pass "
                "total_loss_tokens=<valid loss tokens of the whole step, summed over all DP ranks>"
            )
    else:
        total = float(total_loss_tokens.item() if isinstance(total_loss_tokens, torch.Tensor) else total_loss_tokens)
        if not total > 0:
            raise ValueError(
                f"total_loss_tokens must be > 0 (got {total_loss_tokens}): pass the valid loss tokens of the "
                "whole step, summed over all DP ranks"
            )

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # Mask before exp: padding logprobs may be -inf, and exp(inf) would poison the gradient.
    log_ratio = torch.where(valid, logprobs.to(dtype) - old_logprobs.to(dtype), zero)
    adv = torch.where(valid, advantages.to(dtype), zero)
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    per_token = torch.where(valid, -surrogate, zero)
    return per_token.sum() / total


def group_metrics(
    group_sizes: Sequence[int] | torch.Tensor,
    loss_tokens_per_group: Sequence[int | float] | torch.Tensor,
) -> dict[str, float]:
    """Per-step group metrics (SPEC section 3), as plain Python floats.

    ``usable_group_size/{avg,min,max}`` over groups; ``group_loss_weight/{avg,min,max}``, the valid loss
    tokens per group; and for each size N present, ``n_groups_size_N`` (groups of that size) and
    ``group_loss_weight_size_N`` (their mean valid loss tokens).
    """
    sizes = _to_list(group_sizes, "group_sizes")
    tokens = _to_list(loss_tokens_per_group, "loss_tokens_per_group")
    if not sizes:
        raise ValueError("group_metrics needs at least one group: call it only for steps that trained on groups")
    if len(sizes) != len(tokens):
        raise ValueError(
            f"group_sizes has {len(sizes)} groups but loss_tokens_per_group has {len(tokens)}: "
            "pass one valid-token count per group, in the same order"
        )
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not float(size).is_integer() or size < 1:
            raise ValueError(f"group_sizes must be positive integers, got {size!r} for group {i}")
    for i, count in enumerate(tokens):
        if isinstance(count, bool) or not count >= 0:
            raise ValueError(f"loss_tokens_per_group must be >= 0, got {count!r} for group {i}")
    sizes = [int(s) for s in sizes]
    tokens = [float(t) for t in tokens]

    metrics: dict[str, float] = {
        "usable_group_size/avg": sum(sizes) / len(sizes),
        "usable_group_size/min": float(min(sizes)),
        "usable_group_size/max": float(max(sizes)),
        "group_loss_weight/avg": sum(tokens) / len(tokens),
        "group_loss_weight/min": min(tokens),
        "group_loss_weight/max": max(tokens),
    }
    by_size: dict[int, list[float]] = {}
    for size, count in zip(sizes, tokens):
        by_size.setdefault(size, []).append(count)
    for size in sorted(by_size):
        counts = by_size[size]
        metrics[f"n_groups_size_{size}"] = float(len(counts))
        metrics[f"group_loss_weight_size_{size}"] = sum(counts) / len(counts)
    return metrics


# ----------------------------------------------------------------------------------------------------
# helpers


def _as_2d(values: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(values)
    if values.dim() not in (1, 2):
        raise ValueError(
            f"values must have shape [rows] or [rows, tokens], got {tuple(values.shape)}: "
            "flatten extra dimensions into tokens"
        )
    if values.dtype == torch.bool or values.is_complex():
        raise ValueError(f"values must be real numbers, got dtype {values.dtype}")
    squeeze = values.dim() == 1
    x = values.to(_F64)
    if mask is None:
        valid = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    else:
        if not isinstance(mask, torch.Tensor):
            mask = torch.as_tensor(mask)
        if tuple(mask.shape) != tuple(values.shape):
            raise ValueError(
                f"mask has shape {tuple(mask.shape)} but values has {tuple(values.shape)}: "
                "pass a mask of the same shape as values (True/1 marks a valid entry)"
            )
        valid = _as_bool_mask(mask, "mask").to(x.device)
    if squeeze:
        x, valid = x.unsqueeze(1), valid.unsqueeze(1)
    return x, valid, squeeze


def _as_bool_mask(mask: torch.Tensor, name: str) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            f"{name} must be bool or hold only 0 and 1: it marks valid entries, it is not a weight; "
            "fold weights into the values instead"
        )
    return mask != 0


def _check_group_sizes(
    group_sizes: Sequence[int] | torch.Tensor | None, n_rows: int, spec: NormSpec
) -> list[int] | None:
    if group_sizes is None:
        if spec.uses_group_statistics:
            raise ValueError(
                f"spec uses group statistics (mean_level={spec.mean_level!r}, std_level={spec.std_level!r}) "
                "but group_sizes is None: pass the actual group sizes (usable rows of each group, in row "
                "order, e.g. group_sizes=[3, 2, 3]); a fixed stride would straddle partial groups"
            )
        return None
    sizes = _to_list(group_sizes, "group_sizes")
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"group_sizes must be integers (rows per group), got {size!r} for group {i}")
    bad = [i for i, size in enumerate(sizes) if size <= 0]
    if bad:
        raise ValueError(
            f"group_sizes must all be positive, got {sizes} (group {bad[0]} has size {sizes[bad[0]]}): "
            "leave dropped or empty groups out of group_sizes, as their rows are not in values"
        )
    total = sum(sizes)
    if total != n_rows:
        raise ValueError(
            f"group_sizes sum to {total} but values has {n_rows} rows: pass one actual size per group so "
            "that they sum to the number of rows (a ragged batch is never truncated to fit)"
        )
    return sizes


def _to_list(seq: Sequence[int | float] | torch.Tensor, name: str) -> list:
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(seq.shape)}")
        return seq.tolist()
    if isinstance(seq, (str, bytes, Mapping)) or not isinstance(seq, Sequence):
        raise ValueError(f"{name} must be a sequence or a 1-D tensor, got {type(seq).__name__}")
    return list(seq)


def _segment_sum(v: torch.Tensor, seg: torch.Tensor, n_seg: int) -> torch.Tensor:
    return torch.zeros(n_seg, dtype=_F64, device=v.device).index_add_(0, seg, v)


def _reduce(sums: torch.Tensor, reduce: BatchReduce | None) -> torch.Tensor:
    """Sum [k, n_seg] partial sums over ranks (batch level: n_seg == 1, sent as a 1-D tensor of k)."""
    if reduce is None:
        return sums
    flat = sums.reshape(-1).contiguous()
    out = reduce(flat)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(flat.shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"batch_reduce must return a tensor of the shape it was given {tuple(flat.shape)}, got {got}: "
            "return the all-reduced (summed) tensor"
        )
    return out.to(device=sums.device, dtype=_F64).reshape(sums.shape)


def _refined_mean(
    x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor, n_seg: int, reduce: BatchReduce | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and valid count per segment; ``x`` must already be 0 where ``w`` is 0.

    The second pass adds the mean residual. For equal values the first-pass mean is off by at most a few
    ulps, every residual is then the same exactly representable difference, and the refined mean equals
    the values bit for bit, which is what makes a zero-variance group give exactly 0.
    """
    total, count = _reduce(torch.stack([_segment_sum(x, seg, n_seg), _segment_sum(w, seg, n_seg)]), reduce)
    safe_count = torch.clamp(count, min=1.0)
    first = torch.where(count > 0, total / safe_count, 0.0)
    (residual,) = _reduce(_segment_sum((x - first[seg]) * w, seg, n_seg).unsqueeze(0), reduce)
    return first + residual / safe_count, count

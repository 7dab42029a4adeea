"""What TRL's async GRPO trainer needs to run on a CPU, for tests only: it is built for GPUs.

Two substitutions, both outside streamgrp: the tree attention's FlashAttention-3 kernel (fetched
from the Hub, CUDA only) becomes a plain-torch variable-length attention with the same contract,
and the peak-FLOPs lookup (which asks CUDA for the device name) reports "unknown", as TRL does for
devices it does not know.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=True,
    window_size=(-1, -1),
    **_,
):
    """``flash_attn_varlen_func``: [total, heads, dim] per segment, causal aligned to the key end."""
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]  # grouped-query attention: each key head serves `repeat` query heads
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        query = q[q0:q1].transpose(0, 1)
        key, value = (x[k0:k1].repeat_interleave(repeat, 1).transpose(0, 1) for x in (k, v))
        # A segment's keys are its ancestors' tokens then its own: query j sees keys up to its own position.
        visible = torch.arange(k1 - k0)[None, :] <= torch.arange(q1 - q0)[:, None] + ((k1 - k0) - (q1 - q0))
        out[q0:q1] = F.scaled_dot_product_attention(
            query, key, value, attn_mask=visible, scale=softmax_scale
        ).transpose(0, 1)
    return out


class _Kernel:
    flash_attn_varlen_func = staticmethod(varlen_attention)


def install() -> None:
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.packing as packing

    packing._flash_attn = lambda: _Kernel
    trainer_module.get_peak_flops_per_device = lambda accelerator, dtype: None

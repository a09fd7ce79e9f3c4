"""Causal attention without context parallelism through PyTorch's ``scaled_dot_product_attention``.

SDPA dispatches to cuDNN / FlashAttention on the GPU (the dense baseline of the trainer at CP=1);
it knows the standard causal mask only, so it serves CP=1, where every layout is the identity.
Shapes: ``q [b, s, hq, d]``, ``k, v [b, s, hkv, d]`` (GQA without expanding K/V), ``out`` like ``q``.
"""

from __future__ import annotations

import torch

__all__ = ["sdpa_causal"]


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Causal softmax attention of ``q`` over ``k, v`` (same length), ``out [b, s, hq, d]`` in ``q.dtype``."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=True, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)

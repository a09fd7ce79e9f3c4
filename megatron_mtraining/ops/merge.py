"""Merging partial attention results through their log-sum-exp (LSE).

If ``(o1, l1)`` and ``(o2, l2)`` are softmax attention over two disjoint key sets, attention over
their union is ``l = log(exp(l1) + exp(l2))`` and ``o = o1·exp(l1 − l) + o2·exp(l2 − l)``
(FlashAttention's online softmax; Milakov & Gimelshein 2018). The form below subtracts the
row maximum first, so any LSE gap is safe (no overflow, underflow gives an exact 0 weight),
and a ``-inf`` partial (no visible key) changes nothing. Two ``-inf`` partials give ``o = 0``,
``l = -inf`` (no NaN).
"""

from __future__ import annotations

import torch

__all__ = ["merge_attention"]


def merge_attention(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Merge a partial result into a running one.

    Args:
        out, block_out: ``[b, s, h, d]`` partial outputs (fp32 or fp64).
        lse, block_lse: ``[b, h, s]`` their LSEs (natural log, same dtype as the outputs).

    Returns:
        ``(out, lse)`` of the union, new tensors in the same dtypes.
    """
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1 = torch.exp(lse - m)
    w2 = torch.exp(block_lse - m)
    total = w1 + w2
    new_lse = m + torch.log(total)
    total = torch.where(total == 0, torch.ones_like(total), total)
    w1 = (w1 / total).transpose(1, 2).unsqueeze(-1)     # [b, s, h, 1]
    w2 = (w2 / total).transpose(1, 2).unsqueeze(-1)
    return out * w1 + block_out * w2, new_lse

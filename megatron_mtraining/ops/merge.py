"""Merging partial attention results through their log-sum-exp (LSE).

If ``(o1, l1)`` and ``(o2, l2)`` are softmax attention over two disjoint key sets, attention over
their union is ``l = log(exp(l1) + exp(l2))`` and ``o = o1·exp(l1 − l) + o2·exp(l2 − l)``
(FlashAttention's online softmax; Milakov & Gimelshein 2018). The form below subtracts the
row maximum first, so any LSE gap is safe (no overflow, underflow gives an exact 0 weight),
and a ``-inf`` partial (no visible key) changes nothing. Two ``-inf`` partials give ``o = 0``,
``l = -inf`` (no NaN).

:func:`merge_attention` is the torch form (any device and float dtype, the CPU path and the
reference); :func:`merge_attention_fast` is the one place that picks the fused Triton kernel
(:func:`~megatron_mtraining.ops.triton.launch.attention_merge`, one pass) on CUDA instead.
"""

from __future__ import annotations

import torch

from ..common import triton_runs_on

__all__ = ["merge_attention", "merge_attention_fast"]


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


def merge_attention_fast(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor):
    """:func:`merge_attention` of two partials, in one fused Triton launch on CUDA.

    Args:
        out, out2: ``[b, s, h, d]`` partial outputs; on the fused path bf16/fp16/fp32, each read in its own
            dtype (e.g. FlashAttention-4's bf16 output), unit stride in ``d``.
        lse, lse2: ``[b, h, s]`` their natural-log LSEs (fp32 on the fused path; views allowed).

    Returns:
        ``(out, lse)`` of the union, new tensors: fp32 from the fused kernel
        (:func:`~megatron_mtraining.ops.triton.launch.attention_merge`) for CUDA tensors within its rules
        (:func:`~megatron_mtraining.ops.triton.launch.merge_unsupported`), else :func:`merge_attention`
        (the CPU, fp64, other devices, or shapes past the kernel's limits; dtypes by torch's promotion: fp32
        for a bf16 and an fp32 partial). The same values up to fp32 rounding.
    """
    if out.is_cuda and triton_runs_on(out.device):
        from .triton.launch import attention_merge, merge_unsupported
        if merge_unsupported(out, lse, out2, lse2) is None:
            return attention_merge(out, lse, out2, lse2)
    return merge_attention(out, lse, out2, lse2)

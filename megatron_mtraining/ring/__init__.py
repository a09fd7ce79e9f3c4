"""Exact causal ring attention over a context-parallel process group.

Public API (flash-attn style names)::

    out = ring_attention(q, k, v, layout=Layout("striped", cp_size, 64), group=cp_group,
                         softmax_scale=None, causal=True)

Each rank holds the tokens that ``layout`` assigns to it (``layout.shard``). K/V circulate
around the ring (rank ``r`` sends to ``r+1``); at step ``s`` rank ``r`` attends to the K/V of
owner ``(r - s) mod cp`` under the causal structure of *global* positions, and merges the
partial (out, LSE) in fp32 (fp64 for fp64 inputs). The backward pass is a second ring: K/V
circulate again while fp32 dK/dV accumulators travel one exchange behind them and arrive,
fully reduced, at their owner after ``cp`` hops; dQ accumulates locally. Every step uses the
final (global) out and LSE, as in FlashAttention's backward (Dao et al. 2022, Alg. 2) and
ring attention (Liu et al. 2023; striped layout: Brandon et al. 2023, MTraining §3.3).

The next K/V exchange is posted before the current step's compute (double buffering: at most
two K/V buffers and two dK/dV buffers are alive, whatever ``cp_size``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..distributed import RingComm, check_consistent_across_ranks, group_size
from ..layout import LAYOUT_KINDS, Layout
from ..ops.merge import merge_attention
from ..ops.reference import acc_dtype, attention_backward, attention_forward, default_softmax_scale

__all__ = ["ring_attention", "RingAttentionFunc"]


def _step_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> bool:
    """False when every key of the step lies in the future of every query (step skipped)."""
    return (not causal) or bool(k_pos[0] <= q_pos[-1])


class RingAttentionFunc(torch.autograd.Function):
    """autograd.Function of the dense ring; see :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, layout: Layout, group, softmax_scale: float, causal: bool):
        comm = RingComm(group)
        cp, rank = comm.size, comm.rank
        seq_len = q.shape[1] * cp
        q_pos = layout.positions(rank, seq_len, device=q.device)
        acc = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        kv = (k.contiguous(), v.contiguous())
        for step in range(cp):
            pending = None
            if step + 1 < cp:
                pending = comm.exchange(kv, [torch.empty_like(kv[0]), torch.empty_like(kv[1])])
            owner = (rank - step) % cp
            k_pos = layout.positions(owner, seq_len, device=q.device)
            if _step_visible(q_pos, k_pos, causal):
                block_out, block_lse = attention_forward(q, kv[0], kv[1], q_pos, k_pos, softmax_scale, causal)
                out, lse = merge_attention(out, lse, block_out, block_lse)
            if pending is not None:
                kv = tuple(pending.wait())
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.softmax_scale, ctx.causal = layout, group, softmax_scale, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, causal, scale = ctx.layout, ctx.causal, ctx.softmax_scale
        comm = RingComm(ctx.group)
        cp, rank = comm.size, comm.rank
        seq_len = q.shape[1] * cp
        acc = acc_dtype(q.dtype)
        q_pos = layout.positions(rank, seq_len, device=q.device)
        dout = dout.contiguous()
        delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()   # [b, hq, sq]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = (k.contiguous(), v.contiguous())
        dkv = None           # accumulator for the K/V currently held (owner (rank - step) % cp)
        dkv_pending = None   # in-flight exchange of accumulators
        for step in range(cp):
            kv_pending = None
            if step + 1 < cp:
                kv_pending = comm.exchange(kv, [torch.empty_like(kv[0]), torch.empty_like(kv[1])])
            owner = (rank - step) % cp
            k_pos = layout.positions(owner, seq_len, device=q.device)
            if _step_visible(q_pos, k_pos, causal):
                dq_s, dk_s, dv_s = attention_backward(dout, q, kv[0], kv[1], lse, delta, q_pos, k_pos, scale, causal)
                dq += dq_s
            else:
                dk_s = torch.zeros(k.shape, dtype=acc, device=q.device)
                dv_s = torch.zeros(v.shape, dtype=acc, device=q.device)
            if dkv_pending is not None:                # accumulator for this owner, from rank - 1
                dk_in, dv_in = dkv_pending.wait()
                dk_s += dk_in
                dv_s += dv_in
            dkv = (dk_s, dv_s)
            if cp > 1:                                 # pass it on; the last hop brings it home
                dkv_pending = comm.exchange(dkv, [torch.empty_like(dk_s), torch.empty_like(dv_s)])
            if kv_pending is not None:
                kv = tuple(kv_pending.wait())
        if dkv_pending is not None:
            dkv = dkv_pending.wait()
        dk, dv = dkv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout,
                   group=None, softmax_scale: Optional[float] = None, causal: bool = True,
                   check_inputs: bool = True) -> torch.Tensor:
    """Exact (dense) causal attention over a sequence sharded across a CP group.

    Args:
        q: ``[b, s_local, hq, d]`` this rank's queries (already position-encoded), fp64/fp32/bf16/fp16.
        k, v: ``[b, s_local, hkv, d]`` this rank's keys/values; GQA when ``hkv < hq``
            (``hq % hkv == 0``; K/V are not expanded).
        layout: the :class:`~megatron_mtraining.layout.Layout` the sequence was sharded with;
            ``layout.cp_size`` must equal the group size.
        group: the CP process group (``None``: a single rank, no communication).
        softmax_scale: defaults to ``1/sqrt(d)``.
        causal: causal mask on global positions (key visible iff its position <= the query's).
        check_inputs: before the first exchange, all ranks compare shapes, dtypes and layout
            with one small all_gather and raise the same error on a mismatch (instead of hanging).

    Returns:
        ``[b, s_local, hq, d]`` in the dtype of ``q``.

    Raises:
        ValueError: shapes/dtypes inconsistent locally or across ranks, ``layout.cp_size`` not the
            group size, or a global length ``s_local * cp_size`` the layout cannot split.
    """
    cp = group_size(group)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [b, s_local, h, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must match, "
                         "and share batch, sequence and head_dim with q")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"GQA needs num query heads ({q.shape[2]}) divisible by num kv heads ({k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if layout.cp_size != cp:
        raise ValueError(f"layout.cp_size={layout.cp_size} but the process group has {cp} ranks")
    layout.check_seq_len(q.shape[1] * cp)
    if check_inputs and cp > 1:
        check_consistent_across_ranks(
            group, "ring_attention",
            q_shape=tuple(q.shape), kv_shape=tuple(k.shape), dtype=q.dtype,
            layout=LAYOUT_KINDS.index(layout.kind), granularity=layout.granularity, causal=bool(causal))
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return RingAttentionFunc.apply(q, k, v, layout, group, scale, bool(causal))

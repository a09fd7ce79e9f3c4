"""Torch reference of the block + column sparse attention of one ring step, with LSE.

The CPU path and the oracle of the sparse (vertical-slash) ring. It consumes the shared per-step
index format :class:`~megatron_mtraining.patterns.indices.StepIndices` exactly as a kernel would:
for each 64-row query block it gathers the K/V rows of its active key blocks and of its extra
vertical columns, and computes only those — the work is proportional to the selected keys, no
dense ``[sq, sk]`` mask is built.

Shapes follow :mod:`megatron_mtraining.ops.reference`:
    q: ``[b, sq, hq, d]``; k, v: ``[b, sk, hkv, d]`` (GQA: query head ``h`` reads kv head
    ``h // (hq // hkv)``; K/V are never expanded); ``sq`` and ``sk`` multiples of the block size.
    out: ``[b, sq, hq, d]``; lse: ``[b, hq, sq]`` (natural log), both in :func:`acc_dtype`
    (fp64 for fp64 inputs, fp32 otherwise).

Causality: when ``indices.causal`` (query and key shard are the same rank) a key is visible iff
its local index <= the query's local index — applied to block tiles *and* to columns. For other
steps the index never lists a key outside the strict past of its query block.

Packed documents (``indices.has_documents``): every gathered (query, key) pair is also masked by the
query's document bounds, ``doc_lo[q] <= key_pos[t] <= doc_hi[q]`` in global positions (this mask
contains causality), so a key block that mixes documents is exact; padding queries see nothing.

Rows with no visible key get ``out = 0`` and ``lse = -inf``; their gradients are exactly 0 and no
NaN is produced anywhere (padding slots contribute exact zeros).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..common import acc_dtype, default_softmax_scale
from ..patterns.indices import StepIndices
from .base import SparseStepFunction, SparseStepGradFunction

__all__ = ["sparse_attention_forward", "sparse_attention_backward", "SparseStepKernel"]

# Upper bound on elements of one gathered [b, hq, qblocks, keys, max(block, d)] chunk.
_GATHER_BUDGET = 1 << 24


def _check(q, k, v, idx: StepIndices):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q [b, sq, hq, d], k = v [b, sk, hkv, d] expected; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch/head_dim or GQA grouping")
    bs = idx.block_size
    if sq % bs or k.shape[1] % bs:
        raise ValueError(f"sq={sq} and sk={k.shape[1]} must be multiples of the block size {bs}")
    if tuple(idx.block_count.shape) != (b, hq, sq // bs) or tuple(idx.column_count.shape) != (b, hq, sq // bs):
        raise ValueError(f"StepIndices counts {tuple(idx.block_count.shape)} / {tuple(idx.column_count.shape)} "
                         f"do not match [b, hq, sq/bs] = {(b, hq, sq // bs)}")
    if idx.has_documents and (tuple(idx.doc_lo.shape) != (b, sq) or tuple(idx.doc_hi.shape) != (b, sq)
                              or tuple(idx.key_pos.shape) != (k.shape[1],)):
        raise ValueError(f"StepIndices document bounds {tuple(idx.doc_lo.shape)} / {tuple(idx.doc_hi.shape)} and "
                         f"key positions {tuple(idx.key_pos.shape)} must be [b, sq] = {(b, sq)} and [sk] = "
                         f"{(k.shape[1],)}")


class _Plan:
    """Key gather plan of one step, sliced into query-block chunks that fit the memory budget."""

    def __init__(self, q, k, idx: StepIndices):
        b, sq, hq, d = q.shape
        self.bs = bs = idx.block_size
        self.nqb = sq // bs
        self.rep = hq // k.shape[2]
        self.idx = idx
        self.max_nb = int(idx.block_count.max()) if idx.block_count.numel() else 0
        self.max_nc = int(idx.column_count.max()) if idx.column_count.numel() else 0
        width = self.max_nb * bs + self.max_nc
        self.width = width
        per_qblock = b * hq * max(1, width) * max(bs, d)
        self.rows = max(1, _GATHER_BUDGET // per_qblock)
        dev = q.device
        self.b_ar = torch.arange(b, device=dev)[:, None, None, None]
        self.h_map = (torch.arange(hq, device=dev) // self.rep)[None, :, None, None]

    def chunks(self):
        for i0 in range(0, self.nqb, self.rows):
            yield i0, min(self.nqb, i0 + self.rows)

    def keys(self, i0: int, i1: int):
        """``(kidx [b, hq, n, W] int64, valid [b, hq, n, W] bool)`` local key indices of blocks i0..i1."""
        idx, bs = self.idx, self.bs
        dev = idx.block_count.device
        bc = idx.block_count[:, :, i0:i1].long()
        cc = idx.column_count[:, :, i0:i1].long()
        nb = int(bc.max()) if bc.numel() else 0
        nc = int(cc.max()) if cc.numel() else 0
        parts, valids = [], []
        if nb:
            bi = idx.block_index[:, :, i0:i1, :nb].long()
            tok = bi[..., None] * bs + torch.arange(bs, device=dev)             # [b, hq, n, nb, bs]
            ok = (torch.arange(nb, device=dev) < bc[..., None])[..., None].expand_as(tok)
            parts.append(tok.flatten(-2))
            valids.append(ok.flatten(-2))
        if nc:
            ci = idx.column_index[:, :, i0:i1, :nc].long()
            parts.append(ci)
            valids.append(torch.arange(nc, device=dev) < cc[..., None])
        if not parts:
            return None, None
        kidx, valid = torch.cat(parts, -1), torch.cat(valids, -1)
        return torch.where(valid, kidx, torch.zeros_like(kidx)), valid

    def gather(self, x, kidx):
        """Rows of ``x [b, sk, hkv, d]`` at ``kidx`` for every query head: ``[b, hq, n, W, d]``."""
        return x[self.b_ar, kidx, self.h_map]

    def scores(self, qc, kc, kidx, valid, i0, i1, scale):
        s = torch.einsum("bhnqd,bhnkd->bhnqk", qc, kc) * scale
        mask = ~valid[:, :, :, None, :]
        if self.idx.causal:
            q_loc = torch.arange(i0 * self.bs, i1 * self.bs, device=kidx.device).view(i1 - i0, self.bs)
            mask = mask | (kidx[:, :, :, None, :] > q_loc[None, None, :, :, None])
        if self.idx.has_documents:
            b, n, bs = kidx.shape[0], i1 - i0, self.bs
            t = self.idx.key_pos[kidx][:, :, :, None, :]                               # [b, hq, n, 1, W]
            lo = self.idx.doc_lo[:, i0 * bs:i1 * bs].reshape(b, 1, n, bs, 1)
            hi = self.idx.doc_hi[:, i0 * bs:i1 * bs].reshape(b, 1, n, bs, 1)
            mask = mask | (t < lo) | (t > hi)
        return s.masked_fill(mask, float("-inf"))


def _q_blocks(x: torch.Tensor, i0: int, i1: int, bs: int, acc) -> torch.Tensor:
    """``x [b, s, h, d]`` rows of query blocks i0..i1 as ``[b, h, n, bs, d]``."""
    b, _, h, d = x.shape
    return x[:, i0 * bs:i1 * bs].to(acc).view(b, i1 - i0, bs, h, d).permute(0, 3, 1, 2, 4)


def sparse_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: StepIndices,
                             softmax_scale: Optional[float] = None):
    """Partial attention of ``q`` over the keys of ``k, v`` listed by ``indices``, with its LSE.

    Returns:
        ``(out [b, sq, hq, d], lse [b, hq, sq])`` in :func:`acc_dtype`.

    Raises:
        ValueError: inconsistent shapes.
    """
    indices = indices.per_query_head(q.shape[2]) if q.dim() == 4 else indices
    _check(q, k, v, indices)
    acc = acc_dtype(q.dtype)
    b, sq, hq, d = q.shape
    bs = indices.block_size
    scale = default_softmax_scale(d) if softmax_scale is None else softmax_scale
    out = torch.zeros((b, sq, hq, d), dtype=acc, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=acc, device=q.device)
    plan = _Plan(q, k, indices)
    if plan.width == 0:
        return out, lse
    ka, va = k.to(acc), v.to(acc)
    for i0, i1 in plan.chunks():
        kidx, valid = plan.keys(i0, i1)
        if kidx is None:
            continue
        qc = _q_blocks(q, i0, i1, bs, acc)
        s = plan.scores(qc, plan.gather(ka, kidx), kidx, valid, i0, i1, scale)   # [b, hq, n, bs, W]
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        o = torch.einsum("bhnqk,bhnkd->bhnqd", p / torch.where(l == 0, torch.ones_like(l), l),
                         plan.gather(va, kidx))
        out[:, i0 * bs:i1 * bs] = o.permute(0, 2, 3, 1, 4).reshape(b, (i1 - i0) * bs, hq, d)
        lse[..., i0 * bs:i1 * bs] = (m + torch.log(l)).squeeze(-1).reshape(b, hq, (i1 - i0) * bs)
    return out, lse


def sparse_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              lse: torch.Tensor, delta: torch.Tensor, indices: StepIndices,
                              softmax_scale: Optional[float] = None):
    """Gradients of the *global* attention output through the keys of this step.

    Args:
        dout: ``[b, sq, hq, d]``.
        lse: ``[b, hq, sq]`` final (merged over all steps) LSE; ``-inf`` rows give zero gradients.
        delta: ``[b, hq, sq]`` = ``rowsum(dout * out)`` of the final output.

    Returns:
        ``(dq, dk, dv)`` shaped like ``q, k, v``, in :func:`acc_dtype`.
    """
    indices = indices.per_query_head(q.shape[2]) if q.dim() == 4 else indices
    _check(q, k, v, indices)
    acc = acc_dtype(q.dtype)
    b, sq, hq, d = q.shape
    bs = indices.block_size
    scale = default_softmax_scale(d) if softmax_scale is None else softmax_scale
    dq = torch.zeros((b, sq, hq, d), dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    plan = _Plan(q, k, indices)
    if plan.width == 0:
        return dq, dk, dv
    ka, va = k.to(acc), v.to(acc)
    lse_a = lse.to(acc)
    lse_a = torch.where(torch.isneginf(lse_a), torch.full_like(lse_a, float("inf")), lse_a)
    delta_a = delta.to(acc)
    for i0, i1 in plan.chunks():
        kidx, valid = plan.keys(i0, i1)
        if kidx is None:
            continue
        n = i1 - i0
        qc = _q_blocks(q, i0, i1, bs, acc)
        doc = _q_blocks(dout, i0, i1, bs, acc)
        kc, vc = plan.gather(ka, kidx), plan.gather(va, kidx)
        s = plan.scores(qc, kc, kidx, valid, i0, i1, scale)
        lc = lse_a[..., i0 * bs:i1 * bs].reshape(b, hq, n, bs, 1)
        dc = delta_a[..., i0 * bs:i1 * bs].reshape(b, hq, n, bs, 1)
        p = torch.exp(s - lc)                                                   # 0 on masked / empty rows
        dp = torch.einsum("bhnqd,bhnkd->bhnqk", doc, vc)
        ds = p * (dp - dc)
        dq_c = torch.einsum("bhnqk,bhnkd->bhnqd", ds, kc) * scale
        dq[:, i0 * bs:i1 * bs] = dq_c.permute(0, 2, 3, 1, 4).reshape(b, n * bs, hq, d)
        vmask = valid[..., None].to(acc)
        dk_sel = torch.einsum("bhnqk,bhnqd->bhnkd", ds, qc) * scale * vmask      # [b, hq, n, W, d]
        dv_sel = torch.einsum("bhnqk,bhnqd->bhnkd", p, doc) * vmask
        where = (plan.b_ar.expand_as(kidx), kidx, plan.h_map.expand_as(kidx))
        dk.index_put_(where, dk_sel, accumulate=True)
        dv.index_put_(where, dv_sel, accumulate=True)
    return dq, dk, dv


class SparseStepKernel:
    """Per-step kernel of the sparse ring (:class:`~megatron_mtraining.ops.base.StepKernel`).

    Args:
        steps: ``steps[o]`` is the :class:`StepIndices` of this rank's queries against owner ``o``'s K/V.
        softmax_scale: attention scale.
        forward_fn / backward_fn: step implementations with the signatures of
            :func:`sparse_attention_forward` / :func:`sparse_attention_backward` (default: the torch
            reference; the Triton kernel of :func:`megatron_mtraining.ops.triton.make_sparse_step_kernel`
            plugs in here). Plain functions: a subclass overrides :meth:`forward_fn` /
            :meth:`backward_fn` instead.

    Attributes:
        column_phase: out-of-ring column work (:class:`~megatron_mtraining.ops.base.ColumnWork`) or
            ``None``; set by :func:`~megatron_mtraining.ring.sparse.sparse_ring_attention`.
        expect_backward: a backward will follow the forward (set from the grad mode); kernels may
            prepare for it during the forward.
    """

    def __init__(self, steps: Sequence[StepIndices], softmax_scale: float,
                 forward_fn: Optional[SparseStepFunction] = None, backward_fn: Optional[SparseStepGradFunction] = None):
        self.steps = list(steps)
        self.softmax_scale = softmax_scale
        # plain functions only: a subclass overrides the methods below instead of passing its own bound
        # methods (which, stored on ``self``, would make a reference cycle that keeps every step's
        # index tensors and plans alive until Python's cycle collector runs)
        self._forward_impl = forward_fn or sparse_attention_forward
        self._backward_impl = backward_fn or sparse_attention_backward
        self.empty = [s.is_empty() for s in self.steps]     # no device read for convert_pattern steps (known_max)
        self.column_phase = None
        self.expect_backward = True

    @property
    def computed_steps(self) -> int:
        return sum(not e for e in self.empty)

    def forward_fn(self, q, k, v, indices: StepIndices, softmax_scale: float):
        """One step's forward (signature of :func:`sparse_attention_forward`)."""
        return self._forward_impl(q, k, v, indices, softmax_scale)

    def backward_fn(self, dout, q, k, v, lse, delta, indices: StepIndices, softmax_scale: float):
        """One step's gradients (signature of :func:`sparse_attention_backward`)."""
        return self._backward_impl(dout, q, k, v, lse, delta, indices, softmax_scale)

    def forward(self, q, k, v, owner: int):
        if self.empty[owner]:
            return None
        return self.forward_fn(q, k, v, self.steps[owner], self.softmax_scale)

    def backward(self, dout, q, k, v, lse, delta, owner: int):
        if self.empty[owner]:
            return None
        return self.backward_fn(dout, q, k, v, lse, delta, self.steps[owner], self.softmax_scale)

"""Hierarchical (double) ring attention: an inner intra-node ring inside an outer inter-node ring.

MTraining §4.2 / Algorithm 2. The CP group of ``cp = inner × outer`` ranks is viewed as
``outer`` nodes of ``inner`` ranks, with Megatron's hierarchical-CP numbering
(``--hierarchical-context-parallel-sizes inner outer``: level 0 = consecutive CP ranks = the
inner group, level 1 = stride ``inner`` = the outer group), so
``cp_rank = outer_rank * inner + inner_rank``.

Forward, for each outer step ``o``:
    1. post the outer exchange of the K/V this rank holds for the outer ring (inter-node link);
    2. run a full inner ring over that K/V (``inner`` steps, intra-node link); at inner step
       ``j`` the K/V belongs to CP rank
       ``((outer_rank - o) mod outer) * inner + (inner_rank - j) mod inner``;
    3. wait for the outer exchange.
Every (query shard, K/V owner) pair is visited exactly once; causality is decided by global
positions, so the striped alignment holds at every step. The outer transfer runs during the
inner ring because inner and outer rings use **separate process groups** (separate NCCL
communicators and streams on GPU), unlike the reference code (mtraining_reference.md §2.4).

Backward mirrors it: each inner ring returns the node's fp32 dK/dV contribution for the outer
K/V it circulated; that node-level accumulator then travels on the outer ring one outer step
behind the K/V (its exchange overlaps the next inner ring) and arrives, reduced over all
nodes, at the owner.

A failed or timed-out transfer raises :class:`~megatron_mtraining.distributed.CommError` naming
the ring and the step, e.g. ``"inner ring backward step 1 of outer step 0 (dK/dV exchange)"`` or
``"outer ring forward step 0 (K/V exchange for step 1)"`` (steps count from 0), this rank and its
neighbours on that ring, within the group's timeout.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ..common import REGION_ATTENTION_BWD, REGION_ATTENTION_FWD, first_order_only, \
    profiled, resolve_softmax_scale, softmax_scale_error
from ..distributed import (RingComm, check_hierarchical_consistent, group_rank, group_size,
                           hierarchical_numbering_error)
from ..layout import LAYOUT_KINDS, Layout
from ..layout.documents import documents_agreement_key
from ..ops.backends import KernelBackend
from ..ops.base import DeltaFunction, StepKernel
from ..ops.reference import attention_delta_torch
from . import (backend_for, begin_backward, check_api_arguments, column_phase_of, dense_step_kernel, documents_error,
               end_backward, finish_forward, last_dim_contiguous, packed_documents, ring_input_error,
               ring_pass_backward, ring_pass_forward, zero_dq)

__all__ = ["hierarchical_ring_attention", "HierarchicalRingAttentionFunc", "DelayedComm"]


class DelayedComm(RingComm):
    """A :class:`RingComm` whose transfers take at least ``delay_s`` seconds from posting to
    completion: a slow inter-node link for overlap tests and simulations (the transfer itself
    runs at once; ``wait()`` returns no earlier than ``post time + delay_s``).

    Two counters, in seconds, for measurements (reset them to 0.0 between measurements):
    ``blocked_s`` is the time callers spent inside ``wait()`` (the transfer itself, including
    waiting for a late peer, plus the injected delay); ``exposed_delay_s`` is the part of the
    injected delay that ``wait()`` slept, i.e. the slow-link time not hidden behind other work."""

    def __init__(self, group, delay_s: float, name: str = "flat"):
        super().__init__(group, name)
        self.delay_s = float(delay_s)
        self.blocked_s = 0.0
        self.exposed_delay_s = 0.0

    def exchange(self, send, recv, where: str = "exchange"):
        pending = super().exchange(send, recv, where)
        ready_at = time.perf_counter() + self.delay_s
        inner_wait = pending.wait

        def wait():
            t0 = time.perf_counter()
            res = inner_wait()
            left = ready_at - time.perf_counter()
            if left > 0:
                time.sleep(left)
                self.exposed_delay_s += left
            self.blocked_s += time.perf_counter() - t0
            return res

        pending.wait = wait
        return pending


class HierarchicalRingAttentionFunc(torch.autograd.Function):
    """autograd.Function of the hierarchical ring; per-step work from ``kernel`` (a
    :class:`~megatron_mtraining.ops.base.StepKernel`), ``delta`` as in
    :class:`~megatron_mtraining.ring.RingAttentionFunc`."""

    @staticmethod
    @profiled(REGION_ATTENTION_FWD)
    def forward(ctx, q, k, v, kernel, inner: RingComm, outer: RingComm, overlap: bool,
                delta: Optional[DeltaFunction] = None):
        n_in, n_out = inner.size, outer.size
        r_in, r_out = inner.rank, outer.rank
        out, lse = None, None                     # the first computed step's partial, then merged
        cols = column_phase_of(kernel)
        if cols is not None:
            cols.begin_forward(k, v)
        kv_outer = (k.contiguous(), v.contiguous())
        for o in range(n_out):
            pending = None
            if o + 1 < n_out:
                pending = outer.exchange(kv_outer, [torch.empty_like(kv_outer[0]), torch.empty_like(kv_outer[1])],
                                         f"forward step {o} (K/V exchange for step {o + 1})")
                if not overlap:
                    kv_next = tuple(pending.wait())
            node = (r_out - o) % n_out
            out, lse = ring_pass_forward(kernel, inner, q, kv_outer, out, lse,
                                         lambda j, node=node: node * n_in + (r_in - j) % n_in, f" of outer step {o}")
            if pending is not None:
                kv_outer = tuple(pending.wait()) if overlap else kv_next
        out, lse = finish_forward(q, out, lse, cols)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.inner, ctx.outer, ctx.overlap = kernel, inner, outer, overlap
        ctx.delta = delta or attention_delta_torch
        return out

    @staticmethod
    @profiled(REGION_ATTENTION_BWD)
    @first_order_only("hierarchical ring attention")
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, inner, outer, overlap = ctx.kernel, ctx.inner, ctx.outer, ctx.overlap
        n_in, n_out = inner.size, outer.size
        r_in, r_out = inner.rank, outer.rank
        dout = dout.contiguous()
        delta = ctx.delta(dout, out)
        begin_backward(kernel, out)
        cols = column_phase_of(kernel)
        dq = None                                  # the first computed step's dQ, unless the columns add first
        if cols is not None:
            dq = zero_dq(q)
            cols.begin_backward(dout, q, lse, delta, dq)
        kv_outer = (k.contiguous(), v.contiguous())
        acc_pending = None         # node-level dK/dV accumulator travelling on the outer ring
        for o in range(n_out):
            kv_pending = None
            if o + 1 < n_out:
                kv_pending = outer.exchange(kv_outer, [torch.empty_like(kv_outer[0]), torch.empty_like(kv_outer[1])],
                                            f"backward step {o} (K/V exchange for step {o + 1})")
                if not overlap:
                    kv_next = tuple(kv_pending.wait())
            node = (r_out - o) % n_out
            dq, (dk_node, dv_node) = ring_pass_backward(kernel, inner, dout, q, kv_outer, lse, delta, dq,
                                                        lambda j, node=node: node * n_in + (r_in - j) % n_in,
                                                        f" of outer step {o}")
            if acc_pending is not None:            # other nodes' sum for the same owner
                dk_in, dv_in = acc_pending.wait()
                dk_node = dk_node + dk_in
                dv_node = dv_node + dv_in
            acc = (dk_node, dv_node)
            acc_pending = outer.exchange(acc, [torch.empty_like(dk_node), torch.empty_like(dv_node)],
                                         f"backward step {o} (dK/dV exchange)")
            if not overlap:
                acc_pending.wait()
            if kv_pending is not None:
                kv_outer = tuple(kv_pending.wait()) if overlap else kv_next
        dk, dv = acc_pending.wait()
        if dq is None:
            dq = zero_dq(q)
        if cols is not None:
            cols.finish_backward(dk, dv)
        end_backward(ctx)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def hierarchical_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout,
                                inner_group, outer_group, softmax_scale: Optional[float] = None,
                                causal: bool = True, kernel: Optional[StepKernel] = None, overlap: bool = True,
                                outer_link_delay_s: float = 0.0, check_inputs: bool = True,
                                backend: Optional[KernelBackend] = None, documents=None) -> torch.Tensor:
    """Exact causal attention over ``inner × outer`` CP ranks with a two-level ring.

    Args:
        q, k, v: as in :func:`megatron_mtraining.ring.ring_attention` (``[b, s_local, h, d]``).
        layout: the layout over the whole CP group (``layout.cp_size == inner * outer``); this
            rank's shard index is ``outer_rank * inner + inner_rank``.
        inner_group, outer_group: Megatron's hierarchical CP groups (level 0, level 1), or any
            two groups with that numbering. Both must have at least 2 ranks.
        kernel: per-step kernel (default: the backend's dense step kernel, causal or full by
            ``causal``); the sparse ring plugs its kernel in here.
        overlap: post the outer transfer before the inner ring (Algorithm 2). ``False`` waits
            for it first, which serialises the two links (for comparisons only).
        outer_link_delay_s: make every outer transfer take at least this long (a slow inter-node
            link, for overlap tests and simulations).
        check_inputs: validate the inputs on every rank and agree on the verdict over the inner
            and the outer ring (two small all_gathers), including the group numbering
            (:func:`~megatron_mtraining.distributed.hierarchical_numbering_error`) and
            ``softmax_scale``: every rank raises the same error instead of hanging or computing
            the wrong shards.
        backend: the kernels (:func:`~megatron_mtraining.ops.backends.select_backend`); ``None``:
            ``select_backend("auto")`` for these inputs (on CUDA the GPU dense step kernels, as in
            the flat ring).
        documents: packed documents, as in :func:`~megatron_mtraining.ring.ring_attention` (dense
            only: not with ``kernel``).

    Raises:
        ValueError: an inner or outer size of 1 (that is a flat ring or no CP: use
            :func:`~megatron_mtraining.ring.ring_attention`), ``inner*outer != layout.cp_size``,
            inner/outer groups that are not Megatron's numbering (e.g. swapped), invalid inputs
            on any rank, or shapes/dtypes/parameters that disagree across ranks; documents with a
            sparse ``kernel`` or a backend without document masks.
    """
    check_api_arguments("hierarchical_ring_attention", q, k, v, layout, backend)
    n_in, n_out = group_size(inner_group), group_size(outer_group)
    if n_in < 2 or n_out < 2:
        raise ValueError(f"hierarchical ring needs inner and outer rings of >= 2 ranks, got inner={n_in}, "
                         f"outer={n_out}; with one level of size 1 use the flat ring_attention instead")
    cp_rank = group_rank(outer_group) * n_in + group_rank(inner_group)
    seq_len = q.shape[1] * layout.cp_size
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    documents = packed_documents(documents)
    if documents is not None and kernel is not None:
        raise ValueError("hierarchical_ring_attention: packed documents run on the dense ring only (not with a "
                         "sparse step kernel)")
    if check_inputs:
        error = (ring_input_error(q, k, v, layout, n_in * n_out)
                 or hierarchical_numbering_error(inner_group, outer_group)
                 or documents_error(documents, q, layout, n_in * n_out, causal)
                 or softmax_scale_error(scale))
        check_hierarchical_consistent(inner_group, outer_group, "hierarchical_ring_attention", error,
                                      q_shape=tuple(q.shape), kv_shape=tuple(k.shape), dtype=q.dtype,
                                      layout=LAYOUT_KINDS.index(layout.kind), granularity=layout.granularity,
                                      sizes=(n_in, n_out), causal=bool(causal), softmax_scale=scale,
                                      documents=documents_agreement_key(documents))
    elif (error := (ring_input_error(q, k, v, layout, n_in * n_out)
                    or documents_error(documents, q, layout, n_in * n_out, causal)
                    or softmax_scale_error(scale))) is not None:
        raise ValueError(error)
    backend = backend_for(q, layout.cp_size, backend, sparse=kernel is not None, packed=documents is not None)
    q, k, v = last_dim_contiguous(q, k, v)
    if kernel is None:
        kernel = dense_step_kernel(backend, layout, cp_rank, seq_len, scale, bool(causal), q.device, documents)
    inner = RingComm(inner_group, "inner")
    outer = (DelayedComm(outer_group, outer_link_delay_s, "outer") if outer_link_delay_s > 0
             else RingComm(outer_group, "outer"))
    return HierarchicalRingAttentionFunc.apply(q, k, v, kernel, inner, outer, bool(overlap), backend.delta)

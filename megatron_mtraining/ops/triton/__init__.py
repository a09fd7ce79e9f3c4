"""Triton vertical-slash sparse attention (forward, backward with a deterministic mode).

Public API (ring step protocol: ``q [b,s,hq,d]``, ``k/v [b,s,hkv,d]``, fp32 ``out`` and ``lse [b,hq,s]``)::

    out, lse = sparse_attention_forward(q, k, v, step_indices, softmax_scale)
    dq, dk, dv = sparse_attention_backward(dout, q, k, v, lse, delta, step_indices, softmax_scale,
                                           deterministic=True)
    out = sparse_attention(q, k, v, step_indices, softmax_scale)      # autograd, out in q.dtype
    kernel = make_sparse_step_kernel(steps, softmax_scale)            # a ring step kernel (ops.base.StepKernel)

The work is the one of :class:`~megatron_mtraining.patterns.indices.StepIndices`: per 64-row query
tile its active 64-wide key blocks plus its gathered vertical key columns; with
``step_indices.causal`` every tile (columns included) is masked by local index; with packed documents
(``step_indices.has_documents``) every pair is also masked by the query's document key bounds
(``doc_lo <= key_pos <= doc_hi``; padding queries see nothing). Both functions go
through the ``torch.library`` custom ops ``torch.ops.mtraining.sparse_attn_fwd`` / ``sparse_attn_bwd``
(fake implementations registered: ``torch.compile`` traces them without a graph break).

Dispatch: CUDA tensors (bf16/fp16/fp32) run the Triton kernels; CPU tensors run the torch sparse
reference (:mod:`megatron_mtraining.ops.sparse_reference`) unless the Triton CPU interpreter is on
(``TRITON_INTERPRET=1`` set before the first launch), which runs the same Triton kernels on the CPU
(tests). fp64 always uses the torch reference. The ring does not go through the custom ops: its step
kernel (:func:`make_sparse_step_kernel`, chosen by :func:`~megatron_mtraining.ops.backends.select_backend`)
launches the kernels directly and keeps each step's plan from the forward to the backward.

Determinism: ``deterministic=True`` (default) uses no floating-point atomics anywhere: dQ is
row-parallel, dK/dV of blocks column-parallel over an inverted block index (GQA heads summed in
registers), dK/dV of vertical columns via per-split partials reduced in a fixed order. It is
bitwise repeatable. ``deterministic=False`` allows the fp32 atomics that the launch parameters
enable (:class:`~megatron_mtraining.ops.triton.launch.KernelConfig` ``col_atomic_fast`` for the
columns' dK/dV, ``dq_atomic_fast`` for the blocks' dQ); both are off by default (slower where
measured), so by default both modes run the same kernels.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...common import REGION_PLAN, acc_dtype, first_order_only, record_function, triton_runs_on
from ...patterns.convert import refine_indices
from ...patterns.indices import StepIndices
from ..sparse_reference import SparseStepKernel
from .launch import (BLOCK, DEFAULT_CONFIG, KernelConfig, SparsePlan, attention_delta as _delta_kernel,
                     delta_unsupported, dense_plan, document_plan, plan_from_indices, prebuild_backward_plans,
                     sparse_backward, sparse_forward)

__all__ = [
    "sparse_attention_forward", "sparse_attention_backward", "sparse_attention", "make_sparse_step_kernel",
    "TritonSparseStepKernel", "triton_usable", "triton_runs_on", "plan_for", "SparsePlan", "KernelConfig",
    "DEFAULT_CONFIG", "dense_plan", "document_plan", "sparse_forward", "sparse_backward", "prebuild_backward_plans",
    "attention_delta",
]


def triton_usable(t: torch.Tensor) -> bool:
    """True when the attention kernels can run on ``t``'s device and dtype (the custom ops' dispatch)."""
    return t.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_runs_on(t.device)


def _tiles(indices: StepIndices) -> StepIndices:
    """``indices`` with the kernels' 64-token blocks (:func:`~megatron_mtraining.patterns.convert.refine_indices`
    for patterns estimated at a coarser slash granularity, e.g. 128)."""
    return indices if indices.block_size == BLOCK else refine_indices(indices, BLOCK)


def plan_for(indices: StepIndices, static: Optional[bool] = None) -> SparsePlan:
    """The kernel plan of ``indices`` (built anew; :class:`TritonSparseStepKernel` keeps its steps' plans
    from the forward to the backward). Blocks coarser than the kernels' 64 tokens (a multiple of 64)
    are split first.

    ``static``: build the backward plans (inverted block index, column plan) at sizes known on the
    host, with no device read. ``None`` (the default): on CUDA for indices that carry host bounds
    (a valid ``known_max`` with a ``union`` bound: the steps of a static conversion, their column
    phase), data-dependent otherwise. The column union's buffer is sized by ``known_max.union``
    when valid, else by ``min(sk, nqb * max_nc)`` (up to the dense key count: costly for long
    sequences). The gradients equal those of the data-dependent plans (the same entries in the same
    order; a wider column union only changes the split of the column partials). A valid
    ``indices.column_union`` (:class:`~megatron_mtraining.patterns.indices.ColumnUnion`) is the column plan's
    union and per-tile masks: no union is built from the lists, and the plan needs no bound for it.
    A valid ``known_max`` with ``block == 0`` (a columns-only step) gives a plan without block structures
    (``SparsePlan.no_blocks``: no block split, no inverted block index; the same outputs)."""
    indices = _tiles(indices)
    k = indices.known_max
    if k is not None and not k.valid_for(indices.block_count, indices.column_count):
        k = None
    union = k.union if k is not None else None
    if static is None:
        static = indices.block_index.is_cuda and union is not None
    static = bool(static)
    union = union if static else None
    given = indices.given_column_union
    return plan_from_indices(indices.block_count, indices.block_index, indices.column_count, indices.column_index,
                             bool(indices.causal), static=static, column_union_max=union,
                             doc_lo=indices.doc_lo, doc_hi=indices.doc_hi, key_pos=indices.key_pos,
                             diagonal=indices.diagonal_blocks,
                             column_union=(given.union, given.bits) if given is not None else None,
                             no_blocks=k is not None and k.block == 0)


def _scale(q, softmax_scale):
    return float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5


def _reference_forward(q, k, v, indices, scale):
    from ..sparse_reference import sparse_attention_forward as ref
    return ref(q, k, v, indices, scale)


def _reference_backward(dout, q, k, v, lse, delta, indices, scale):
    from ..sparse_reference import sparse_attention_backward as ref
    return ref(dout, q, k, v, lse, delta, indices, scale)


# ----------------------------------------------------------------------------- custom ops
def _indices(bc, bi, cc, ci, causal, doc_lo=None, doc_hi=None, key_pos=None):
    return StepIndices(bc, bi, cc, ci, bool(causal), doc_lo=doc_lo, doc_hi=doc_hi, key_pos=key_pos)


@torch.library.custom_op("mtraining::sparse_attn_fwd", mutates_args=())
def _sparse_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_count: torch.Tensor,
                     block_index: torch.Tensor, column_count: torch.Tensor, column_index: torch.Tensor,
                     causal: bool, softmax_scale: float, deterministic: bool, doc_lo: Optional[torch.Tensor] = None,
                     doc_hi: Optional[torch.Tensor] = None, key_pos: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    idx = _indices(block_count, block_index, column_count, column_index, causal, doc_lo, doc_hi, key_pos)
    if triton_usable(q):
        return sparse_forward(q, k, v, plan_for(idx), softmax_scale)
    out, lse = _reference_forward(q, k, v, idx, softmax_scale)
    return out.float() if q.dtype != torch.float64 else out, lse.float() if q.dtype != torch.float64 else lse


@_sparse_attn_fwd.register_fake
def _(q, k, v, block_count, block_index, column_count, column_index, causal, softmax_scale, deterministic,
      doc_lo=None, doc_hi=None, key_pos=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, s, h, d = q.shape
    return q.new_empty((b, s, h, d), dtype=acc), q.new_empty((b, h, s), dtype=acc)


@torch.library.custom_op("mtraining::sparse_attn_bwd", mutates_args=())
def _sparse_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                     delta: torch.Tensor, block_count: torch.Tensor, block_index: torch.Tensor,
                     column_count: torch.Tensor, column_index: torch.Tensor, causal: bool, softmax_scale: float,
                     deterministic: bool, doc_lo: Optional[torch.Tensor] = None, doc_hi: Optional[torch.Tensor] = None,
                     key_pos: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    idx = _indices(block_count, block_index, column_count, column_index, causal, doc_lo, doc_hi, key_pos)
    if triton_usable(q):
        return sparse_backward(dout, q, k, v, lse, delta, plan_for(idx), softmax_scale, deterministic)
    dq, dk, dv = _reference_backward(dout, q, k, v, lse, delta, idx, softmax_scale)
    return tuple(t.clone() for t in (dq, dk, dv))


@_sparse_attn_bwd.register_fake
def _(dout, q, k, v, lse, delta, block_count, block_index, column_count, column_index, causal, softmax_scale,
      deterministic, doc_lo=None, doc_hi=None, key_pos=None):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape, dtype=acc), k.new_empty(k.shape, dtype=acc), v.new_empty(v.shape, dtype=acc)


@torch.library.custom_op("mtraining::attn_delta", mutates_args=())
def _attn_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    if triton_usable(out) and triton_usable(dout) and delta_unsupported(dout, out) is None:
        return _delta_kernel(dout, out)
    acc = acc_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()


@_attn_delta.register_fake
def _(dout, out):
    b, s, h, _ = out.shape
    return out.new_empty((b, h, s), dtype=acc_dtype(out.dtype))


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)`` of the attention backward (FlashAttention-2, Dao 2023, Alg. 2).

    Args:
        dout, out: ``[b, s, hq, d]``, any float dtypes (the final output of the attention and its
            gradient).
    Returns:
        ``[b, hq, s]`` contiguous, in :func:`~megatron_mtraining.ops.reference.acc_dtype` of
        ``out.dtype`` (fp32, or fp64 for fp64). One Triton launch that reads the inputs as they are
        where the kernels run (:func:`triton_usable`: CUDA, or the CPU under ``TRITON_INTERPRET=1``),
        for bf16/fp16/fp32 inputs of the same shape with ``d`` a power of two <= 256, a contiguous last
        dimension and fewer than 2**31 elements; otherwise torch in the accumulation dtype.
        Custom op ``torch.ops.mtraining.attn_delta`` (fake implementation registered).
    """
    return _attn_delta(dout, out)


def _setup_context(ctx, inputs, output):
    q, k, v, bc, bi, cc, ci, causal, scale, det = inputs[:10]
    docs = tuple(inputs[10:13]) + (None,) * (13 - len(inputs))
    out, lse = output
    ctx.has_docs = docs[0] is not None
    ctx.save_for_backward(q, k, v, bc, bi, cc, ci, out, lse, *(docs if ctx.has_docs else ()))
    ctx.causal, ctx.scale, ctx.det = causal, scale, det


@first_order_only("sparse attention (torch.ops.mtraining.sparse_attn_fwd)")
def _backward(ctx, dout, dlse):
    q, k, v, bc, bi, cc, ci, out, lse = ctx.saved_tensors[:9]
    docs = ctx.saved_tensors[9:12] if ctx.has_docs else (None, None, None)
    acc = out.dtype
    delta = attention_delta(dout, out)
    if dlse is not None:      # d lse / d s = p: folds into delta
        delta = delta - dlse.to(acc)
    dq, dk, dv = _sparse_attn_bwd(dout.to(q.dtype) if q.dtype != torch.float32 else dout, q, k, v, lse,
                                  delta.contiguous(), bc, bi, cc, ci, ctx.causal, ctx.scale, ctx.det, *docs)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 10


torch.library.register_autograd("mtraining::sparse_attn_fwd", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public functions
def _docs(indices: StepIndices) -> tuple:
    """The document arguments of the custom ops (none without documents)."""
    return (indices.doc_lo, indices.doc_hi, indices.key_pos) if indices.has_documents else ()


def sparse_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: StepIndices,
                             softmax_scale: Optional[float] = None):
    """Partial attention of ``q`` over the keys listed by ``indices``: ``(out, lse)``, fp32
    (fp64 for fp64 inputs). Rows with no key: ``out = 0``, ``lse = -inf``."""
    indices = _tiles(indices)
    return torch.ops.mtraining.sparse_attn_fwd(q, k, v, indices.block_count, indices.block_index,
                                               indices.column_count, indices.column_index, bool(indices.causal),
                                               _scale(q, softmax_scale), True, *_docs(indices))


def sparse_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              lse: torch.Tensor, delta: torch.Tensor, indices: StepIndices,
                              softmax_scale: Optional[float] = None, deterministic: bool = True):
    """Gradients of the global output through this step's keys given the final ``lse`` and
    ``delta = rowsum(dout * out)`` (both ``[b, hq, s]``): ``(dq, dk, dv)`` in fp32 (fp64 for fp64)."""
    indices = _tiles(indices)
    return torch.ops.mtraining.sparse_attn_bwd(dout, q, k, v, lse, delta, indices.block_count, indices.block_index,
                                               indices.column_count, indices.column_index, bool(indices.causal),
                                               _scale(q, softmax_scale), bool(deterministic), *_docs(indices))


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: StepIndices,
                     softmax_scale: Optional[float] = None, deterministic: bool = True) -> torch.Tensor:
    """Differentiable single-shard sparse attention; returns ``out`` in ``q.dtype``."""
    indices = _tiles(indices)
    out, _ = torch.ops.mtraining.sparse_attn_fwd(q, k, v, indices.block_count, indices.block_index,
                                                 indices.column_count, indices.column_index, bool(indices.causal),
                                                 _scale(q, softmax_scale), bool(deterministic), *_docs(indices))
    return out.to(q.dtype)


class TritonSparseStepKernel(SparseStepKernel):
    """Sparse ring step kernel (:class:`~megatron_mtraining.ops.base.StepKernel`) on the Triton kernels.

    Launches :func:`~.launch.sparse_forward` / :func:`~.launch.sparse_backward` directly; the plan of
    each :class:`StepIndices` it runs (ring steps and out-of-ring column work alike) is built once and
    kept on the kernel, which lives from the forward to the backward.

    Args:
        steps, softmax_scale: as for :class:`~megatron_mtraining.ops.sparse_reference.SparseStepKernel`.
        deterministic: backward without floating-point atomics (bitwise repeatable).
        prebuild: after each step's forward kernel is launched, build that step's backward index plans
            (:func:`~.launch.prebuild_backward_plans`, on a CUDA side stream overlapping the kernel)
            when ``expect_backward`` is true. The results are bitwise the same either way.
        config: launch parameters (default :class:`KernelConfig`).
        stats: a dict receiving the registers / spills of each launched kernel, or ``None``.
        static_plans: backward plans at host-known sizes, without device reads (:func:`plan_for`;
            ``None``, the default: on CUDA for indices with host bounds).

    Steps with packed-document bounds (``StepIndices.has_documents``) are masked by them.

    Inputs must be bf16/fp16/fp32 on a device where Triton runs, with ``d`` in 16/32/64/128/256 and
    lengths that are multiples of 64 (:func:`~megatron_mtraining.ops.backends.select_backend` checks
    this before choosing the kernel); the launchers raise ``ValueError`` otherwise.
    """

    def __init__(self, steps: Sequence[StepIndices], softmax_scale: float, deterministic: bool = True,
                 prebuild: bool = True, config: Optional[KernelConfig] = None, stats: Optional[dict] = None,
                 static_plans: Optional[bool] = None):
        super().__init__(steps, softmax_scale)
        self.static_plans = static_plans
        self.deterministic, self.prebuild = bool(deterministic), bool(prebuild)
        self.config = config or DEFAULT_CONFIG
        self.stats = stats
        self._plans: dict = {}       # id(indices) -> (indices, plan); the indices are held, so ids stay unique

    def plan(self, indices: StepIndices) -> SparsePlan:
        """The plan of ``indices`` (built on first use, then reused)."""
        hit = self._plans.get(id(indices))
        if hit is None or hit[0] is not indices:
            hit = self._plans[id(indices)] = (indices, plan_for(indices, self.static_plans))
        return hit[1]

    def _forward_step(self, q, k, v, idx: StepIndices, scale: float):
        early = self.prebuild and self.expect_backward
        with record_function(REGION_PLAN):
            plan = self.plan(idx)   # its int32 copies of the indices are written before `ready`
        ready = None
        if early and q.is_cuda and not torch.cuda.is_current_stream_capturing():
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(q.device))   # the forward kernel comes next
        out = sparse_forward(q, k, v, plan, scale, config=self.config, stats=self.stats)
        if early:
            with record_function(REGION_PLAN):
                prebuild_backward_plans(plan, q.shape, k.shape, self.deterministic, config=self.config, after=ready)
        return out

    def _backward_step(self, dout, q, k, v, lse, delta, idx: StepIndices, scale: float):
        return sparse_backward(dout, q, k, v, lse, delta, self.plan(idx), scale, self.deterministic,
                               config=self.config, stats=self.stats)

    forward_fn = _forward_step
    backward_fn = _backward_step


def make_sparse_step_kernel(steps: Sequence[StepIndices], softmax_scale: float, deterministic: bool = True,
                            prebuild: bool = True, config: Optional[KernelConfig] = None,
                            stats: Optional[dict] = None, static_plans: Optional[bool] = None
                            ) -> TritonSparseStepKernel:
    """A :class:`TritonSparseStepKernel` (arguments as there). Steps with packed-document bounds
    (``StepIndices.has_documents``) are masked by them in every tile and column."""
    return TritonSparseStepKernel(steps, softmax_scale, deterministic, prebuild, config, stats, static_plans)

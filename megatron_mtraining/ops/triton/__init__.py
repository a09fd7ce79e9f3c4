"""Triton vertical-slash sparse attention (forward, backward with a deterministic mode).

Public API (ring step protocol: ``q [b,s,hq,d]``, ``k/v [b,s,hkv,d]``, fp32 ``out`` and ``lse [b,hq,s]``)::

    out, lse = sparse_attention_forward(q, k, v, step_indices, softmax_scale)
    dq, dk, dv = sparse_attention_backward(dout, q, k, v, lse, delta, step_indices, softmax_scale,
                                           deterministic=True)
    out = sparse_attention(q, k, v, step_indices, softmax_scale)      # autograd, out in q.dtype
    kernel = make_sparse_step_kernel(steps, softmax_scale)            # a ring.sparse.SparseStepKernel

The work is the one of :class:`~megatron_mtraining.patterns.indices.StepIndices`: per 64-row query
tile its active 64-wide key blocks plus its gathered vertical key columns; with
``step_indices.causal`` every tile (columns included) is masked by local index. Both functions go
through the ``torch.library`` custom ops ``torch.ops.mtraining.sparse_attn_fwd`` / ``sparse_attn_bwd``
(fake implementations registered: ``torch.compile`` traces them without a graph break).

Dispatch: CUDA tensors (bf16/fp16/fp32) run the Triton kernels; CPU tensors run the torch sparse
reference (:mod:`megatron_mtraining.ops.sparse_reference`) unless the Triton CPU interpreter is on
(``TRITON_INTERPRET=1`` set before the first launch), which runs the same Triton kernels on the CPU
(tests). fp64 always uses the torch reference.

Determinism: ``deterministic=True`` (default) uses no floating-point atomics anywhere: dQ is
row-parallel, dK/dV of blocks column-parallel over an inverted block index (GQA heads summed in
registers), dK/dV of vertical columns via per-split partials reduced in a fixed order. It is
bitwise repeatable. ``deterministic=False`` adds the columns' dK/dV with fp32 atomics.
"""

from __future__ import annotations

import os
import weakref
from typing import Optional, Sequence

import torch

from ...patterns.indices import StepIndices
from ..reference import acc_dtype
from .launch import (CONFIG, KernelConfig, SparsePlan, attention_delta as _delta_kernel, delta_unsupported,
                     dense_plan, plan_from_indices, prebuild_backward_plans, sparse_backward, sparse_forward)

__all__ = [
    "sparse_attention_forward", "sparse_attention_backward", "sparse_attention", "make_sparse_step_kernel",
    "triton_usable", "triton_runs_on", "plan_for", "SparsePlan", "KernelConfig", "CONFIG", "dense_plan",
    "sparse_forward", "sparse_backward", "prebuild_backward_plans", "PREBUILD_BACKWARD_PLANS", "attention_delta",
]


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except Exception:
        return False


_HAS_TRITON = _triton_importable()


def triton_runs_on(device: torch.device) -> bool:
    """True when Triton kernels can run on ``device``: CUDA, or the CPU under ``TRITON_INTERPRET=1``."""
    if not _HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_usable(t: torch.Tensor) -> bool:
    """True when the attention kernels can run on ``t``'s device and dtype."""
    return t.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_runs_on(t.device)


_PLAN_CACHE: "dict[int, tuple]" = {}
_PLAN_CACHE_SIZE = 256


def plan_for(indices: StepIndices) -> SparsePlan:
    """The kernel plan of ``indices``, cached while its index tensors are alive and unmodified
    (built once per ring step and reused by the backward, also through the custom ops)."""
    ts = (indices.block_count, indices.block_index, indices.column_count, indices.column_index)
    key = id(indices.block_index)
    hit = _PLAN_CACHE.get(key)
    if hit is not None:
        refs, versions, causal, plan = hit
        if (causal == bool(indices.causal) and all(r() is t for r, t in zip(refs, ts))
                and versions == tuple(t._version for t in ts)):
            return plan
    plan = plan_from_indices(*ts, bool(indices.causal))
    if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
        for dead in [k for k, v in _PLAN_CACHE.items() if v[0][1]() is None] or list(_PLAN_CACHE)[:1]:
            _PLAN_CACHE.pop(dead, None)
    _PLAN_CACHE[key] = (tuple(weakref.ref(t) for t in ts), tuple(t._version for t in ts), bool(indices.causal), plan)
    return plan


def _scale(q, softmax_scale):
    return float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5


def _reference_forward(q, k, v, indices, scale):
    from ..sparse_reference import sparse_attention_forward as ref
    return ref(q, k, v, indices, scale)


def _reference_backward(dout, q, k, v, lse, delta, indices, scale):
    from ..sparse_reference import sparse_attention_backward as ref
    return ref(dout, q, k, v, lse, delta, indices, scale)


# ----------------------------------------------------------------------------- custom ops
def _indices(bc, bi, cc, ci, causal):
    return StepIndices(bc, bi, cc, ci, bool(causal))


@torch.library.custom_op("mtraining::sparse_attn_fwd", mutates_args=())
def _sparse_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_count: torch.Tensor,
                     block_index: torch.Tensor, column_count: torch.Tensor, column_index: torch.Tensor,
                     causal: bool, softmax_scale: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    idx = _indices(block_count, block_index, column_count, column_index, causal)
    if triton_usable(q):
        return sparse_forward(q, k, v, plan_for(idx), softmax_scale)
    out, lse = _reference_forward(q, k, v, idx, softmax_scale)
    return out.float() if q.dtype != torch.float64 else out, lse.float() if q.dtype != torch.float64 else lse


@_sparse_attn_fwd.register_fake
def _(q, k, v, block_count, block_index, column_count, column_index, causal, softmax_scale, deterministic):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, s, h, d = q.shape
    return q.new_empty((b, s, h, d), dtype=acc), q.new_empty((b, h, s), dtype=acc)


@torch.library.custom_op("mtraining::sparse_attn_bwd", mutates_args=())
def _sparse_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                     delta: torch.Tensor, block_count: torch.Tensor, block_index: torch.Tensor,
                     column_count: torch.Tensor, column_index: torch.Tensor, causal: bool, softmax_scale: float,
                     deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    idx = _indices(block_count, block_index, column_count, column_index, causal)
    if triton_usable(q):
        return sparse_backward(dout, q, k, v, lse, delta, plan_for(idx), softmax_scale, deterministic)
    dq, dk, dv = _reference_backward(dout, q, k, v, lse, delta, idx, softmax_scale)
    return tuple(t.clone() for t in (dq, dk, dv))


@_sparse_attn_bwd.register_fake
def _(dout, q, k, v, lse, delta, block_count, block_index, column_count, column_index, causal, softmax_scale,
      deterministic):
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
    q, k, v, bc, bi, cc, ci, causal, scale, det = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bc, bi, cc, ci, out, lse)
    ctx.causal, ctx.scale, ctx.det = causal, scale, det


def _backward(ctx, dout, dlse):
    q, k, v, bc, bi, cc, ci, out, lse = ctx.saved_tensors
    acc = out.dtype
    delta = attention_delta(dout, out)
    if dlse is not None:      # d lse / d s = p: folds into delta
        delta = delta - dlse.to(acc)
    dq, dk, dv = _sparse_attn_bwd(dout.to(q.dtype) if q.dtype != torch.float32 else dout, q, k, v, lse,
                                  delta.contiguous(), bc, bi, cc, ci, ctx.causal, ctx.scale, ctx.det)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


torch.library.register_autograd("mtraining::sparse_attn_fwd", _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public functions
def sparse_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: StepIndices,
                             softmax_scale: Optional[float] = None):
    """Partial attention of ``q`` over the keys listed by ``indices``: ``(out, lse)``, fp32
    (fp64 for fp64 inputs). Rows with no key: ``out = 0``, ``lse = -inf``."""
    return torch.ops.mtraining.sparse_attn_fwd(q, k, v, indices.block_count, indices.block_index,
                                               indices.column_count, indices.column_index, bool(indices.causal),
                                               _scale(q, softmax_scale), True)


def sparse_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              lse: torch.Tensor, delta: torch.Tensor, indices: StepIndices,
                              softmax_scale: Optional[float] = None, deterministic: bool = True):
    """Gradients of the global output through this step's keys given the final ``lse`` and
    ``delta = rowsum(dout * out)`` (both ``[b, hq, s]``): ``(dq, dk, dv)`` in fp32 (fp64 for fp64)."""
    return torch.ops.mtraining.sparse_attn_bwd(dout, q, k, v, lse, delta, indices.block_count, indices.block_index,
                                               indices.column_count, indices.column_index, bool(indices.causal),
                                               _scale(q, softmax_scale), bool(deterministic))


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: StepIndices,
                     softmax_scale: Optional[float] = None, deterministic: bool = True) -> torch.Tensor:
    """Differentiable single-shard sparse attention; returns ``out`` in ``q.dtype``."""
    out, _ = torch.ops.mtraining.sparse_attn_fwd(q, k, v, indices.block_count, indices.block_index,
                                                 indices.column_count, indices.column_index, bool(indices.causal),
                                                 _scale(q, softmax_scale), bool(deterministic))
    return out.to(q.dtype)


PREBUILD_BACKWARD_PLANS = True   # default of make_sparse_step_kernel(prebuild=None)


def make_sparse_step_kernel(steps: Sequence[StepIndices], softmax_scale: float, deterministic: bool = True,
                            prebuild: Optional[bool] = None):
    """A :class:`~megatron_mtraining.ring.sparse.SparseStepKernel` running these kernels.

    ``prebuild`` (default :data:`PREBUILD_BACKWARD_PLANS`): after each step's forward kernel is
    launched, build that step's backward index plans (:func:`~.launch.prebuild_backward_plans`, on
    a CUDA side stream overlapping the kernel) when the kernel's ``expect_backward`` is true (set by
    :func:`~megatron_mtraining.ring.sparse.sparse_ring_attention` from the grad mode). The results
    are bitwise the same either way; the plans live from the forward to the backward.
    """
    from ...ring.sparse import SparseStepKernel

    prebuild = PREBUILD_BACKWARD_PLANS if prebuild is None else bool(prebuild)

    def bwd(dout, q, k, v, lse, delta, idx, scale):
        return sparse_attention_backward(dout, q, k, v, lse, delta, idx, scale, deterministic)

    kernel = SparseStepKernel(steps, softmax_scale, forward_fn=None, backward_fn=bwd)

    def fwd(q, k, v, idx, scale):
        early = prebuild and kernel.expect_backward and triton_usable(q)
        plan = ready = None
        if early:
            plan = plan_for(idx)      # its int32 copies of the indices are written before `ready`
            if q.is_cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(q.device))   # the forward kernel comes next
        out = sparse_attention_forward(q, k, v, idx, scale)      # reuses the cached plan
        if early:
            prebuild_backward_plans(plan, q.shape, k.shape, deterministic, after=ready)
        return out

    kernel.forward_fn = fwd
    return kernel

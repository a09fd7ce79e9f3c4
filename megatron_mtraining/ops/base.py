"""Protocols every attention kernel implements and the ring schedules call.

Shapes (flash-attn's bshd convention), for one ring step of the local queries against the K/V of
CP rank ``owner``:

    q, dout: ``[b, sq, hq, d]``; k, v: ``[b, sk, hkv, d]`` with ``hq % hkv == 0`` (GQA: query head
    ``h`` reads key/value head ``h // (hq // hkv)``; K/V are never expanded).
    out: ``[b, sq, hq, d]``; lse: ``[b, hq, sq]``, natural log (``-inf`` for a row with no visible
    key, whose ``out`` is 0).
    delta: ``[b, hq, sq]`` = ``rowsum(dout * out)`` of the *final* output.

Dtypes: inputs bf16/fp16/fp32/fp64; ``out``, ``lse``, ``dq``, ``dk``, ``dv`` in the accumulation
dtype :func:`~megatron_mtraining.common.acc_dtype` (fp32, fp64 for fp64 inputs), so the ring merges
partials by LSE (FlashAttention's online softmax) without rounding to the input dtype. The one
exception: a kernel of a one-step ring (CP=1) without a column phase may return ``out``, ``dq``,
``dk``, ``dv`` in the inputs' dtype, which the ring then takes as they are (the only partial is the
result; nothing is merged into it or added to it).

The backward of a step takes the final (merged over all steps) ``lse`` and ``delta``, so the
per-step gradients add up exactly (FlashAttention, Dao et al. 2022, Alg. 2; ring attention, Liu et
al. 2023; MTraining §3.3 / §4.2 for the ring schedules).
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple, runtime_checkable

import torch

__all__ = ["StepKernel", "SparseStepFunction", "SparseStepGradFunction", "ColumnWork", "DeltaFunction",
           "DenseSingleFunction"]

Tensor = torch.Tensor


@runtime_checkable
class StepKernel(Protocol):
    """Per-step attention of a ring (dense or sparse).

    ``forward(q, k, v, owner) -> (out, lse) | None`` and
    ``backward(dout, q, k, v, lse, delta, owner) -> (dq, dk, dv) | None``, in the shapes and dtypes
    of the module docstring; ``None`` means the step has no visible key (no compute, no gradient).
    Each call returns tensors of its own (not buffers reused by a later call): the ring keeps the first
    computed step's ``(out, lse)`` as its running result and adds later steps' dQ into the first one's.
    A kernel may carry ``column_phase`` (a :class:`ColumnWork`): work outside the ring, merged by
    LSE.
    """

    def forward(self, q: Tensor, k: Tensor, v: Tensor, owner: int) -> Optional[Tuple[Tensor, Tensor]]: ...

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                 owner: int) -> Optional[Tuple[Tensor, Tensor, Tensor]]: ...


class SparseStepFunction(Protocol):
    """Forward of one sparse step: ``(q, k, v, indices, softmax_scale) -> (out, lse)``, with
    ``indices`` a :class:`~megatron_mtraining.patterns.indices.StepIndices` (shapes as above)."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, indices, softmax_scale: float) -> Tuple[Tensor, Tensor]: ...


class SparseStepGradFunction(Protocol):
    """Backward of one sparse step: ``(dout, q, k, v, lse, delta, indices, softmax_scale) -> (dq, dk, dv)``."""

    def __call__(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor, indices,
                 softmax_scale: float) -> Tuple[Tensor, Tensor, Tensor]: ...


class ColumnWork(Protocol):
    """Attention work a kernel does outside the ring (the out-of-ring vertical columns, MTraining §3.3).

    ``begin_forward(k, v)`` before the ring (may post communication), ``forward(q) -> (out, lse) | None``
    after it (merged by LSE); ``begin_backward(dout, q, lse, delta, dq)`` before the backward ring (adds
    its dQ into ``dq``), ``finish_backward(dk, dv)`` after it (adds its dK/dV in place).
    """

    def begin_forward(self, k: Tensor, v: Tensor) -> None: ...

    def forward(self, q: Tensor) -> Optional[Tuple[Tensor, Tensor]]: ...

    def begin_backward(self, dout: Tensor, q: Tensor, lse: Tensor, delta: Tensor, dq: Tensor) -> None: ...

    def finish_backward(self, dk: Tensor, dv: Tensor) -> None: ...


class DeltaFunction(Protocol):
    """``(dout, out) -> delta``: ``[b, s, hq, d]`` inputs, ``[b, hq, s]`` contiguous output in the
    accumulation dtype of ``out.dtype``."""

    def __call__(self, dout: Tensor, out: Tensor) -> Tensor: ...


class DenseSingleFunction(Protocol):
    """Causal attention without context parallelism: ``(q, k, v, softmax_scale) -> out``, ``q``
    ``[b, s, hq, d]``, ``k, v`` ``[b, s, hkv, d]``, ``out`` ``[b, s, hq, d]`` in ``q.dtype``."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, softmax_scale: float) -> Tensor: ...

"""Sparse (vertical-slash) ring attention: MTraining's dynamic sparse attention over a CP group.

Public API::

    out = sparse_ring_attention(q, k, v, layout=Layout("striped", cp, 64), group=cp_group,
                                config=VerticalSlashConfig(recall=0.95))

Per forward: (1) :func:`~megatron_mtraining.patterns.estimator.estimate_vertical_slash` estimates
the global pattern from the current q/k shards (small collectives on ``group``; identical on every
rank); (2) :func:`~megatron_mtraining.patterns.convert.convert_pattern` turns it into this rank's
per-owner :class:`StepIndices`; (3) the ring runs through the *same*
:class:`~megatron_mtraining.ring.RingAttentionFunc` as the dense ring, with a
:class:`SparseStepKernel` doing the per-step work. The indices are kept on the kernel for the
backward pass (not rebuilt). A step whose indices are empty for every query block is skipped in
both passes (no compute; K/V still circulate, as the ring schedule is fixed).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..distributed import group_rank, group_size
from ..layout import Layout
from ..ops.reference import default_softmax_scale
from ..ops.sparse_reference import sparse_attention_backward, sparse_attention_forward
from ..patterns.convert import check_block_layout, convert_pattern
from ..patterns.estimator import VerticalSlashConfig, VerticalSlashPattern, estimate_vertical_slash
from ..patterns.indices import StepIndices
from . import RingAttentionFunc, check_ring_inputs

__all__ = ["SparseStepKernel", "sparse_ring_attention"]


class SparseStepKernel:
    """Per-step kernel of the sparse ring (protocol of :class:`~megatron_mtraining.ring.DenseStepKernel`).

    Args:
        steps: ``steps[o]`` is the :class:`StepIndices` of this rank's queries against owner ``o``'s K/V.
        softmax_scale: attention scale.
        forward_fn / backward_fn: step implementations with the signatures of
            :func:`~megatron_mtraining.ops.sparse_reference.sparse_attention_forward` /
            ``sparse_attention_backward`` (default: the torch reference; a Triton kernel plugs in here).
    """

    def __init__(self, steps: Sequence[StepIndices], softmax_scale: float,
                 forward_fn: Optional[Callable] = None, backward_fn: Optional[Callable] = None):
        self.steps = list(steps)
        self.softmax_scale = softmax_scale
        self.forward_fn = forward_fn or sparse_attention_forward
        self.backward_fn = backward_fn or sparse_attention_backward
        self.empty = [s.is_empty() for s in self.steps]     # one host sync per step, at construction

    @property
    def computed_steps(self) -> int:
        return sum(not e for e in self.empty)

    def forward(self, q, k, v, owner: int):
        if self.empty[owner]:
            return None
        return self.forward_fn(q, k, v, self.steps[owner], self.softmax_scale)

    def backward(self, dout, q, k, v, lse, delta, owner: int):
        if self.empty[owner]:
            return None
        return self.backward_fn(dout, q, k, v, lse, delta, self.steps[owner], self.softmax_scale)


def sparse_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout, group=None,
                          config: VerticalSlashConfig = VerticalSlashConfig(),
                          softmax_scale: Optional[float] = None, check_inputs: bool = True,
                          return_pattern: bool = False, kernel_factory: Optional[Callable] = None,
                          hierarchical_groups: Optional[tuple] = None):
    """Causal attention restricted to the online-estimated vertical-slash pattern, over a CP group.

    Args:
        q: ``[b, s_local, hq, d]`` this rank's queries (position-encoded).
        k, v: ``[b, s_local, hkv, d]`` this rank's keys/values (GQA when ``hkv < hq``).
        layout: the CP layout of the shards; must keep ``config.block_size`` blocks whole (striped
            with granularity a multiple of the block size, or zigzag with chunks that are).
        group: the CP process group (``None``: one rank).
        config: estimator budgets (:class:`VerticalSlashConfig`).
        softmax_scale: defaults to ``1/sqrt(d)``.
        check_inputs: compare shapes/dtypes/layout/config across ranks first (one small all_gather).
        return_pattern: also return the estimated global :class:`VerticalSlashPattern`.
        kernel_factory: ``(steps, softmax_scale) -> step kernel``; default: on CUDA
            ``megatron_mtraining.ops.triton.make_sparse_step_kernel`` (Triton), else
            :class:`SparseStepKernel` with the torch reference.
        hierarchical_groups: ``(inner_group, outer_group)`` (Megatron's hierarchical CP groups, whose
            numbering gives this rank's index in ``group``): run the two-level ring of
            :mod:`megatron_mtraining.ring.hierarchical` instead of the flat ring. The pattern is still
            estimated over ``group``.

    Returns:
        ``out [b, s_local, hq, d]`` in ``q.dtype`` (and the pattern if ``return_pattern``).

    Raises:
        ValueError: inconsistent shapes/dtypes (locally or across ranks), ``layout.cp_size`` not the
            group size, or a layout that splits sparse blocks.
    """
    cp = check_ring_inputs(q, k, v, layout, group, "sparse_ring_attention", check_inputs,
                           budgets=(config.last_q, config.block_size, config.sink_tokens, config.local_blocks,
                                    config.max_vertical, config.max_slash, int(round(config.recall * 1_000_000))))
    check_block_layout(layout, q.shape[1] * cp, config.block_size)
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    pattern: VerticalSlashPattern = estimate_vertical_slash(q.detach(), k.detach(), layout=layout, group=group,
                                                            config=config, softmax_scale=scale)
    steps = convert_pattern(pattern, layout, group_rank(group))
    if kernel_factory is None and q.is_cuda:
        from ..ops.triton import make_sparse_step_kernel as kernel_factory   # Triton kernels on the GPU
    kernel = (kernel_factory or SparseStepKernel)(steps, scale)
    if hierarchical_groups is None:
        out = RingAttentionFunc.apply(q, k, v, kernel, group)
    else:
        from .hierarchical import hierarchical_ring_attention

        inner, outer = hierarchical_groups
        if group_rank(outer) * group_size(inner) + group_rank(inner) != group_rank(group):
            raise ValueError("hierarchical_groups must number ranks as outer_rank * inner_size + inner_rank "
                             "of the CP group (Megatron's --hierarchical-context-parallel-sizes order)")
        out = hierarchical_ring_attention(q, k, v, layout=layout, inner_group=inner, outer_group=outer,
                                          softmax_scale=scale, kernel=kernel)
    return (out, pattern) if return_pattern else out

"""Training-step timings of attention functions: forward and backward, with the one timer.

:func:`time_forward_backward` times what one attention call costs a training step: the forward and the
backward of a fixed random output gradient. :func:`compare_speed` times two such functions on the same
inputs (a sparse attention against the dense one it would replace) and gives the speedup.

The attention is any callable ``attention(q, k, v) -> out``; this module imports no attention code (a
caller passes, e.g., :meth:`megatron_mtraining.plan.CPPlan.attention` of a layer's plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .timer import DeviceLike, Timing, measure

__all__ = ["SpeedComparison", "time_forward_backward", "compare_speed"]

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def time_forward_backward(attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                          device: DeviceLike = None, warmup: int = 1, repeats: int = 3, seed: int = 0,
                          timer: Callable[..., Timing] = measure) -> Timing:
    """Time one training step of ``attention`` on ``q, k, v``: ``out = attention(q, k, v)``, then the
    gradients of ``q, k, v`` for a fixed random gradient of ``out`` (normal, from ``seed``, drawn once,
    in ``out``'s dtype), by :func:`torch.autograd.grad` (nothing accumulates between calls).

    ``q, k, v`` are detached copies that require gradients (the caller's tensors are untouched).
    ``timer`` is called as ``timer(step, device=..., warmup=..., repeats=...)`` (default :func:`measure`:
    CUDA events on a GPU, the wall clock elsewhere; the median of ``repeats`` samples after ``warmup``
    untimed calls, which absorb Triton compilation and plan caches); a test may pass a fake one.
    """
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    grad: list[Optional[torch.Tensor]] = [None]

    def step():
        out = attention(q, k, v)
        if grad[0] is None:
            gen = torch.Generator(device=out.device).manual_seed(seed)
            grad[0] = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
        return torch.autograd.grad(out, (q, k, v), grad[0])

    return timer(step, device=device, warmup=warmup, repeats=repeats)


@dataclass(frozen=True)
class SpeedComparison:
    """Two :func:`time_forward_backward` timings on the same inputs."""

    sparse: Timing
    dense: Timing

    @property
    def speedup(self) -> float:
        """Dense time / sparse time (> 1: the sparse attention is faster)."""
        return self.dense.median_ms / self.sparse.median_ms

    def to_dict(self) -> dict:
        """``sparse_ms``, ``dense_ms`` (medians), ``speedup``, ``repeats``, ``warmup``, ``clock``."""
        return {"sparse_ms": self.sparse.median_ms, "dense_ms": self.dense.median_ms, "speedup": self.speedup,
                "repeats": self.sparse.reps, "warmup": self.sparse.warmup, "clock": self.sparse.clock}


def compare_speed(sparse: Attention, dense: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  device: DeviceLike = None, warmup: int = 1, repeats: int = 3, seed: int = 0,
                  timer: Callable[..., Timing] = measure) -> SpeedComparison:
    """:func:`time_forward_backward` of ``sparse`` and then of ``dense`` on the same ``q, k, v`` and output
    gradient (same ``seed``)."""
    kw = dict(device=device, warmup=warmup, repeats=repeats, seed=seed, timer=timer)
    return SpeedComparison(sparse=time_forward_backward(sparse, q, k, v, **kw),
                           dense=time_forward_backward(dense, q, k, v, **kw))

"""Numerical conventions and platform checks shared by every layer (imports nothing from the package).

* :func:`acc_dtype`: the accumulation dtype of attention partials (fp64 for fp64 inputs, else fp32).
* :func:`default_softmax_scale`: ``1 / sqrt(head_dim)`` (scaled dot-product attention).
* :func:`triton_runs_on`: whether Triton kernels can run on a device (CUDA, or the CPU under
  Triton's interpreter, ``TRITON_INTERPRET=1`` set before ``triton`` is imported).
* :func:`free_local_port`: a free TCP port on 127.0.0.1 (the address of a one-process world).
* ``REGION_*``: the stable names of the :func:`torch.profiler.record_function` ranges that label the
  attention path (``tools/profile_step.py`` sums profiler time by them; a range costs next to
  nothing while no profiler runs).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from typing import Mapping

import torch
from torch.profiler import record_function

__all__ = ["acc_dtype", "default_softmax_scale", "TRITON_DTYPES", "triton_importable", "triton_runs_on",
           "record_function", "REGIONS", "REGION_ESTIMATOR_SCORES", "REGION_ESTIMATOR_SELECTION", "REGION_CONVERT",
           "REGION_PLAN", "REGION_ATTENTION_FWD", "REGION_ATTENTION_BWD", "REGION_COPIES", "REGION_LM_HEAD_LOSS",
           "REGION_OPTIMIZER", "REGION_INPUT_CHECK", "profiled", "first_order_only", "DOUBLE_BACKWARD_RULE",
           "softmax_scale_error", "check_softmax_scale", "resolve_softmax_scale", "plain_numbers",
           "free_local_port"]

# profiler ranges (record_function names) of one training iteration
REGION_INPUT_CHECK = "mtraining.input_check"                  # cross-rank input check (once per signature)
REGION_ESTIMATOR_SCORES = "mtraining.estimator.scores"        # probe softmax, column and diagonal scores
REGION_ESTIMATOR_SELECTION = "mtraining.estimator.selection"  # budgets, sorts, the selected lines
REGION_CONVERT = "mtraining.convert"                          # pattern -> per-step block / column lists
REGION_PLAN = "mtraining.plan"                                # kernel plans (forward, backward, column phase)
REGION_ATTENTION_FWD = "mtraining.attention.forward"          # attention kernels (ring steps, merges)
REGION_ATTENTION_BWD = "mtraining.attention.backward"
REGION_COPIES = "mtraining.copies"                            # q/k/v and output layout copies around attention
REGION_LM_HEAD_LOSS = "mtraining.lm_head_loss"                # output layer and cross entropy
REGION_OPTIMIZER = "mtraining.optimizer"                      # gradient reduction, optimizer step, zeroing
REGIONS = (REGION_INPUT_CHECK, REGION_ESTIMATOR_SCORES, REGION_ESTIMATOR_SELECTION, REGION_CONVERT, REGION_PLAN, REGION_ATTENTION_FWD,
           REGION_ATTENTION_BWD, REGION_COPIES, REGION_LM_HEAD_LOSS, REGION_OPTIMIZER)

# input dtypes the Triton kernels (attention, estimator, delta) take
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def profiled(name: str):
    """Decorator: run the function inside ``record_function(name)`` (a profiler range)."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return wrapper
    return deco


DOUBLE_BACKWARD_RULE = (
    "double backward (the gradient of a gradient, e.g. torch.autograd.grad(..., create_graph=True) followed by "
    "another backward through its result) is not supported: the attention backward kernels compute first-order "
    "gradients only and are not differentiable themselves; for higher-order gradients use an attention whose "
    "backward is differentiable (e.g. torch's math SDPA)")


class _DoubleBackwardError(torch.autograd.Function):
    """Passes gradients through unchanged; differentiating them raises ``RuntimeError(message)``.

    ``forward(ctx, message, n_anchors, *anchors_then_grads)``: the anchors (tensors of the graph the
    gradients came from, e.g. the saved q/k/v) only connect the outputs to that graph, so that a
    second backward towards q, k or v reaches this node (and its error) instead of reporting an
    unused input."""

    @staticmethod
    def forward(ctx, message, n_anchors, *tensors):
        ctx.message = message
        return tuple(t.detach() for t in tensors[n_anchors:])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def first_order_only(what: str, rule: str = DOUBLE_BACKWARD_RULE):
    """Decorator of an autograd ``backward``: the gradients it returns cannot be differentiated again.

    The backward runs under ``torch.no_grad()`` (as without ``create_graph``), so first-order
    gradients are the same with ``create_graph=True``; when grad mode is on (``create_graph=True``),
    the returned tensors come out of a node that raises ``RuntimeError`` naming ``what`` and ``rule``
    (default :data:`DOUBLE_BACKWARD_RULE`, the attention's) if a second backward reaches it (rather than a silently wrong second
    derivative, which differentiating the kernels' internals would give). Like PyTorch's
    ``once_differentiable``, connected to the inputs' graph and with a message that names the rule.
    """
    message = f"{what}: {rule}"

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(ctx, *args):
            with torch.no_grad():
                grads = fn(ctx, *args)
            if not torch.is_grad_enabled():
                return grads
            single = not isinstance(grads, tuple)
            grads = (grads,) if single else grads
            slots = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
            anchors = [t for t in tuple(args) + tuple(ctx.saved_tensors)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if not slots or not anchors:
                return grads[0] if single else grads
            guarded = _DoubleBackwardError.apply(message, len(anchors), *anchors, *(grads[i] for i in slots))
            out = list(grads)
            for i, g in zip(slots, guarded):
                out[i] = g
            return out[0] if single else tuple(out)
        return wrapper
    return deco


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: fp64 stays fp64, everything else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def plain_numbers(value):
    """``value`` with NumPy scalars (e.g. ``np.float32(0.9)``, ``np.int64(64)``) as Python numbers, inside
    mappings (returned as ``dict``) and lists / tuples too; everything else unchanged (the config
    fields' own rules then check it)."""
    if isinstance(value, Mapping):
        return {k: plain_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_numbers(v) for v in value)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def default_softmax_scale(head_dim: int) -> float:
    """The default attention logit scale ``1 / sqrt(head_dim)`` (NaN for a ``head_dim < 1``, which the
    entry points' input checks reject by name on every rank)."""
    return 1.0 / math.sqrt(head_dim) if head_dim >= 1 else float("nan")


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """``softmax_scale`` as a float, ``1/sqrt(head_dim)`` for ``None``.

    Raises:
        TypeError: not a number (a bool included). A NaN or infinite value is returned as it is:
            the entry points report it through :func:`softmax_scale_error` as part of every rank's
            verdict (so that every rank raises the same error)."""
    if softmax_scale is None:
        return default_softmax_scale(head_dim)
    if isinstance(softmax_scale, bool) or not (isinstance(softmax_scale, numbers.Real) or (
            isinstance(softmax_scale, torch.Tensor) and softmax_scale.numel() == 1)):
        raise TypeError(f"softmax_scale must be a number or None, got {softmax_scale!r}")
    return float(softmax_scale)


def softmax_scale_error(softmax_scale) -> "str | None":
    """Why the (resolved) ``softmax_scale`` cannot scale attention logits, or ``None``: a NaN or
    infinite scale turns every output into NaN."""
    if softmax_scale is not None and not math.isfinite(float(softmax_scale)):
        return f"softmax_scale must be a finite number (or None for 1/sqrt(head_dim)), got {float(softmax_scale)}"
    return None


def check_softmax_scale(softmax_scale, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` and the rule of :func:`softmax_scale_error`."""
    error = softmax_scale_error(softmax_scale)
    if error is not None:
        raise ValueError(f"{what}: {error}")


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when ``import triton`` succeeds (imported on the first call, not at module import)."""
    try:
        import triton  # noqa: F401
        return True
    except Exception:
        return False


def triton_runs_on(device) -> bool:
    """True when Triton kernels can run on ``device``: CUDA, or the CPU under ``TRITON_INTERPRET=1``."""
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        return False
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    return triton_importable()


def cuda_index(device) -> int:
    """The index of the CUDA ``device`` (a ``torch.device``, string or index); the current device for a bare
    ``"cuda"``."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT`` / a ``tcp://`` init
    method of a one-process world)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

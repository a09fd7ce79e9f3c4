"""Numerical conventions and platform checks shared by every layer (imports nothing from the package).

* :func:`acc_dtype`: the accumulation dtype of attention partials (fp64 for fp64 inputs, else fp32).
* :func:`default_softmax_scale`: ``1 / sqrt(head_dim)`` (scaled dot-product attention).
* :func:`triton_runs_on`: whether Triton kernels can run on a device (CUDA, or the CPU under
  Triton's interpreter, ``TRITON_INTERPRET=1`` set before ``triton`` is imported).
"""

from __future__ import annotations

import functools
import math
import os

import torch

__all__ = ["acc_dtype", "default_softmax_scale", "TRITON_DTYPES", "triton_importable", "triton_runs_on"]

# input dtypes the Triton kernels (attention, estimator, delta) take
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: fp64 stays fp64, everything else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_softmax_scale(head_dim: int) -> float:
    """The default attention logit scale ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)


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

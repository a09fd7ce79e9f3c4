"""Numerical conventions and platform checks shared by every layer (imports nothing from the package).

* :func:`acc_dtype`: the accumulation dtype of attention partials (fp64 for fp64 inputs, else fp32).
* :func:`default_softmax_scale`: ``1 / sqrt(head_dim)`` (scaled dot-product attention).
* :func:`triton_runs_on`: whether Triton kernels can run on a device (CUDA, or the CPU under
  Triton's interpreter, ``TRITON_INTERPRET=1`` set before ``triton`` is imported).
* ``REGION_*``: the stable names of the :func:`torch.profiler.record_function` ranges that label the
  attention path (``tools/profile_step.py`` sums profiler time by them; a range costs next to
  nothing while no profiler runs).
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch.profiler import record_function

__all__ = ["acc_dtype", "default_softmax_scale", "TRITON_DTYPES", "triton_importable", "triton_runs_on",
           "record_function", "REGIONS", "REGION_ESTIMATOR_SCORES", "REGION_ESTIMATOR_SELECTION", "REGION_CONVERT",
           "REGION_PLAN", "REGION_ATTENTION_FWD", "REGION_ATTENTION_BWD", "REGION_COPIES", "REGION_LM_HEAD_LOSS",
           "REGION_OPTIMIZER", "REGION_INPUT_CHECK", "profiled"]

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

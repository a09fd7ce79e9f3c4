"""Numerical and throughput faults of a training run, detected with the same verdict on every rank.

* :class:`NanGuard` (``--check-for-nan-in-loss-and-grad``, on by default; Megatron-LM's flag): a
  non-finite training loss, or a non-finite gradient after the DP x CP reduction, stops the run
  *before* the optimizer step with the iteration and the first offending parameter (model order).
  The loss is already identical on every rank (all-reduced); the gradient verdict is one
  all-reduce (MIN of the first bad ``(pipeline stage, parameter index)``) over the world, so every
  rank raises the same error and none waits in a collective. Parameters are named by global layer
  number (``decoder.layers.<L>``, as in the one-stage model) and the stage that holds them.
* :class:`ThroughputGuard`: a model TFLOP/s per GPU above the GPU's dense peak
  (:data:`PEAK_TFLOPS`) means the counted FLOPs were not computed, typically attention that ran
  without context parallelism. Skipped on CPU and on GPUs not in the table.

Both raise ``SystemExit`` with a message starting ``pretrain_gpt.py: error: iteration N:`` (exit
status 1).
"""

from __future__ import annotations

import math
import re
from typing import Optional

from .runtime import log0

__all__ = ["NanGuard", "ThroughputGuard", "PEAK_TFLOPS", "peak_tflops", "device_peak_tflops"]

# Dense tensor-core peaks, TFLOP/s per GPU: (bf16/fp16, tf32). Matched against
# torch.cuda.get_device_name(); the first match wins. Variants share the highest figure of the
# family (H100 PCIe is lower than SXM), so the table is an upper bound and never refuses a real run.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    (r"\bB200\b", 2250.0, 1100.0),
    (r"\bGB200\b", 2500.0, 1250.0),
    (r"\bGH200\b", 989.0, 494.5),
    (r"\bH200\b", 989.0, 494.5),
    (r"\bH100\b", 989.0, 494.5),
    (r"\bH800\b", 989.0, 494.5),
    (r"\bH20\b", 148.0, 74.0),
    (r"\bA100\b", 312.0, 156.0),
    (r"\bA800\b", 312.0, 156.0),
    (r"\bL40S\b", 362.0, 183.0),
)


def peak_tflops(device_name: str, dtype) -> Optional[float]:
    """Dense peak TFLOP/s of the GPU called ``device_name`` for matmuls in ``dtype``
    (``torch.bfloat16``/``torch.float16``: the 16-bit tensor-core peak; else the TF32 peak, an
    upper bound for fp32). ``None`` for a GPU not in :data:`PEAK_TFLOPS`."""
    import torch

    half = dtype in (torch.bfloat16, torch.float16)
    for pattern, p16, p32 in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return p16 if half else p32
    return None


def device_peak_tflops(device, dtype) -> tuple[Optional[float], str]:
    """``(peak TFLOP/s or None, device name)`` of this rank's ``device`` (``None`` on CPU)."""
    import torch

    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    return peak_tflops(name, dtype), name


def _clean(name: str) -> str:
    while name.startswith("module."):         # DDP / Float16Module wrappers
        name = name[len("module."):]
    return name


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_param_names(model) -> list:
    """``[(name, param)]`` of ``model`` (wrappers stripped) in model order, a transformer layer's
    parameters named by its *global* layer number: with pipeline parallelism megatron-core numbers
    a stage's layers from 0 in ``named_parameters`` while each ``TransformerLayer.layer_number``
    (1-based) counts from the first stage."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    layers = getattr(getattr(inner, "decoder", None), "layers", None)
    out = []
    for n, p in model.named_parameters():
        n = _clean(n)
        m = _LAYER.match(n)
        if m and layers is not None and hasattr(layers[int(m.group(1))], "layer_number"):
            n = f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}.{n[m.end():]}"
        out.append((n, p))
    return out


class NanGuard:
    """``--check-for-nan-in-loss-and-grad``: stop on a non-finite loss or gradient.

    Args:
        args: validated arguments (``check_for_nan_in_loss_and_grad``, ``fp16``, ``loss_scale``).
        model: the DDP-wrapped model (gradients in ``param.main_grad``).
        device: this rank's device.

    With ``--fp16`` and a dynamic loss scale an overflowing gradient is normal (the step is
    skipped and the scale lowered), so only the loss is checked there.
    """

    def __init__(self, args, model, device):
        self.enabled = bool(getattr(args, "check_for_nan_in_loss_and_grad", True))
        self.check_grads = self.enabled and not (args.fp16 and args.loss_scale is None)
        self.model, self.device = model, device
        self._params = [(n, p) for n, p in global_param_names(model) if p.requires_grad]

    def _grad(self, p):
        g = getattr(p, "main_grad", None)
        return g if g is not None else p.grad

    def _first_bad(self, values: bool) -> Optional[str]:
        """Quoted name of the first parameter (model order, agreed by every rank; with pipeline
        parallelism the stage follows the name) whose gradient
        (``values=False``) or value (``values=True``) has a NaN/Inf; ``None`` when all are finite.
        Collective: every rank must call it."""
        import torch
        import torch.distributed as dist

        from megatron.core import parallel_state as ps

        flags = []
        for _, p in self._params:
            t = p.detach() if values else self._grad(p)
            flags.append(torch.zeros((), dtype=torch.bool, device=self.device) if t is None
                         else torch.isfinite(t).all().logical_not().to(self.device))
        bad = torch.stack(flags) if flags else torch.zeros(0, dtype=torch.bool, device=self.device)
        idx = torch.nonzero(bad).flatten()
        # pipeline stages hold different parameters: order them by (stage, index), not by index alone
        stage = ps.get_pipeline_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
        none = torch.iinfo(torch.int64).max
        key = (stage << 32) + idx[0].item() if idx.numel() else none
        first = torch.tensor([key], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        k = int(first.item())
        if k == none:
            return None
        stages = ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
        mine = (self._params[k & 0xFFFFFFFF][0] if stage == k >> 32 else None)
        if stages > 1:          # only the stage that holds it knows its name (rare path: one more collective)
            names: list = [None] * dist.get_world_size()
            dist.all_gather_object(names, mine)
            mine = next(x for x in names if x is not None)
            return f"{mine!r} (pipeline stage {k >> 32})"
        return repr(mine)

    def after_backward(self, iteration: int, loss_sum, n_tokens) -> None:
        """Check the iteration's global loss (identical on every rank); on a non-finite loss name
        the first parameter with a non-finite gradient and value, then raise on every rank."""
        if not self.enabled:
            return
        loss = (loss_sum / n_tokens.clamp(min=1)).item()
        if math.isfinite(loss):
            return
        grad = self._first_bad(values=False)
        value = self._first_bad(values=True)
        where = (f"; first parameter with a non-finite gradient: {grad}" if grad else
                 "; every gradient is finite")
        where += f"; first parameter with a non-finite value: {value}" if value else ""
        raise SystemExit(f"pretrain_gpt.py: error: iteration {iteration}: the training loss is {loss}{where}. "
                         "The step was not applied; resume from the last checkpoint with a lower --lr or "
                         "other data (--no-check-for-nan-in-loss-and-grad turns this check off)")

    def after_grad_reduce(self, iteration: int) -> None:
        """Check every gradient after the DP x CP reduction (before the optimizer step); raise on
        every rank naming the first parameter (model order) with a NaN/Inf gradient."""
        if not self.check_grads:
            return
        name = self._first_bad(values=False)
        if name is not None:
            raise SystemExit(f"pretrain_gpt.py: error: iteration {iteration}: non-finite (NaN/Inf) gradient in "
                             f"parameter {name} (the first in model order); the loss was finite. The step was "
                             "not applied; resume from the last checkpoint with a lower --lr or --clip-grad "
                             "(--no-check-for-nan-in-loss-and-grad turns this check off)")


class ThroughputGuard:
    """Refuse a model TFLOP/s per GPU above the GPU's dense peak.

    Args:
        args: validated arguments (``world_size``).
        flops_iter: the FLOPs counted for one iteration. With a sparse attention pattern pass the
            FLOPs without attention (its real work is below the dense count, so the dense count can
            legitimately beat the peak).
        device: this rank's device.
        dtype: the parameters' dtype (picks the 16-bit or the TF32 peak).

    Construction is collective (one all-reduce: does any rank know its peak?); so is
    :meth:`check` while the guard is active, on every rank. Inactive on CPU and on unknown GPUs.
    """

    def __init__(self, args, flops_iter: float, device, dtype):
        import torch
        import torch.distributed as dist

        self.args, self.flops_iter, self.device = args, flops_iter, device
        peak, self.device_name = device_peak_tflops(device, dtype)
        self.dtype_name = "16-bit" if dtype in (torch.bfloat16, torch.float16) else "TF32"
        t = torch.tensor([-(peak if peak is not None else float("inf"))], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)      # the lowest known peak of any rank
        self.peak = None if t.item() == float("-inf") else -t.item()
        if self.peak is not None:
            log0(f" > throughput check: model TFLOP/s per GPU must stay below the {self.dtype_name} dense peak "
                 f"{self.peak:g} of {self.device_name}")

    def check(self, iteration: int, dt: float) -> None:
        """Raise on every rank when the iteration's model TFLOP/s per GPU (slowest rank's ``dt``
        seconds) exceeds the peak. Collective while active."""
        import torch
        import torch.distributed as dist

        if self.peak is None:
            return
        t = torch.tensor([dt], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        tflops = self.flops_iter / max(t.item(), 1e-12) / self.args.world_size / 1e12
        if tflops > self.peak:
            raise SystemExit(
                f"pretrain_gpt.py: error: iteration {iteration}: model throughput {tflops:.1f} TFLOP/s per GPU "
                f"is above the {self.dtype_name} dense peak {self.peak:g} TFLOP/s of {self.device_name}: the "
                "counted FLOPs were not all computed (typically attention ran without context parallelism, "
                "each rank attending to its own tokens only); refusing to go on")

"""The benchmark timer: median time of a callable, CUDA events on the GPU, wall clock on the CPU.

Semantics (every tool of the project times with :func:`measure`):

* **What one sample is.** One call of ``fn``. On a CUDA device: ``torch.cuda.synchronize`` (work
  queued before the call is not counted), a CUDA event recorded on the current stream, ``fn()``,
  a second event, ``torch.cuda.synchronize``; the sample is the events' elapsed time — the device
  time of everything ``fn`` queued on that stream, plus host gaps between its launches (the same
  measurement as ``triton.testing.do_bench``, without its L2 flush: training runs kernels back to
  back on warm caches). Elsewhere: ``time.perf_counter`` around ``fn()``.
* **Warm-up.** ``warmup`` calls before the first sample, not counted (compilation, autotuning,
  lazy module loads, allocator growth, plan caches). With ``long_call_ms``, warm-up stops after a
  call that took longer than that (a call that long has amortised its one-time costs).
* **Repetitions.** ``repeats`` samples, or, with ``budget_s``, as many as fit in about
  ``budget_s`` seconds judging by the first sample (which counts), clamped to
  ``[min_repeats, max_repeats]``.
* **Statistic.** The median of the samples (:attr:`Timing.median_ms`); all samples are kept.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

__all__ = ["Timing", "measure"]

DeviceLike = Union[torch.device, str, None]


@dataclass(frozen=True)
class Timing:
    """Samples of one :func:`measure` call, in milliseconds, and how they were taken."""

    samples_ms: Sequence[float]
    warmup: int             # warm-up calls that ran (not counted)
    clock: str              # "cuda_event" or "perf_counter"

    @property
    def reps(self) -> int:
        return len(self.samples_ms)

    @property
    def median_ms(self) -> float:
        return float(statistics.median(self.samples_ms))

    @property
    def median_s(self) -> float:
        return self.median_ms / 1e3

    @property
    def min_ms(self) -> float:
        return float(min(self.samples_ms))

    @property
    def max_ms(self) -> float:
        return float(max(self.samples_ms))

    def to_dict(self) -> dict:
        """``median_ms``, ``min_ms``, ``max_ms``, ``reps``, ``warmup``, ``clock`` (for result files)."""
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms, "reps": self.reps,
                "warmup": self.warmup, "clock": self.clock}


def _resolve(device: DeviceLike) -> torch.device:
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def _sampler(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        def once(fn):
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return float(start.elapsed_time(end))
    else:
        def once(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return once


def measure(fn: Callable[[], object], *, device: DeviceLike = None, warmup: int = 1, repeats: Optional[int] = None,
            budget_s: Optional[float] = None, min_repeats: int = 3, max_repeats: int = 50,
            long_call_ms: Optional[float] = None) -> Timing:
    """Time ``fn()`` (no arguments) as described in the module docstring.

    Args:
        fn: the work to time; its return value is ignored.
        device: where ``fn`` runs its work (``torch.device`` or string); CUDA devices are timed
            with events, anything else with the wall clock. Default: ``cuda`` when available.
        warmup: untimed calls first (``>= 0``).
        repeats: number of samples (``>= 1``); exclusive with ``budget_s``.
        budget_s: seconds of samples to aim for (``> 0``); the count is derived from the first
            sample and clamped to ``[min_repeats, max_repeats]``.
        long_call_ms: stop warming up after a warm-up call longer than this (milliseconds).

    Returns:
        A :class:`Timing` (median in :attr:`Timing.median_ms`).

    Raises:
        ValueError: neither or both of ``repeats`` and ``budget_s``, or a count/budget out of range.
    """
    if (repeats is None) == (budget_s is None):
        raise ValueError("measure: give exactly one of repeats (a count) and budget_s (seconds)")
    if warmup < 0:
        raise ValueError(f"measure: warmup must be >= 0, got {warmup}")
    if repeats is not None and repeats < 1:
        raise ValueError(f"measure: repeats must be >= 1, got {repeats}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"measure: budget_s must be > 0, got {budget_s}")
    if not 1 <= min_repeats <= max_repeats:
        raise ValueError(f"measure: need 1 <= min_repeats <= max_repeats, got {min_repeats}, {max_repeats}")
    dev = _resolve(device)
    once = _sampler(dev)
    done = 0
    for _ in range(warmup):
        t = once(fn)
        done += 1
        if long_call_ms is not None and t > long_call_ms:
            break
    samples = [once(fn)]
    n = repeats if repeats is not None else int(max(min_repeats, min(max_repeats,
                                                                     budget_s * 1e3 / max(samples[0], 1e-3))))
    samples += [once(fn) for _ in range(n - 1)]
    return Timing(tuple(samples), done, "cuda_event" if dev.type == "cuda" else "perf_counter")

"""The online estimate and the index conversion at CP=1 replayed from a CUDA graph (experimental, opt-in).

At 64K-128K tokens the GPU work of :func:`~megatron_mtraining.patterns.estimator.estimate_vertical_slash`
+ :func:`~megatron_mtraining.patterns.convert.convert_pattern` is 1-4 ms, but run eagerly they cost
4-8 ms: about 130 small torch ops launched one by one and two host syncs (docs/benchmarks.md, "Pattern
estimation after the selection/conversion rewrite"). With ``static_widths=True`` both run without a host
sync and with shapes fixed by the inputs' shapes and the config, so the whole sequence can be captured
once per shape and replayed: one launch.

Per ``(shapes, dtypes, device, layout, config, softmax_scale, score implementation)`` the first call copies
the inputs into static buffers, runs the estimate once eagerly on a side stream (Triton compilation,
allocator warm-up), captures it and replays it. Later calls copy the probe queries (``[b, last_q, hq, d]``)
and ``k`` into the buffers, replay, and clone the outputs (the next replay overwrites them). The result is
the eager ``static_widths=True`` result: the same selection as the default path, with index lists padded
with -1 to the static widths (tests/test_static_widths.py). The graph's private memory pool keeps the
intermediates allocated: at 128K tokens with 16 query heads, several hundred MB per shape; at most
:data:`MAX_GRAPHS` shapes are kept (least recently used dropped).

Off CUDA the same function runs eagerly (what the CPU tests exercise). CP > 1 is not supported here:
the estimate's collectives would have to be captured too.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import List, Optional, Tuple

import torch

from ..layout import Layout
from .convert import check_block_layout, convert_pattern
from .estimator import (
    VerticalSlashConfig, VerticalSlashPattern, _estimate_from_probe, _gather_probe_queries, resolve_impl,
)
from .indices import StepIndices

MAX_GRAPHS = 4

_PATTERN_FIELDS = ("slash", "slash_count", "vertical", "vertical_count", "est_slash_mass", "est_vertical_mass")
_STEP_FIELDS = ("block_count", "block_index", "column_count", "column_index")


def _cloned(pattern: VerticalSlashPattern, steps: List[StepIndices]):
    pat = dataclasses.replace(pattern, **{f: getattr(pattern, f).clone() for f in _PATTERN_FIELDS
                                          if getattr(pattern, f) is not None})
    return pat, [dataclasses.replace(st, known_max=None, **{f: getattr(st, f).clone() for f in _STEP_FIELDS})
                 for st in steps]


class _Captured:
    """One captured estimate + conversion (see the module docstring)."""

    def __init__(self, probe: torch.Tensor, k: torch.Tensor, layout: Layout, config: VerticalSlashConfig,
                 scale: float, fused: bool):
        dev = k.device
        S = k.shape[1]
        self.probe = probe.detach().clone()
        self.k = k.detach().clone()
        self.k_pos = layout.positions(0, S, device=dev)

        def run():
            pat = _estimate_from_probe(self.probe, self.k, self.k_pos, layout=layout, group=None, rank=0, cp=1,
                                       S=S, config=config, scale=scale, fused=fused, static_widths=True)
            return pat, convert_pattern(pat, layout, 0, static_widths=True)

        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            run()                                   # warm-up: Triton compilation, allocator
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = run()

    def __call__(self, probe: torch.Tensor, k: torch.Tensor):
        self.probe.copy_(probe)
        self.k.copy_(k)
        self.graph.replay()
        return _cloned(*self.out)


_GRAPHS: "OrderedDict[tuple, _Captured]" = OrderedDict()


def estimate_and_convert_graphed(q: torch.Tensor, k: torch.Tensor, *, layout: Layout,
                                 config: VerticalSlashConfig = VerticalSlashConfig(),
                                 softmax_scale: Optional[float] = None, impl: str = "auto",
                                 use_graph: Optional[bool] = None) -> Tuple[VerticalSlashPattern, List[StepIndices]]:
    """``(pattern, steps)`` of :func:`estimate_vertical_slash` + :func:`convert_pattern` at CP=1, both with
    ``static_widths=True``, replayed from a cached CUDA graph (MTraining §3.2's online estimate; see the
    module docstring).

    Args:
        q: ``[b, S, hq, d]`` queries (position-encoded); k: ``[b, S, hkv, d]`` keys.
        layout: a CP layout with ``cp_size == 1``; config, softmax_scale, impl: as for
            :func:`~megatron_mtraining.patterns.estimator.estimate_vertical_slash`.
        use_graph: capture/replay a CUDA graph (default: when ``q`` is on CUDA); ``False`` runs the same
            computation eagerly.

    Returns:
        the :class:`VerticalSlashPattern` and the one-element list of :class:`StepIndices` (queries
        against their own keys), as the eager ``static_widths=True`` calls would return them.

    Raises:
        ValueError: ``layout.cp_size != 1``, the input errors of ``estimate_vertical_slash``, a layout
            that splits sparse blocks; ``use_graph=True`` off CUDA.
    """
    from .estimator import default_softmax_scale, estimate_vertical_slash

    if layout.cp_size != 1:
        raise ValueError(f"estimate_and_convert_graphed supports CP=1 only, got layout.cp_size={layout.cp_size}")
    use_graph = q.is_cuda if use_graph is None else bool(use_graph)
    if use_graph and not (q.is_cuda and k.is_cuda):
        raise ValueError("use_graph=True needs CUDA tensors")
    if not use_graph:
        pat = estimate_vertical_slash(q, k, layout=layout, group=None, config=config, softmax_scale=softmax_scale,
                                      impl=impl, static_widths=True)
        check_block_layout(layout, pat.seq_len, pat.block_size)
        return pat, convert_pattern(pat, layout, 0, static_widths=True)
    # argument checks of the eager path, without running it
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q [b, s, hq, d] and k [b, s, hkv, d] expected, got {tuple(q.shape)}, {tuple(k.shape)}")
    b, S, hq, d = q.shape
    if hq % k.shape[2]:
        raise ValueError(f"GQA needs num query heads ({hq}) divisible by num kv heads ({k.shape[2]})")
    layout.check_seq_len(S)
    if S % config.block_size:
        raise ValueError(f"sequence length {S} must be a multiple of VerticalSlashConfig.block_size={config.block_size}")
    if config.last_q > S:
        raise ValueError(f"VerticalSlashConfig.last_q={config.last_q} exceeds the sequence length {S}")
    check_block_layout(layout, S, config.block_size)
    fused = resolve_impl(impl, q, k) == "triton"
    scale = default_softmax_scale(d) if softmax_scale is None else float(softmax_scale)
    probe = _gather_probe_queries(q.detach(), layout, None, 0, 1, S, config.last_q)
    key = (tuple(q.shape), tuple(k.shape), q.dtype, k.dtype, str(q.device), repr(layout), config, scale, fused)
    cap = _GRAPHS.get(key)
    if cap is None:
        cap = _Captured(probe, k, layout, config, scale, fused)
        _GRAPHS[key] = cap
        while len(_GRAPHS) > MAX_GRAPHS:
            _GRAPHS.popitem(last=False)
    else:
        _GRAPHS.move_to_end(key)
    return cap(probe, k.detach())

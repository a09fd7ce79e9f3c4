#!/usr/bin/env python3
"""One layer's attention as training runs it, forward and backward: time, host time, GPU time by region.

For every sequence length and mode, on one layer's q/k/v (``[1, S, heads, head_dim]``):

* ``sparse``: :meth:`~megatron_mtraining.plan.CPPlan.attention` of the config's layer (estimation, index
  conversion, kernel plans, sparse kernels; MTraining §3.2-3.3);
* ``graphs``: the same through the layer's CUDA graphs (the config with ``cuda_graphs: true``,
  :meth:`~megatron_mtraining.plan.CPPlan.attention_runner`; CUDA only);
* ``dense``: the same config with the layer in ``dense_layers`` (the dense attention its ``kernel_backend``
  picks: FlashAttention-4 where installed on Hopper/Blackwell, else SDPA or Triton; the torch reference on the CPU).

Per row: ``median_ms`` (:func:`~megatron_mtraining.bench.time_forward_backward`: CUDA events on a GPU, the
wall clock elsewhere), ``host_ms`` (wall clock per call of calls issued without waiting for the device: the
host's own work), ``region_ms`` (device time per call by profiler region, ``torch.profiler`` summed by
:func:`~megatron_mtraining.bench.profile.region_rows`; a kernel is charged to the op that launched it, the
attention kernels' launches land in ``other``), ``ops`` (profiled ops per call) and ``peak_gb`` (CUDA).

Inputs (``--inputs``): ``random`` (normal q/k/v with a strong 64-token sink: the estimator keeps up to the
config's caps) or ``structured`` (:func:`~megatron_mtraining.bench.inputs.structured_qkv`: local attention
under RoPE plus a few strong columns, so the patterns are sparser). A trained model's own q/k/v: ``tools/pattern_recall.py --policy-min-speedup``.

    python tools/bench_layer.py --seq-lengths 32768,131072 --heads 9 --kv-heads 3 --head-dim 64 \\
        --mtraining-config configs/long_context_r098.yaml --inputs structured --json layer.json
    python tools/bench_layer.py --seq-lengths 512 --heads 2 --kv-heads 1 --head-dim 16 --modes sparse,dense \\
        --mtraining-config configs/demo_sparse.yaml --repeats 1          # CPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from megatron_mtraining.bench.cli import int_list, nonnegative_int, positive_int

MODES = ("sparse", "graphs", "dense")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lengths", type=int_list(), default="32768",
                   help="comma-separated sequence lengths (multiples of 64 for the Triton kernels)")
    p.add_argument("--heads", type=positive_int, default=9)
    p.add_argument("--kv-heads", type=positive_int, default=3)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--mtraining-config", required=True, help="a YAML config with pattern: vertical_slash")
    p.add_argument("--modes", default="sparse,graphs,dense", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--inputs", choices=("random", "structured"), default="structured")
    p.add_argument("--device", default=None, help="e.g. cpu, cuda, cuda:1 (default: cuda when available, else cpu)")
    p.add_argument("--warmup", type=nonnegative_int, default=3)
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write a result record here")
    return p


def layer_inputs(s: int, heads: int, kv_heads: int, head_dim: int, kind: str, device, dtype, seed: int = 0):
    """``q [1, s, heads, d]``, ``k, v [1, s, kv_heads, d]`` of kind ``random`` or ``structured`` (see the module
    docstring), in ``dtype`` on ``device``."""
    import torch

    from megatron_mtraining.bench.inputs import structured_qkv

    if kind == "structured":
        return tuple(t.to(device=device, dtype=dtype) for t in structured_qkv(s, heads, kv_heads, head_dim, "cpu", seed))
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda h: torch.randn(1, s, h, head_dim, generator=g)  # noqa: E731
    q, k, v = mk(heads), mk(kv_heads), mk(kv_heads)
    k[:, :64] *= 3
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _host_ms(fn, q, k, v, calls: int = 5) -> float:
    """Wall-clock ms per call of ``calls`` fwd+bwd calls issued without waiting for the device."""
    import torch

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    gout = torch.randn_like(q)
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    t0 = time.perf_counter()
    for _ in range(calls):
        torch.autograd.grad(fn(q, k, v), (q, k, v), gout)
    dt = time.perf_counter() - t0
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    return dt / calls * 1e3


def _regions(fn, q, k, v, calls: int = 3):
    """``({region: device ms per call}, ops per call)`` of ``calls`` profiled fwd+bwd calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron_mtraining.bench.profile import region_rows

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    gout = torch.randn_like(q)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if q.is_cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            torch.autograd.grad(fn(q, k, v), (q, k, v), gout)
        if q.is_cuda:
            torch.cuda.synchronize(q.device)
    by_region, ops = {}, 0.0
    for r in region_rows(prof.events(), iterations=calls):
        by_region[r["region"]] = by_region.get(r["region"], 0.0) + r["device_ms"]
        ops += r["events"]
    return {k_: round(v_, 4) for k_, v_ in sorted(by_region.items(), key=lambda kv: -kv[1]) if v_ > 0}, ops


def bench_mode(mode: str, cfg, q, k, v, *, warmup: int, repeats: int) -> dict:
    """One row: ``mode`` (of :data:`MODES`) of config ``cfg`` (an :class:`~megatron_mtraining.config.MTrainingConfig`
    with the sparse pattern) on ``q, k, v``."""
    import torch

    from megatron_mtraining.bench import time_forward_backward
    from megatron_mtraining.plan import resolve

    if mode == "dense":
        cfg = cfg.with_dense_layers([1])
    elif mode == "graphs":
        cfg = dataclasses.replace(cfg, cuda_graphs=True)
    plan = resolve(cfg, cp_group=None, seq_len=q.shape[1]).for_layer(1)
    run = plan.fixed_attention_runner()
    scale = q.shape[-1] ** -0.5
    fn = lambda a, b, c: run(a, b, c, softmax_scale=scale)  # noqa: E731
    cuda = q.is_cuda
    if cuda:
        torch.cuda.synchronize(q.device)
        torch.cuda.reset_peak_memory_stats(q.device)
        base = torch.cuda.memory_allocated(q.device)
    t = time_forward_backward(fn, q, k, v, device=q.device, warmup=warmup, repeats=repeats)
    row = dict(seq=q.shape[1], mode=mode, kernels=plan.kernel_text(q), median_ms=round(t.median_ms, 4),
               host_ms=round(_host_ms(fn, q, k, v), 4))
    row["peak_gb"] = round((torch.cuda.max_memory_allocated(q.device) - base) / 2 ** 30, 4) if cuda else None
    row["region_ms"], row["ops"] = _regions(fn, q, k, v)
    return row


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.heads % a.kv_heads:
        parser.error(f"--heads {a.heads} must be a multiple of --kv-heads {a.kv_heads} (GQA)")
    import torch

    if a.device is not None:
        from megatron_mtraining.bench.cli import checked_device

        checked_device(parser, a.device)

    from megatron_mtraining.bench import result_record, write_json
    from megatron_mtraining.bench.cli import check_seq_len
    from megatron_mtraining.config import load_mtraining_config

    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown {', '.join(bad)} (choose from {', '.join(MODES)})")
    try:
        cfg = load_mtraining_config(a.mtraining_config)
    except (OSError, ValueError) as e:
        parser.error(f"--mtraining-config: {e}")
    if not cfg.sparse:
        raise SystemExit(f"--mtraining-config {a.mtraining_config}: needs pattern: vertical_slash")
    layout = cfg.make_layout(1)
    for s in a.seq_lengths:
        check_seq_len(parser, "--seq-lengths", layout, s)
        if a.inputs == "structured" and s <= 64:
            parser.error(f"--seq-lengths: {s} must be > 64 with --inputs structured (64 sink tokens come first)")
    if a.inputs == "structured" and a.head_dim % 4:
        parser.error(f"--head-dim must be a multiple of 4 with --inputs structured, got {a.head_dim}")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and "graphs" in modes:
        print("graphs: needs CUDA, skipped", file=sys.stderr)
        modes = [m for m in modes if m != "graphs"]
    if not modes:
        parser.error(f"--modes {a.modes!r}: no mode left to run on {device.type} (choose from {', '.join(MODES)})")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for s in a.seq_lengths:
        q, k, v = layer_inputs(s, a.heads, a.kv_heads, a.head_dim, a.inputs, device, dtype, a.seed)
        for mode in modes:
            row = bench_mode(mode, cfg, q, k, v, warmup=a.warmup, repeats=a.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        write_json(a.json, result_record(dict(config=cfg.to_dict(), inputs=a.inputs, heads=a.heads,
                                              kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=str(dtype), rows=rows),
                                         device=device))
    return 0


if __name__ == "__main__":
    sys.exit(main())

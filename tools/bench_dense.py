#!/usr/bin/env python
"""Benchmark dense attention kernels on one GPU: CP=1 dense attention and one dense ring step.

    python tools/bench_dense.py --json out.json --seqs 32768,131072 --head-dims 128,64

Rows (bf16, batch 1; d=128: 16 query / 2 KV heads, d=64: 9 / 3 heads), all in one process:

* ``cudnn``: ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on cuDNN, CP=1;
* ``fa4``: FlashAttention-4 dense causal (:func:`megatron_mtraining.ops.fa4.fa4_attention`), CP=1;
* ``ring_step_triton`` / ``ring_step_fa4``: one step of the striped dense ring (granularity 128,
  ``--cp`` ranks, local length ``seq / cp``) with ``owner < rank`` (block-causal, diagonal tiles
  visible), forward + backward with the step's own LSE, through the Triton position-mask step
  kernel and the FA4 step kernel.

TFLOP/s count the visible (query, key) pairs: ``fwd = 4 * d * hq * pairs``, fwd+bwd = 3.5 × fwd.
``speedup_vs_cudnn`` compares equal work per FLOP (rate ratio) for ring steps, time ratio for CP=1.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from megatron_mtraining.bench import measure, result_record, write_json
from megatron_mtraining.bench.cli import int_list, positive_float, positive_int
from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.fa4 import FA4DenseStepKernel, fa4_attention
from megatron_mtraining.ring import begin_backward

SHAPES = {128: (16, 2), 64: (9, 3)}


def _inputs(s, hq, hkv, d, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda h: torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16, generator=g)
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _time_fwd_bwd(fwd, bwd, budget):
    t_f = measure(fwd, budget_s=budget, warmup=2, long_call_ms=1000).median_ms
    t_fb = measure(lambda: bwd(fwd()), budget_s=budget, warmup=2, long_call_ms=1000).median_ms
    return t_f, t_fb


def cp1_rows(s, d, budget):
    hq, hkv = SHAPES[d]
    q, k, v, do = _inputs(s, hq, hkv, d, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    pairs = s * (s + 1) // 2
    flops = 4 * d * hq * pairs
    rows = []

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, enable_gqa=True)
    impls = {"cudnn": sdpa, "fa4": lambda: fa4_attention(q, k, v, softmax_scale=d ** -0.5, causal=True)}
    for name, fn in impls.items():
        def bwd(o):
            torch.autograd.grad(o, (q, k, v), do.transpose(1, 2) if name == "cudnn" else do)
        with torch.no_grad():
            t_f = measure(fn, budget_s=budget, warmup=2, long_call_ms=1000).median_ms
        t_fb = measure(lambda: bwd(fn()), budget_s=budget, warmup=2, long_call_ms=1000).median_ms
        rows.append({"impl": name, "kind": "cp1_dense", "seq": s, "head_dim": d, "heads": hq, "kv_heads": hkv,
                     "sparsity": None, "fwd_ms": t_f, "fwd_bwd_ms": t_fb,
                     "tflops_computed": 3.5 * flops / t_fb / 1e9})
    for r in rows:
        r["speedup_vs_cudnn"] = rows[0]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return rows


def ring_step_rows(s, d, cp, budget, cudnn_tflops):
    from megatron_mtraining.ops.dense_gpu import DenseGpuStepKernel
    hq, hkv = SHAPES[d]
    lay, rank, owner = Layout("striped", cp_size=cp, granularity=128), cp - 1, 0
    q, k, v, do = _inputs(s // cp, hq, hkv, d, "cuda")
    scale = d ** -0.5
    tri = DenseGpuStepKernel(lay, rank, s, scale, True, device=q.device)
    fa4 = FA4DenseStepKernel(tri.q_pos, tri.k_pos, scale, True, fallback=tri)
    pairs = int((tri.k_pos(owner)[None, :] <= tri.q_pos[:, None]).sum())
    flops = 4 * d * hq * pairs
    rows = []
    for name, kern in (("ring_step_triton", tri), ("ring_step_fa4", fa4)):
        def fwd():
            return kern.forward(q, k, v, owner)

        def bwd(res):
            out = res[0].to(q.dtype)
            delta = (do.float() * out.float()).sum(-1).transpose(1, 2)
            begin_backward(kern, out)
            kern.backward(do, q, k, v, res[1], delta, owner)
        t_f, t_fb = _time_fwd_bwd(fwd, bwd, budget)
        tf = 3.5 * flops / t_fb / 1e9
        rows.append({"impl": name, "kind": f"ring_step_striped128_cp{cp}", "seq": s, "head_dim": d, "heads": hq,
                     "kv_heads": hkv, "sparsity": None, "fwd_ms": t_f, "fwd_bwd_ms": t_fb, "tflops_computed": tf,
                     "speedup_vs_cudnn": tf / cudnn_tflops, "fa4_fallback_steps": getattr(kern, "fallback_steps", 0)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int_list(64), default="32768,131072")
    ap.add_argument("--head-dims", type=int_list(), default="128,64")
    ap.add_argument("--cp", type=positive_int, default=4, help="ring size of the ring-step rows")
    ap.add_argument("--budget", type=positive_float, default=1.0, help="seconds of samples per timing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("times GPU kernels: needs a CUDA device")
    rows = []
    for d in args.head_dims:
        for s in args.seqs:
            cp1 = cp1_rows(s, d, args.budget)
            rows += cp1
            rows += ring_step_rows(s, d, args.cp, args.budget, cp1[0]["tflops_computed"])
            torch.cuda.empty_cache()
    print("| impl | kind | seq | d | fwd ms | fwd+bwd ms | TFLOP/s | x cuDNN |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['impl']} | {r['kind']} | {r['seq']} | {r['head_dim']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} "
              f"| {r['tflops_computed']:.0f} | {r['speedup_vs_cudnn']:.2f} |")
    if args.json:
        write_json(args.json, result_record({"rows": rows}))


if __name__ == "__main__":
    main()

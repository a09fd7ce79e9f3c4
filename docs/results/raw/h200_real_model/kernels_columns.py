"""The Triton sparse kernels' fwd+bwd on synthetic vertical-slash patterns: the deterministic mode, the fast mode
with the columns' dK/dV by atomics in the dQ kernel (KernelConfig.col_atomic_fast=True), and the fast mode with
the column kernel (col_atomic_fast=False). One GPU, bf16, batch 1, the SmolLM2-135M (9/3 x 64) and
Qwen2.5-3B (16/2 x 128) attention shapes, 32K to 128K, 80 % and 95 % sparsity.

    python docs/results/raw/h200_real_model/kernels_columns.py     # -> $OUT/kernels_columns.json
"""
import json
import os
from dataclasses import replace

import torch

from megatron_mtraining.bench import measure
from megatron_mtraining.ops.triton import launch, make_sparse_step_kernel
from megatron_mtraining.ops.triton.launch import DEFAULT_CONFIG
from megatron_mtraining.patterns.synthetic import vertical_slash_indices


def fwd_bwd(kern, q, k, v, dout):
    out, lse = kern.forward(q, k, v, 0)
    delta = launch.attention_delta(dout, out.to(q.dtype))
    return kern.backward(dout, q, k, v, lse, delta, 0)


rows = []
dev = torch.device("cuda")
for s in (32768, 65536, 131072):
    for hq, hkv, d in ((9, 3, 64), (16, 2, 128)):
        for sp in (0.8, 0.95):
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v, do = (torch.randn(1, s, h, d, device=dev, generator=g).bfloat16() for h in (hq, hkv, hkv, hq))
            idx, st = vertical_slash_indices(s, hq, sp, seed=0, device=dev)
            r = dict(seq=s, hq=hq, d=d, sparsity=sp)
            for name, det, cfg in (("det", True, None),
                                   ("fast", False, replace(DEFAULT_CONFIG, col_atomic_fast=True)),
                                   ("fast_nocolatomic", False, replace(DEFAULT_CONFIG, col_atomic_fast=False))):
                kern = make_sparse_step_kernel([idx], d ** -0.5, deterministic=det, config=cfg)
                kern.expect_backward = True
                r[name] = measure(lambda: fwd_bwd(kern, q, k, v, do), budget_s=0.5, warmup=2, max_repeats=15).median_ms
            print(json.dumps(r), flush=True)
            rows.append(r)
            json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "kernels_columns.json"), "w"), indent=1)

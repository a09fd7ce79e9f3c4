"""The column plan's kernels (_col_present, _col_union, _col_bits) at other launch shapes, on the estimator's
pattern of structured synthetic q/k (SmolLM2-135M attention shape, configs/long_context_r098.yaml), alone on the
GPU: CUDA-event median of the whole column plan and profiler device time per kernel; every variant's plan is
compared with the default's bit for bit.

    PYTHONPATH=. python docs/results/raw/selection_phases/colplan.py
"""
import json, os, tempfile
import torch
from torch.profiler import ProfilerActivity, profile
import megatron_mtraining.ops.triton.launch as L
from megatron_mtraining.bench import structured_qkv
from megatron_mtraining.config import load_mtraining_config
from megatron_mtraining.patterns.convert import convert_pattern
from megatron_mtraining.patterns.estimator import estimate_vertical_slash
from megatron_mtraining.ops.triton import plan_for

_orig = L._kernels
VAR = {}


class _Launch:
    def __init__(self, fn, name):
        self.fn, self.name = fn, name

    def __getitem__(self, grid):
        def call(*a, **kw):
            kw.update(VAR.get(self.name, {}))
            return self.fn[grid](*a, **kw)
        return call


class _Proxy:
    def __init__(self, k):
        self.k = k

    def __getattr__(self, n):
        f = getattr(self.k, n)
        return _Launch(f, n) if n in ("_col_bits_kernel", "_col_present_kernel", "_col_union_kernel") else f


L._kernels = lambda: _Proxy(_orig())
VARIANTS = {
    "default": {},
    "bits_j128_w4": {"_col_bits_kernel": dict(BLOCK_J=128, num_warps=4, SPAN=4)},
    "bits_j256_w4": {"_col_bits_kernel": dict(BLOCK_J=256, num_warps=4, SPAN=8)},
    "bits_j64_w1": {"_col_bits_kernel": dict(BLOCK_J=64, num_warps=1)},
    "bits_j128_w2_s8": {"_col_bits_kernel": dict(BLOCK_J=128, num_warps=2, SPAN=8)},
    "present_j256_w4": {"_col_present_kernel": dict(BLOCK_J=256, num_warps=4)},
    "present_j128_w2": {"_col_present_kernel": dict(BLOCK_J=128, num_warps=2)},
    "union_w16": {"_col_union_kernel": dict(num_warps=16)},
}
dev = torch.device("cuda")
for seq in (32768, 131072):
    cfg = load_mtraining_config("configs/long_context_r098.yaml")
    layout, vs = cfg.make_layout(1), cfg.vertical_slash
    q, k, v = structured_qkv(seq, 9, 3, 64, dev, seed=seq)
    with torch.no_grad():
        pat = estimate_vertical_slash(q, k, layout=layout, group=None, config=vs, softmax_scale=0.125, impl="triton")
        st = convert_pattern(pat, layout, 0)[0]
    plan = plan_for(st)
    ref = None
    for name, var in VARIANTS.items():
        VAR.clear(); VAR.update(var)

        def build():
            plan._col.clear()
            return L._col_plan(plan, seq, 1, 9)
        got = build()
        torch.cuda.synchronize()
        flat = [t for t in got if isinstance(t, torch.Tensor)]
        if ref is None:
            ref = [t.clone() for t in flat]
        same = all(torch.equal(a, b) for a, b in zip(ref, flat)) and len(ref) == len(flat)
        for _ in range(3):
            build()
        torch.cuda.synchronize()
        ts = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); build(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        ts.sort()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                build()
            torch.cuda.synchronize()
        ker = {e.key: round(e.device_time_total / 5, 1) for e in prof.key_averages() if e.key.startswith("_col")}
        print(json.dumps(dict(seq=seq, variant=name, same_plan=same, wall_us=round(ts[15] * 1e3, 1), kernels_us=ker,
                              max_cols=int(st.column_count.max()))), flush=True)

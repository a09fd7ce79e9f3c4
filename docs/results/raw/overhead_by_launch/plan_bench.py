# run from a tree root: python3 planbench.py TAG
import json, math, sys, dataclasses, tempfile, os
import torch
from torch.profiler import ProfilerActivity, profile
from megatron_mtraining.bench import structured_qkv
from megatron_mtraining.config import load_mtraining_config
from megatron_mtraining.patterns.convert import convert_pattern
from megatron_mtraining.patterns.estimator import estimate_vertical_slash
from megatron_mtraining.ops.triton import plan_for
from megatron_mtraining.ops.triton.launch import prebuild_backward_plans, _kv_csr, _col_plan
tag = sys.argv[1]
dev = torch.device("cuda")
out = {}
for seq in (32768, 131072):
    cfg = load_mtraining_config("configs/long_context_r098.yaml")
    layout, vs = cfg.make_layout(1), cfg.vertical_slash
    q, k, v = structured_qkv(seq, 9, 3, 64, dev, seed=seq)
    with torch.no_grad():
        pat = estimate_vertical_slash(q, k, layout=layout, group=None, config=vs, softmax_scale=0.125, impl="triton")
        steps = convert_pattern(pat, layout, 0)
    st = steps[0]
    def plans():
        plan = plan_for(st)
        _kv_csr(plan.kv_source, seq // 64, 9, 3)
        if plan.has_columns:
            _col_plan(plan, seq, 1, 9)
        return plan
    for _ in range(3): plans()
    torch.cuda.synchronize()
    ts = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); plans(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5): plans()
        torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".json"); prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]; os.remove(path)
    ker = {}
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"):
            ker[e["name"]] = ker.get(e["name"], 0.0) + e["dur"] / 5
    tot = sum(ker.values())
    print(f"{tag} seq {seq}: plans wall median {ts[15]*1e3:.1f} us; kernel sum {tot:.1f} us in {len(ker)} kernels; "
          f"cols {int(st.column_count.max())} blocks {int(st.block_count.max())}")
    for n, t in sorted(ker.items(), key=lambda kv: -kv[1])[:8]:
        print(f"   {t:7.1f} {n[:90]}")
    out[seq] = dict(wall_us=ts[15] * 1e3, kernel_us=tot, kernels=ker)
    import megatron_mtraining.patterns.triton.convert as TC
    def tconv():
        with torch.no_grad():
            convert_pattern(pat, layout, 0)
    chunks = [TC.CHUNK] + ([256, 512] if tag == "new" else [])
    c0 = TC.CHUNK
    for ch in chunks:
        TC.CHUNK = ch
        for _ in range(3): tconv()
        torch.cuda.synchronize(); ts = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); tconv(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        ts.sort()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5): tconv()
            torch.cuda.synchronize()
        kt = sum(e.device_time_total for e in prof.key_averages() if "convert_rows" in e.key) / 5
        print(f"{tag} seq {seq}: convert CHUNK {ch}: wall median {ts[15]*1e3:.1f} us, _convert_rows {kt:.1f} us")
        out[seq][f"convert_{ch}"] = dict(wall_us=ts[15] * 1e3, kernel_us=kt)
    TC.CHUNK = c0
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"planbench_{tag}.json"), "w"))

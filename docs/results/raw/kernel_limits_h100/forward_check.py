"""Forward variants (forward_variants.py): fp64 check at 4K (slash blocks + token columns, GQA) and timing at
128K, 95 % (whole pattern, and slash blocks alone), one variant per process. FV_DEV=cpu: the check at 512 tokens
under TRITON_INTERPRET=1 (fp16)."""
import json, math, os, sys
import torch
from megatron_mtraining.ops.triton.launch import plan_from_indices, sparse_forward
from megatron_mtraining.patterns.synthetic import vertical_slash_indices
DEV = os.environ.get("FV_DEV", "cuda")

def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

def mk(S, hq, hkv, d, sp, seed=0):
    ind, st = vertical_slash_indices(S, hq, sp, device=DEV)
    plan = plan_from_indices(ind.block_count, ind.block_index, ind.column_count, ind.column_index, causal=True)
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(1, S, h, d, device=DEV, dtype=torch.bfloat16 if DEV == "cuda" else torch.float16, generator=g) for h in (hq, hkv, hkv))
    return ind, plan, q, k, v

def dense_mask(ind, S, hq):
    nqb = S // 64
    m = torch.zeros(hq, S, S, dtype=torch.bool, device=DEV)
    for h in range(hq):
        for qb in range(nqb):
            n = int(ind.block_count[0, h, qb])
            for kb in ind.block_index[0, h, qb, :n].tolist():
                m[h, qb * 64:(qb + 1) * 64, kb * 64:(kb + 1) * 64] = True
            c = int(ind.column_count[0, h, qb])
            cols = ind.column_index[0, h, qb, :c].long()
            m[h, qb * 64:(qb + 1) * 64, cols] = True
    return m & torch.ones(S, S, dtype=torch.bool, device=DEV).tril()

res = {"variant": os.environ.get("VARIANT", "base"), "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu"}
for S, hq, hkv, d in ([(4096, 4, 2, 64), (4096, 4, 2, 128)] if DEV == "cuda" else [(512, 2, 1, 64)]):
    ind, plan, q, k, v = mk(S, hq, hkv, d, 0.9)
    scale = 1 / math.sqrt(d)
    o, l = sparse_forward(q, k, v, plan, scale, out_dtype=torch.float32)
    mask = dense_mask(ind, S, hq)
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(hq // hkv, 1), vd.repeat_interleave(hq // hkv, 1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    lr = torch.logsumexp(s, -1)
    orf = (torch.exp(s - lr[..., None]) @ vd).transpose(1, 2)
    res[f"err_out_d{d}"] = float((o.double() - orf).abs().max() / orf.abs().max())
    res[f"err_lse_d{d}"] = float((l.double() - lr).abs().max())
for S, hq, hkv, d in ([(131072, 16, 2, 128), (131072, 9, 3, 64)] if DEV == "cuda" else []):
    ind, plan, q, k, v = mk(S, hq, hkv, d, 0.95)
    scale = 1 / math.sqrt(d)
    res[f"fwd_ms_d{d}"] = round(timed(lambda: sparse_forward(q, k, v, plan, scale, out_dtype=torch.bfloat16)), 3)
    ind2 = plan_from_indices(ind.block_count, ind.block_index, None, None, causal=True)
    res[f"fwd_slash_ms_d{d}"] = round(timed(lambda: sparse_forward(q, k, v, ind2, scale, out_dtype=torch.bfloat16)), 3)
print(json.dumps(res), flush=True)

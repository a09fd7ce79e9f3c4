"""Is the sparse forward / backward bound by K/V (Q/dO) traffic? The same tile count at four localities
(synthetic per-head lists; the first head's lists for its whole KV group; a band of the last n blocks; the
diagonal plus the first n-1 blocks, L2-resident). Run from the repository root: python locality.py; writes
$OUT/loc.json (TFLOP/s: forward 2, dQ 3, dK/dV 4 matmuls of 64x64xd per listed tile)."""
import math, json, os, sys
import torch
from megatron_mtraining.ops.triton.launch import plan_from_indices, sparse_backward, sparse_forward
from megatron_mtraining.patterns.synthetic import vertical_slash_indices
from torch.profiler import ProfilerActivity, profile
DEV = "cuda"

def timed(fn, reps=10):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]

def prof(fn):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in p.key_averages():
        if "kernel" in ev.key and ("dq" in ev.key or "dkdv" in ev.key or "fwd" in ev.key):
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            out[ev.key[:24]] = round(t / 3 / 1000, 3)
    return out

def lists_to_plan(lists, hq, nqb):
    mx = max(len(l) for h in lists for l in h)
    bc = torch.zeros(1, hq, nqb, dtype=torch.int32)
    bi = torch.zeros(1, hq, nqb, mx, dtype=torch.int32)
    for h in range(hq):
        for qb in range(nqb):
            l = lists[h][qb]
            bc[0, h, qb] = len(l)
            bi[0, h, qb, :len(l)] = torch.tensor(l, dtype=torch.int32)
    return plan_from_indices(bc.to(DEV), bi.to(DEV), None, None, causal=True)

def run(S, hq, hkv, d):
    nqb = S // 64
    ind, _ = vertical_slash_indices(S, hq, 0.95, device="cpu")
    bc, bi = ind.block_count, ind.block_index
    syn = [[bi[0, h, qb, :int(bc[0, h, qb])].tolist() for qb in range(nqb)] for h in range(hq)]
    n = int(round(float(bc.float().mean())))
    rep = hq // hkv
    variants = {
        "synthetic": syn,
        # the first head of each KV group's lists for every head of the group: cross-head reuse
        "group_shared": [syn[(h // rep) * rep] for h in range(hq)],
        # each tile the last n blocks (adjacent tiles share n-1 blocks)
        "band": [[list(range(max(0, qb - n + 1), qb + 1)) for qb in range(nqb)] for h in range(hq)],
        # each tile the diagonal + the first n-1 blocks (the same few blocks everywhere: L2-resident)
        "sinks": [[sorted(set(list(range(min(n - 1, qb))) + [qb])) for qb in range(nqb)] for h in range(hq)],
    }
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, S, hq, d, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, S, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, S, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    scale = 1 / math.sqrt(d)
    res = {}
    for name, lists in variants.items():
        plan = lists_to_plan(lists, hq, nqb)
        tiles = int(plan.block_count.sum())
        unit = tiles * 2 * 64 * 64 * d          # one 64x64xd matmul over all tiles, FLOP
        tf = timed(lambda: sparse_forward(q, k, v, plan, scale, out_dtype=torch.bfloat16))
        out, lse = sparse_forward(q, k, v, plan, scale, out_dtype=torch.bfloat16)
        dout = torch.randn_like(q)
        delta = (out.float() * dout.float()).sum(-1).transpose(1, 2).contiguous()
        kb = prof(lambda: sparse_backward(dout, q, k, v, lse, delta, plan, scale))
        r = {"tiles": tiles, "fwd_ms": round(tf, 3), "fwd_tflops": round(2 * unit / tf / 1e9, 1)}
        for kk, ms in kb.items():
            mm = 4 if "dkdv" in kk else 3
            r[kk] = ms
            r[kk + "_tflops"] = round(mm * unit / ms / 1e9, 1)
        res[name] = r
        print(f"S={S} hq={hq}/{hkv} d={d} {name}: {r}", flush=True)
    return res

if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    allr = {}
    for S, hq, hkv, d in [(131072, 16, 2, 128), (131072, 9, 3, 64)]:
        allr[f"{S}_{hq}_{hkv}_{d}"] = run(S, hq, hkv, d)
    json.dump(allr, open(os.path.join(os.environ.get("OUT", "."), "loc.json"), "w"), indent=1)

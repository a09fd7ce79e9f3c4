"""Shared K/V stream: heads 2p and 2p+1 with the same block lists, one producer, two consumer warp groups
(gluon_ws_shared.py), against the Triton and one-warp-group Gluon forwards on the same plan."""
import math, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_check import dense_mask, reference, inputs, vs_plan, random_plan, max_err, timed  # noqa: E402
from gluon_sparse import sparse_forward_gluon  # noqa: E402
from gluon_ws_shared import sparse_forward_ws  # noqa: E402
from megatron_mtraining.ops.triton.launch import plan_from_indices, sparse_forward  # noqa: E402


def pair_shared(plan):
    bc, bi = plan.block_count.clone(), plan.block_index.clone()
    if bc.shape[0] > 1 and bc.stride(0) == 0:
        pass
    bc = bc.contiguous(); bi = bi.contiguous()
    bc[:, 1::2] = bc[:, 0::2]
    bi[:, 1::2] = bi[:, 0::2]
    return plan_from_indices(bc, bi, None, None, causal=True)


def cfgs(d):
    return [dict(stages=s, consumer_regs=232, maxnreg=168) for s in ((3, 4, 5) if d == 128 else (3, 4, 6))]


ok = True
for S, hq, hkv, d, b, kind in [(2048, 4, 2, 64, 1, "vs"), (2048, 4, 2, 128, 1, "vs"), (1024, 4, 2, 64, 2, "random"),
                               (1024, 4, 2, 128, 2, "random")]:
    plan = pair_shared(vs_plan(S, hq, 0.9) if kind == "vs" else random_plan(S, hq, b))
    q, k, v = inputs(S, hq, hkv, d, b=b, seed=0 if kind == "vs" else 2)
    scale = 1 / math.sqrt(d)
    o_r, l_r = reference(q, k, v, dense_mask(plan, S, hq), scale)
    o_t, l_t = sparse_forward(q, k, v, plan, scale, out_dtype=torch.bfloat16)
    e_t = {"out": max_err(o_t, o_r), "lse": max_err(l_t, l_r)}
    for c in cfgs(d):
        try:
            o_g, l_g = sparse_forward_ws(q, k, v, plan.block_count, plan.block_split, plan.block_index, scale, **c)
            torch.cuda.synchronize()
        except Exception as e:
            print(f"ws3 {c} {kind} d={d}: ERROR {repr(e)[:300]}", flush=True)
            continue
        e = {"out": max_err(o_g, o_r), "lse": max_err(l_g, l_r)}
        good = e["out"] <= 2 * e_t["out"] + 1e-6 and e["lse"] <= 2 * e_t["lse"] + 1e-5
        good = good and bool(torch.equal(torch.isinf(l_g), torch.isinf(l_r))) and bool(torch.isfinite(o_g).all())
        ok &= good
        print(f"check ws3 {c} {kind} b={b} d={d}: {e} triton {e_t} {'OK' if good else 'FAIL'}", flush=True)
print("CHECKS", "OK" if ok else "FAILED", flush=True)
for S, hq, hkv, d in [(131072, 16, 2, 128), (131072, 12, 3, 64)]:
    plan = pair_shared(vs_plan(S, hq, 0.95))
    q, k, v = inputs(S, hq, hkv, d)
    scale = 1 / math.sqrt(d)
    tiles = int(plan.block_count.sum())
    flop = tiles * 4 * 64 * 64 * d
    res = {"triton": timed(lambda: sparse_forward(q, k, v, plan, scale, out_dtype=torch.bfloat16)),
           "gluon_1wg_s3": timed(lambda: sparse_forward_gluon(q, k, v, plan.block_count, plan.block_split,
                                                               plan.block_index, scale, stages=3))}
    for c in cfgs(d):
        try:
            res[f"ws3_shared_s{c['stages']}"] = timed(lambda: sparse_forward_ws(
                q, k, v, plan.block_count, plan.block_split, plan.block_index, scale, **c))
        except Exception as e:
            print(f"ws3 {c} timing: ERROR {repr(e)[:300]}", flush=True)
    print(f"time fwd S={S} {hq}/{hkv} d={d} tiles={tiles}: " +
          ", ".join(f"{k_} {v_:.3f} ms ({flop / v_ / 1e9:.1f} TFLOP/s)" for k_, v_ in res.items()), flush=True)
sys.exit(0 if ok else 1)

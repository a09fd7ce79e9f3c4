"""The warp-specialized forward with two listed blocks per softmax round (gluon_ws_pair.py, pair=True): fp64 check
and timing at 128K, 95 %, as gluon_ws_check.py."""
import math, os, sys, traceback
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_check import dense_mask, reference, inputs, vs_plan, random_plan, max_err, timed  # noqa: E402
from gluon_sparse import sparse_forward_gluon  # noqa: E402
from gluon_ws_pair import sparse_forward_ws  # noqa: E402
from megatron_mtraining.ops.triton.launch import sparse_forward  # noqa: E402

CFGS = [dict(stages=3, consumer_regs=232, maxnreg=168), dict(stages=2, consumer_regs=232, maxnreg=168, pair=True),
        dict(stages=3, consumer_regs=232, maxnreg=168, pair=True), dict(stages=4, consumer_regs=232, maxnreg=168, pair=True)]


def check(tag, q, k, v, plan, scale, o_r, l_r):
    o_t, l_t = sparse_forward(q, k, v, plan, scale, out_dtype=torch.bfloat16)
    e_t = {"out": max_err(o_t, o_r), "lse": max_err(l_t, l_r)}
    ok = True
    for c in CFGS:
        try:
            o_g, l_g = sparse_forward_ws(q, k, v, plan.block_count, plan.block_split, plan.block_index, scale, **c)
            torch.cuda.synchronize()
        except Exception as e:
            print(f"ws {c} {tag}: ERROR {repr(e)[:400]}", flush=True)
            ok = False
            continue
        e = {"out": max_err(o_g, o_r), "lse": max_err(l_g, l_r)}
        good = e["out"] <= 2 * e_t["out"] + 1e-6 and e["lse"] <= 2 * e_t["lse"] + 1e-5
        good = good and bool(torch.equal(torch.isinf(l_g), torch.isinf(l_r))) and bool(torch.isfinite(o_g).all())
        ok &= good
        print(f"check ws {c} {tag}: ws {e} triton {e_t} {'OK' if good else 'FAIL'}", flush=True)
    return ok


ok = True
for S, hq, hkv, d in [(2048, 4, 2, 64), (2048, 4, 2, 128)]:
    plan = vs_plan(S, hq, 0.9)
    q, k, v = inputs(S, hq, hkv, d)
    scale = 1 / math.sqrt(d)
    o_r, l_r = reference(q, k, v, dense_mask(plan, S, hq), scale)
    ok &= check(f"vs d={d}", q, k, v, plan, scale, o_r, l_r)
for S, hq, hkv, d, b in [(1024, 4, 2, 64, 2), (1024, 4, 2, 128, 2)]:
    plan = random_plan(S, hq, b)
    q, k, v = inputs(S, hq, hkv, d, b=b, seed=2)
    scale = 1 / math.sqrt(d)
    o_r, l_r = reference(q, k, v, dense_mask(plan, S, hq), scale)
    ok &= check(f"random b={b} d={d}", q, k, v, plan, scale, o_r, l_r)
print("CHECKS", "OK" if ok else "FAILED", flush=True)
for S, hq, hkv, d in [(131072, 9, 3, 64), (131072, 16, 2, 128)]:
    plan = vs_plan(S, hq, 0.95)
    q, k, v = inputs(S, hq, hkv, d)
    scale = 1 / math.sqrt(d)
    tiles = int(plan.block_count.sum())
    flop = tiles * 4 * 64 * 64 * d
    res = {"triton": timed(lambda: sparse_forward(q, k, v, plan, scale, out_dtype=torch.bfloat16)),
           "gluon_1wg_s3": timed(lambda: sparse_forward_gluon(q, k, v, plan.block_count, plan.block_split,
                                                               plan.block_index, scale, stages=3))}
    for c in CFGS:
        try:
            res[f"ws_{c['stages']}_{'pair' if c.get('pair') else 'one'}"] = timed(lambda: sparse_forward_ws(
                q, k, v, plan.block_count, plan.block_split, plan.block_index, scale, **c))
        except Exception as e:
            print(f"ws {c} timing: ERROR {repr(e)[:300]}", flush=True)
    print(f"time fwd S={S} {hq}/{hkv} d={d} tiles={tiles}: " +
          ", ".join(f"{k_} {v_:.3f} ms ({flop / v_ / 1e9:.1f} TFLOP/s)" for k_, v_ in res.items()), flush=True)
sys.exit(0 if ok else 1)

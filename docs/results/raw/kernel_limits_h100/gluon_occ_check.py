"""Minimal-shared-memory Gluon forward (gluon_occ.py): fp64 check, then timing at 128K, 95 % against the Triton
forward at 3 (default), 2 and 1 stages and the one-warp-group Gluon forward (gluon_sparse.py, 3 stages)."""
import dataclasses, math, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_check import dense_mask, reference, inputs, vs_plan, random_plan, max_err, timed  # noqa: E402
from gluon_sparse import sparse_forward_gluon  # noqa: E402
from gluon_occ import sparse_forward_occ  # noqa: E402
from megatron_mtraining.ops.triton.launch import DEFAULT_CONFIG, sparse_forward  # noqa: E402

ok = True
for S, hq, hkv, d, b, kind in [(2048, 4, 2, 64, 1, "vs"), (2048, 4, 2, 128, 1, "vs"), (1024, 4, 2, 64, 2, "random"),
                               (1024, 4, 2, 128, 2, "random")]:
    plan = vs_plan(S, hq, 0.9) if kind == "vs" else random_plan(S, hq, b)
    q, k, v = inputs(S, hq, hkv, d, b=b, seed=0 if kind == "vs" else 2)
    scale = 1 / math.sqrt(d)
    o_r, l_r = reference(q, k, v, dense_mask(plan, S, hq), scale)
    o_t, l_t = sparse_forward(q, k, v, plan, scale, out_dtype=torch.bfloat16)
    e_t = {"out": max_err(o_t, o_r), "lse": max_err(l_t, l_r)}
    for mx in (None, 128):
        try:
            o_g, l_g = sparse_forward_occ(q, k, v, plan.block_count, plan.block_split, plan.block_index, scale,
                                          maxnreg=mx)
            torch.cuda.synchronize()
        except Exception as e:
            print(f"occ maxnreg={mx} {kind} d={d}: ERROR {repr(e)[:300]}", flush=True)
            ok = False
            continue
        e = {"out": max_err(o_g, o_r), "lse": max_err(l_g, l_r)}
        good = e["out"] <= 2 * e_t["out"] + 1e-6 and e["lse"] <= 2 * e_t["lse"] + 1e-5
        good = good and bool(torch.equal(torch.isinf(l_g), torch.isinf(l_r))) and bool(torch.isfinite(o_g).all())
        ok &= good
        print(f"check occ maxnreg={mx} {kind} b={b} d={d}: {e} triton {e_t} {'OK' if good else 'FAIL'}", flush=True)
print("CHECKS", "OK" if ok else "FAILED", flush=True)
for S, hq, hkv, d in [(131072, 16, 2, 128), (131072, 9, 3, 64)]:
    plan = vs_plan(S, hq, 0.95)
    q, k, v = inputs(S, hq, hkv, d)
    scale = 1 / math.sqrt(d)
    flop = int(plan.block_count.sum()) * 4 * 64 * 64 * d
    res = {}
    for st in (3, 2, 1):
        cfg = dataclasses.replace(DEFAULT_CONFIG, fwd_stages=st)
        res[f"triton_s{st}"] = timed(lambda: sparse_forward(q, k, v, plan, scale, out_dtype=torch.bfloat16,
                                                            config=cfg))
    res["gluon_1wg_s3"] = timed(lambda: sparse_forward_gluon(q, k, v, plan.block_count, plan.block_split,
                                                             plan.block_index, scale, stages=3))
    for mx in (None, 128):
        res[f"occ_{mx}"] = timed(lambda: sparse_forward_occ(q, k, v, plan.block_count, plan.block_split,
                                                             plan.block_index, scale, maxnreg=mx))
    print(f"time fwd S={S} {hq}/{hkv} d={d}: " +
          ", ".join(f"{k_} {v_:.3f} ms ({flop / v_ / 1e9:.1f} TFLOP/s)" for k_, v_ in res.items()), flush=True)
sys.exit(0 if ok else 1)

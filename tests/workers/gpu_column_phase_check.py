"""GPU check of the sparse ring's column placement: the check and a CLI.

    pytest -m gpu tests/kernels/test_gpu_column_phase.py     # one test per quantity
    python3 tests/workers/gpu_column_phase_check.py            # prints one line per quantity and RESULT

The sparse ring at CP=1 with the Triton kernels, vertical columns in the ring vs out of the ring
(ColumnPhase), bf16, against fp64 attention masked with the same estimated pattern; the error of
each of out, dQ, dK, dV must be within 2x that of a bf16 torch reference (masked SDPA-free einsum).
Also: the backward plans built during the forward on a side stream (the default) give bitwise the
same out/dQ/dK/dV as plans built inside the backward (``prebuild=False``).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron_mtraining.layout import Layout  # noqa: E402
from megatron_mtraining.ops.backends import select_backend  # noqa: E402
from megatron_mtraining.patterns.estimator import VerticalSlashConfig  # noqa: E402
from megatron_mtraining.ring.sparse import sparse_ring_attention  # noqa: E402
from tests.workers.vs_data import make_qkv, naive_masked_attention  # noqa: E402

QUANTITIES = ("out", "dq", "dk", "dv")


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def column_phase_check(device="cuda", s=4096, hq=4, hkv=2, d=128, dtype=torch.bfloat16) -> dict:
    """Run the three sparse-ring variants and the fp64 / ``dtype`` references on ``device``.

    Returns ``{"errors": {q: {"in_ring", "out_of_ring", "ref"}}, "prebuild_bitwise": bool,
    "density": float}``; ``"ref"`` is the torch reference in ``dtype`` (bf16 on the GPU)."""
    q, k, v = make_qkv(1, s, hq, hkv, d, seed=3)
    dout = torch.randn(1, s, hq, d, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    scale = d ** -0.5
    res = {}
    pat = None
    triton = select_backend("triton", device=device, dtype=dtype, head_dim=d, seq_len_local=s, sparse=True)
    late = select_backend("triton", device=device, dtype=dtype, head_dim=d, seq_len_local=s, sparse=True,
                          prebuild_backward_plans=False)
    for run, columns, backend in (("in_ring", "in_ring", triton),
                                  ("out_of_ring", "out_of_ring", triton),
                                  ("in_ring_plans_in_bwd", "in_ring", late)):
        qa, ka, va = (t.to(device, dtype, copy=True).requires_grad_(True) for t in (q, k, v))
        out, pat = sparse_ring_attention(qa, ka, va, layout=Layout("striped", 1, 64), group=None,
                                         config=VerticalSlashConfig(recall=0.9), softmax_scale=scale,
                                         return_pattern=True, backend=backend, columns=columns)
        out.backward(dout.to(device, dtype))
        res[run] = [t.detach().double().cpu() for t in (out, qa.grad, ka.grad, va.grad)]
    mask = pat.dense_mask().cpu()
    refs = []
    for dt in (torch.float64, torch.bfloat16):
        qr, kr, vr = (t.to(device, dt, copy=True).requires_grad_(True) for t in (q, k, v))
        o = naive_masked_attention(qr, kr, vr, mask.to(device), scale)
        o.backward(dout.to(device, dt))
        refs.append([t.detach().double().cpu() for t in (o, qr.grad, kr.grad, vr.grad)])
    errors = {name: {"in_ring": rel(res["in_ring"][i], refs[0][i]),
                     "out_of_ring": rel(res["out_of_ring"][i], refs[0][i]),
                     "ref": rel(refs[1][i], refs[0][i])} for i, name in enumerate(QUANTITIES)}
    same = all(torch.equal(a, b) for a, b in zip(res["in_ring"], res["in_ring_plans_in_bwd"]))
    return {"errors": errors, "prebuild_bitwise": bool(same), "density": float(mask.float().mean())}


def quantity_ok(e: dict) -> bool:
    """Both column placements within 2x the bf16 torch reference's error."""
    return e["in_ring"] <= 2 * e["ref"] and e["out_of_ring"] <= 2 * e["ref"]


def main():
    r = column_phase_check()
    ok = True
    for name in QUANTITIES:
        e = r["errors"][name]
        good = quantity_ok(e)
        ok &= good
        print(f"{name}: in_ring {e['in_ring']:.2e} out_of_ring {e['out_of_ring']:.2e} bf16 torch ref {e['ref']:.2e} "
              f"{'ok' if good else 'FAIL'}")
    same = r["prebuild_bitwise"]
    print(f"backward plans built during the forward (side stream) vs in the backward: {'bitwise equal' if same else 'DIFFER'}")
    ok &= same
    print("RESULT " + json.dumps({"pass": bool(ok), "density": r["density"], "prebuild_bitwise": same}))


if __name__ == "__main__":
    main()

"""GPU check (device tool): the sparse ring at CP=1 with the Triton kernels, vertical columns in the
ring vs out of the ring (ColumnPhase), bf16, against fp64 attention masked with the same estimated
pattern; error of each compared with that of a bf16 torch reference (masked SDPA-free einsum). Also:
the backward plans built during the forward on a side stream (the default) give bitwise the same
out/dQ/dK/dV as plans built inside the backward (``prebuild=False``).

    python3 tests/workers/gpu_column_phase_check.py      # prints one line per quantity and RESULT
"""
import json
import sys

import torch

sys.path.insert(0, ".")
from megatron_mtraining.layout import Layout  # noqa: E402
from megatron_mtraining.ops.backends import select_backend  # noqa: E402
from megatron_mtraining.patterns.estimator import VerticalSlashConfig  # noqa: E402
from megatron_mtraining.ring.sparse import sparse_ring_attention  # noqa: E402
from tests.workers.vs_data import make_qkv, naive_masked_attention  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def main():
    s, hq, hkv, d = 4096, 4, 2, 128
    q, k, v = make_qkv(1, s, hq, hkv, d, seed=3)
    dout = torch.randn(1, s, hq, d, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    scale = d ** -0.5
    res = {}
    pat = None
    triton = select_backend("triton", device="cuda", dtype=torch.bfloat16, head_dim=d, seq_len_local=s, sparse=True)
    late = select_backend("triton", device="cuda", dtype=torch.bfloat16, head_dim=d, seq_len_local=s, sparse=True,
                          prebuild_backward_plans=False)
    for run, columns, backend in (("in_ring", "in_ring", triton),
                                  ("out_of_ring", "out_of_ring", triton),
                                  ("in_ring_plans_in_bwd", "in_ring", late)):
        qa, ka, va = (t.cuda().bfloat16().requires_grad_(True) for t in (q, k, v))
        out, pat = sparse_ring_attention(qa, ka, va, layout=Layout("striped", 1, 64), group=None,
                                         config=VerticalSlashConfig(recall=0.9), softmax_scale=scale,
                                         return_pattern=True, backend=backend, columns=columns)
        out.backward(dout.cuda().bfloat16())
        res[run] = [t.detach().double().cpu() for t in (out, qa.grad, ka.grad, va.grad)]
    mask = pat.dense_mask().cpu()
    refs = []
    for dt in (torch.float64, torch.bfloat16):
        qr, kr, vr = (t.cuda().to(dt).requires_grad_(True) for t in (q, k, v))
        o = naive_masked_attention(qr, kr, vr, mask.cuda(), scale)
        o.backward(dout.cuda().to(dt))
        refs.append([t.detach().double().cpu() for t in (o, qr.grad, kr.grad, vr.grad)])
    ok = True
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        e_bf = rel(refs[1][i], refs[0][i])
        e_in, e_out = rel(res["in_ring"][i], refs[0][i]), rel(res["out_of_ring"][i], refs[0][i])
        good = e_in <= 2 * e_bf and e_out <= 2 * e_bf
        ok &= good
        print(f"{name}: in_ring {e_in:.2e} out_of_ring {e_out:.2e} bf16 torch ref {e_bf:.2e} {'ok' if good else 'FAIL'}")
    same = all(torch.equal(a, b) for a, b in zip(res["in_ring"], res["in_ring_plans_in_bwd"]))
    print(f"backward plans built during the forward (side stream) vs in the backward: {'bitwise equal' if same else 'DIFFER'}")
    ok &= same
    print("RESULT " + json.dumps({"pass": bool(ok), "density": float(mask.float().mean()), "prebuild_bitwise": same}))


if __name__ == "__main__":
    main()

import sys, collections, dataclasses, torch
from torch.profiler import profile, ProfilerActivity
import megatron_mtraining.ops.triton as T
import megatron_mtraining.ops.triton.launch as L
from megatron_mtraining.plan import resolve
from megatron_mtraining.bench.speed import time_forward_backward
base = {"implementation": "striped", "granularity": 64, "pattern": "vertical_slash",
        "vertical_slash": {"recall": 0.98, "last_q": 64, "block_size": 64, "sink_tokens": 64, "local_blocks": 2,
                           "max_vertical": 2048, "max_slash": 256}}
variants = [("default", {}), ("col_atomic", dict(col_atomic_fast=True)), ("dq_atomic", dict(dq_atomic_fast=True)),
            ("both_atomic", dict(col_atomic_fast=True, dq_atomic_fast=True))]
for S in [int(x) for x in sys.argv[1].split(",")]:
    g = torch.Generator(device="cuda").manual_seed(0)
    pos = torch.arange(S, device="cuda", dtype=torch.float32)
    freq = torch.exp(-torch.arange(32, device="cuda") / 32 * 9.2)
    ang = pos[:, None] * freq[None]
    rope = torch.cat([ang.cos(), ang.sin()], -1)
    q = (torch.randn(1, S, 9, 64, device="cuda", generator=g) * 0.5 + 2 * rope[None, :, None]).bfloat16()
    k = (torch.randn(1, S, 3, 64, device="cuda", generator=g) * 0.5 + 2 * rope[None, :, None]).bfloat16()
    k[:, :16] += 3
    v = torch.randn(1, S, 3, 64, device="cuda", generator=g).bfloat16()
    for det in (False, True):
        for name, kw in variants:
            if det and kw:
                continue
            cfg = dataclasses.replace(L.KernelConfig(), **kw)
            T.DEFAULT_CONFIG = L.DEFAULT_CONFIG = cfg
            plan = resolve(dict(base, deterministic=det), cp_group=None, seq_len=S).for_layer(1)
            f = lambda a, b, c: plan.attention(a, b, c, softmax_scale=0.125)
            t = time_forward_backward(f, q, k, v, device=q.device, warmup=3, repeats=15)
            qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
            gout = torch.randn_like(q)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    torch.autograd.grad(f(qq, kk, vv), (qq, kk, vv), gout)
                torch.cuda.synchronize()
            reg = collections.Counter()
            for e in prof.events():
                if not e.kernels: continue
                p, r = e, "other"
                while p is not None:
                    if p.name.startswith("mtraining."): r = p.name; break
                    p = p.cpu_parent
                reg[r] += sum(x.duration for x in e.kernels) / 3 / 1e3
            print(f"S={S} det={det} {name:12s} event {t.median_ms:7.2f} ms | kernels {sum(reg.values()):7.2f} | plan {reg['mtraining.plan']:6.2f} | attn-kernels {reg['other']:7.2f} | fwd-misc {reg['mtraining.attention.forward']:5.2f}", flush=True)

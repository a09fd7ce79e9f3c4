import sys, collections, torch
from torch.profiler import profile, ProfilerActivity
from megatron_mtraining.plan import resolve
base = {"implementation": "striped", "granularity": 64, "pattern": "vertical_slash",
        "vertical_slash": {"recall": 0.98, "last_q": 64, "block_size": 64, "sink_tokens": 64, "local_blocks": 2,
                           "max_vertical": 2048, "max_slash": 256}}
kb = sys.argv[2] if len(sys.argv) > 2 else "auto"
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
    plan = resolve(dict(base, kernel_backend=kb), cp_group=None, seq_len=S).for_layer(1)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    gout = torch.randn_like(q)
    def step():
        out = plan.attention(qq, kk, vv, softmax_scale=0.125)
        return torch.autograd.grad(out, (qq, kk, vv), gout)
    for _ in range(3): step()
    torch.cuda.synchronize()
    N = 3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(N): step()
        torch.cuda.synchronize()
    reg_t = collections.Counter(); reg_n = collections.Counter(); ops = collections.defaultdict(collections.Counter)
    opn = collections.defaultdict(collections.Counter)
    for e in prof.events():
        if not e.kernels:
            continue
        p, region = e, "other"
        while p is not None:
            if p.name.startswith("mtraining."):
                region = p.name; break
            p = p.cpu_parent
        t = sum(kk_.duration for kk_ in e.kernels) / N / 1e3
        reg_t[region] += t; reg_n[region] += len(e.kernels) / N
        ops[region][e.name] += t; opn[region][e.name] += len(e.kernels) / N
    tot = sum(reg_t.values())
    print(f"=== S={S} {plan.kernel_text(q)}: kernels {tot:.2f} ms per call, {sum(reg_n.values()):.0f} kernels")
    for r, t in reg_t.most_common():
        print(f"  {r:36s} {t:8.3f} ms  {reg_n[r]:5.0f} kernels")
        for name, t2 in ops[r].most_common(8):
            print(f"      {t2:7.3f} ms x{opn[r][name]:4.0f}  {name[:90]}")

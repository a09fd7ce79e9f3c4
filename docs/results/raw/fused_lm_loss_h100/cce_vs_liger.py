# time Liger (our fused_lm_loss) vs cut-cross-entropy fwd+bwd, bf16, reduction none, per-token upstream grads
import sys, torch, json, time
from megatron_mtraining.megatron.lm_loss import fused_lm_loss
from cut_cross_entropy import linear_cross_entropy
H, V = int(sys.argv[1]), int(sys.argv[2]); toks = [int(t) for t in sys.argv[3].split(",")]
dev = "cuda"; out = []
def timeit(f, n=10):
    for _ in range(2): f()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]
for T in toks:
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(T, 1, H, device=dev, generator=g) * 1.0).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device=dev, generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, V, (1, T), device=dev, generator=g)
    up = torch.rand(1, T, device=dev, generator=g)
    ref = None
    if T <= 32768:
        xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        l = torch.nn.functional.cross_entropy((xd[:, 0] @ wd.t()), y[0], reduction="none")
        (l * up[0].double()).sum().backward(); ref = (l.detach(), xd.grad, wd.grad); del l
    def rel(a, b): return float((a.double() - b).norm() / b.norm())
    def run(name, f):
        def step():
            x.grad = None; w.grad = None
            l = f(); (l.float() * up.reshape(l.shape)).sum().backward(); return l
        torch.cuda.reset_peak_memory_stats(); ms = timeit(step); l = step()
        r = {"name": name, "tokens": T, "ms": ms, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        if ref is not None:
            r.update(loss=rel(l.reshape(-1), ref[0]), dx=rel(x.grad, ref[1]), dw=rel(w.grad, ref[2]))
        print(json.dumps(r), flush=True); out.append(r)
    run("liger", lambda: fused_lm_loss(x, w, y))
    for fe in (None, "high"):
        run(f"cce_filter_{fe}", lambda fe=fe: linear_cross_entropy(x[:, 0], w, y[0], reduction="none", filter_eps=fe))
    def unchunked():
        return torch.nn.functional.cross_entropy((x[:, 0] @ w.t()).float(), y[0], reduction="none")
    if T * V * 4 <= 30 * 2**30: run("torch_unchunked_fp32_logits", unchunked)
    del x, w, ref

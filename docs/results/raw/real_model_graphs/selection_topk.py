"""Selection alternatives at the SmolLM2 shape: torch sorts (library) vs topk on packed int64 keys.
Checks bitwise equality, then times each (CUDA events, and one CUDA graph replay each)."""
import sys, time, json
import torch
from megatron_mtraining.patterns.estimator import floor_first_sort, _select, VerticalSlashConfig
from megatron_mtraining.layout import Layout

def floor_first_topk(score, n_floor, keep):
    """Same as floor_first_sort for fp32 scores >= 0 (no NaN): keys (bits << 32) | (2^32-1-idx)."""
    n = score.shape[-1]
    nf = min(max(n_floor, 0), n); keep = min(keep, n)
    def seg(s, off, k):
        bits = s.contiguous().view(torch.int32).to(torch.int64)
        idx = torch.arange(s.shape[-1], device=s.device, dtype=torch.int64)
        key = (bits << 32) | (0xFFFFFFFF - idx)
        top = torch.topk(key, k, dim=-1, largest=True, sorted=True).values
        o = 0xFFFFFFFF - (top & 0xFFFFFFFF)
        v = (top >> 32).to(torch.int32).view(torch.float32)
        return v, o + off
    if nf == 0 or nf == n:
        return seg(score, 0, keep)
    vf, of = seg(score[..., :nf], 0, min(nf, keep))
    if keep <= nf:
        return vf, of
    vr, orr = seg(score[..., nf:], nf, keep - nf)
    return torch.cat([vf, vr], -1), torch.cat([of, orr], -1)

def inputs(n, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.rand(1, 9, n, generator=g) ** 8 * 64 / n * 30
    x[..., ::7] = 0.0                                   # exact zeros (keys no probe sees)
    x[..., 100:400] = x[..., 100:101]                   # ties
    return x.to(dev).float()

def bench(fn, reps=50):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    eager = s.elapsed_time(e) / reps * 1000
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
    torch.cuda.current_stream().wait_stream(st)
    with torch.cuda.graph(g):
        fn()
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps): g.replay()
    e.record(); torch.cuda.synchronize()
    return eager, s.elapsed_time(e) / reps * 1000

dev = "cuda" if torch.cuda.is_available() else "cpu"
res = {}
for n in (32768, 131072):
    col = inputs(n, dev)
    for nf, keep in ((64, 2048), (0, 2048), (64, 64), (64, 4096)):
        a = floor_first_sort(col, nf, keep); b = floor_first_topk(col, nf, keep)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (n, nf, keep)
    print("equal", n, flush=True)
    if dev == "cuda":
        res[f"sort_{n}"] = bench(lambda: floor_first_sort(col, 64, 2048))
        res[f"topk_{n}"] = bench(lambda: floor_first_topk(col, 64, 2048))
        cfg = VerticalSlashConfig(recall=0.98, last_q=64, block_size=64, sink_tokens=64, local_blocks=2,
                                  max_vertical=2048, max_slash=256)
        slash = torch.rand(1, 9, n // 64, device=dev, dtype=torch.float64)
        kpos = torch.arange(n, device=dev)
        lay = Layout("striped", 1, 64)
        res[f"select_{n}"] = bench(lambda: _select(slash, col, kpos, lay, 0, n, 64, cfg, None, static_widths=True))
        print(n, {k: [round(x, 1) for x in v] for k, v in res.items() if k.endswith(str(n))}, flush=True)
print("RESULT us (eager, graph):", json.dumps(res))

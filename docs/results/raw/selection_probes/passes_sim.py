"""Full passes over a row that the selection search makes before at most CAND = 2048 candidates are left, by
keys tested per pass (1: bisection, P: P + 1 parts per pass), on the synthetic rows of bench_probes.py; a CPU
simulation of the kernel's search loop (numpy), one line per case and probe count."""
import torch, numpy as np
torch.manual_seed(0)
def heavy(h, S):
    x = torch.rand(1, h, S, dtype=torch.float64) ** 12; x[..., :4] += 5.0
    return (x / x.sum(-1, keepdim=True) * 64).float()
def slash(h, nb):
    d = torch.arange(nb, dtype=torch.float64)
    s = (1.0 / (d + 1) ** 1.1) * (0.2 + torch.rand(1, h, nb, dtype=torch.float64))
    return (s / s.sum(-1, keepdim=True) * 64)
CAND=2048
def passes(row, lo, target, ways, fp64):
    x = row.numpy().astype(np.float64)
    keys = (row.view(torch.int64) if fp64 else row.view(torch.int32).to(torch.int64)).numpy()
    keys = np.maximum(keys, 0)
    rest = np.arange(len(x)) >= lo
    F = x[~rest].sum(); R = x[rest].sum()
    if F >= target or F + R < target: return 0
    lo_k, hi_k = 0, keys[rest].max() + 1
    c_lo, c_hi = rest.sum(), 0
    n = 0
    kr, xr = keys[rest], x[rest]
    while hi_k - lo_k > 1 and c_lo - c_hi > CAND:
        n += 1
        span = hi_k - lo_k
        ms = [lo_k + (span * j) // ways for j in range(ways)]
        holds = [(F + xr[kr >= m].sum() >= target) for m in ms]
        J = max(j for j in range(ways) if holds[j])
        nlo = ms[J]; c_lo = (kr >= nlo).sum()
        if J + 1 < ways:
            hi_k = ms[J + 1]; c_hi = (kr >= hi_k).sum()
        lo_k = nlo
    return n
for name, (h, S) in {"9x32K": (9, 32768), "9x128K": (9, 131072)}.items():
    col, sl = heavy(h, S), slash(h, S // 64)
    for ways in (2, 3, 5, 9):
        pc = [passes(col[0, i], 64, 0.98 * 64, ways, False) for i in range(h)]
        ps = [passes(sl[0, i], 2, 0.98 * 64, ways, True) for i in range(h)]
        print(name, "probes", ways - 1, "column-row passes", pc, "slash", ps)

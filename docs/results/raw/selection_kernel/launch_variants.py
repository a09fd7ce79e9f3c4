import torch
import megatron_mtraining.patterns.triton.select as M
from tests.helpers.select_ref import torch_select, assert_same_selection
torch.manual_seed(0)
def heavy(h, S):
    x = torch.rand(1, h, S, dtype=torch.float64) ** 12; x[..., :4] += 5.0
    return (x / x.sum(-1, keepdim=True) * 64).float().cuda()
def slash(h, nb):
    d = torch.arange(nb, dtype=torch.float64)
    s = (1.0 / (d + 1) ** 1.1) * (0.2 + torch.rand(1, h, nb, dtype=torch.float64))
    return (s / s.sum(-1, keepdim=True) * 64).cuda()
def tm(fn, n=30):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2] * 1e3
cases = {"9x32K": (9, 32768), "16x128K": (16, 131072), "9x128K": (9, 131072)}
print("variant".ljust(16), *[c.rjust(10) for c in cases], "(pair: columns fp32 + slash fp64, one launch; us)")
rows = {}
for tag, shape in [("c2048w8", (2048, 8)), ("c4096w16", (4096, 16)), ("c8192w16", (8192, 16)), ("c1024w4", (1024, 4)), ("c4096w8", (4096, 8))]:
    M.launch_shape = lambda n, shape=shape: shape
    out = []
    for name, (h, S) in cases.items():
        col, sl = heavy(h, S), slash(h, S // 64)
        kinds = [(sl, 2, 1024, 0.98 * 64, False, min(1024, S // 64), 64), (col, 64, 4096, 0.98 * 64, False, 4096, 64)]
        got = M.select_line_kinds(*kinds)
        for g, k in zip(got, kinds):
            assert_same_selection(g, torch_select(*k), k[0].shape[-1], (tag, name))
        out.append(tm(lambda: M.select_line_kinds(*kinds)))
    print(tag.ljust(16), *[f"{t:10.1f}" for t in out])

"""Selection kernel: RADIX (capped count's threshold first by a radix search) vs LOCKSTEP (main), same rows,
each checked against the torch selection first. One JSON line per case."""
import json, sys, torch
import megatron_mtraining.patterns.triton.select as OLD
import megatron_mtraining.patterns.triton.select_radix as NEW
import megatron_mtraining.patterns.triton.select_radix_bis as BIS
from tests.helpers.select_ref import assert_same_selection, torch_select

def tm_us(fn, n=30):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2] * 1e3

def columns(h, S, kind):
    x = torch.rand(1, h, S, dtype=torch.float64)
    if kind == "heavy": x = x ** 12; x[..., :4] += 5.0
    if kind == "peaky": x = x ** 60; x[..., :4] += 20.0
    return (x / x.sum(-1, keepdim=True) * 64).float().cuda()

def slash(h, nb):
    d = torch.arange(nb, dtype=torch.float64)
    s = (1.0 / (d + 1) ** 1.1) * (0.2 + torch.rand(1, h, nb, dtype=torch.float64))
    return (s / s.sum(-1, keepdim=True) * 64).cuda()

torch.manual_seed(0)
variants = {"lockstep": (OLD, {}), "radix6_bisect": (BIS, dict(DIGIT=6)), "radix6": (NEW, dict(DIGIT=6)),
            "radix8": (NEW, dict(DIGIT=8))}
def run(tag, ks):
    mod, over = variants[tag]
    old = {k: getattr(mod, k) for k in over}
    for k, v in over.items(): setattr(mod, k, v)
    try: return mod.select_line_kinds(*ks)
    finally:
        for k, v in old.items(): setattr(mod, k, v)
for S in (32768, 131072):
    for kind in ("heavy", "uniform", "peaky"):
        col, sl = columns(9, S, kind), slash(9, S // 64)
        nb = S // 64
        caps = (2048, 256)
        kinds = [(sl, 2, caps[1], 0.98 * 64, False, min(caps[1], nb), 64), (col, 64, caps[0], 0.98 * 64, False, caps[0], 64)]
        for tag in variants:
            got = run(tag, kinds)
            for g, k in zip(got, kinds):
                assert_same_selection(g, torch_select(*k), k[0].shape[-1], (tag, S, kind))
            us = tm_us(lambda: run(tag, kinds))
            print(json.dumps(dict(seq=S, rows=kind, caps=list(caps), launch="pair", variant=tag, us=round(us, 1),
                                  kept=[float(g[1].float().mean()) for g in got], same_selection_as_torch=True)), flush=True)

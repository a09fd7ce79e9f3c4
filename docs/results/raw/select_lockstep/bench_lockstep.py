"""Selection kernel: step 2's passes also advancing step 3's search for a capped count (select.LOCKSTEP, the
default) against the searches one after the other (LOCKSTEP = False, same launch registers) and against the
kernel of 4073e91 (before/select.py of the job, imported from its file), per pair launch (block diagonals fp64 +
columns fp32, one launch, as the estimator runs it at cp 1) and per kind alone. Every variant's selection is
first checked against the torch selection. One JSON line per (case, launch, variant) on stdout.

    PYTHONPATH=. python docs/results/raw/select_lockstep/bench_lockstep.py     # before/select.py from 4073e91
Rows: heavy-tailed synthetic column scores (a uniform variable to the 12th power, 4 dominant floors) and
near-uniform ones (a uniform variable, as random weights give), caps of configs/long_context_r098.yaml (2048
columns, 256 block diagonals; 64 sink floors, 2 local floors) and 4096 / 1024; 9 heads at 32K and 128K.
"""
import importlib.util
import json

import torch

import megatron_mtraining.patterns.triton.select as M
from tests.helpers.select_ref import assert_same_selection, torch_select


def tm_us(fn, n=40):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2] * 1e3


def columns(h, S, kind):
    x = torch.rand(1, h, S, dtype=torch.float64)
    if kind == "heavy":
        x = x ** 12
        x[..., :4] += 5.0
    return (x / x.sum(-1, keepdim=True) * 64).float().cuda()


def slash(h, nb):
    d = torch.arange(nb, dtype=torch.float64)
    s = (1.0 / (d + 1) ** 1.1) * (0.2 + torch.rand(1, h, nb, dtype=torch.float64))
    return (s / s.sum(-1, keepdim=True) * 64).cuda()


if __name__ == "__main__":
    torch.manual_seed(0)
    spec = importlib.util.spec_from_file_location("select_4073e91", "before/select.py")
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)

    def run(tag, ks):
        if tag == "4073e91":
            return before.select_line_kinds(*ks)
        M.LOCKSTEP = tag == "lockstep"
        try:
            return M.select_line_kinds(*ks)
        finally:
            M.LOCKSTEP = True

    for S in (32768, 131072):
        for kind in ("heavy", "uniform"):
            col, sl = columns(9, S, kind), slash(9, S // 64)
            nb = S // 64
            for caps in ((2048, 256), (4096, 1024)):
                kinds = [(sl, 2, caps[1], 0.98 * 64, False, min(caps[1], nb), 64),
                         (col, 64, caps[0], 0.98 * 64, False, caps[0], 64)]
                for launch, ks in (("pair", kinds), ("columns", kinds[1:])):
                    for tag in ("4073e91", "sequential", "lockstep"):
                        got = run(tag, ks)
                        for g, k in zip(got, ks):
                            assert_same_selection(g, torch_select(*k), k[0].shape[-1], (tag, S, kind, caps))
                        us = tm_us(lambda: run(tag, ks))
                        print(json.dumps(dict(seq=S, rows=kind, caps=list(caps), launch=launch, variant=tag,
                                              us=round(us, 1), kept=[float(g[1].float().mean()) for g in got],
                                              same_selection_as_torch=True)), flush=True)

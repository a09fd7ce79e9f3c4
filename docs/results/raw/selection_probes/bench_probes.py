"""Selection kernel: keys tested per search step (PROBES) and loop shapes, timed per pair launch (columns
fp32 + block diagonals fp64, one launch) on the synthetic score rows of the selection-kernel record, each
checked against the torch selection first. Writes one JSON line per (variant, case) to argv[1].

Needs the kernel with the PROBES constant (commit 54118c8); run from the repository root with PYTHONPATH=.
"""
import json
import sys
import time

import torch

import megatron_mtraining.patterns.triton.select as M
from tests.helpers.select_ref import assert_same_selection, torch_select

torch.manual_seed(0)


def heavy(h, S):
    x = torch.rand(1, h, S, dtype=torch.float64) ** 12
    x[..., :4] += 5.0
    return (x / x.sum(-1, keepdim=True) * 64).float().cuda()


def slash(h, nb):
    d = torch.arange(nb, dtype=torch.float64)
    s = (1.0 / (d + 1) ** 1.1) * (0.2 + torch.rand(1, h, nb, dtype=torch.float64))
    return (s / s.sum(-1, keepdim=True) * 64).cuda()


def tm(fn, n=30):
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


cases = {"9x32K": (9, 32768), "9x128K": (9, 131072), "16x128K": (16, 131072)}
inputs = {}
for name, (h, S) in cases.items():
    col, sl = heavy(h, S), slash(h, S // 64)
    inputs[name] = [(sl, 2, 1024, 0.98 * 64, False, min(1024, S // 64), 64),
                    (col, 64, 4096, 0.98 * 64, False, 4096, 64)]
variants = [  # (tag, probes, (chunk, warps) up to LONG_ROW lines, (chunk, warps) beyond)
    ("p1", 1, (2048, 8), (8192, 16)),
    ("p2", 2, (2048, 8), (8192, 16)),
    ("p4", 4, (2048, 8), (8192, 16)),
    ("p4_long4096", 4, (2048, 8), (4096, 16)),
    ("p8_1024", 8, (1024, 8), (2048, 16)),
]
out = open(sys.argv[1], "w")
for tag, probes, short, long in variants:
    M.PROBES = probes
    M.launch_shape = lambda n, short=short, long=long: short if n <= M.LONG_ROW else long
    for name, kinds in inputs.items():
        t0 = time.time()
        got = M.select_line_kinds(*kinds)
        for g, k in zip(got, kinds):
            assert_same_selection(g, torch_select(*k), k[0].shape[-1], (tag, name))
        us = tm(lambda: M.select_line_kinds(*kinds))
        rec = {"variant": tag, "probes": probes, "short": short, "long": long, "case": name,
               "us_per_pair_launch": round(us, 1), "same_selection_as_torch": True,
               "first_call_s": round(time.time() - t0, 2)}
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n"); out.flush()

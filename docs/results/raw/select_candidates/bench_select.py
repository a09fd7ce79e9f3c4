"""Selection kernel: steps 2-3 on the candidates under the cap bound (select.FAST, the default) against the
bisection by full passes (FAST = False, the kernel before), per pair launch (block diagonals fp64 + columns
fp32, one launch, as the estimator runs it at cp 1) and per kind alone; with ``STAGES=1`` also the row loops
with software pipelining (``tl.range(..., num_stages=s)``). Every variant's selection is first checked against the torch
selection. One JSON line per (case, variant) on stdout.

    PYTHONPATH=. python docs/results/raw/select_candidates/bench_select.py     # at commit 28c5e4a (select.FAST)
Cases: synthetic heavy-tailed column scores (the selection-kernel record's rows) at the caps of
configs/long_context_r098.yaml (2048 columns, 256 block diagonals, 64 sink floors, 2 local floors) and at the
record's 4096/1024 caps; 9 heads (SmolLM2-135M) and 16 (Qwen2.5-3B) at 32K and 128K.
"""
import importlib.util
import inspect
import json
import os
import tempfile

import torch

import megatron_mtraining.patterns.triton.select as M
from tests.helpers.select_ref import assert_same_selection, torch_select


def variant(tag, repl):
    src = inspect.getsource(M).replace("range(0, N, CHUNK)", repl)
    path = os.path.join(tempfile.mkdtemp(), f"select_{tag}.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"select_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def heavy(h, S):
    x = torch.rand(1, h, S, dtype=torch.float64) ** 12
    x[..., :4] += 5.0
    return (x / x.sum(-1, keepdim=True) * 64).float().cuda()


def slash(h, nb):
    d = torch.arange(nb, dtype=torch.float64)
    s = (1.0 / (d + 1) ** 1.1) * (0.2 + torch.rand(1, h, nb, dtype=torch.float64))
    return (s / s.sum(-1, keepdim=True) * 64).cuda()


if __name__ == "__main__":
    torch.manual_seed(0)
    mods = {"candidates": (M, True), "passes": (M, False)}
    if os.environ.get("STAGES"):            # the software-pipelined loops (slower in the first run: not the default)
        for tag, st in (("candidates_stages2", 2), ("candidates_stages3", 3)):
            try:
                mods[tag] = (variant(tag, f"tl.range(0, N, CHUNK, num_stages={st})"), True)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(variant=tag, error=repr(e)[:300])), flush=True)
    cases = {}
    for h, S in ((9, 32768), (9, 131072), (16, 131072)):
        col, sl = heavy(h, S), slash(h, S // 64)
        nb = S // 64
        cases[f"{h}x{S // 1024}K_r098"] = [(sl, 2, 256, 0.98 * 64, False, min(256, nb), 64),
                                           (col, 64, 2048, 0.98 * 64, False, 2048, 64)]
        cases[f"{h}x{S // 1024}K_cap4096"] = [(sl, 2, 1024, 0.98 * 64, False, min(1024, nb), 64),
                                              (col, 64, 4096, 0.98 * 64, False, 4096, 64)]
    for name, kinds in cases.items():
        for tag, (mod, fast) in mods.items():
            mod.FAST = fast
            try:
                for sub, ks in (("pair", kinds), ("columns", kinds[1:])):
                    got = mod.select_line_kinds(*ks)
                    for g, k in zip(got, ks):
                        assert_same_selection(g, torch_select(*k), k[0].shape[-1], (tag, name))
                    us = tm_us(lambda: mod.select_line_kinds(*ks))
                    print(json.dumps(dict(case=name, launch=sub, variant=tag, us=round(us, 1),
                                          kept=[int(g[1].float().mean()) for g in got],
                                          same_selection_as_torch=True)), flush=True)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(case=name, variant=tag, error=repr(e)[:300])), flush=True)
        M.FAST = True

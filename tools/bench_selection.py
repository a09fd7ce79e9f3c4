#!/usr/bin/env python3
"""Torch ops, sorts, host syncs and time of the estimator's selection and the index conversion: the
current code against the frozen pre-``fast-selection`` oracle kept in
``tests/unit/test_selection_equivalence.py``.

On synthetic scores (``[1, heads, S]`` column scores: heavy-tailed, 4 sink columns; ``[1, heads, S/64]``
slash scores decaying with the offset; each row normalized to the probe mass ``last_q``) with the
config's budgets (default ``configs/e2e_sparse.yaml``), CP=1, for each sequence length:

* ``select``: budgets and selection from the scores (``estimator._select`` vs the oracle's
  ``old_select``), i.e. ``estimate_vertical_slash`` after the score kernels; with ``--device cuda`` (or the
  CPU under ``TRITON_INTERPRET=1``) also ``select_kernel``: ``_select`` through the Triton selection kernel
  (:mod:`megatron_mtraining.patterns.triton.select`, static widths as on CUDA), checked to keep the same
  lines;
* ``convert``: :func:`~megatron_mtraining.patterns.convert.convert_pattern` vs ``old_convert_pattern``
  on the selected pattern (which both sides must produce bit for bit: checked).

Counts (one call, under a ``TorchDispatchMode``): ``kernels`` = aten ops that launch work on a GPU
(views and CPU-scalar wrappers excluded), ``sorts`` (sort/argsort/topk), ``syncs`` = device-to-host
reads (``_local_scalar_dense``: ``.item()`` / ``int(t)``; ``Tensor.tolist``; ``nonzero``) plus
host-to-device copies (``torch.tensor(..., device=)``, and ``Tensor.to(device)`` of the probe
gather's host index tensors: a stream sync on CUDA unless pinned and non-blocking; the other
``.to(device=...)`` calls here move tensors already on the device). Reads of the probe gather's
host-side owner map (CPU tensors on any machine: no device sync) are reported apart
(``host_only``); ops run by the Triton CPU interpreter (``impl="triton"``: one kernel launch each
on a GPU) are not counted. Triton launches are not aten ops: the kernel row's counts are its
output allocations only. Times: median of ``--repeats`` by the shared timer (CUDA events with ``--device
cuda``; on the CPU the wall clock, only a proxy for the GPU, where these ops are launch- and sync-bound at
small S and bandwidth-bound at large S). ``--col-dtype fp32`` hands the selection fp32 column scores, as the
fused score kernels do when the probes span one query block (the oracle sees their fp64 copies).

    python3 -m tools.bench_selection --seqs 8192,65536 --repeats 5 [--profile] [--json out.json]   # from the checkout
    python3 -m tools.bench_selection --device cuda --col-dtype fp32 --heads 9 --seqs 32768,131072 --estimate-seq 0
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

from megatron_mtraining.bench import measure, result_record, structured_qkv, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_NO_KERNEL = {"view", "unsqueeze", "squeeze", "expand", "slice", "select", "alias", "permute", "reshape",
              "_unsafe_view", "as_strided", "t", "transpose", "detach", "lift_fresh", "scalar_tensor"}
_D2H = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "_unique2"}
_HOST_ONLY = {"_gather_probe_queries", "old_gather_probe_queries"}


def count_ops(fn):
    """``(result, {kernels, sorts, syncs, ops})`` of one call of ``fn``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = collections.Counter()
    extra = collections.Counter()

    def caller(names=_HOST_ONLY) -> str:
        """``"host"``: called from the probe gather's owner map (index tensors on the host on any
        machine); ``"triton"``: by the Triton CPU interpreter running a kernel (one launch on a GPU)."""
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_name in names:
                return "host"
            if str(f.f_globals.get("__name__", "")).startswith("triton."):
                return "triton"
            f = f.f_back
        return ""

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            where = caller()
            if where == "triton":
                extra["interpreter"] += 1
            elif name in _D2H and where == "host":
                extra["host"] += 1
            else:
                ops[name] += 1
            return func(*args, **(kwargs or {}))

    orig_tolist, orig_to, orig_tensor = torch.Tensor.tolist, torch.Tensor.to, torch.tensor

    def tolist(self):
        where = caller()
        if where != "triton":
            extra["host" if where == "host" else "tolist"] += 1
        return orig_tolist(self)

    def to(self, *a, **kw):     # a host index tensor of the probe gather sent to the device
        if ("device" in kw or any(isinstance(x, (torch.device, str)) for x in a)) and caller() == "host":
            extra["h2d"] += 1
        return orig_to(self, *a, **kw)

    def tensor(*a, **kw):
        if kw.get("device") is not None:
            extra["h2d"] += 1
        return orig_tensor(*a, **kw)

    torch.Tensor.tolist, torch.Tensor.to, torch.tensor = tolist, to, tensor
    try:
        with Mode():
            out = fn()
    finally:
        torch.Tensor.tolist, torch.Tensor.to, torch.tensor = orig_tolist, orig_to, orig_tensor
    kern = {k: v for k, v in ops.items() if k not in _NO_KERNEL}
    syncs = sum(v for k, v in kern.items() if k in _D2H) + extra["tolist"] + extra["h2d"]
    return out, {"kernels": sum(v for k, v in kern.items() if k not in _D2H),
                 "sorts": sum(v for k, v in kern.items() if k in ("sort", "argsort", "topk")),
                 "syncs": syncs, "h2d": extra["h2d"], "host_only": extra["host"],
                 "ops": dict(sorted(kern.items(), key=lambda kv: -kv[1]))}


def synthetic_scores(S: int, heads: int, last_q: int, block_size: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    col = torch.rand(1, heads, S, generator=g, dtype=torch.float64) ** 12
    col[..., :4] += 5.0
    col = col / col.sum(-1, keepdim=True) * last_q
    nb = S // block_size
    d = torch.arange(nb, dtype=torch.float64)
    slash = (1.0 / (d + 1) ** 1.1) * (0.2 + torch.rand(1, heads, nb, generator=g, dtype=torch.float64))
    return col, slash / slash.sum(-1, keepdim=True) * last_q


def median_time(fn, repeats: int, device="cpu") -> float:
    """Median seconds of ``repeats`` calls after one warm-up (:func:`megatron_mtraining.bench.measure`: CUDA
    events on a CUDA device, else the wall clock)."""
    return measure(fn, device=device, warmup=1, repeats=repeats).median_s


def _oracle():
    """The frozen oracle module (``tests/unit/test_selection_equivalence.py``): importable from a checkout."""
    try:
        import tests.unit.test_selection_equivalence as oracle
    except ImportError as e:
        raise SystemExit("error: bench_selection compares against tests/unit/test_selection_equivalence.py: run it from the "
                         "repository root as `python -m tools.bench_selection` (or with PYTHONPATH=<checkout>); "
                         f"{e}") from e
    return oracle


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="8192,32768,65536")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2,
                    help="KV heads of the --estimate-seq count's k (a divisor of --heads; checked when that "
                         "count runs)")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "e2e_sparse.yaml"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of the new conversion at each S")
    ap.add_argument("--estimate-seq", type=int, default=2048,
                    help="also count the whole estimate_vertical_slash (fp32 q [1, S, heads, 64], "
                         "k [1, S, kv_heads, 64]) at this S (0: skip)")
    ap.add_argument("--estimate-impl", choices=("torch", "triton"), default="torch",
                    help="score implementation of that count (triton on the CPU: set TRITON_INTERPRET=1)")
    ap.add_argument("--device", default="cpu", help="where the scores live and the selection runs (cpu, cuda)")
    ap.add_argument("--col-dtype", choices=("fp64", "fp32"), default="fp64",
                    help="dtype of the column scores handed to the selection")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.heads < 1 or args.kv_heads < 1:
        ap.error(f"--heads ({args.heads}) and --kv-heads ({args.kv_heads}) must be positive")
    if args.estimate_seq and args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a positive multiple of --kv-heads ({args.kv_heads}) "
                 f"for the --estimate-seq count")

    for flag, val, lo in (("--repeats", args.repeats, 1), ("--threads", args.threads, 0),
                          ("--estimate-seq", args.estimate_seq, 0)):
        if val < lo:
            ap.error(f"{flag} must be >= {lo}, got {val}")

    import torch

    from megatron_mtraining.bench.cli import check_seq_len, number_list
    from megatron_mtraining.config import load_mtraining_config
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns import estimator as E
    from megatron_mtraining.patterns.convert import convert_pattern

    try:
        full_cfg = load_mtraining_config(args.config)
    except (OSError, ValueError) as e:
        ap.error(f"--config {args.config}: {e}")
    if not full_cfg.sparse:
        ap.error(f"--config {args.config}: pattern {full_cfg.pattern!r}; the selection needs a sparse config "
                 "(pattern: vertical_slash)")
    cfg = full_cfg.vertical_slash
    layout = Layout("striped", 1, cfg.block_size)
    L = cfg.last_q
    seqs = number_list(ap, "--seqs", args.seqs, int)
    for S in seqs + ([args.estimate_seq] if args.estimate_seq else []):
        flag = "--seqs" if S in seqs else "--estimate-seq"
        if S <= L:
            ap.error(f"{flag}: {S} must be larger than the config's last_q {L} (the probe rows)")
        check_seq_len(ap, flag, layout, S)

    from megatron_mtraining.common import triton_runs_on

    try:
        dev = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r}: {e}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available")
    kernel = triton_runs_on(dev)
    oracle = _oracle()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for S in seqs:
        col, slash = (t.to(dev) for t in synthetic_scores(S, args.heads, L, cfg.block_size, seed=S))
        if args.col_dtype == "fp32":
            col = col.float()
        kp = torch.arange(S, device=dev)
        static = dev.type == "cuda"                    # the estimator's default widths on this device
        fns = {"select_old": lambda: oracle.old_select(slash, col.double(), kp, S, L, cfg),
               "select_new": lambda: E._select(slash, col, kp, layout, 0, S, L, cfg, static_widths=static)}
        pat_new, pat_old = fns["select_new"](), fns["select_old"]()
        if static:
            assert pat_new.same_selection(pat_old), S
        else:
            oracle.assert_same_pattern(pat_new, pat_old, S)
        if kernel:
            fns["select_kernel"] = lambda: E._select(slash, col, kp, layout, 0, S, L, cfg, static_widths=True,
                                                     fused=True)
            assert fns["select_kernel"]().same_selection(pat_old), S
        # the conversion of the pattern with the largest-count widths (the oracle's; padding changes the widths)
        pat_conv = E._select(slash, col, kp, layout, 0, S, L, cfg, static_widths=False) if static else pat_new
        fns["convert_old"] = lambda: oracle.old_convert_pattern(pat_old, layout, 0)
        fns["convert_new"] = lambda: convert_pattern(pat_conv, layout, 0)
        if not static:      # on a device the conversion's widths differ from the oracle's (checked by the GPU tests)
            oracle.assert_same_steps(fns["convert_new"](), fns["convert_old"](), S)
        row = {"seq": S, "heads": args.heads, "mean_slash": float(pat_new.slash_count.float().mean()),
               "mean_vertical": float(pat_new.vertical_count.float().mean())}
        for name, fn in fns.items():
            row[name + "_s"] = median_time(fn, args.repeats, dev)
            row[name] = count_ops(fn)[1]
        rows.append(row)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fns["convert_new"]()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

    est = None
    if args.estimate_seq:
        S = args.estimate_seq
        q, k, _ = structured_qkv(S, args.heads, args.kv_heads, 64, torch.device("cpu"), seed=S)
        q, k = q.float(), k.float()
        kw = dict(layout=layout, config=cfg, impl=args.estimate_impl)
        new, c_new = count_ops(lambda: E.estimate_vertical_slash(q, k, **kw))
        old, c_old = count_ops(lambda: oracle.old_estimate_vertical_slash(q, k, **kw))
        oracle.assert_same_pattern(new, old, "estimate")
        est = {"seq": S, "heads": args.heads, "kv_heads": args.kv_heads, "impl": args.estimate_impl,
               "estimate_old": c_old, "estimate_new": c_new}

    print(f"{'seq':>7} {'slash':>6} {'vert':>6} | {'select old ms':>13} {'new ms':>8} {'kernel ms':>9} | "
          f"{'convert old ms':>14} {'new ms':>8}")
    for r in rows:
        k_ms = f"{r['select_kernel_s'] * 1e3:>9.3f}" if "select_kernel_s" in r else f"{'-':>9}"
        print(f"{r['seq']:>7} {r['mean_slash']:>6.0f} {r['mean_vertical']:>6.0f} | {r['select_old_s'] * 1e3:>13.3f} "
              f"{r['select_new_s'] * 1e3:>8.3f} {k_ms} | {r['convert_old_s'] * 1e3:>14.3f} "
              f"{r['convert_new_s'] * 1e3:>8.3f}")
    print(f"\n{'(one call)':>12} {'kernels':>8} {'sorts':>6} {'syncs':>6}   ops")
    for name in ("select_old", "select_new", "select_kernel", "convert_old", "convert_new"):
        if name not in rows[-1]:
            continue
        c = rows[-1][name]
        print(f"{name:>12} {c['kernels']:>8} {c['sorts']:>6} {c['syncs']:>6}   {c['ops']}")
    if est:
        print(f"whole estimate_vertical_slash (impl {est['impl']}, S={est['seq']}; score ops included):")
        for name in ("estimate_old", "estimate_new"):
            c = est[name]
            print(f"{name:>12} {c['kernels']:>8} {c['sorts']:>6} {c['syncs']:>6}   (of which h2d {c['h2d']}; "
                  f"host-only reads apart: {c['host_only']})  {c['ops']}")
    if args.json:
        write_json(args.json, result_record({"config": args.config, "device": str(dev), "col_dtype": args.col_dtype,
                                             "rows": rows, "estimate": est}, device=dev))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Share of the online pattern estimation in MTraining's sparse attention (target: pattern estimation
<= 5 % of the sparse attention time).

For every sequence length, on structured synthetic q/k with vertical-slash structure
(:func:`megatron_mtraining.bench.structured_qkv`, Qwen2.5-3B attention shape: q ``[1, S, 16, 128]``,
k/v ``[1, S, 2, 128]``, bf16), CP=1, the config's estimator budgets (default
``configs/e2e_sparse.yaml``):

* ``estimate_s``: :func:`~megatron_mtraining.patterns.estimator.estimate_vertical_slash` +
  :func:`~megatron_mtraining.patterns.convert.convert_pattern` (index conversion), no grad; split
  into ``scores_s`` (``estimate_vertical_slash`` alone: probe gather, scores, budgets, selection)
  and ``convert_s`` (``convert_pattern`` alone, on the estimated pattern), each timed on its own;
* ``impl``: the estimator's score implementation that ran (``--impl``: ``auto`` = the Triton
  kernels on CUDA, the fp64 torch path on the CPU; ``triton`` on the CPU needs
  ``TRITON_INTERPRET=1``); it is used in every column, ``total_s`` included;
* ``kernels_s``: the sparse attention fwd+bwd on that fixed pattern (the step kernel through
  :class:`~megatron_mtraining.ring.RingAttentionFunc`, estimation excluded);
* ``total_s``: :func:`~megatron_mtraining.ring.sparse.sparse_ring_attention` fwd+bwd
  (estimation included, as in training; the config's ``columns`` schedule — ``kernels_s`` always
  runs the columns inside the step, which at CP=1 is the same work);
* ``backward_plans_s`` (CUDA only): building the step's kernel plan
  (:func:`~megatron_mtraining.ops.triton.plan_for`, as in training) and its backward index plans from
  scratch (:func:`~megatron_mtraining.ops.triton.launch.prebuild_backward_plans`: inverted block index,
  column union), which ``kernels_s`` reuses from its cache (before ``plan_for`` was included, this field
  timed the data-dependent backward plans alone: not comparable with such older rows); ``total_plans_in_backward_s`` (CUDA
  only): ``total_s`` with ``prebuild_backward_plans=False`` in the backend, i.e. those plans built inside the
  backward instead of on a side stream during the forward kernel;
* ``estimate_share`` = ``estimate_s / kernels_s`` (the target's ratio) and
  ``estimate_s / total_s``.

Times: seconds, median of ``--repeats`` after ``--warmup`` (:func:`megatron_mtraining.bench.measure`:
CUDA events on the GPU, wall clock on the CPU). Prints a table; ``--json OUT`` writes the rows.

    python3 tools/bench_estimator.py --seqs 65536,131072,262144 --json est.json     # H200
    python3 tools/bench_estimator.py --seqs 65536,131072 --impl torch               # the fp64 path
    python3 tools/bench_estimator.py --seqs 131072 --impl triton --profile 30       # where the time goes
    python3 tools/bench_estimator.py --device cpu --seqs 1024 --heads 4 --kv-heads 2 --head-dim 64
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from megatron_mtraining import bench
from megatron_mtraining.bench import kept_fraction, result_record, structured_qkv, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timer(device):
    """``run(fn, warmup, repeats)``: median seconds of ``fn`` on ``device`` (:func:`megatron_mtraining.bench.measure`)."""
    def run(fn, warmup: int, repeats: int) -> float:
        return bench.measure(fn, device=device, warmup=warmup, repeats=repeats).median_s
    return run


def measure(seq: int, args) -> dict:
    import torch

    from megatron_mtraining.config import load_mtraining_config
    from megatron_mtraining.patterns.convert import convert_pattern
    from megatron_mtraining.patterns.estimator import estimate_vertical_slash, resolve_impl
    from megatron_mtraining.ops.backends import select_backend
    from megatron_mtraining.ring import RingAttentionFunc
    from megatron_mtraining.ring.sparse import sparse_ring_attention

    dev = torch.device(args.device)
    cfg = load_mtraining_config(args.config)
    layout, vs = cfg.make_layout(1), cfg.vertical_slash
    q, k, v = structured_qkv(seq, args.heads, args.kv_heads, args.head_dim, dev, seed=seq)
    if dev.type == "cpu":
        q, k, v = q.float(), k.float(), v.float()
    scale = 1.0 / math.sqrt(args.head_dim)
    timeit = _timer(dev)

    impl = resolve_impl(args.impl, q, k)
    # the ring's kernels for this device, with the estimator pinned to this run's impl
    def ring_backend(prebuild: bool = True):
        return dataclasses.replace(select_backend("auto", device=dev, dtype=q.dtype, head_dim=args.head_dim,
                                                  seq_len_local=seq, sparse=True, prebuild_backward_plans=prebuild),
                                   estimator_impl=impl)

    backend = ring_backend()

    def scores():
        with torch.no_grad():
            return estimate_vertical_slash(q, k, layout=layout, group=None, config=vs, softmax_scale=scale, impl=impl)

    def convert(pat):
        with torch.no_grad():
            return convert_pattern(pat, layout, 0)

    def estimate():
        pat = scores()
        return pat, convert(pat)

    pattern, steps = estimate()
    kernel = backend.sparse_step(steps, scale)
    dout = torch.ones_like(q)

    def kernels():
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        RingAttentionFunc.apply(qq, kk, vv, kernel, None, backend.delta).backward(dout)

    def total(backend=backend):
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        sparse_ring_attention(qq, kk, vv, layout=layout, group=None, config=vs, softmax_scale=scale,
                              columns=cfg.columns, backend=backend).backward(dout)

    t_est = timeit(estimate, args.warmup, args.repeats)
    if args.profile:
        print(f"--- profile: estimate (scores + convert) at seq {seq}, impl {impl}, one call after warm-up ---")
        print(profile_table(estimate, dev, args.profile))
    t_scores = timeit(scores, args.warmup, args.repeats)
    t_conv = timeit(lambda: convert(pattern), args.warmup, args.repeats)
    t_ker = timeit(kernels, args.warmup, args.repeats)
    t_tot = timeit(total, args.warmup, args.repeats)
    t_plans = t_tot_late = None
    if dev.type == "cuda":
        from megatron_mtraining.ops.triton import plan_for
        from megatron_mtraining.ops.triton.launch import prebuild_backward_plans

        def plans():     # the step's plan and its backward index plans, from scratch (no cache), as in training
            plan = plan_for(steps[0])
            prebuild_backward_plans(plan, q.shape, k.shape, deterministic=True)
            torch.cuda.synchronize()       # the plans are built on a side stream: the end event follows them

        t_plans = timeit(plans, args.warmup, args.repeats)
        if args.profile:
            print(f"--- profile: backward plans at seq {seq}, one call after warm-up ---")
            print(profile_table(plans, dev, args.profile))
        late = ring_backend(prebuild=False)
        t_tot_late = timeit(lambda: total(late), args.warmup, args.repeats)     # the backward builds them
    return {"seq": seq, "device": str(dev), "impl": impl, "estimate_s": t_est, "scores_s": t_scores,
            "convert_s": t_conv, "kernels_s": t_ker, "total_s": t_tot,
            "backward_plans_s": t_plans, "total_plans_in_backward_s": t_tot_late,
            "estimate_share": t_est / t_ker, "estimate_share_of_total": t_est / t_tot,
            "kept_fraction": kept_fraction(pattern),
            "mean_slash_blocks": float(pattern.slash_count.float().mean()),
            "mean_vertical": float(pattern.vertical_count.float().mean())}


def profile_table(fn, device, rows: int) -> str:
    """``torch.profiler`` table of one call of ``fn``: the ``rows`` ops with the most device time
    (self CUDA time on the GPU, self CPU time on the CPU), with call counts."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def check_args(ap, args) -> list:
    """The sequence lengths, or ``ap.error`` (exit 2) naming the flag of a user mistake."""
    from megatron_mtraining.bench.cli import check_output_dir, check_seq_len
    from megatron_mtraining.config import load_mtraining_config

    try:
        cfg = load_mtraining_config(args.config)
    except (OSError, ValueError) as e:
        ap.error(f"--config {args.config}: {e}")
    if not cfg.sparse:
        ap.error(f"--config {args.config}: pattern {cfg.pattern!r}; the estimator needs a sparse config "
                 "(pattern: vertical_slash)")
    for flag, val, lo in (("--heads", args.heads, 1), ("--kv-heads", args.kv_heads, 1),
                          ("--head-dim", args.head_dim, 4), ("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1)):
        if val < lo:
            ap.error(f"{flag} must be >= {lo}, got {val}")
    if args.impl == "triton":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            ap.error("--impl triton: triton is not installed")
        if args.device != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            ap.error(f"--impl triton on --device {args.device} needs TRITON_INTERPRET=1 (the Triton CPU interpreter)")
    if args.heads % args.kv_heads:
        ap.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.head_dim % 4:
        ap.error(f"--head-dim must be a multiple of 4, got {args.head_dim}")
    check_output_dir(ap, "--json", args.json)
    layout, seqs = cfg.make_layout(1), []
    for tok in args.seqs.split(","):
        try:
            s = int(tok)
        except ValueError:
            ap.error(f"--seqs {args.seqs!r}: {tok!r} is not an integer")
        if s <= 64:
            ap.error(f"--seqs: {s} must be > 64 (the synthetic inputs put 64 sink tokens first)")
        check_seq_len(ap, "--seqs", layout, s)
        seqs.append(s)
    return seqs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="65536,131072,262144", help="comma-separated sequence lengths")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "e2e_sparse.yaml"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impl", choices=("auto", "torch", "triton"), default="auto",
                    help="estimator score implementation (estimate_vertical_slash impl=)")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="also print torch.profiler tables (top ROWS ops) of one estimate and (CUDA) one build of "
                         "the backward plans at each seq")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from megatron_mtraining.bench.cli import checked_device

    if checked_device(ap, args.device).type != args.device:
        ap.error(f"--device {args.device}: cpu or cuda (the current CUDA device), without an index")
    seqs = check_args(ap, args)
    rows = [measure(s, args) for s in seqs]

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.2f}"

    print(f"{'seq':>8} {'impl':>6} {'estimate ms':>12} {'scores ms':>10} {'convert ms':>11} {'bwd plans ms':>12} "
          f"{'kernels ms':>11} {'total ms':>9} {'total, plans in bwd':>19} {'est/kernels':>11} {'kept':>6} "
          f"{'slash':>6} {'vert':>6}")
    for r in rows:
        print(f"{r['seq']:>8} {r['impl']:>6} {r['estimate_s'] * 1e3:>12.2f} {r['scores_s'] * 1e3:>10.2f} "
              f"{r['convert_s'] * 1e3:>11.2f} {ms(r['backward_plans_s']):>12} {r['kernels_s'] * 1e3:>11.2f} "
              f"{r['total_s'] * 1e3:>9.2f} {ms(r['total_plans_in_backward_s']):>19} "
              f"{r['estimate_share']:>11.3f} {r['kept_fraction']:>6.3f} {r['mean_slash_blocks']:>6.1f} "
              f"{r['mean_vertical']:>6.0f}")
    if args.json:
        write_json(args.json, result_record({"config": args.config, "impl": args.impl, "rows": rows},
                                            device=args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())

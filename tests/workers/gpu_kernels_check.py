"""GPU accuracy and determinism check of the Triton kernels: the case list, the checks, and a CLI.

    pytest -m gpu tests/kernels/test_gpu_kernels.py               # one test per case
    python tests/workers/gpu_kernels_check.py --json OUT.json     # the same cases as one JSON report

For each case: bf16 (and fp16) inputs, our kernel vs an fp64 masked attention, and a bf16 torch
reference (tests/workers/gpu_common.py) vs the same fp64 oracle; the criterion is
``err(ours) <= 2 * err(bf16 reference)`` for out, lse, dQ, dK, dV separately (the non-deterministic
backward too, for dQ, dK, dV). Deterministic backward: three runs, bitwise equal. Outputs are
poisoned with NaN before each run; no NaN may appear. Cases (:data:`CASES`): synthetic
vertical-slash patterns (4K, 8K; head_dim 128 and 64; Qwen2.5-3B heads 16/2), the same with one
pattern per KV head (``kv_group``: per-group indices, Qwen2.5-3B 16/2 and SmolLM2 9/3), random indices with
blocks past the diagonal (1K), the dense position-mask step kernel on a causal shard (4K, 32K),
striped block-causal steps (owner < rank and owner > rank) and a zigzag step; the delta kernel
(``rowsum(dout * out)``) against fp64, within 2x torch fp32. :data:`SMOKE_CASES`: tiny fp16 cases
that run on the CPU under ``TRITON_INTERPRET=1`` (``--cpu-smoke``).
"""

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron_mtraining.layout import Layout  # noqa: E402
from megatron_mtraining.ops.dense_gpu import DenseGpuStepKernel  # noqa: E402
from megatron_mtraining.ops.triton import launch, plan_for  # noqa: E402
from megatron_mtraining.patterns.synthetic import vertical_slash_indices  # noqa: E402
from tests.workers.gpu_common import bf16_reference, dense_mask_rows, oracle, random_step_indices, rel_err  # noqa: E402

NAMES = ("out", "lse", "dq", "dk", "dv")


CFG = launch.DEFAULT_CONFIG          # launch parameters (--config overrides them)


@dataclass(frozen=True)
class Case:
    """One check: ``kind`` is ``"sparse"``, ``"dense"`` or ``"delta"``; ``args`` are the keyword
    arguments of :func:`sparse_case`, :func:`dense_case` or :func:`delta_case`; ``id`` names the
    test."""

    id: str
    name: str
    kind: str
    args: dict = field(default_factory=dict)


bf16, fp16 = torch.bfloat16, torch.float16

CASES = (
    Case("vs4k-90-d128", "vs 4K 90% d128 h16/2", "sparse",
         dict(s=4096, hq=16, hkv=2, d=128, dtype=bf16, sparsity=0.9)),
    Case("vs4k-90-d64", "vs 4K 90% d64 h16/2", "sparse",
         dict(s=4096, hq=16, hkv=2, d=64, dtype=bf16, sparsity=0.9, seed=1)),
    Case("vs4k-90-d128-fp16", "vs 4K 90% d128 h16/2 fp16", "sparse",
         dict(s=4096, hq=16, hkv=2, d=128, dtype=fp16, sparsity=0.9, seed=2)),
    Case("random1k-d128-past-diag", "random 1K d128 h8/2 (blocks past diag)", "sparse",
         dict(s=1024, hq=8, hkv=2, d=128, dtype=bf16, sparsity=0, seed=3, rand=True)),
    Case("vs4k-90-d128-kvg", "vs 4K 90% d128 h16/2 kv_group", "sparse",
         dict(s=4096, hq=16, hkv=2, d=128, dtype=bf16, sparsity=0.9, kv_group=True)),
    Case("vs4k-90-d64-kvg-h9", "vs 4K 90% d64 h9/3 kv_group", "sparse",
         dict(s=4096, hq=9, hkv=3, d=64, dtype=bf16, sparsity=0.9, kv_group=True)),
    Case("random1k-d64-kvg-h8", "random 1K d64 h8/2 kv_group (blocks past diag)", "sparse",
         dict(s=1024, hq=8, hkv=2, d=64, dtype=bf16, sparsity=0, rand=True, kv_group=True, seed=3)),
    Case("vs8k-95-d128", "vs 8K 95% d128 h16/2", "sparse",
         dict(s=8192, hq=16, hkv=2, d=128, dtype=bf16, sparsity=0.95, seed=4)),
    Case("dense-causal-4k-d128", "dense causal 4K d128 h16/2", "dense",
         dict(layout=("striped", 1, 64), rank=0, owner=0, seq=4096, hq=16, hkv=2, d=128, dtype=bf16)),
    Case("dense-striped-cp4-r2o1-16k", "dense striped cp4 r2<-o1 (incl) 16K", "dense",
         dict(layout=("striped", 4, 64), rank=2, owner=1, seq=16384, hq=16, hkv=2, d=128, dtype=bf16)),
    Case("dense-striped-cp4-r1o2-16k", "dense striped cp4 r1<-o2 (strict) 16K", "dense",
         dict(layout=("striped", 4, 64), rank=1, owner=2, seq=16384, hq=16, hkv=2, d=128, dtype=bf16)),
    Case("dense-zigzag-cp2-r0o1-8k-d64", "dense zigzag cp2 r0<-o1 8K d64", "dense",
         dict(layout=("zigzag", 2, 64), rank=0, owner=1, seq=8192, hq=16, hkv=2, d=64, dtype=bf16)),
    Case("dense-causal-32k-d128", "dense causal 32K d128 h16/2", "dense",
         dict(layout=("striped", 1, 64), rank=0, owner=0, seq=32768, hq=16, hkv=2, d=128, dtype=bf16)),
    Case("delta-128k-d128", "delta 128K d128 h16", "delta", dict(s=131072, hq=16, d=128, dtype=bf16)),
    Case("delta-32k-d64-fp16", "delta 32K d64 h16 fp16", "delta", dict(s=32768, hq=16, d=64, dtype=fp16)),
)

SMOKE_CASES = (
    Case("smoke-vs-512", "smoke vs 512", "sparse", dict(s=512, hq=2, hkv=1, d=64, dtype=fp16, sparsity=0.5)),
    Case("smoke-random-256", "smoke random 256", "sparse",
         dict(s=256, hq=2, hkv=1, d=64, dtype=fp16, sparsity=0, seed=3, rand=True)),
    Case("smoke-dense-striped", "smoke dense striped", "dense",
         dict(layout=("striped", 2, 64), rank=1, owner=0, seq=512, hq=2, hkv=1, d=64, dtype=fp16)),
)


def _inputs(b, s, hq, hkv, d, dtype, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h: torch.randn(b, s, h, d, generator=g, device=device).to(dtype)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _poisoned_run(fn, device):
    """Run with the caching allocator pre-filled with NaN so unwritten outputs show up."""
    junk = torch.full((1 << 28,) if torch.device(device).type == "cuda" else (16,), float("nan"), device=device)
    del junk
    return fn()


def check_case(name, q, k, v, dout, mask_fn, fwd, bwd, scale, bits_runs=3):
    """Errors of our forward / backward (deterministic and fast) and of the bf16 reference against
    the fp64 oracle; ``row["ok"]`` is the criterion of the module docstring."""
    t0 = time.time()
    device = q.device
    o64, l64, dq64, dk64, dv64, lse_g, delta_g = oracle(q, k, v, mask_fn, scale, dout)
    ref = bf16_reference(q, k, v, mask_fn, scale, dout)
    out, lse = _poisoned_run(lambda: fwd(q, k, v), device)
    # the step's backward with its own final lse/delta (from our forward, as the ring does)
    delta = launch.attention_delta(dout, out)          # the Triton delta kernel, as the ring computes it
    grads = [_poisoned_run(lambda: bwd(dout, q, k, v, lse, delta, True), device) for _ in range(bits_runs)]
    det_equal = all(all(torch.equal(a, b) for a, b in zip(grads[0], g)) for g in grads[1:])
    fast = bwd(dout, q, k, v, lse, delta, False)
    ours = (out, lse, *grads[0])
    gold = (o64, l64, dq64, dk64, dv64)
    e_ours = {n: rel_err(a, r) for n, a, r in zip(NAMES, ours, gold)}
    e_out_bf16 = rel_err(out.to(torch.bfloat16), o64)
    e_ref = {n: rel_err(a, r) for n, a, r in zip(NAMES, ref, gold)}
    e_fast = {n: rel_err(a, r) for n, a, r in zip(NAMES[2:], fast, gold[2:])}
    nan = any(bool(torch.isnan(t).any()) for t in (*ours, *fast))
    ratio = {n: e_ours[n] / max(e_ref[n], 1e-12) for n in NAMES}
    ok = (not nan) and det_equal and all(ratio[n] <= 2.0 for n in NAMES) and \
        all(e_fast[n] <= 2.0 * e_ref[n] for n in e_fast)
    return dict(case=name, dtype=str(q.dtype).replace("torch.", ""), shape=list(q.shape), kv_heads=k.shape[2],
                err_ours=e_ours, err_out_rounded_bf16=e_out_bf16, err_bf16_ref=e_ref, err_fast=e_fast,
                ratio=ratio, deterministic_bitwise=det_equal, nan=nan, ok=ok, seconds=round(time.time() - t0, 1))


def delta_case(name, s, hq, d, dtype, device="cuda"):
    """The delta kernel (``rowsum(dout * out)``, fp32) against fp64 and against torch in fp32."""
    t0 = time.time()
    g = torch.Generator(device=device).manual_seed(s + d)
    out = torch.randn(1, s, hq, d, generator=g, device=device).to(dtype)
    dout = torch.randn(1, s, hq, d, generator=g, device=device).to(dtype)
    ref = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    ours = launch.attention_delta(dout, out)
    torch32 = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    e_ours, e_t = rel_err(ours, ref), rel_err(torch32, ref)
    finite = bool(torch.isfinite(ours).all())
    ok = finite and e_ours <= max(2 * e_t, 1e-6)
    return dict(case=name, dtype=str(dtype).replace("torch.", ""), err_ours=e_ours, err_torch_fp32=e_t,
                finite=finite, ok=ok, seconds=round(time.time() - t0, 1))


def sparse_case(name, s, hq, hkv, d, dtype, sparsity, seed=0, rand=False, kv_group=False, device="cuda"):
    """Sparse forward / backward kernels on a vertical-slash (or random, ``rand``) causal step;
    ``kv_group``: one pattern per KV head (per-group indices, ``share_pattern: kv_group``)."""
    full_heads = hq
    if kv_group:
        hq = hkv                         # build hkv index rows
    if rand:
        gen = torch.Generator().manual_seed(seed)
        idx = random_step_indices(1, hq, s // 64, s // 64, True, gen, above_diag=True)
        idx.block_count, idx.block_index, idx.column_count, idx.column_index = (
            t.to(device) for t in (idx.block_count, idx.block_index, idx.column_count, idx.column_index))
    else:
        idx, _ = vertical_slash_indices(s, hq, sparsity, seed=seed, device=device)
    hq = full_heads
    q, k, v, dout = _inputs(1, s, hq, hkv, d, dtype, seed + 1, device)
    scale = d ** -0.5
    plan = plan_for(idx)
    full = idx.per_query_head(hq)
    mask_fn = lambda r0, r1: dense_mask_rows(full, r0, r1, s, device=device)  # noqa: E731
    fwd = lambda q, k, v: launch.sparse_forward(q, k, v, plan, scale, config=CFG)  # noqa: E731
    bwd = lambda do, q, k, v, lse, delta, det: launch.sparse_backward(  # noqa: E731
        do, q, k, v, lse, delta, plan, scale, det, config=CFG)
    return check_case(name, q, k, v, dout, mask_fn, fwd, bwd, scale)


def dense_case(name, layout, rank, owner, seq, hq, hkv, d, dtype, seed=0, device="cuda"):
    """The dense position-mask step kernel: rank ``rank``'s queries against ``owner``'s keys.
    ``layout``: ``(kind, cp_size, granularity)``."""
    layout = Layout(*layout)
    s = seq // layout.cp_size
    kern = DenseGpuStepKernel(layout, rank, seq, d ** -0.5, device=device, config=CFG)
    qp, kp = kern.q_pos, kern.k_pos(owner)
    q, k, v, dout = _inputs(1, s, hq, hkv, d, dtype, seed, device)
    mask_fn = lambda r0, r1: (kp[None, :] <= qp[r0:r1, None])[None, None].expand(1, hq, r1 - r0, s)  # noqa: E731
    fwd = lambda q, k, v: kern.forward(q, k, v, owner)  # noqa: E731
    bwd = lambda do, q, k, v, lse, delta, det: kern.backward(do, q, k, v, lse, delta, owner)  # noqa: E731
    return check_case(name, q, k, v, dout, mask_fn, fwd, bwd, d ** -0.5)


def run_case(case: Case, device="cuda") -> dict:
    """Run one :class:`Case` on ``device``; returns its result row (``row["ok"]``)."""
    fn = {"sparse": sparse_case, "dense": dense_case, "delta": delta_case}[case.kind]
    return fn(case.name, device=device, **case.args)


def describe(row: dict) -> str:
    """One line per result row."""
    if "err_torch_fp32" in row:
        return (f"{'OK ' if row['ok'] else 'BAD'} {row['case']:42s} "
                f"delta={row['err_ours']:.2e}/torch fp32 {row['err_torch_fp32']:.2e}")
    return (f"{'OK ' if row['ok'] else 'BAD'} {row['case']:42s} {row['dtype']:8s} "
            + " ".join(f"{n}={row['err_ours'][n]:.2e}/{row['err_bf16_ref'][n]:.2e}" for n in NAMES)
            + f" det={row['deterministic_bitwise']} nan={row['nan']} ({row['seconds']}s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the first two cases only")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny fp16 cases on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--config", default="",
                    help="launch.KernelConfig overrides, e.g. column_split=0,col_warps=4")
    args = ap.parse_args()
    global CFG
    for kv in filter(None, args.config.split(",")):
        key, val = kv.split("=")
        cur = getattr(CFG, key)          # AttributeError names an unknown field
        CFG = dataclasses.replace(CFG, **{key: type(cur)(int(val)) if isinstance(cur, (bool, int)) else type(cur)(val)})
    if args.config:
        print("KernelConfig", CFG, flush=True)
    if args.cpu_smoke:
        device, cases = "cpu", SMOKE_CASES
    else:
        print(torch.__version__, torch.cuda.get_device_name(), flush=True)
        device, cases = "cuda", CASES
    if args.quick:
        cases = cases[:2]
    results, oks = [], []
    for c in cases:
        try:
            row = run_case(c, device)
            results.append(row)
            print(describe(row), flush=True)
            oks.append(row["ok"])
        except Exception:
            traceback.print_exc()
            oks.append(False)
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"RESULT {'PASS' if all(oks) else 'FAIL'} {sum(oks)}/{len(oks)}", flush=True)


if __name__ == "__main__":
    main()

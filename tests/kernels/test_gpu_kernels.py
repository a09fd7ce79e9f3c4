"""Triton sparse / dense step kernels and the delta kernel on a GPU (marker ``gpu``; skipped without CUDA).

Cases and checks: tests/workers/gpu_kernels_check.py (one test per case of its ``CASES``). Per
case: out, LSE, dQ, dK, dV of our kernels (bf16 or fp16 inputs) against an fp64 masked attention,
each within 2x the error of a bf16 torch reference against the same fp64 oracle; the
non-deterministic backward's dQ, dK, dV too; the deterministic backward bitwise equal over three
runs; no NaN with outputs poisoned beforehand. Delta kernel: within 2x torch fp32 (or 1e-6) of fp64.

On the CPU, the same code path runs on tiny fp16 cases in the Triton interpreter (``SMOKE_CASES``),
and a corrupted forward output must fail the criterion (negative control).
"""
import pytest
import torch

from tests.helpers.triton_interp import requires_interpreter
from tests.workers import gpu_kernels_check as gk


def assert_case_passes(row: dict) -> None:
    """The criterion of gpu_kernels_check, one assertion per quantity (messages carry the row)."""
    if "err_torch_fp32" in row:                                   # delta kernel
        assert row["finite"], row
        assert row["err_ours"] <= max(2 * row["err_torch_fp32"], 1e-6), row
        assert row["ok"], row
        return
    assert not row["nan"], row
    assert row["deterministic_bitwise"], row
    for name in gk.NAMES:
        assert row["ratio"][name] <= 2.0, (name, row["err_ours"][name], row["err_bf16_ref"][name], row)
    for name, err in row["err_fast"].items():
        assert err <= 2.0 * row["err_bf16_ref"][name], ("fast backward", name, err, row)
    assert row["ok"], row


@pytest.mark.gpu
@pytest.mark.parametrize("case", gk.CASES, ids=lambda c: c.id)
def test_kernel_case_on_gpu(case):
    try:
        row = gk.run_case(case, "cuda")
    finally:
        torch.cuda.empty_cache()
    print(gk.describe(row))
    assert_case_passes(row)


VARIANT_CASES = ("vs4k-90-d128", "vs4k-90-d64", "random1k-d128-past-diag", "vs4k-90-d64-kvg-h9",
                 "dense-striped-cp4-r2o1-16k")
VARIANTS = {"paired": dict(fwd_pair=True, dq_pair=True, dkdv_pair=True, col_chunk=128),
            "dq-tma": dict(dq_atomic_fast=True, dq_tma=True, fwd_pair=True, dq_pair=True),
            "pointer-loads": dict(tma_loads=False),
            "col-atomic": dict(col_atomic_fast=True)}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", [c for c in gk.CASES if c.id in VARIANT_CASES], ids=lambda c: c.id)
def test_launch_variant_on_gpu(monkeypatch, variant, case):
    """The launch variants other than the defaults (``KernelConfig`` paired loop steps, 128 columns
    per step, dQ by bulk TMA reductions, pointer loads instead of the default tensor-descriptor loads, the
    columns' dK/dV by atomics)
    under the same criterion, on sparse and dense cases."""
    import dataclasses

    monkeypatch.setattr(gk, "CFG", dataclasses.replace(gk.CFG, **VARIANTS[variant]))
    try:
        row = gk.run_case(case, "cuda")
    finally:
        torch.cuda.empty_cache()
    print(variant, gk.describe(row))
    assert_case_passes(row)


def test_case_ids_are_unique():
    ids = [c.id for c in gk.CASES + gk.SMOKE_CASES]
    assert len(ids) == len(set(ids))
    assert {c.kind for c in gk.CASES} == {"sparse", "dense", "delta"}


def _smoke_params():
    """The 512-token smoke cases take tens of seconds in the interpreter: marked slow."""
    for c in gk.SMOKE_CASES:
        big = c.args.get("s", c.args.get("seq", 0)) >= 512
        yield pytest.param(c, id=c.id, marks=[pytest.mark.slow] if big else [])


@requires_interpreter
@pytest.mark.parametrize("case", list(_smoke_params()))
def test_smoke_case_on_cpu_interpreter(case):
    """The GPU check's code path (oracle, bf16 reference, criterion) on the CPU, fp16, tiny shapes."""
    assert_case_passes(gk.run_case(case, "cpu"))


@requires_interpreter
def test_corrupted_output_fails_the_criterion(monkeypatch):
    """Negative control: a forward output off by 1 % of its scale must fail the 2x-bf16 criterion."""
    real = gk.launch.sparse_forward

    def corrupted(q, k, v, plan, scale, **kw):
        out, lse = real(q, k, v, plan, scale, **kw)
        return out + 0.01 * out.abs().max() * torch.ones_like(out), lse

    monkeypatch.setattr(gk.launch, "sparse_forward", corrupted)
    row = gk.sparse_case("negative control", s=128, hq=2, hkv=1, d=64, dtype=torch.float16, sparsity=0, seed=5,
                         rand=True, device="cpu")
    assert not row["ok"] and row["ratio"]["out"] > 2.0, row


@pytest.mark.gpu
@pytest.mark.parametrize("s,heads,hq,hkv", [(131072, 9, 9, 3), (32768, 2, 16, 2)])   # per query head; per group
def test_diagonal_plan_equals_the_sorted_plan_on_gpu(s, heads, hq, hkv):
    """The inverted block index of diagonal block lists (compiled kernel) equals the sorted one at
    long lengths, static (the CUDA default) and data dependent."""
    from megatron_mtraining.ops.triton import launch, plan_for
    from megatron_mtraining.patterns.synthetic import vertical_slash_indices

    idx, _ = vertical_slash_indices(s, heads, 0.9, device="cuda")
    nkb = s // 64
    for static in (True, False):
        diag = plan_for(idx, static=static)
        ref = launch.plan_from_indices(idx.block_count, idx.block_index, idx.column_count, idx.column_index, True,
                                       static=static)
        assert diag.diagonal and not ref.diagonal and torch.equal(diag.block_split, ref.block_split)
        got, want = launch._kv_csr(diag, nkb, hq, hkv), launch._kv_csr(ref, nkb, hq, hkv)
        n = int(want[0][-1])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[3:] == want[3:]
        assert torch.equal(got[2][:n], want[2][:n])


@pytest.mark.gpu
def test_column_plan_kernels_equal_the_torch_ops_on_gpu(monkeypatch):
    """The causal splits and the deterministic column plan by the compiled kernels (present columns,
    chunk masks by atomic OR, entries by prefix sums) equal the torch ops over every slot at 32K,
    static and data dependent."""
    from megatron_mtraining.ops.triton import launch, plan_for
    from megatron_mtraining.patterns.synthetic import vertical_slash_indices

    idx, _ = vertical_slash_indices(32768, 9, 0.9, device="cuda")
    for index, count, scale in ((idx.column_index, idx.column_count, 64), (idx.block_index, idx.block_count, 1)):
        tile = torch.arange(index.shape[-2], device="cuda", dtype=torch.int32)[:, None] * scale
        assert torch.equal(launch._leading_below(index, count, scale),
                           launch._leading_split(index, count, index < tile))      # the causal splits
    for static in (True, False):
        got = launch._col_plan(plan_for(idx, static=static), 32768, 1, 9)
        with monkeypatch.context() as mp:
            mp.setattr(launch, "triton_runs_on", lambda device: False)
            want = launch._col_plan(plan_for(idx, static=static), 32768, 1, 9)
        n = int(want[2][-1])
        got, want = list(got), list(want)
        got[4:6], want[4:6] = [t[:n] for t in got[4:6]], [t[:n] for t in want[4:6]]   # the entries (buffers padded)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w) if isinstance(g, torch.Tensor) else g == w, (i, static)

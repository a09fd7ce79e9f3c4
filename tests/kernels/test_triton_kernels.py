"""Triton sparse/dense attention kernels, run by the Triton CPU interpreter (TRITON_INTERPRET=1).

Checked against an independent fp64 masked attention (tests/workers/gpu_common.py): out, LSE, dQ,
dK, dV separately; fp32 and fp16 inputs (bf16 ``tl.dot`` is wrong in the interpreter, so bf16 is
checked on the GPU by tests/workers/gpu_kernels_check.py); head_dim 64 and 128; GQA 1, 2 and 4;
causal (local index, incl. columns inside the diagonal tile and blocks past it) and non-causal
steps; deterministic mode bitwise repeatable; empty tiles and all-padding indices give exact zeros
and no NaN; the dense (position-mask) step kernel on striped and zigzag ring steps; the custom ops
trace under torch.compile(fullgraph=True).

The interpreter must be chosen before triton is imported: triton's own ``@jit`` library functions
(``tl.zeros``, ``tl.sum``, ...) are decorated at import time. The variable is set here; if another
test module imported triton earlier in this pytest process, these tests re-run this file in a fresh
subprocess instead (one test, same checks).
"""

import dataclasses
import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:  # else compiled Triton is in use (GPU session): the tests run in a subprocess
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.triton_interp import rerun_in_fresh_interpreter, use_interpreted_kernels

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from megatron_mtraining.layout import Layout  # noqa: E402
from megatron_mtraining.ops import reference  # noqa: E402
from megatron_mtraining.ops.backends import select_backend  # noqa: E402
from megatron_mtraining.ops.dense_gpu import DenseGpuStepKernel  # noqa: E402
from megatron_mtraining.ops.triton import (  # noqa: E402
    launch, sparse_attention, sparse_attention_backward, sparse_attention_forward,
)
from megatron_mtraining.ops.triton.synthetic import vertical_slash_indices  # noqa: E402
from megatron_mtraining.patterns.indices import StepIndices  # noqa: E402
from tests.workers.gpu_common import dense_mask_rows, oracle, random_step_indices, rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.ops.triton.kernels", "_sparse_fwd_kernel")
    yield


TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


def _inputs(b, s, hq, hkv, d, dtype, gen):
    mk = lambda h: (torch.randn(b, s, h, d, generator=gen) * 1.5).to(dtype)
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _check_all(got, ref, tol, names=("out", "lse", "dq", "dk", "dv")):
    errs = {n: rel_err(g, r) for n, g, r in zip(names, got, ref)}
    for n, g in zip(names, got):
        assert not torch.isnan(g).any(), f"NaN in {n}"
    assert all(e <= tol for e in errs.values()), errs
    return errs


@pytest.mark.parametrize("b,s,hq,hkv,d,dtype,causal", [
    (1, 256, 2, 1, 64, torch.float32, True),      # GQA 2, columns inside diagonal tiles
    (1, 256, 4, 1, 128, torch.float16, True),     # GQA 4, head_dim 128
    (2, 192, 2, 2, 64, torch.float32, False),     # batch 2, MHA, non-causal (another owner)
])            # 320 tokens, 4/2 heads: test_paired_blocks_match_fp64_oracle
def test_sparse_matches_fp64_oracle(b, s, hq, hkv, d, dtype, causal):
    gen = torch.Generator().manual_seed(s + hq + d)
    idx = random_step_indices(b, hq, s // 64, s // 64, causal, gen, above_diag=causal)
    q, k, v, dout = _inputs(b, s, hq, hkv, d, dtype, gen)
    scale = d ** -0.5
    mask_fn = lambda r0, r1: dense_mask_rows(idx, r0, r1, s)
    # backward with a *global* normalisation that differs from this step's own (as in the ring)
    o_ref, l_ref = oracle(q, k, v, mask_fn, scale)
    lse_g = l_ref + 0.25 * torch.rand(l_ref.shape, generator=gen, dtype=torch.float64)
    lse_g = torch.where(torch.isinf(l_ref), l_ref, lse_g)
    delta_g = torch.randn(l_ref.shape, generator=gen, dtype=torch.float64)
    *_, dq_r, dk_r, dv_r, _, _ = oracle(q, k, v, mask_fn, scale, dout, lse_g, delta_g)
    out, lse = sparse_attention_forward(q, k, v, idx, scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    dq, dk, dv = sparse_attention_backward(dout, q, k, v, lse_g.float(), delta_g.float(), idx, scale,
                                           deterministic=True)
    _check_all((out, lse, dq, dk, dv), (o_ref, l_ref, dq_r, dk_r, dv_r), TOL[dtype])
    # fast mode (atomics where the launch parameters enable them): same numbers up to summation order
    dq2, dk2, dv2 = sparse_attention_backward(dout, q, k, v, lse_g.float(), delta_g.float(), idx, scale,
                                              deterministic=False)
    _check_all((dq2, dk2, dv2), (dq_r, dk_r, dv_r), TOL[dtype], names=("dq", "dk", "dv"))


def test_deterministic_bitwise_and_fast_modes():
    gen = torch.Generator().manual_seed(7)
    b, s, hq, hkv, d = 1, 256, 4, 1, 64
    idx = random_step_indices(b, hq, s // 64, s // 64, True, gen, p_col=0.08)
    q, k, v, dout = _inputs(b, s, hq, hkv, d, torch.float16, gen)
    out, lse = sparse_attention_forward(q, k, v, idx)
    delta = (dout.float() * out).sum(-1).transpose(1, 2).contiguous()
    r1 = sparse_attention_backward(dout, q, k, v, lse, delta, idx, deterministic=True)
    r2 = sparse_attention_backward(dout, q, k, v, lse, delta, idx, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(r1, r2))
    out2, lse2 = sparse_attention_forward(q, k, v, idx)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_empty_rows_and_padding_give_exact_zeros():
    gen = torch.Generator().manual_seed(3)
    b, s, hq, hkv, d = 1, 192, 2, 1, 64
    nqb = s // 64
    q, k, v, dout = _inputs(b, s, hq, hkv, d, torch.float32, gen)
    # all tiles empty; padding full of garbage (negative and out-of-range indices)
    idx = StepIndices(torch.zeros(b, hq, nqb, dtype=torch.int32), torch.full((b, hq, nqb, 5), -3, dtype=torch.int32),
                      torch.zeros(b, hq, nqb, dtype=torch.int32), torch.full((b, hq, nqb, 70), 99999, dtype=torch.int32),
                      True)
    out, lse = sparse_attention_forward(q, k, v, idx)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    delta = torch.zeros(b, hq, s)
    for det in (True, False):
        dq, dk, dv = sparse_attention_backward(dout, q, k, v, lse, delta, idx, deterministic=det)
        for t in (dq, dk, dv):
            assert torch.equal(t, torch.zeros_like(t))
    # one tile with a column past every row of the tile (causal: fully masked) -> that tile empty
    bc = torch.zeros(b, hq, nqb, dtype=torch.int32)
    cc = torch.zeros(b, hq, nqb, dtype=torch.int32)
    ci = torch.full((b, hq, nqb, 3), 99999, dtype=torch.int32)
    cc[0, 0, 1] = 1
    ci[0, 0, 1, 0] = 150          # tile 1 is rows 64..127; key 150 lies after all of them
    bc[0, 1, 2] = 1
    bi = torch.zeros(b, hq, nqb, 2, dtype=torch.int32)
    bi[0, 1, 2, 0] = 0
    idx = StepIndices(bc, bi, cc, ci, True)
    out, lse = sparse_attention_forward(q, k, v, idx)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert bool(torch.isneginf(lse[0, 0]).all()) and torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))
    assert bool(torch.isfinite(lse[0, 1, 128:]).all()) and bool(torch.isneginf(lse[0, 1, :128]).all())
    delta = (dout.float() * out).sum(-1).transpose(1, 2).contiguous()
    dq, dk, dv = sparse_attention_backward(dout, q, k, v, lse, delta, idx)
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))
    assert torch.equal(dq[0, :128], torch.zeros_like(dq[0, :128]))
    assert torch.equal(dk[0, 64:], torch.zeros_like(dk[0, 64:]))


def test_synthetic_vertical_slash_pattern_and_autograd():
    gen = torch.Generator().manual_seed(11)
    s, hq, hkv, d = 512, 2, 1, 128
    idx, st = vertical_slash_indices(s, hq, sparsity=0.5, window=2, sinks=3, seed=1)
    assert st.mean_columns > 0
    q, k, v, dout = _inputs(1, s, hq, hkv, d, torch.float32, gen)
    mask_fn = lambda r0, r1: dense_mask_rows(idx, r0, r1, s)
    o_ref, l_ref, dq_r, dk_r, dv_r, _, _ = oracle(q, k, v, mask_fn, d ** -0.5, dout)
    qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = sparse_attention(qa, ka, va, idx)
    out.backward(dout)
    _check_all((out, qa.grad, ka.grad, va.grad), (o_ref, dq_r, dk_r, dv_r), 2e-5, names=("out", "dq", "dk", "dv"))


def test_custom_ops_trace_without_graph_break():
    gen = torch.Generator().manual_seed(5)
    s, hq, hkv, d = 128, 2, 1, 64
    idx = random_step_indices(1, hq, s // 64, s // 64, True, gen)
    q, k, v, _ = _inputs(1, s, hq, hkv, d, torch.float32, gen)

    def f(q, k, v):
        return sparse_attention(q, k, v, idx).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(q, k, v), f(q, k, v))
    torch.library.opcheck(torch.ops.mtraining.sparse_attn_fwd.default,
                          (q, k, v, idx.block_count, idx.block_index, idx.column_count, idx.column_index, True,
                           0.125, True), test_utils=("test_schema", "test_faketensor"))


def test_cpu_fallback_without_interpreter(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    s, hq, hkv, d = 128, 2, 1, 64
    idx = random_step_indices(1, hq, s // 64, s // 64, True, gen)
    q, k, v, _ = _inputs(1, s, hq, hkv, d, torch.float32, gen)
    ref = sparse_attention_forward(q, k, v, idx)
    monkeypatch.setenv("TRITON_INTERPRET", "0")          # -> torch sparse reference
    fb = sparse_attention_forward(q, k, v, idx)
    assert rel_err(fb[0], ref[0]) < 1e-5 and rel_err(fb[1], ref[1]) < 1e-5


@pytest.mark.parametrize("layout,rank,owner,rows", [
    (Layout("striped", 2, 64), 1, 0, 128),      # block-causal inclusive (owner < rank)
    (Layout("striped", 2, 64), 0, 1, 128),      # block-causal strict (owner > rank)
    (Layout("striped", 2, 16), 1, 1, 128),      # token-level mask inside tiles (granularity < 64)
    (Layout("zigzag", 2), 0, 1, 128),           # half empty, half full
    (Layout("striped", 2, 64), 1, 0, 64),       # 64-row tiles
    (Layout("zigzag", 2), 1, 1, 64),
])
def test_dense_step_kernel_matches_reference(layout, rank, owner, rows):
    gen = torch.Generator().manual_seed(rank * 7 + owner)
    seq, hq, hkv, d = 512, 4, 2, 64
    s = seq // layout.cp_size
    q, k, v, dout = _inputs(1, s, hq, hkv, d, torch.float32, gen)
    kern = DenseGpuStepKernel(layout, rank, seq, d ** -0.5, row_block=rows)
    assert select_backend("triton", device=q.device, dtype=q.dtype, head_dim=d, seq_len_local=s).name == "triton"
    qp, kp = kern.q_pos, kern.k_pos(owner)
    o_r, l_r = reference.attention_forward(q.double(), k.double(), v.double(), qp, kp, d ** -0.5)
    out, lse = kern.forward(q, k, v, owner)
    assert rel_err(out, o_r) < TOL[torch.float32] and rel_err(lse, l_r) < TOL[torch.float32]
    lse_g = torch.where(torch.isinf(l_r), l_r, l_r + 0.1)
    delta = torch.randn(l_r.shape, generator=gen, dtype=torch.float64)
    ref = reference.attention_backward(dout.double(), q.double(), k.double(), v.double(), lse_g, delta, qp, kp,
                                       d ** -0.5)
    got = kern.backward(dout, q, k, v, lse_g.float(), delta.float(), owner)
    _check_all(got, ref, TOL[torch.float32], names=("dq", "dk", "dv"))


def test_dense_plan_skips_invisible_and_future_blocks():
    lay = Layout("zigzag", 2)
    kern = DenseGpuStepKernel(lay, 0, 512, 0.125, row_block=64)
    plan = kern.plan(1)
    # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2: the first query half sees nothing
    assert plan is not None and plan.block_count[0, 0, :2].sum() == 0 and plan.block_count[0, 0, 2:].min() == 4
    assert launch.dense_plan(torch.arange(64, 128), torch.arange(128, 192)) is None


@pytest.mark.parametrize("columns,bs", [("in_ring", 64), ("out_of_ring", 64), ("in_ring", 128)])
def test_sparse_ring_with_triton_kernels_and_column_phase(columns, bs):
    """The sparse ring (cp=1) driven by the Triton step kernels, columns in the ring or in the
    out-of-ring column phase (gathered column K/V, non-causal step, LSE merge): fwd and
    dQ/dK/dV vs fp64 attention masked with the same estimated pattern. Slash blocks of 128 tokens
    run as 64-row tiles (indices refined)."""
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    from megatron_mtraining.ring.sparse import sparse_ring_attention
    from tests.workers.vs_data import make_qkv, naive_masked_attention

    s, hq, hkv, d = 256 if bs == 64 else 1024, 2, 1, 64
    q, k, v = make_qkv(1, s, hq, hkv, d, seed=5)
    backend = select_backend("triton", device="cpu", dtype=torch.float32, head_dim=d, seq_len_local=s, sparse=True)
    assert backend.name == "triton" and backend.estimator_impl == "triton" and backend.convert_impl == "triton"
    dout = torch.randn(1, s, hq, d, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    qa, ka, va = (t.float().requires_grad_(True) for t in (q, k, v))
    out, pat = sparse_ring_attention(qa, ka, va, layout=Layout("striped", 1, bs), group=None,
                                     config=VerticalSlashConfig(recall=0.9, block_size=bs), softmax_scale=d ** -0.5,
                                     return_pattern=True, backend=backend, columns=columns)
    out.backward(dout.float())
    mask = pat.dense_mask()
    assert bool(pat.vertical_mask().any()) and mask.float().mean() < 0.45     # columns exist; sparse
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = naive_masked_attention(qr, kr, vr, mask, d ** -0.5)
    ref.backward(dout)
    _check_all((out, qa.grad, ka.grad, va.grad), (ref, qr.grad, kr.grad, vr.grad), TOL[torch.float32],
               names=("out", "dq", "dk", "dv"))


def test_slash_blocks_below_the_triton_tile_are_refused_before_estimation():
    """A slash block of 32 tokens cannot run on the 64-token Triton tiles: the sparse ring names the rule before
    the estimator runs (an internal refinement error after it before), as does a config that asks for it."""
    from megatron_mtraining.config import load_mtraining_config
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    from megatron_mtraining.ring.sparse import sparse_ring_attention

    q = torch.randn(1, 256, 2, 64)
    backend = select_backend("triton", device="cpu", dtype=torch.float32, head_dim=64, seq_len_local=256, sparse=True)
    with pytest.raises(ValueError, match="vertical_slash.block_size must be a multiple of 64, got 32"):
        sparse_ring_attention(q, q[:, :, :1], q[:, :, :1], layout=Layout("striped", 1, 64), group=None,
                              config=VerticalSlashConfig(block_size=32, last_q=32), backend=backend)
    with pytest.raises(ValueError, match="'vertical_slash.block_size' must be a multiple of 64, got 32"):
        load_mtraining_config({"pattern": "vertical_slash", "kernel_backend": "triton",
                               "vertical_slash": {"block_size": 32, "last_q": 32}})


@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_plans_built_in_forward_are_the_ones_the_backward_uses(deterministic):
    """The Triton sparse step kernel with prebuild=True builds each step's backward plans right after its
    forward kernel (on a CUDA side stream on the GPU; here in place): out and dQ/dK/dV are bitwise
    those of prebuild=False, the plans exist after the forward (negative control: not without
    prebuild, nor under no_grad, where no backward follows) and the backward reuses them."""
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    from megatron_mtraining.ring.sparse import sparse_ring_attention
    from tests.workers.vs_data import make_qkv

    s, hq, hkv, d = 256, 2, 1, 64
    q, k, v = make_qkv(1, s, hq, hkv, d, seed=7)
    dout = torch.randn(1, s, hq, d, generator=torch.Generator().manual_seed(8))
    kernels, results = {}, {}

    def backend_for(pre):      # the Triton backend, recording the sparse step kernel it builds
        base = select_backend("triton", device="cpu", dtype=torch.float32, head_dim=d, seq_len_local=s,
                              sparse=True, deterministic=deterministic, prebuild_backward_plans=pre)

        def factory(steps, scale):
            kernels[pre] = base.sparse_step(steps, scale)
            assert kernels[pre].prebuild == pre and kernels[pre].deterministic == deterministic
            return kernels[pre]
        return dataclasses.replace(base, sparse_step=factory)

    def plans(pre):
        (st,) = kernels[pre].steps
        return kernels[pre].plan(st)

    for pre in (False, True):
        qa, ka, va = (t.float().requires_grad_(True) for t in (q, k, v))
        out = sparse_ring_attention(qa, ka, va, layout=Layout("striped", 1, 64), group=None,
                                    config=VerticalSlashConfig(recall=0.9), softmax_scale=d ** -0.5,
                                    backend=backend_for(pre))
        plan = plans(pre)
        assert plan.has_columns
        uses_col_plan = deterministic or not launch.KernelConfig().col_atomic_fast   # fast mode may add columns by atomics
        assert bool(plan._kv) == pre and bool(plan._col) == (pre and uses_col_plan)
        kv_before = dict(plan._kv)
        out.backward(dout)
        assert plan._pending is None and len(plan._kv) == 1
        if pre:   # reused, not rebuilt
            assert all(plan._kv[key] is val for key, val in kv_before.items())
        results[pre] = (out.detach(), qa.grad, ka.grad, va.grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), results[False], results[True]):
        assert torch.equal(a, b), name
    with torch.no_grad():
        sparse_ring_attention(*(t.float() for t in (q, k, v)), layout=Layout("striped", 1, 64), group=None,
                              config=VerticalSlashConfig(recall=0.9), softmax_scale=d ** -0.5,
                              backend=backend_for(True))
    assert kernels[True].expect_backward is False and not plans(True)._kv


@pytest.mark.parametrize("kind", ["random causal", "random non-causal", "synthetic vertical-slash",
                                  "synthetic non-causal"])
def test_unmasked_column_chunks_match_masked_path_and_fp64(kind):
    """Whole 64-column chunks that every row of the tile sees run without a mask: in the forward and
    dQ kernels (``column_split``; bitwise the all-masked path) and in the column dK/dV kernel (its
    leading entries; fp64 oracle). The unmasked paths really run here (negative control: a split that
    counts the tile's own columns lets rows see their future)."""
    causal = "non-causal" not in kind
    gen = torch.Generator().manual_seed(11 + causal)
    b, s, hq, hkv, d = 1, 512, 2, 1, 64
    if kind.startswith("random"):
        idx = random_step_indices(b, hq, s // 64, s // 64, causal, gen, p_block=0.25, p_col=0.35, empty_frac=0.0)
    else:   # per-head column sets shared by every tile, as the estimator's: full chunks of the union
        s = 1024
        idx, _ = vertical_slash_indices(s, hq, sparsity=0.6, window=1, sinks=3, seed=5)
        if not causal:    # the same lists as a step against another owner: every listed key visible
            idx = dataclasses.replace(idx, causal=False)
    q, k, v, dout = _inputs(b, s, hq, hkv, d, torch.float32, gen)
    scale = d ** -0.5
    plan = launch.plan_from_indices(idx.block_count, idx.block_index, idx.column_count, idx.column_index, causal)
    split = plan.column_split()
    assert int((split >= 64).sum()) >= 4                        # the unmasked loop runs
    if kind == "random causal":
        assert bool((split < plan.column_count).any())          # and some columns lie inside their tile
    configs = {"split": None, "masked": launch.KernelConfig(column_split=False)}
    res = {}
    for name, cfg in configs.items():
        out, lse = launch.sparse_forward(q, k, v, plan, scale, config=cfg)
        delta = (dout.float() * out).sum(-1).transpose(1, 2).contiguous()
        res[name] = (out, lse) + launch.sparse_backward(dout, q, k, v, lse, delta, plan, scale, True, config=cfg)
    assert all(torch.equal(x, y) for x, y in zip(res["split"], res["masked"]))
    if kind.startswith("synthetic"):
        key = ("col", s, b, hq)
        offsets, mid = plan._col[key][2:4]
        assert bool((mid > offsets[:-1]).any())                 # the column kernel's unmasked entries run
    mask_fn = lambda r0, r1: dense_mask_rows(idx, r0, r1, s)
    o_ref, l_ref = oracle(q, k, v, mask_fn, scale)
    delta_ref = (dout.double() * o_ref).sum(-1).transpose(1, 2)
    *_, dq_r, dk_r, dv_r, _, _ = oracle(q, k, v, mask_fn, scale, dout, l_ref, delta_ref)
    _check_all(res["split"], (o_ref, l_ref, dq_r, dk_r, dv_r), TOL[torch.float32])
    if kind == "synthetic vertical-slash":   # negative control: every column entry declared unmasked
        key = ("col", s, b, hq)
        good = plan._col[key]
        plan._col[key] = good[:3] + (good[2][1:].clone(),) + good[4:]          # mid = end of each segment
        delta = (dout.float() * res["split"][0]).sum(-1).transpose(1, 2).contiguous()
        _, dk_bad, dv_bad = launch.sparse_backward(dout, q, k, v, res["split"][1], delta, plan, scale, True)
        plan._col[key] = good
        assert max(rel_err(dk_bad, dk_r), rel_err(dv_bad, dv_r)) > 1e-2
    if kind == "random causal":   # lists out of order (against the StepIndices contract): still exact
        perm = torch.randperm(idx.column_index.shape[-1], generator=gen)
        ci = idx.column_index.clone()
        for h in range(hq):
            for t in range(s // 64):
                n = int(idx.column_count[0, h, t])
                ci[0, h, t, :n] = ci[0, h, t, :n][perm[perm < n]]
        shuffled = launch.plan_from_indices(idx.block_count, idx.block_index, idx.column_count, ci, True)
        assert bool((shuffled.column_split() <= split).all()) and bool((shuffled.column_split() < split).any())
        out_s, _ = launch.sparse_forward(q, k, v, shuffled, scale)
        assert rel_err(out_s, o_ref) <= TOL[torch.float32]
    if kind == "random causal":   # negative control: a chunk that holds the tile's own keys, claimed unmasked, sees the future
        nqb = s // 64
        z = torch.zeros(b, hq, nqb, dtype=torch.int32)
        cc = z.clone()
        cc[:, :, 1] = 64
        ci = torch.arange(32, 96, dtype=torch.int32).expand(b, hq, nqb, 64).contiguous()   # tile 1: rows 64..127
        one = StepIndices(z, torch.zeros(b, hq, nqb, 1, dtype=torch.int32), cc, ci, True)
        good_plan = launch.plan_from_indices(z, one.block_index, cc, ci, True)
        assert int(good_plan.column_split()[0, 0, 1]) == 32
        o_one, _ = oracle(q, k, v, lambda r0, r1: dense_mask_rows(one, r0, r1, s), scale)
        good, _ = launch.sparse_forward(q, k, v, good_plan, scale)
        assert rel_err(good, o_one) <= TOL[torch.float32]
        good_plan._column_split = cc.clone()
        bad, _ = launch.sparse_forward(q, k, v, good_plan, scale)
        assert rel_err(bad, o_one) > 1e-2


@pytest.mark.parametrize("dtype,d,s", [(torch.float32, 64, 200), (torch.float16, 128, 257), (torch.float32, 32, 64)])
def test_attention_delta_kernel_matches_fp64(dtype, d, s):
    """``rowsum(dout * out)`` by the Triton kernel (``launch.attention_delta`` itself, inputs read in
    their own dtype, strided views) and through the custom op: against fp64 within the fp32
    tolerance; fp64 inputs stay on the torch path in fp64."""
    from megatron_mtraining.ops.triton import attention_delta
    gen = torch.Generator().manual_seed(d + s)
    b, h = 2, 3
    out = torch.randn(b, h, s, d, generator=gen).to(dtype).transpose(1, 2)       # [b, s, h, d], strided
    dout = torch.randn(b, s, h, d, generator=gen).to(dtype)
    ref = (dout.double() * out.double()).sum(-1).transpose(1, 2)
    for got in (launch.attention_delta(dout, out), attention_delta(dout, out)):
        assert got.dtype == torch.float32 and got.shape == (b, h, s) and got.is_contiguous()
        assert rel_err(got, ref) <= 1e-6
    bad = launch.attention_delta(dout, out.roll(1, dims=1))     # negative control: rows shifted
    assert rel_err(bad, ref) > 0.1
    got64 = attention_delta(dout.double(), out.double())
    assert got64.dtype == torch.float64 and torch.allclose(got64, ref, rtol=1e-12, atol=1e-12)


def test_attention_delta_fallbacks_and_op_checks():
    """Shapes the kernel does not take go to torch (head_dim 48, a strided last dimension); the
    launcher itself refuses them with a clear error; the custom op passes ``torch.library.opcheck``."""
    from megatron_mtraining.ops.triton import attention_delta
    gen = torch.Generator().manual_seed(5)
    out48 = torch.randn(1, 70, 2, 48, generator=gen)
    dout48 = torch.randn(1, 70, 2, 48, generator=gen)
    ref48 = (dout48.double() * out48.double()).sum(-1).transpose(1, 2)
    assert rel_err(attention_delta(dout48, out48), ref48) <= 1e-6
    with pytest.raises(ValueError, match="power of two"):
        launch.attention_delta(dout48, out48)
    wide = torch.randn(1, 70, 2, 128, generator=gen)
    out_s, dout_s = wide[..., ::2], torch.randn(1, 70, 2, 64, generator=gen)      # last-dim stride 2
    ref_s = (dout_s.double() * out_s.double()).sum(-1).transpose(1, 2)
    assert rel_err(attention_delta(dout_s, out_s), ref_s) <= 1e-6
    with pytest.raises(ValueError, match="contiguous"):
        launch.attention_delta(dout_s, out_s)
    x = torch.randn(1, 64, 2, 32, generator=gen)
    torch.library.opcheck(torch.ops.mtraining.attn_delta, (x, torch.randn_like(x)))
    torch.library.opcheck(torch.ops.mtraining.attn_delta, (x.double(), torch.randn_like(x).double()))


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a view with last-dim stride 2 (same values)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("sparse", [False, True])
def test_triton_backend_accepts_last_dim_strided_inputs_like_the_cpu_path(sparse):
    """q/k/v with a strided last dimension: the Triton backend gives what the torch backend gives and
    both match fp64 (out, dQ, dK, dV separately). Negative control: the launcher itself refuses such a q."""
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    from megatron_mtraining.ring import ring_attention
    from megatron_mtraining.ring.sparse import sparse_ring_attention
    from tests.workers.vs_data import make_qkv, naive_masked_attention

    s, hq, hkv, d = 256, 2, 1, 64
    q, k, v = make_qkv(1, s, hq, hkv, d, seed=11)
    dout = torch.randn(1, s, hq, d, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    lay = Layout("striped", 1, 64)
    results = {}
    for name in ("torch", "triton"):
        backend = select_backend(name, device="cpu", dtype=torch.float32, head_dim=d, seq_len_local=s, sparse=sparse)
        leaves = [t.float().requires_grad_(True) for t in (q, k, v)]
        qa, ka, va = (_strided(t) for t in leaves)
        assert qa.stride(-1) == 2
        if sparse:
            out, pat = sparse_ring_attention(qa, ka, va, layout=lay, config=VerticalSlashConfig(recall=0.9),
                                             softmax_scale=d ** -0.5, return_pattern=True, backend=backend)
            mask = pat.dense_mask()
        else:
            out = ring_attention(qa, ka, va, layout=lay, softmax_scale=d ** -0.5, backend=backend)
            mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(1, hq, s, s)
        out.backward(dout.float())
        results[name] = (out, *(t.grad for t in leaves))
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = naive_masked_attention(qr, kr, vr, mask, d ** -0.5)
        ref.backward(dout)
        _check_all(results[name], (ref, qr.grad, kr.grad, vr.grad), TOL[torch.float32],
                   names=("out", "dq", "dk", "dv"))
    _check_all(results["triton"], tuple(t.double() for t in results["torch"]), TOL[torch.float32],
               names=("out", "dq", "dk", "dv"))
    idx, _ = vertical_slash_indices(s, hq, 0.5, seed=0)
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        launch.sparse_forward(_strided(q.float()), k.float(), v.float(), launch.plan_from_indices(
            idx.block_count, idx.block_index, idx.column_count, idx.column_index, True), d ** -0.5)


PAIRED = dict(fwd_pair=True, dq_pair=True, dkdv_pair=True, col_chunk=128)


@pytest.mark.parametrize("case", ["sparse-gqa-fp32", "sparse-fp16-dq-atomic", "dense-positions-64"])
def test_paired_blocks_match_fp64_oracle(monkeypatch, case):
    """``KernelConfig.{fwd,dq,dkdv}_pair`` (two listed 64-key blocks, or two inverted-index entries, per
    step) and ``col_chunk=128``: the same cases as the single-block kernels against the fp64 oracle:
    local causal masks with GQA, columns and odd block counts (deterministic and fast backward; dQ by
    atomics; the columns' dK/dV by atomics, off by default), and the position masks of dense ring steps."""
    extra = (dict(dq_atomic_fast=True, dq_tma=True, col_atomic_fast=True)   # dq_tma: CUDA only
             if "dq-atomic" in case else {})
    monkeypatch.setattr(launch, "DEFAULT_CONFIG", dataclasses.replace(launch.DEFAULT_CONFIG, **PAIRED, **extra))
    if case == "sparse-gqa-fp32":
        test_sparse_matches_fp64_oracle(1, 320, 4, 2, 64, torch.float32, True)
    elif case == "sparse-fp16-dq-atomic":
        test_sparse_matches_fp64_oracle(1, 256, 4, 1, 128, torch.float16, True)
    else:
        test_dense_step_kernel_matches_reference(Layout("striped", 2, 16), 1, 1, 64)
    with pytest.raises(ValueError, match="col_chunk must be 64 or 128"):
        dataclasses.replace(launch.DEFAULT_CONFIG, col_chunk=96)


@pytest.mark.parametrize("case", ["sparse-gqa-fp32", "sparse-fp16-dq-atomic"])
def test_tma_loads_match_fp64_oracle(monkeypatch, case):
    """``KernelConfig.tma_loads`` (listed K/V blocks and the dK/dV kernel's query tiles by tensor-descriptor
    loads): the single-block kernels' oracle cases, local causal masks with GQA, columns and odd block
    counts, deterministic and fast backward, with dQ and the columns' dK/dV by atomics; and the descriptors are
    really built."""
    built = []
    real = launch._tma_descriptors
    monkeypatch.setattr(launch, "_tma_descriptors", lambda *a: built.append(real(*a)) or built[-1])
    extra = dict(dq_atomic_fast=True, col_atomic_fast=True) if "dq-atomic" in case else {}
    monkeypatch.setattr(launch, "DEFAULT_CONFIG", dataclasses.replace(launch.DEFAULT_CONFIG, tma_loads=True, **extra))
    if case == "sparse-gqa-fp32":
        test_sparse_matches_fp64_oracle(1, 320, 4, 2, 64, torch.float32, True)
    else:
        test_sparse_matches_fp64_oracle(1, 256, 4, 1, 128, torch.float16, True)
    assert built and all(d is not None for ds in built for d in ds)


def test_tma_descriptors_fall_back_to_pointer_loads():
    """Tensors a tensor descriptor cannot address get none (pointer loads): a stride-0 (expanded) batch, a base
    address off 16 bytes, an empty tensor; a fused-qkv slice with aligned strides gets one."""
    x = torch.zeros(2, 128, 6, 64)
    assert all(d is not None for d in launch._tma_descriptors(64, x[:, :, :2], x[:, :, 2:4]))
    assert launch._tma_descriptors(64, x[:1].expand(2, -1, -1, -1)) == (None,)
    off = torch.zeros(x.numel() + 1)[1:].view(x.shape)            # base 4 bytes past an aligned address
    assert launch._tma_descriptors(64, x, off) == (None, None)
    assert launch._tma_descriptors(64, x[:, :0]) == (None,)


def test_tma_default_follows_the_device_and_the_triton_version(monkeypatch):
    """``tma_loads=None`` takes the descriptors for CUDA bf16/fp16 tensors of head_dim 64 or 128 only (CPU
    tensors, fp32 and other head dims: pointer loads unless forced); a Triton without host-side tensor
    descriptors (before 3.4) gets none, so the default still runs there."""
    import sys
    from unittest import mock

    x = torch.zeros(1, 128, 2, 64)
    assert launch.DEFAULT_CONFIG.tma_loads is None
    assert not launch._use_tma(launch.DEFAULT_CONFIG, x)
    for dtype, d, want in [(torch.bfloat16, 64, True), (torch.float16, 128, True), (torch.float32, 64, False),
                           (torch.bfloat16, 32, False), (torch.bfloat16, 256, False)]:
        cuda_like = mock.Mock(is_cuda=True, dtype=dtype, shape=(1, 128, 2, d))
        assert launch._use_tma(launch.DEFAULT_CONFIG, cuda_like) is want, (dtype, d)
    assert launch._use_tma(launch.KernelConfig(tma_loads=True), x)
    assert not launch._use_tma(launch.KernelConfig(tma_loads=False), x)
    assert launch._tma_descriptors(64, x)[0] is not None
    monkeypatch.setitem(sys.modules, "triton.tools.tensor_descriptor", None)     # import fails
    assert launch._tma_descriptors(64, x) == (None,)


def test_column_union_from_the_conversion_matches_fp64():
    """The backward's column plan taking the conversion's column union and per-tile masks (an estimated
    pattern converted by the Triton kernel at cp 1, slash blocks of 64 and of 128 tokens) gives out, LSE,
    dQ, dK and dV of the fp64 oracle, with the plan's union being the pattern's vertical list; negative
    control: a mask word with one listed column cleared loses that column's dK/dV."""
    from megatron_mtraining.ops.triton import plan_for
    from megatron_mtraining.patterns.convert import convert_pattern, refine_indices
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash

    gen = torch.Generator().manual_seed(23)
    b, s, hq, hkv, d = 1, 512, 2, 1, 64
    q, k, v, dout = _inputs(b, s, hq, hkv, d, torch.float32, gen)
    k[:, :8] *= 3
    scale = d ** -0.5
    for bs in (64, 128):
        cfg = VerticalSlashConfig(recall=0.9, last_q=64, block_size=bs, sink_tokens=8, local_blocks=1,
                                  max_vertical=96, max_slash=3)
        layout = Layout("striped", 1, bs)
        pat = estimate_vertical_slash(q, k, layout=layout, config=cfg, softmax_scale=scale, impl="torch")
        st = refine_indices(convert_pattern(pat, layout, 0, impl="triton")[0], 64)
        assert st.given_column_union is not None
        plan = plan_for(st)
        assert plan.column_union is not None
        out, lse = launch.sparse_forward(q, k, v, plan, scale)
        delta = (dout * out).sum(-1).transpose(1, 2).contiguous()
        grads = launch.sparse_backward(dout, q, k, v, lse, delta, plan, scale, True)
        col_u, ucount = plan._col[("col", s, b, hq)][:2]
        nv = pat.vertical.shape[-1]
        assert torch.equal(col_u[..., :nv], pat.vertical.clamp(min=0).to(torch.int32))
        assert torch.equal(ucount, (pat.vertical >= 0).sum(-1).to(torch.int32))
        mask_fn = lambda r0, r1: dense_mask_rows(st, r0, r1, s)  # noqa: E731
        o_ref, l_ref = oracle(q, k, v, mask_fn, scale)
        delta_ref = (dout.double() * o_ref).sum(-1).transpose(1, 2)
        *_, dq_r, dk_r, dv_r, _, _ = oracle(q, k, v, mask_fn, scale, dout, l_ref, delta_ref)
        _check_all((out, lse) + grads, (o_ref, l_ref, dq_r, dk_r, dv_r), TOL[torch.float32])
        if bs == 64:      # negative control: one listed column dropped from one tile's mask
            bits = st.column_union.bits.clone()
            h, t, w = (int(x[0]) for x in (bits != 0).nonzero(as_tuple=True)[1:])
            bits[0, h, t, w] &= bits[0, h, t, w] - 1                         # clear the lowest set bit
            bad = plan_for(st)
            bad.column_union = (st.column_union.union, bits)
            _, dk_bad, dv_bad = launch.sparse_backward(dout, q, k, v, lse, delta, bad, scale, True)
            assert max(rel_err(dk_bad, dk_r), rel_err(dv_bad, dv_r)) > 1e-4

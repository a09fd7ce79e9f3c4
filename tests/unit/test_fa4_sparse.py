"""Sparse ring steps at 128-token slash blocks (CPU): index refinement for the 64-row Triton tiles,
FA4 block lists from a step's indices, and the FA4 sparse step kernel's merge and gradient sums,
run with an fp64 emulation of FA4's block-sparse kernels against the fp64 dense-mask reference."""
from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.ops import fa4 as fa4_mod
from megatron_mtraining.ops.fa4 import FA4_BLOCK, FA4SparseStepKernel, make_fa4_sparse_step, sparsity_from_indices
from megatron_mtraining.ops.sparse_reference import SparseStepKernel
from megatron_mtraining.patterns.convert import convert_pattern, refine_indices, step_key_mask
from tests.helpers.ring_sim import random_pattern, simulate_dense_ring
from tests.workers.gpu_common import bf16_reference, oracle, rel_err

pytestmark = pytest.mark.unit


LAYOUTS = [Layout("striped", cp_size=1, granularity=128), Layout("striped", cp_size=2, granularity=128),
           Layout("striped", cp_size=4, granularity=256), Layout("zigzag", cp_size=2, granularity=1)]


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda l: f"{l.kind}-cp{l.cp_size}-g{l.granularity}")
def test_refine_indices_keeps_the_token_mask(lay):
    seq = 2048
    pat = random_pattern(seq, 128, 2, 3, seed=lay.cp_size)
    s_local = seq // lay.cp_size
    for rank in range(lay.cp_size):
        for idx in convert_pattern(pat, lay, rank):
            fine = refine_indices(idx, 64)
            assert fine.block_size == 64 and fine.block_count.shape[-1] == 2 * idx.block_count.shape[-1]
            assert torch.equal(step_key_mask(fine, s_local, counts=True), step_key_mask(idx, s_local, counts=True))
            assert fine.is_empty() == idx.is_empty()
            assert fine.known_max is not None and fine.known_max.valid_for(fine.block_count, fine.column_count)
            assert fine.known_max.block == int(fine.block_count.max())
    assert refine_indices(idx, 128) is idx
    with pytest.raises(ValueError, match="must divide"):
        refine_indices(idx, 96)


def test_refine_indices_negative_control():
    """A refinement that drops one sub-block changes the mask (the comparison above can fail)."""
    lay = Layout("striped", cp_size=2, granularity=128)
    idx = convert_pattern(random_pattern(1024, 128, 1, 2, seed=3), lay, 1)[1]
    fine = refine_indices(idx, 64)
    fine.block_count[0, 0, -1] -= 1
    assert not torch.equal(step_key_mask(fine, 512), step_key_mask(idx, 512))


def lists_to_map(cnt, idx, n):
    m = torch.zeros(*cnt.shape, n, dtype=torch.bool)
    for pos in torch.cartesian_prod(*(torch.arange(x) for x in cnt.shape)).tolist():
        row = idx[tuple(pos)][: int(cnt[tuple(pos)])].tolist()
        assert row == sorted(row)
        m[tuple(pos)][row] = True
    return m


@pytest.mark.parametrize("limit", [None, 0])
def test_sparsity_from_indices_lists(limit, monkeypatch):
    if limit is not None:        # the large-step path (one host read for the width) gives the same lists
        monkeypatch.setattr(fa4_mod, "_FULL_WIDTH_LIMIT", limit)
    lay = Layout("striped", cp_size=2, granularity=128)
    pat = random_pattern(2048, 128, 2, 3, seed=7)
    for idx in convert_pattern(pat, lay, 1):
        sp = sparsity_from_indices(idx)
        m = idx.block_count.shape[-1]
        fwd = lists_to_map(sp.fwd_cnt, sp.fwd_idx, m)
        bwd = lists_to_map(sp.bwd_cnt, sp.bwd_idx, m)
        blocks = step_key_mask(refine_indices(idx, 128), 1024)      # token mask of the blocks only
        assert torch.equal(fwd, bwd.transpose(-1, -2))
        assert torch.equal(sp.empty_rows, idx.block_count == 0)
        ref = lists_to_map(idx.block_count, idx.block_index, m)
        assert torch.equal(fwd, ref)
        assert all(t.dtype == torch.int32 for t in (sp.fwd_cnt, sp.fwd_idx, sp.bwd_cnt, sp.bwd_idx))
        assert blocks.shape[-1] == 1024
    with pytest.raises(ValueError, match="128-token blocks"):
        sparsity_from_indices(refine_indices(idx, 64))


# ------------------------------------------------------------------ fp64 emulation of FA4's block sparsity
def _block_mask(cnt, idx, causal, sq, sk, transpose=False):
    n = (sq if transpose else sk) // FA4_BLOCK
    m = lists_to_map(cnt.cpu(), idx.cpu(), n)                        # [b, h, rows, n]
    if transpose:
        m = m.transpose(-1, -2)
    tok = m.repeat_interleave(FA4_BLOCK, -2).repeat_interleave(FA4_BLOCK, -1)
    if causal:
        tok = tok & torch.ones(sq, sk, dtype=torch.bool).tril()
    return tok


def _fake_forward(q, k, v, *, softmax_scale, causal=False, sparsity=None):
    b, sq, hq, d = q.shape
    rep = hq // k.shape[2]
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    mask = _block_mask(sparsity.fwd_cnt, sparsity.fwd_idx, causal, sq, k.shape[1])
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * softmax_scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return out.to(q.dtype), lse


def _fake_backward(dout, q, k, v, out, lse, *, softmax_scale, causal=False, sparsity=None, deterministic=False):
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    mask = _block_mask(sparsity.bwd_cnt, sparsity.bwd_idx, causal, sq, k.shape[1], transpose=True)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * softmax_scale
    p = torch.exp(s - lse[..., None]).masked_fill(~mask, 0.0)
    delta = (dout * out).sum(-1).transpose(1, 2)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vv)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q).view(b, -1, hkv, rep, d).sum(3) * softmax_scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout).view(b, -1, hkv, rep, d).sum(3)
    return dq, dk, dv


@pytest.mark.parametrize("lay", LAYOUTS[:3] + [Layout("striped", cp_size=4, granularity=128)],
                         ids=lambda l: f"{l.kind}-cp{l.cp_size}-g{l.granularity}")
@pytest.mark.parametrize("deterministic", [False, True])
def test_fa4_sparse_step_kernel_matches_fp64(lay, deterministic, monkeypatch):
    """Blocks (emulated FA4) + columns (torch reference) merged by LSE, gradients summed."""
    monkeypatch.setattr(fa4_mod, "fa4_forward", _fake_forward)
    monkeypatch.setattr(fa4_mod, "fa4_backward", _fake_backward)
    seq, b, hq, hkv, d, scale = 1024, 2, 4, 2, 16, 0.3
    pat = random_pattern(seq, 128, b, hq, seed=11 + lay.cp_size, shared_columns=(5, 300))
    g = torch.Generator().manual_seed(lay.cp_size)
    q, k, v, do = (torch.randn(b, seq, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    steps = {r: convert_pattern(pat, lay, r) for r in range(lay.cp_size)}
    kernels = []

    def make(rank):
        kern = make_fa4_sparse_step(steps[rank], scale, fallback=SparseStepKernel, deterministic=deterministic)
        assert isinstance(kern, FA4SparseStepKernel)
        kernels.append(kern)
        return kern
    got = simulate_dense_ring(lay, q, k, v, do, make)
    dm = pat.dense_mask()
    ref = oracle(q, k, v, lambda r0, r1: dm[:, :, r0:r1], scale, dout=do)
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref[:5]):
        assert rel_err(a, r) < 1e-6, name          # the ring harness and the step outputs are fp32
    # negative control: the same kernel without the columns' forward misses their mass
    monkeypatch.setattr(FA4SparseStepKernel, "_parts", lambda self, idx: (sparsity_from_indices(idx), None))
    bad = simulate_dense_ring(lay, q, k, v, do, make)
    assert rel_err(bad[0], ref[0]) > 1e-3


def _fa4_like_forward(q, k, v, *, softmax_scale, causal=False, sparsity=None):
    """The emulation computed in fp32 with the output in q's dtype, as FA4 returns it (fp32 LSE)."""
    out, lse = _fake_forward(q.float(), k.float(), v.float(), softmax_scale=softmax_scale, causal=causal,
                             sparsity=sparsity)
    return out.to(q.dtype), lse


def _fa4_like_backward(dout, q, k, v, out, lse, *, softmax_scale, causal=False, sparsity=None, deterministic=False):
    grads = _fake_backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse,
                           softmax_scale=softmax_scale, causal=causal, sparsity=sparsity)
    return tuple(g.to(q.dtype) for g in grads)


@pytest.mark.parametrize("columns", [False, True])
def test_one_step_ring_passes_fa4_half_precision_results_through(columns, monkeypatch):
    """CP=1 through the ring Function, bf16: FA4's output is the ring's output itself (no fp32 copy and none
    back), out / dQ / dK / dV bitwise those of the fp32 copies (``_only_step`` off, the path before), and within
    2x the error of a bf16 torch attention against fp64. With columns the merge is fp32, as before."""
    from megatron_mtraining.ring import RingAttentionFunc

    handed = []

    def fwd(*a, **kw):
        res = _fa4_like_forward(*a, **kw)
        handed.append(res[0])
        return res
    monkeypatch.setattr(fa4_mod, "fa4_forward", fwd)
    monkeypatch.setattr(fa4_mod, "fa4_backward", _fa4_like_backward)
    lay = Layout("striped", cp_size=1, granularity=128)
    seq, b, hq, hkv, d, scale = 512, 1, 4, 2, 16, 0.25
    pat = random_pattern(seq, 128, b, hq, seed=21, max_vertical=5 if columns else 0)
    steps = convert_pattern(pat, lay, 0)
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(b, seq, h, d, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv, hq))

    def run():
        kern = make_fa4_sparse_step(steps, scale, fallback=SparseStepKernel)
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = RingAttentionFunc.apply(*xs, kern, None)
        out.backward(do)
        return kern, out.detach(), *(x.grad for x in xs)
    kern, *new = run()
    assert kern._only_step and (kern._cache[next(iter(kern._cache))][2] is not None) == columns
    assert (new[0].data_ptr() == handed[-1].data_ptr()) != columns        # FA4's own buffer unless merged
    monkeypatch.setattr(FA4SparseStepKernel, "_only_step", property(lambda self: False))
    _, *old = run()
    for name, a, b in zip(("out", "dq", "dk", "dv"), new, old):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    dm = pat.dense_mask()
    mask = lambda r0, r1: dm[:, :, r0:r1]  # noqa: E731
    ref = oracle(q, k, v, mask, scale, dout=do)
    bar = bf16_reference(q, k, v, mask, scale, do)
    for name, a, r64, r16 in zip(("out", "dq", "dk", "dv"), new, (ref[0], *ref[2:5]), (bar[0], *bar[2:])):
        assert rel_err(a, r64) <= 2 * rel_err(r16, r64), name


def test_fa4_sparse_step_keeps_64_block_patterns_on_the_fallback():
    lay = Layout("striped", cp_size=2, granularity=64)
    pat = random_pattern(1024, 64, 1, 2, seed=1)
    steps = convert_pattern(pat, lay, 0)
    kern = make_fa4_sparse_step(steps, 0.5, fallback=SparseStepKernel)
    assert type(kern) is SparseStepKernel
    with pytest.raises(ValueError, match="128-token blocks"):
        FA4SparseStepKernel(steps, 0.5, fallback=SparseStepKernel(steps, 0.5))


def test_coarsen_pattern_keeps_every_pair_and_rounds_to_touched_tiles():
    from tests.helpers.ring_sim import random_pattern

    fine = random_pattern(2048, 64, 2, 3, seed=5, max_slash=6)
    coarse = fine.coarsen(128)
    assert coarse.block_size == 128 and fine.coarsen(64) is fine
    mf, mc = fine.dense_mask(), coarse.dense_mask()
    assert bool((mc | ~mf).all())                                   # nothing of the fine pattern is lost
    # every coarse tile of the slash part holds a fine slash pair (nothing beyond the touched tiles)
    pos = torch.arange(2048)
    causal = pos[None, :] <= pos[:, None]
    d64 = pos[:, None] // 64 - pos[None, :] // 64
    slash_f = fine.slash_mask()[..., d64.clamp(min=0)] & (d64 >= 0) & causal
    d128 = pos[:, None] // 128 - pos[None, :] // 128
    slash_c = coarse.slash_mask()[..., d128.clamp(min=0)] & (d128 >= 0) & causal
    tiles_f = slash_f.view(2, 3, 16, 128, 16, 128).any(3).any(-1)
    tiles_c = slash_c.view(2, 3, 16, 128, 16, 128).any(3).any(-1)
    assert torch.equal(tiles_f, tiles_c)
    with pytest.raises(ValueError, match="multiple"):
        fine.coarsen(96)


def test_fa4_sparse_step_keeps_only_forward_lists_until_its_backward(monkeypatch):
    """A layer's forward keeps the forward block lists only (the backward lists, ``b*hq*M*M`` int32 per
    step, are built by the backward and dropped after it); the gradients are those with the lists built up
    front (bitwise). ``end_backward`` drops the output (the reference cycle) but not the forward lists: a CUDA
    graph's backward replay reads them where the forward's capture put them, so they live as long as the
    kernel (freed with it by reference counting), never handed back to the graphs' pool in between."""
    seen = []

    def fake_backward(*a, sparsity=None, **kw):
        seen.append(sparsity.bwd_idx is not None)
        return _fake_backward(*a, sparsity=sparsity, **kw)
    monkeypatch.setattr(fa4_mod, "fa4_forward", _fake_forward)
    monkeypatch.setattr(fa4_mod, "fa4_backward", fake_backward)
    lay = Layout("striped", cp_size=1, granularity=128)
    pat = random_pattern(512, 128, 1, 2, seed=4, shared_columns=(7,))
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 512, h, 16, generator=g, dtype=torch.float64) for h in (2, 1, 1, 2))
    steps = convert_pattern(pat, lay, 0)
    kern = make_fa4_sparse_step(steps, 0.25, fallback=SparseStepKernel)
    out, lse = kern.forward(q, k, v, 0)
    (_, sp, cols), = kern._cache.values()
    assert sp.bwd_cnt is None and sp.bwd_idx is None and cols is not None
    o = out.to(q.dtype)
    kern.begin_backward(o)
    delta = (do * o).sum(-1).transpose(1, 2)
    grads = kern.backward(do, q, k, v, lse, delta, 0)
    kern.end_backward()
    assert seen == [True] and kern._out is None
    (_, sp_after, cols_after), = kern._cache.values()
    assert sp_after is sp and cols_after is cols      # the forward's lists themselves, still held
    lists = weakref.ref(sp.fwd_idx)
    del sp, sp_after, cols, cols_after
    assert lists() is not None
    # the same step with both lists built before the forward gives the same values
    monkeypatch.setattr(FA4SparseStepKernel, "_parts",
                        lambda self, idx: (sparsity_from_indices(idx), fa4_mod._without_blocks(idx)))
    kern2 = make_fa4_sparse_step(steps, 0.25, fallback=SparseStepKernel)
    out2, lse2 = kern2.forward(q, k, v, 0)
    kern2.begin_backward(o)
    ref = kern2.backward(do, q, k, v, lse2, delta, 0)
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, ref))
    assert grads[1].abs().sum() > 0
    del kern
    assert lists() is None                            # ...and freed with the kernel


def test_fa4_sparse_steps_refuse_a_cuda_graph_capture_by_name(monkeypatch):
    """Inside a CUDA-graph capture the FA4 sparse step runs as outside one (``capture``, the default), and raises
    FA4_CAPTURE_RULE with ``capture`` off (the graphs module then runs the layer eagerly and warns). The capture
    is simulated."""
    monkeypatch.setattr(fa4_mod, "fa4_forward", _fake_forward)
    lay = Layout("striped", cp_size=1, granularity=128)
    steps = convert_pattern(random_pattern(512, 128, 1, 2, seed=4, shared_columns=(7,)), lay, 0)
    q, k, v = (torch.randn(1, 512, h, 16, dtype=torch.float64) for h in (2, 1, 1))
    kern = make_fa4_sparse_step(steps, 0.25, fallback=SparseStepKernel)
    ref = kern.forward(q, k, v, 0)
    monkeypatch.setattr(fa4_mod, "_capturing", lambda t: True)
    got = kern.forward(q, k, v, 0)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    monkeypatch.setattr(FA4SparseStepKernel, "capture", False)
    with pytest.raises(RuntimeError, match="set not to be captured in CUDA graphs"):
        kern.forward(q, k, v, 0)
    # out-of-ring column work (not the ring's own steps) runs the fallback kernels, captured either way
    other = dataclasses.replace(steps[0], block_count=steps[0].block_count.clone())
    got = kern.forward_fn(q, k, v, other, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(got, kern.fallback.forward_fn(q, k, v, other, 0.25)))

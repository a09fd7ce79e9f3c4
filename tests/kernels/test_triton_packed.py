"""Triton dense ring steps with packed documents (mask mode 3), run by the Triton CPU interpreter.

A simulated ring (every rank's steps and the LSE merge) of :class:`DenseGpuStepKernel` with
:class:`PackedDocuments` against an fp64 per-document reference (each document attended alone):
out, dQ, dK, dV separately (fp32 inputs, <= 1e-5 relative to the largest reference magnitude);
striped and zigzag, cp 1, 2 and 4, GQA 1 and 4, padded documents (exact zeros), two streams with
different documents; tiles of other documents are not listed in the plan.

The vertical-slash sparse steps with packed documents (the Triton sparse kernels' document mask):
random indices restricted to the documents (two streams, a document crossing block boundaries,
padded slots and a padded tail; the own causal step and another owner's step; per-head and
per-group indices with packed GQA tiles) against fp64 masked attention: out, LSE, dQ, dK, dV
separately (fp32, <= 1e-5), both backward modes, exact zeros for padding; the plan's unmasked splits
against a brute-force count; a negative control without the bounds; the custom ops (autograd,
torch.compile) and ``sparse_ring_attention`` at cp 1 with ``kernel_backend`` triton.
"""

import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.triton_interp import rerun_in_fresh_interpreter, use_interpreted_kernels  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from megatron_mtraining.layout import Layout, PackedDocuments  # noqa: E402
from megatron_mtraining.ops.dense_gpu import DenseGpuStepKernel  # noqa: E402
from megatron_mtraining.ops.triton import document_plan  # noqa: E402
from megatron_mtraining.patterns.convert import restrict_to_documents  # noqa: E402
from megatron_mtraining.patterns.indices import StepIndices  # noqa: E402
from tests.helpers.packed_ref import per_document_attention  # noqa: E402
from tests.helpers.ring_sim import simulate_dense_ring  # noqa: E402
from tests.workers.gpu_common import dense_mask_rows, oracle, random_step_indices, rel_err  # noqa: E402

S, D = 256, 32


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.ops.triton.kernels", "_sparse_fwd_kernel")
    yield


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


def _data(b, hq, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(b, S, h, D, generator=g).float()
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


CASES = [
    (Layout("striped", 1, 64), [0, 1, 9, 70, 71, 200, 256], None),
    (Layout("striped", 2, 64), [0, 1, 9, 70, 71, 200, 256], None),
    (Layout("striped", 4, 16), [0, 1, 9, 70, 71, 200, 256], None),
    (Layout("zigzag", 2), [0, 5, 60, 61], [0, 8, 100, 128]),            # tokens 128..255 padding
    (Layout("striped", 2, 64), [0, 5, 60, 61], [0, 8, 100, 128]),
]


@pytest.mark.parametrize("layout, cu, padded", CASES)
@pytest.mark.parametrize("hkv", [4, 1])
def test_triton_packed_steps_match_per_document_reference(layout, cu, padded, hkv):
    q, k, v, do = _data(1, 4, hkv)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, cu_seqlens_padded=padded)
    scale = D ** -0.5
    out, _, dq, dk, dv = simulate_dense_ring(layout, q, k, v, do,
                                             lambda r: DenseGpuStepKernel(layout, r, S, scale, documents=docs))
    ref = per_document_attention(q, k, v, do, cu, scale, padded)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        assert torch.isfinite(got).all(), name
        assert _err(got, want) <= 1e-5, (name, _err(got, want))
    pad = ~docs.real()[0]
    for got in (out, dq, dk, dv):
        assert torch.equal(got[0, pad], torch.zeros_like(got[0, pad]))


def test_triton_packed_two_streams_with_different_documents():
    q, k, v, do = _data(2, 4, 2, seed=1)
    cu = [0, 30, 200, 256, 257, 400, 450]
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, batch_size=2)
    lay = Layout("striped", 2, 64)
    out, _, dq, dk, dv = simulate_dense_ring(lay, q, k, v, do,
                                             lambda r: DenseGpuStepKernel(lay, r, S, 0.2, documents=docs))
    ref = per_document_attention(q, k, v, do, cu, 0.2)
    for got, want in zip((out, dq, dk, dv), ref):
        assert _err(got, want) <= 1e-5
    # negative control: the same steps without the documents
    bad = simulate_dense_ring(lay, q, k, v, do, lambda r: DenseGpuStepKernel(lay, r, S, 0.2))
    assert _err(bad[0], ref[0]) > 1e-2 and _err(bad[2], ref[1]) > 1e-2


def test_document_plan_lists_only_blocks_of_the_tiles_documents():
    pos = torch.arange(256)
    docs = PackedDocuments.from_cu_seqlens([0, 64, 150, 256], 256)
    lo, hi = docs.key_bounds(Layout("striped", 1, 64), 0)
    plan = document_plan(lo[0], hi[0], pos)
    count, split, index = plan.block_count[0, 0], plan.block_split[0, 0], plan.block_index[0, 0]
    assert count.tolist() == [1, 1, 2, 2] and plan.mask_mode == 3
    assert split.tolist() == [0, 0, 0, 0]                  # every listed block has a boundary or the diagonal
    assert index[0, :1].tolist() == [0] and index[2].tolist() == [1, 2] and index[3].tolist() == [2, 3]
    docs = PackedDocuments.from_cu_seqlens([0, 200, 256], 256)   # blocks wholly inside the past run unmasked
    lo, hi = docs.key_bounds(Layout("striped", 1, 64), 0)
    plan = document_plan(lo[0], hi[0], pos)
    assert plan.block_count[0, 0].tolist() == [1, 2, 3, 4] and plan.block_split[0, 0].tolist() == [0, 1, 2, 0]
    pad = PackedDocuments.from_cu_seqlens([0, 10], 256)      # tokens 10..255 padding
    lo, hi = pad.key_bounds(Layout("striped", 1, 64), 0)
    assert document_plan(lo[0], hi[0], pos).block_count[0, 0].tolist() == [1, 0, 0, 0]


# ----------------------------------------------------------------------------- sparse steps with documents
# Two streams: stream 0 has documents of 37 and 113 tokens (the second crosses the 64- and
# 128-token block boundaries), one of 40 tokens in a 106-token slot and padding up to the end;
# stream 1 has a 34-token document and a 222-token one, long enough for tiles that see whole key
# blocks of it without a mask.
SPARSE_CU = [0, 37, 150, 190, 224, 446]            # real lengths 37, 113, 40, 34, 222
SPARSE_PAD = [0, 37, 150, 256, 290, 512]


def _sparse_documents(seq):
    if seq == 256:
        return PackedDocuments.from_cu_seqlens(torch.tensor(SPARSE_CU), 256, batch_size=2,
                                               cu_seqlens_padded=torch.tensor(SPARSE_PAD))
    # one 512-token stream for the cp-2 steps: the same cuts, the padding inside the stream
    return PackedDocuments.from_cu_seqlens(torch.tensor(SPARSE_CU), 512, cu_seqlens_padded=torch.tensor(SPARSE_PAD))


def _sparse_steps(layout, rank, seq, b, heads, gen):
    """Random vertical-slash indices of every owner of ``rank`` (the own step causal, the others not:
    the document bounds contain causality), restricted to the documents."""
    nqb = seq // layout.cp_size // 64
    steps = [random_step_indices(b, heads, nqb, nqb, o == rank, gen, p_block=0.5, p_col=0.06, empty_frac=0.1,
                                 above_diag=o == rank) for o in range(layout.cp_size)]
    for st in steps:          # the converter's padding (-1) instead of the generator's garbage
        for cnt, index in ((st.block_count, st.block_index), (st.column_count, st.column_index)):
            index.masked_fill_(torch.arange(index.shape[-1]) >= cnt[..., None], -1)
    return restrict_to_documents(steps, _sparse_documents(seq), layout, rank)


def _doc_mask_fn(idx, sk):
    lo, hi, kpos = idx.doc_lo, idx.doc_hi, idx.key_pos

    def fn(r0, r1):
        inside = (kpos[None, None, :] >= lo[:, r0:r1, None]) & (kpos[None, None, :] <= hi[:, r0:r1, None])
        return dense_mask_rows(idx, r0, r1, sk) & inside[:, None]
    return fn


SPARSE_CASES = [   # (layout, rank, seq, b, hq, hkv, index heads)
    pytest.param(Layout("striped", 1, 64), 0, 256, 2, 2, 1, 2, id="cp1-gqa2"),
    pytest.param(Layout("striped", 2, 64), 1, 512, 1, 2, 2, 2, id="cp2-rank1"),
]   # 8/2 heads packed into one tile: test_paired_blocks_with_documents_match_fp64_oracle


@pytest.mark.parametrize("layout, rank, seq, b, hq, hkv, ih", SPARSE_CASES)
def test_triton_sparse_steps_with_documents_match_fp64_oracle(layout, rank, seq, b, hq, hkv, ih, monkeypatch):
    """The fast backward with the columns' dK/dV by atomics (``col_atomic_fast``), the deterministic one without."""
    import dataclasses

    from megatron_mtraining.ops.triton import launch, sparse_attention_backward, sparse_attention_forward

    monkeypatch.setattr(launch, "DEFAULT_CONFIG", dataclasses.replace(launch.DEFAULT_CONFIG, col_atomic_fast=True))

    gen = torch.Generator().manual_seed(seq + hq + rank)
    s_local = seq // layout.cp_size
    if seq == 512:
        b = 1
    q, k, v, dout = (torch.randn(b, s_local, h, D, generator=gen) * 1.5 for h in (hq, hkv, hkv, hq))
    steps = _sparse_steps(layout, rank, seq, b, ih, gen)
    scale = D ** -0.5
    for o, idx in enumerate(steps):
        assert idx.has_documents
        rep_idx = idx.per_query_head(hq)
        mask_fn = _doc_mask_fn(rep_idx, s_local)
        o_ref, l_ref = oracle(q, k, v, mask_fn, scale)
        # backward with a global normalisation other than the step's own (as in the ring)
        lse_g = torch.where(torch.isinf(l_ref), l_ref, l_ref + 0.25 * torch.rand(l_ref.shape, generator=gen,
                                                                                  dtype=torch.float64))
        delta_g = torch.randn(l_ref.shape, generator=gen, dtype=torch.float64)
        *_, dq_r, dk_r, dv_r, _, _ = oracle(q, k, v, mask_fn, scale, dout, lse_g, delta_g)
        out, lse = sparse_attention_forward(q, k, v, idx, scale)
        got = {"out": out, "lse": lse}
        for det in (True, False):
            dq, dk, dv = sparse_attention_backward(dout, q, k, v, lse_g.float(), delta_g.float(), idx, scale,
                                                   deterministic=det)
            got.update({f"dq{det}": dq, f"dk{det}": dk, f"dv{det}": dv})
        ref = {"out": o_ref, "lse": l_ref}
        for det in (True, False):
            ref.update({f"dq{det}": dq_r, f"dk{det}": dk_r, f"dv{det}": dv_r})
        for name in got:
            assert not torch.isnan(got[name]).any(), (o, name)
            err = rel_err(got[name], ref[name])
            assert err <= 1e-5, (o, name, err)
        # padding queries see nothing: out 0, lse -inf, dQ 0; padding keys get dK = dV = 0 (exact)
        pad_q = idx.doc_lo > idx.doc_hi                                      # [b, s_local]
        assert bool(torch.isneginf(lse.transpose(1, 2)[pad_q]).all())
        for t in (out, got["dqTrue"]):
            assert torch.equal(t[pad_q], torch.zeros_like(t[pad_q]))
        pad_k = ~_sparse_documents(seq).real()[:, idx.key_pos]               # [b, s_local]
        assert bool(pad_q.any()) and bool(pad_k.any())
        for t in (got["dkTrue"], got["dvTrue"]):
            assert torch.equal(t[pad_k], torch.zeros_like(t[pad_k]))


def test_triton_sparse_documents_splits_and_negative_control():
    """The plan runs whole-document blocks unmasked and mixed ones masked; without the document
    bounds the same indices give other results (the bounds matter beyond the restriction)."""
    from megatron_mtraining.ops.triton import plan_for, sparse_attention_forward

    gen = torch.Generator().manual_seed(5)
    layout, seq, b, h = Layout("striped", 1, 64), 256, 2, 2
    (idx,) = _sparse_steps(layout, 0, seq, b, h, gen)
    plan = plan_for(idx)
    assert plan.has_documents
    bc, split = plan.block_count.expand_as(plan.block_split), plan.block_split
    assert bool((split > 0).any()) and bool((split < bc).any())
    # brute force: a slot runs unmasked iff every row of the tile sees the whole key block
    lo, hi = idx.doc_lo.view(b, 1, -1, 64, 1), idx.doc_hi.view(b, 1, -1, 64, 1)
    for x in range(b):
        for hh in range(h):
            for i in range(seq // 64):
                n = 0
                for s in range(int(idx.block_count[x, hh, i])):
                    kb = int(idx.block_index[x, hh, i, s])
                    keys = torch.arange(kb * 64, kb * 64 + 64)
                    whole = bool(((keys >= lo[x, 0, i]) & (keys <= hi[x, 0, i]) & (keys < i * 64)).all())
                    if not whole:
                        break
                    n += 1
                assert int(split[x, hh, i]) == n, (x, hh, i)
    q, k, v, _ = (torch.randn(b, seq, h, D, generator=gen) * 1.5 for _ in range(4))
    o_ref, _ = oracle(q, k, v, _doc_mask_fn(idx, seq), D ** -0.5)
    out, _ = sparse_attention_forward(q, k, v, idx, D ** -0.5)
    assert rel_err(out, o_ref) <= 1e-5
    bare = StepIndices(idx.block_count, idx.block_index, idx.column_count, idx.column_index, idx.causal)
    out_bare, _ = sparse_attention_forward(q, k, v, bare, D ** -0.5)
    assert rel_err(out_bare, o_ref) > 1e-2


@pytest.mark.parametrize("share", ["head", "kv_group"])
def test_sparse_ring_with_documents_on_triton_matches_pattern_reference(share):
    """``sparse_ring_attention`` at cp 1 with ``kernel_backend`` triton: the Triton sparse steps with
    the document mask, against an fp64 reference built from the returned pattern."""
    import dataclasses

    from megatron_mtraining.ops.backends import select_backend
    from megatron_mtraining.ops.triton import TritonSparseStepKernel
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    from megatron_mtraining.ring.sparse import sparse_ring_attention
    from tests.helpers.packed_ref import pattern_document_attention
    from tests.helpers.packed_ref import rel_err as max_rel_err

    seq, hq, hkv = 256, 4, 2
    gen = torch.Generator().manual_seed(17)
    q, k, v, dout = (torch.randn(1, seq, h, D, generator=gen) * 1.5 for h in (hq, hkv, hkv, hq))
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 37, 150, 190]), seq,
                                           cu_seqlens_padded=torch.tensor([0, 37, 150, 230]))   # tail: padding
    cfg = VerticalSlashConfig(recall=0.6, last_q=64, block_size=64, sink_tokens=2, local_blocks=1, max_vertical=24,
                              max_slash=3, share_pattern=share)
    tri = select_backend("triton", device="cpu", dtype=torch.float32, head_dim=D, sparse=True, packed=True)
    kernels = []
    backend = dataclasses.replace(tri, sparse_step=lambda steps, scale: kernels.append(tri.sparse_step(steps, scale))
                                  or kernels[-1])
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, pat = sparse_ring_attention(*xs, layout=Layout("striped", 1, 64), config=cfg, softmax_scale=0.25,
                                     documents=docs, return_pattern=True, backend=backend)
    out.backward(dout)
    (kernel,) = kernels
    assert isinstance(kernel, TritonSparseStepKernel) and kernel.steps[0].has_documents
    assert all(plan.has_documents for _, plan in kernel._plans.values())
    r_out, r_dq, r_dk, r_dv, _ = pattern_document_attention(q, k, v, dout, pat, docs, 0.25)
    for name, got, want in (("out", out, r_out), ("dq", xs[0].grad, r_dq), ("dk", xs[1].grad, r_dk),
                            ("dv", xs[2].grad, r_dv)):
        assert torch.isfinite(got).all(), name
        assert max_rel_err(got, want) <= 1e-5, (name, max_rel_err(got, want))
    real = docs.real()[0]
    for t in (out, *(x.grad for x in xs)):
        assert bool((t[:, ~real] == 0).all())


def test_sparse_attention_autograd_with_documents():
    """The custom ops carry the document bounds: autograd and torch.compile (fullgraph)."""
    from megatron_mtraining.ops.triton import sparse_attention

    gen = torch.Generator().manual_seed(1)
    (idx,) = _sparse_steps(Layout("striped", 1, 64), 0, 256, 2, 2, gen)
    q, k, v, dout = (torch.randn(2, 256, 2, D, generator=gen) for _ in range(4))
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = sparse_attention(*xs, idx, 0.2)
    out.backward(dout)
    ref = oracle(q, k, v, _doc_mask_fn(idx, 256), 0.2, dout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in xs)), (ref[0], *ref[2:5])):
        assert rel_err(got.detach(), want) <= 1e-5, name
    compiled = torch.compile(lambda a, b, c: sparse_attention(a, b, c, idx, 0.2), fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v), out.detach())


def test_shared_block_index_with_per_stream_document_bounds():
    """One causal block index for the batch (batch dim 1) and document bounds per stream (stream 0 one
    document, stream 1 two of 128 tokens): the dK/dV kernel may skip the mask only for key blocks that
    every stream's tile sees whole (stream 0's split would run stream 1's cross-document blocks
    unmasked); out, dQ, dK, dV against the fp64 masked oracle, data-dependent and static plans."""
    from megatron_mtraining.ops.triton.launch import plan_from_indices, sparse_backward, sparse_forward

    n, nqb = 256, 4
    gen = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(2, n, h, D, generator=gen) for h in (2, 1, 1, 2))
    bc = torch.arange(1, nqb + 1, dtype=torch.int32)[None, None]                # tile qb lists blocks 0..qb
    bi = torch.arange(nqb, dtype=torch.int32).expand(nqb, nqb).contiguous()[None, None]
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 256, 384, 512]), n, batch_size=2)
    lo, hi = docs.key_bounds(Layout("striped", 1, 64), 0)                          # [2, n], causal included
    pos = torch.arange(n)

    def mask_fn(r0, r1):
        inside = (pos[None, None, :] >= lo[:, r0:r1, None]) & (pos[None, None, :] <= hi[:, r0:r1, None])
        return inside[:, None].expand(2, 2, r1 - r0, n)

    scale = D ** -0.5
    o_ref, l_ref = oracle(q, k, v, mask_fn, scale)
    delta = torch.randn(l_ref.shape, generator=gen, dtype=torch.float64)
    *_, dq_r, dk_r, dv_r, _, _ = oracle(q, k, v, mask_fn, scale, dout, l_ref, delta)
    for static in (False, True):
        plan = plan_from_indices(bc, bi, None, None, causal=True, static=static, doc_lo=lo, doc_hi=hi, key_pos=pos)
        out, lse = sparse_forward(q, k, v, plan, scale)
        dq, dk, dv = sparse_backward(dout, q, k, v, l_ref.float(), delta.float(), plan, scale)
        for name, got, want in (("out", out, o_ref), ("dq", dq, dq_r), ("dk", dk, dk_r), ("dv", dv, dv_r)):
            assert _err(got, want) <= 1e-5, (static, name, _err(got, want))


@pytest.mark.parametrize("case", ["sparse-documents-kv-group-packed", "dense-position-bounds"])
def test_paired_blocks_with_documents_match_fp64_oracle(monkeypatch, case):
    """``KernelConfig.{fwd,dq,dkdv}_pair`` with documents: the document bounds of sparse steps (GQA heads
    packed into one tile) and the position bounds of packed dense steps, against the same oracles."""
    import dataclasses

    from megatron_mtraining.ops.triton import launch

    paired = dataclasses.replace(launch.DEFAULT_CONFIG, fwd_pair=True, dq_pair=True, dkdv_pair=True)
    monkeypatch.setattr(launch, "DEFAULT_CONFIG", paired)
    if case.startswith("sparse"):
        test_triton_sparse_steps_with_documents_match_fp64_oracle(Layout("striped", 1, 64), 0, 256, 2, 8, 2, 2,
                                                                  monkeypatch)
    else:
        test_triton_packed_steps_match_per_document_reference(Layout("zigzag", 2), [0, 5, 60, 61], [0, 8, 100, 128], 1)

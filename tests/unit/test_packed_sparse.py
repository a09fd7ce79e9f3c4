"""Vertical-slash sparse attention over packed documents (THD), on the CPU in one process.

The mask is (vertical-slash pattern) ∧ causal ∧ same document. Every test compares with an
independent fp64 reference built from the SAME selected pattern: the dense token mask of the
pattern (:meth:`VerticalSlashPattern.dense_mask`) ∧ ``lo[p] <= t <= hi[p]`` of the documents, a
softmax per row and autograd for dQ, dK, dV (each checked separately). The ring at cp 2 and 4 is
simulated rank by rank (tests/helpers/ring_sim.py) with the per-rank conversion, the document
restriction and the torch sparse step kernel; the estimator itself runs over gloo in
tests/distributed/test_packed_sparse_ring.py.
"""
import dataclasses

import pytest
import torch

from megatron_mtraining.layout import Layout, PackedDocuments
from megatron_mtraining.ops.backends import select_backend
from megatron_mtraining.ops.sparse_reference import SparseStepKernel
from megatron_mtraining.patterns.convert import convert_pattern, restrict_to_documents
from megatron_mtraining.patterns.estimator import VerticalSlashConfig, VerticalSlashPattern, estimate_vertical_slash
from megatron_mtraining.ring.sparse import sparse_ring_attention
from tests.helpers.packed_ref import document_probe_oracle, pattern_document_attention, rel_err
from tests.helpers.ring_sim import simulate_dense_ring

BS = 16
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _cfg(**kw):
    base = dict(recall=0.6, last_q=16, block_size=BS, sink_tokens=2, local_blocks=1, max_vertical=6, max_slash=3)
    base.update(kw)
    return VerticalSlashConfig(**base)


def _inputs(S, hq, hkv, dtype, seed=0, b=1):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: (torch.randn(b, S, h, 16, generator=g, dtype=torch.float64) * 1.5).to(dtype)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _reference(q, k, v, dout, pattern, docs, scale):
    out, dq, dk, dv, m = pattern_document_attention(q, k, v, dout, pattern, docs, scale)
    return out, dq, dk, dv, m


def _simulate(layout, q, k, v, dout, pattern, docs, scale, use_documents=True):
    def make(rank):
        steps = convert_pattern(pattern, layout, rank, impl="torch")
        if use_documents:
            steps = restrict_to_documents(steps, docs, layout, rank)
        return SparseStepKernel(steps, scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return simulate_dense_ring(layout, q, k, v, dout, make, acc=acc)


def _documents(S, cp, kind):
    """Documents of lengths 1 ... 2*cp*BS, non-divisible, straddling stripes; with padding."""
    if kind == "contiguous":
        lens, cu = [1, 2 * cp * BS, 7, BS + 3], [0]
        for n in lens:
            cu.append(min(S, cu[-1] + n))
        if cu[-1] < S:
            cu.append(S)
        return PackedDocuments.from_cu_seqlens(torch.tensor(cu), S)
    if kind == "padded_real_tail":     # padded slots, the last document real up to the end (real probes)
        return PackedDocuments.from_cu_seqlens(torch.tensor([0, 5, 38, 38 + S - 64]), S,
                                               cu_seqlens_padded=torch.tensor([0, 24, 64, S]))
    # padded: slots of 24, 40, rest; real lengths 5, 33, 1 (the tail past the last slot is padding too,
    # so every probe is padding: the pattern is the floors)
    pad = [0, 24, 64, S - 8]
    cu = [0, 5, 38, 39]
    return PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, cu_seqlens_padded=torch.tensor(pad))


@pytest.mark.parametrize("cp,kind,gran", [(1, "striped", BS), (2, "striped", BS), (4, "striped", BS),
                                          (2, "zigzag", None), (4, "zigzag", None)])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("docs_kind", ["contiguous", "padded", "padded_real_tail"])
def test_simulated_sparse_ring_matches_pattern_reference(cp, kind, gran, heads, dtype, docs_kind):
    S = 2 * cp * BS * 2 if kind == "zigzag" else 128
    S = max(S, 128)
    layout = Layout(kind, cp, gran) if gran else Layout(kind, cp)
    hq, hkv = heads
    q, k, v, dout = _inputs(S, hq, hkv, dtype, seed=cp + hq)
    docs = _documents(S, cp, docs_kind)
    scale = 0.25
    pattern = estimate_vertical_slash(q.double(), k.double(), layout=Layout("striped", 1, BS), config=_cfg(),
                                      softmax_scale=scale, documents=docs)
    out, lse, dq, dk, dv = _simulate(layout, q, k, v, dout, pattern, docs, scale)
    r_out, r_dq, r_dk, r_dv, m = _reference(q, k, v, dout, pattern, docs, scale)
    real = docs.real()[0]
    assert bool(m[:, :, real].any(-1).all()), "a real query without any selected key"
    assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    assert torch.isfinite(lse[:, :, real]).all()
    for name, a, r in (("out", out, r_out), ("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert rel_err(a, r) <= TOL[dtype], (name, rel_err(a, r))
    for t in (out, dq, dk, dv):
        assert bool((t[:, ~real] == 0).all()), "padding tokens must get exact zeros"


def test_every_document_keeps_its_sinks_and_its_diagonal():
    S = 128
    q, k, _, _ = _inputs(S, 2, 2, torch.float64, seed=3)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 1, 20, 37, 90, 128]), S)
    pat = estimate_vertical_slash(q, k, layout=Layout("striped", 1, BS), config=_cfg(max_vertical=2),
                                  softmax_scale=0.25, documents=docs)
    vm = pat.vertical_mask()                                             # [b, h, S]
    for start, end in ((0, 1), (1, 20), (20, 37), (37, 90), (90, 128)):
        for j in range(min(2, end - start)):
            assert bool(vm[0, :, start + j].all()), (start, j)
    assert bool(pat.slash_mask()[..., 0].all())


def test_negative_control_ignoring_documents_fails():
    S, cp = 128, 2
    layout = Layout("striped", cp, BS)
    q, k, v, dout = _inputs(S, 2, 2, torch.float64, seed=5)
    docs = _documents(S, cp, "contiguous")
    pattern = estimate_vertical_slash(q, k, layout=Layout("striped", 1, BS), config=_cfg(recall=0.9),
                                      softmax_scale=0.25, documents=docs)
    out = _simulate(layout, q, k, v, dout, pattern, docs, 0.25, use_documents=False)[0]
    r_out = _reference(q, k, v, dout, pattern, docs, 0.25)[0]
    assert rel_err(out, r_out) > 1e-3


def test_blocks_and_columns_of_other_documents_are_dropped():
    S, cp = 128, 2
    layout = Layout("striped", cp, BS)
    q, k, _, _ = _inputs(S, 2, 2, torch.float64, seed=7)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 64, 128]), S)   # block-aligned documents
    pattern = estimate_vertical_slash(q, k, layout=Layout("striped", 1, BS), config=_cfg(recall=1.0, max_slash=8,
                                      max_vertical=8), softmax_scale=0.25, documents=docs)
    for rank in range(cp):
        kpos_q = layout.positions(rank, S)
        for o, st in enumerate(restrict_to_documents(convert_pattern(pattern, layout, rank, impl="torch"),
                                                     docs, layout, rank)):
            kpos = layout.positions(o, S)
            for i in range(st.block_count.shape[-1]):
                qdoc = int(kpos_q[i * BS]) // 64
                n = st.block_count[..., i].max()
                for j in st.block_index[..., i, :int(n)].flatten().tolist():
                    if j >= 0:
                        assert int(kpos[j * BS]) // 64 == qdoc
                for c in st.column_index[..., i, :].flatten().tolist():
                    if c >= 0:
                        assert int(kpos[c]) // 64 == qdoc


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_document_equals_unpacked_sparse_path_bitwise(dtype):
    S = 128
    q, k, v, dout = _inputs(S, 4, 2, dtype, seed=11)
    layout = Layout("striped", 1, BS)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, S]), S)
    res = []
    for d in (None, docs):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = sparse_ring_attention(qq, kk, vv, layout=layout, config=_cfg(), documents=d)
        out.backward(dout)
        res.append((out, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*res):
        assert torch.equal(a, b)


@pytest.mark.parametrize("heads,share,budgets", [((2, 2), "head", {}), ((4, 1), "head", {}), ((2, 2), "kv_group", {}),
                                                 ((4, 1), "kv_group", {}),
                                                 ((4, 1), "head", {"max_vertical": 0, "sink_tokens": 0})])
def test_front_door_cp1_matches_reference(heads, share, budgets):
    """The documents' front door against the pattern reference; also with no vertical budget at all (no
    candidate column: the selection crashed on the empty list)."""
    S = 128
    hq, hkv = heads
    q, k, v, dout = _inputs(S, hq, hkv, torch.float64, seed=13)
    docs = _documents(S, 1, "padded_real_tail" if budgets else "padded")
    layout = Layout("striped", 1, BS)
    cfg = _cfg(share_pattern=share, **budgets)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, pat = sparse_ring_attention(qq, kk, vv, layout=layout, config=cfg, softmax_scale=0.25, documents=docs,
                                     return_pattern=True)
    out.backward(dout)
    r_out, r_dq, r_dk, r_dv, _ = _reference(q, k, v, dout, pat, docs, 0.25)
    for name, a, r in (("out", out, r_out), ("dq", qq.grad, r_dq), ("dk", kk.grad, r_dk), ("dv", vv.grad, r_dv)):
        assert rel_err(a, r) <= 1e-10, name
    real = docs.real()[0]
    for t in (out, qq.grad, kk.grad, vv.grad):
        assert bool((t[:, ~real] == 0).all())
    if budgets:
        assert int(pat.vertical_count.max()) == 0 and int(pat.slash_count.min()) >= 1


def test_refusals_name_the_rule():
    S = 128
    q, k, v, _ = _inputs(S, 2, 2, torch.float32)
    docs = _documents(S, 1, "contiguous")
    layout = Layout("striped", 1, BS)
    with pytest.raises(NotImplementedError, match="columns='in_ring'"):
        sparse_ring_attention(q, k, v, layout=layout, config=_cfg(), documents=docs, columns="out_of_ring")
    with pytest.raises(ValueError, match="kernel_backend='fa4' cannot run packed sequences"):
        select_backend("fa4", device="cpu", dtype=torch.float32, head_dim=16, sparse=True, packed=True,
                       triton_available=True, fa4_available=True)
    with pytest.raises(ValueError, match="packed documents describe 1 streams of 256"):
        estimate_vertical_slash(q, k, layout=layout, config=_cfg(), documents=_documents(2 * S, 1, "contiguous"))
    fa4_named = dataclasses.replace(select_backend("torch", device="cpu", dtype=torch.float32, head_dim=16,
                                                   sparse=True, packed=True), name="fa4")
    with pytest.raises(NotImplementedError, match="FA4 sparse kernels have no document mask"):
        sparse_ring_attention(q, k, v, layout=layout, config=_cfg(), documents=docs, backend=fa4_named)
    auto = select_backend("auto", device="cpu", dtype=torch.float32, head_dim=16, sparse=True, packed=True)
    assert auto.sparse_step is SparseStepKernel


def test_triton_backends_keep_the_triton_sparse_steps_for_documents():
    pytest.importorskip("triton")
    from megatron_mtraining.ops.triton import make_sparse_step_kernel

    tri = select_backend("triton", device="cpu", dtype=torch.float32, head_dim=16, sparse=True, packed=True,
                         triton_available=True)
    assert tri.name == "triton" and tri.sparse_step.func is make_sparse_step_kernel
    assert tri.estimator_impl == "triton"      # the Triton score kernels take the document bounds
    cuda_auto = select_backend("auto", device="cuda", dtype=torch.bfloat16, head_dim=64, sparse=True, packed=True,
                               triton_available=True, fa4_available=True)
    assert cuda_auto.name == "triton" and cuda_auto.sparse_step.func is make_sparse_step_kernel


def test_step_kernels_take_document_bounds():
    """The Triton sparse step kernel keeps the bounds; FA4's refuses them, naming the rule."""
    pytest.importorskip("triton")
    from megatron_mtraining.ops.fa4 import make_fa4_sparse_step
    from megatron_mtraining.ops.triton import make_sparse_step_kernel, plan_for

    S = 128
    q, k, _, _ = _inputs(S, 2, 2, torch.float64)
    layout = Layout("striped", 1, 64)
    docs = _documents(S, 1, "contiguous")
    pat = estimate_vertical_slash(q, k, layout=layout, config=_cfg(block_size=64), softmax_scale=0.25,
                                  documents=docs)
    steps = restrict_to_documents(convert_pattern(pat, layout, 0, impl="torch"), docs, layout, 0)
    kernel = make_sparse_step_kernel(steps, 0.25)
    plan = kernel.plan(steps[0])
    assert plan.has_documents and plan_for(steps[0]).has_documents
    assert torch.equal(plan.doc_lo.long(), steps[0].doc_lo) and torch.equal(plan.k_pos.long(), steps[0].key_pos)
    with pytest.raises(NotImplementedError, match="FA4 sparse step kernels have no document mask"):
        make_fa4_sparse_step(steps, 0.25, fallback=make_sparse_step_kernel)
    # patterns at 128-token blocks are split into the kernels' 64-token tiles with their bounds
    from megatron_mtraining.patterns.convert import refine_indices

    lay128 = Layout("striped", 1, 128)
    pat = estimate_vertical_slash(q, k, layout=lay128, config=_cfg(block_size=128), softmax_scale=0.25,
                                  documents=docs)
    (st,) = restrict_to_documents(convert_pattern(pat, lay128, 0, impl="torch"), docs, lay128, 0)
    fine = refine_indices(st, 64)
    assert fine.block_size == 64 and fine.doc_lo is st.doc_lo and fine.doc_hi is st.doc_hi
    assert fine.key_pos is st.key_pos and plan_for(st).has_documents


def _restrict_per_query(st, docs, layout, rank, owner):
    """Independent oracle of restrict_to_documents: the kept (block, column) entries by the per-query
    definition, every query of the block tested against every key of the entry, in Python loops."""
    S = docs.seq_len
    lo, hi = docs.key_bounds(layout, rank)
    kpos = layout.positions(owner, S).tolist()
    bs = st.block_size
    b, h, nqb = st.block_count.shape
    keep_b, keep_c = {}, {}
    for bb in range(b):
        for hh in range(h):
            for i in range(nqb):
                rows = [(int(lo[bb, i * bs + r]), int(hi[bb, i * bs + r])) for r in range(bs)]
                blocks = st.block_index[bb, hh, i, :int(st.block_count[bb, hh, i])].tolist()
                keep_b[bb, hh, i] = [j for j in blocks
                                     if any(a <= kpos[j * bs + x] <= z for a, z in rows for x in range(bs))]
                cols = st.column_index[bb, hh, i, :int(st.column_count[bb, hh, i])].tolist()
                keep_c[bb, hh, i] = [c for c in cols if any(a <= kpos[c] <= z for a, z in rows)]
    return keep_b, keep_c


@pytest.mark.parametrize("cp,kind", [(1, "striped"), (2, "striped"), (4, "striped"), (2, "zigzag")])
@pytest.mark.parametrize("docs_kind", ["contiguous", "padded", "padded_real_tail", "gaps"])
def test_restriction_per_block_equals_the_per_query_definition(cp, kind, docs_kind):
    """The per-query-block test of restrict_to_documents keeps exactly the entries that some query of the
    block may see (oracle: every query against every key); the documents include padding between
    documents inside one block, documents shorter than a block and documents straddling stripes."""
    S = max(128, 4 * cp * BS)
    layout = Layout(kind, cp, BS) if kind == "striped" else Layout(kind, cp)
    q, k, _, _ = _inputs(S, 2, 2, torch.float64, seed=5)
    if docs_kind == "gaps":      # real lengths 3, 20, 1, 40 in slots of 10, 30, 5, rest: padding inside blocks
        docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 3, 23, 24, 64]), S,
                                               cu_seqlens_padded=torch.tensor([0, 10, 40, 45, S]))
    else:
        docs = _documents(S, cp, docs_kind)
    if docs_kind == "gaps":     # a hand-made pattern without the diagonal: columns on padding inside a block
        pattern = VerticalSlashPattern.from_lists(S, BS, [[[1]] * 2], [[list(range(S))] * 2])
    else:
        pattern = estimate_vertical_slash(q, k, layout=Layout("striped", 1, BS), config=_cfg(
            recall=1.0, max_vertical=S, max_slash=S // BS, sink_tokens=2), softmax_scale=0.25, documents=docs)
    for rank in range(cp):
        steps = convert_pattern(pattern, layout, rank, impl="torch")
        for o, (st, got) in enumerate(zip(steps, restrict_to_documents(steps, docs, layout, rank))):
            keep_b, keep_c = _restrict_per_query(st, docs, layout, rank, o)
            for (bb, hh, i), want in keep_b.items():
                assert got.block_index[bb, hh, i, :int(got.block_count[bb, hh, i])].tolist() == want
            for (bb, hh, i), want in keep_c.items():
                assert got.column_index[bb, hh, i, :int(got.column_count[bb, hh, i])].tolist() == want
    # negative control: the oracle does drop entries here (the test is not vacuous)
    st = convert_pattern(pattern, layout, 0, impl="torch")[0]
    keep_b, keep_c = _restrict_per_query(st, docs, layout, 0, 0)
    assert sum(map(len, keep_b.values())) + sum(map(len, keep_c.values())) < \
        int(st.block_count.sum()) + int(st.column_count.sum())


@pytest.mark.parametrize("cp", [1, 2])
def test_restriction_in_chunks_equals_one_pass(monkeypatch, cp):
    """restrict_to_documents tests its entries in chunks bounded by RESTRICT_CHUNK_ELEMENTS; any chunk size
    keeps and drops exactly the entries of one pass over all of them (padded documents, straddling blocks)."""
    import megatron_mtraining.patterns.convert as conv

    S = 256
    layout = Layout("striped", cp, BS)
    q, k, _, _ = _inputs(S, 4, 2, torch.float64, seed=11)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 5, 38, 100, 180]), S,
                                           cu_seqlens_padded=torch.tensor([0, 24, 64, 130, S]))
    pattern = estimate_vertical_slash(q, k, layout=Layout("striped", 1, BS), config=_cfg(recall=1.0, max_vertical=12,
                                      max_slash=8), softmax_scale=0.25, documents=docs)
    calls = []
    real = conv._any_row_sees
    monkeypatch.setattr(conv, "_any_row_sees", lambda test, rows, width: calls.append(width) or real(test, rows, width))
    for rank in range(cp):
        steps = convert_pattern(pattern, layout, rank, impl="torch")
        whole = restrict_to_documents(steps, docs, layout, rank)
        for chunk in (1, 4 * (S // cp // BS) + 1, 3 * 4 * (S // cp // BS)):
            monkeypatch.setattr(conv, "RESTRICT_CHUNK_ELEMENTS", chunk)    # 1 entry, 1 entry (+1), 3 entries a chunk
            part = restrict_to_documents(steps, docs, layout, rank)
            monkeypatch.setattr(conv, "RESTRICT_CHUNK_ELEMENTS", 1 << 26)
            for a, b in zip(whole, part):
                for name in ("block_count", "block_index", "column_count", "column_index"):
                    assert torch.equal(getattr(a, name), getattr(b, name)), (rank, chunk, name)
    assert calls and max(calls) > 3                       # the chunked runs really split the entries


# ------------------------------------------------------------------------------ per-document probes
def _two_probe_streams():
    """``(S, hq, hkv, L, q, k, docs, layout)``: two fp64 streams of padded documents of 1 to 60 tokens."""
    S, hq, hkv, L = 128, 4, 2, 12
    q, k, _, _ = _inputs(S, hq, hkv, torch.float64, seed=3, b=2)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 5, 30, 90, 91, 130, 190]), S, batch_size=2,
                                           cu_seqlens_padded=torch.tensor([0, 10, 40, 120, 128, 180, 256]))
    return S, hq, hkv, L, q, k, docs, Layout("striped", 1, BS)


def test_per_document_probe_scores_match_explicit_oracle():
    from megatron_mtraining.patterns.estimator import _document_probe_scores

    S, hq, hkv, L, q, k, docs, lay = _two_probe_streams()
    col, slash, k_pos, n_real = _document_probe_scores(q, k, lay, None, 0, 1, S, BS, L, S // BS, 0.25, False, docs)
    r_col, r_slash, r_n = document_probe_oracle(q, k, docs, L, BS, 0.25, hkv)
    assert torch.equal(n_real, r_n) and torch.equal(k_pos, torch.arange(S))
    assert rel_err(col, r_col) <= 1e-12 and rel_err(slash, r_slash) <= 1e-12
    # every document's probes carry mass 1 per row: the scores hold the whole probe mass
    assert torch.allclose(col.sum(-1), n_real[:, None].expand(2, hq), rtol=1e-12)
    # negative control: the stream's probes see only its last document's keys
    from megatron_mtraining.patterns.estimator import _scores

    s_col, *_ = _scores(q, k, lay, None, 0, 1, S, BS, L, S // BS, 0.25, False, documents=docs)
    assert rel_err(s_col, r_col) > 0.5


@pytest.mark.parametrize("budget", [64 * 4 * 12, 4 * 12 * 64 * 3])
def test_per_document_probe_scores_within_a_small_logit_budget(monkeypatch, budget):
    """Under a logit budget smaller than all documents' logits together (the first: one 64-key chunk of
    one document's probes; the second: some documents cached, the rest recomputed), the scores are the
    same as with everything cached."""
    from megatron_mtraining.patterns import estimator as est

    S, hq, hkv, L, q, k, docs, lay = _two_probe_streams()
    args = (q, k, lay, None, 0, 1, S, BS, L, S // BS, 0.25, False, docs)
    full = est._document_probe_scores(*args)
    monkeypatch.setattr(est, "_LOGIT_BUDGET", budget)
    small = est._document_probe_scores(*args)
    for a, b in zip(full, small):
        assert torch.equal(a, b)


def test_per_document_probes_select_lines_in_every_document():
    """With per-document probes the columns of documents other than the last carry scores (beyond their
    sinks) and the masses are fractions of all probes; the stream's probes leave those documents at the floors."""
    S, hq, hkv = 128, 2, 2
    q, k, _, _ = _inputs(S, hq, hkv, torch.float64, seed=9)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 60, 100, 128]), S)
    lay = Layout("striped", 1, BS)
    cfg = _cfg(recall=0.9, max_vertical=40, max_slash=8)
    stream = estimate_vertical_slash(q, k, layout=lay, config=cfg, softmax_scale=0.25, documents=docs)
    per_doc = estimate_vertical_slash(q, k, layout=lay, config=dataclasses.replace(cfg, probes="document"),
                                      softmax_scale=0.25, documents=docs)
    first = lambda pat: {int(t) for t in pat.vertical[0, 0, :int(pat.vertical_count[0, 0])] if 2 <= t < 60}  # noqa: E731
    assert not first(stream) and first(per_doc)
    for m in (per_doc.est_vertical_mass, per_doc.est_slash_mass):      # fractions of all probes' mass
        assert ((m > 0) & (m <= 1 + 1e-12)).all()
    with pytest.raises(ValueError, match="probes must be one of 'stream', 'document'"):
        _cfg(probes="documents")

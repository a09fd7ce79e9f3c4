"""Fused Triton estimator scores (patterns/triton/estimator.py), run by the Triton CPU interpreter.

Checked against an independent fp64 computation (full probe logits against all S keys with an
explicit causal mask, torch.logsumexp / softmax, block diagonals by an explicit offset matrix):
local (m, z) merged like the CP all-reduce -> LSE, per-key column sums, block-diagonal sums;
fp32 and fp16 inputs (fp16: the oracle uses the same fp16-rounded values; bf16 ``tl.dot`` is wrong
in the interpreter, see test_triton_kernels.py); GQA 2 and 4 and MHA; batch 2; probe counts with one
and two query blocks (aligned and not), probe rows padded and split over several row chunks;
striped (granularity 64 and 16), zigzag and contiguous layouts at cp 1 and simulated cp 2 (the
kernels run on each rank's local keys); packed documents (per-row key bounds against an oracle with
an explicit document mask: several documents among the probes, padding, two streams, probes that
are all padding, whole key tiles skipped); per-document probes (``probes="document"``: the
per-document kernels over simulated ranks against an explicit fp64 oracle, several documents in one
key tile, probes straddling query blocks, padding; a key range one tile short is caught; launches of
one slot each give the same scores). ``estimate_vertical_slash(impl="triton")`` selects the
same lines as ``impl="torch"``, with and without documents and with per-document probes; a shifted ``k_pos`` (negative control) is caught; ranks / rows
without visible keys give exact zeros, no NaN; bad ``impl`` values raise.

The interpreter must be chosen before triton is imported (same mechanism as
test_triton_kernels.py): if another test module imported triton earlier in this pytest process,
the tests re-run this file in a fresh subprocess instead.
"""

import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:  # else compiled Triton is in use (GPU session): the tests run in a subprocess
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.triton_interp import rerun_in_fresh_interpreter, run_aot_worker, use_interpreted_kernels

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from megatron_mtraining.layout import Layout  # noqa: E402
from megatron_mtraining.patterns.estimator import (  # noqa: E402
    VerticalSlashConfig, estimate_vertical_slash, resolve_impl,
)
from tests.workers.gpu_estimator_check import merge_lse  # noqa: E402
from tests.workers.vs_data import make_qkv  # noqa: E402

F64 = torch.float64
TOL = 1e-5          # relative, fp32 accumulation (fp32 and fp16 inputs)


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.patterns.triton.estimator",
                            "_probe_stats_kernel")
    yield


def _ops():
    from megatron_mtraining.patterns.triton import estimator as E
    return E


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


# ------------------------------------------------------------------------------ independent fp64 oracle
def oracle(q, k, L, bs, scale, doc_ids=None):
    """``(lse [b,hq,L], col [b,hq,S], slash [b,hq,S/bs])`` in fp64 from the given (rounded) values.
    ``doc_ids [b, S]``: packed documents (a key is visible iff causal and of the row's document;
    id ``-1`` is padding, which sees and is seen by nothing)."""
    b, S, hq, _ = q.shape
    rep = hq // k.shape[2]
    qq = q[:, S - L:].to(F64)
    kk = k.to(F64).repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qq, kk) * scale                 # [b, hq, L, S]
    qpos, kpos = torch.arange(S - L, S), torch.arange(S)
    vis = kpos[None, :] <= qpos[:, None]                                  # explicit causal mask
    if doc_ids is not None:
        same = doc_ids[:, S - L:, None] == doc_ids[:, None, :]
        vis = vis[None] & same & (doc_ids[:, S - L:, None] >= 0)          # [b, L, S]
        s = s.masked_fill(~vis[:, None], float("-inf"))
        rows_ok = vis.any(-1)[:, None, :, None]
        lse = torch.logsumexp(s, -1)
        p = torch.where(rows_ok, torch.softmax(torch.where(rows_ok, s, 0.0), -1), 0.0)
        p = p.masked_fill(~vis[:, None], 0.0)
        vis = vis[:, None]
    else:
        s = s.masked_fill(~vis, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.softmax(s, -1)
    col = p.sum(2)
    diag = qpos[:, None] // bs - kpos[None, :] // bs                      # [L, S] block offset
    slash = torch.stack([(p * ((diag == dd) & vis)).sum((-1, -2)) for dd in range(S // bs)], -1)
    return lse, col, slash


def max_rel(got, ref, floor=1e-30):
    got, ref = got.to(F64), ref.to(F64)
    assert not torch.isnan(got).any(), "NaN"
    return float(((got - ref).abs() / (ref.abs() + floor)).max())


def simulated_scores(q, k, layout, L, bs, scale, shift_kpos=0, bounds=None):
    """The kernels on every rank's local keys, (m, z) merged like the all-reduce (MAX, rescaled SUM).
    ``bounds``: the probe rows' key bounds ``(lo, hi)`` ``[b, L]`` (packed documents) or ``None``.

    Returns ``(lse [b,hq,L], col [b,hq,S] in global positions, slash [b,hq,S/bs], per-rank (m, z))``."""
    E = _ops()
    b, S, hq, _ = q.shape
    cp = layout.cp_size
    probe = q[:, S - L:]
    ranks = []
    for r in range(cp):
        k_loc = layout.shard(k, r, dim=1)
        k_pos = layout.positions(r, S) + shift_kpos
        m, z = E.probe_softmax_stats(probe, k_loc, k_pos, S, scale, bounds=bounds)
        assert m.dtype == F64 and z.dtype == F64 and m.shape == (b, hq, L)
        ranks.append((k_loc, k_pos, m, z))
    lse = merge_lse([x[2] for x in ranks], [x[3] for x in ranks])
    col = torch.zeros(b, hq, S, dtype=F64)
    slash = torch.zeros(b, hq, S // bs, dtype=F64)
    u0, nu = E.probe_block_range(S, L, bs)
    for k_loc, k_pos, _, _ in ranks:
        colu = E.probe_column_sums(probe, k_loc, k_pos, S, lse, scale, bs, bounds=bounds)
        assert colu.dtype == torch.float32 and colu.shape == (b, hq, nu, k_loc.shape[1])
        colu = colu.to(F64)
        col[:, :, (k_pos - shift_kpos).long()] = colu.sum(2)
        for i in range(nu):
            slash.index_add_(-1, (u0 + i - k_pos // bs).clamp(min=0), colu[:, :, i])
    return lse, col, slash, [(x[2], x[3]) for x in ranks]


def _inputs(b, S, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, S, hq, d, generator=g) * 1.5).to(dtype)
    k = (torch.randn(b, S, hkv, d, generator=g) * 1.5).to(dtype)
    return q, k


CASES = [
    # b, S,  hq, hkv, d,  L,   bs, dtype,          layout
    (2, 512, 4, 2, 32, 64, 64, torch.float32, Layout("striped", 1, 64)),      # nu = 1, GQA 2
    (2, 512, 4, 1, 64, 48, 32, torch.float32, Layout("striped", 2, 64)),      # nu = 2, S-L not block aligned
    (2, 256, 4, 2, 64, 64, 64, torch.float16, Layout("contiguous", 2)),
    (1, 512, 4, 1, 32, 100, 64, torch.float32, Layout("striped", 2, 16)),     # L > 64: row chunks, nu = 2
    (2, 384, 4, 4, 32, 48, 64, torch.float16, Layout("striped", 1, 64)),      # padded probe rows, MHA
    (2, 256, 4, 2, 32, 64, 32, torch.float32, Layout("zigzag", 2)),           # nu = 2 aligned
    (1, 320, 4, 2, 64, 64, 64, torch.float32, Layout("contiguous", 1)),       # S_local not a tile multiple
]


@pytest.mark.parametrize("b,S,hq,hkv,d,L,bs,dtype,layout", CASES)
def test_kernels_match_fp64_oracle(b, S, hq, hkv, d, L, bs, dtype, layout):
    q, k = _inputs(b, S, hq, hkv, d, dtype, seed=S + L + d)
    scale = d ** -0.5
    lse_r, col_r, slash_r = oracle(q, k, L, bs, scale)
    lse, col, slash, _ = simulated_scores(q, k, layout, L, bs, scale)
    errs = {"lse": float(((lse - lse_r).abs() / lse_r.abs().clamp_min(1.0)).max()),
            "col": max_rel(col, col_r), "slash": max_rel(slash, slash_r)}
    assert all(e <= TOL for e in errs.values()), errs
    # future keys / diagonals never reached are exact zeros
    assert torch.equal(slash == 0, slash_r == 0)


def test_cp1_local_stats_are_the_row_max_and_sum():
    b, S, hq, hkv, d, L = 2, 256, 4, 2, 32, 64
    q, k = _inputs(b, S, hq, hkv, d, torch.float32, seed=7)
    scale = d ** -0.5
    lse_r, _, _ = oracle(q, k, L, 64, scale)
    m, z = _ops().probe_softmax_stats(q[:, S - L:], k, torch.arange(S), S, scale)
    rep = hq // hkv
    s = torch.einsum("bqhd,bkhd->bhqk", q[:, S - L:].to(F64), k.to(F64).repeat_interleave(rep, 2)) * scale
    s = s.masked_fill(torch.arange(S)[None, :] > torch.arange(S - L, S)[:, None], float("-inf"))
    assert float((m - s.amax(-1)).abs().max()) <= TOL * float(s.amax(-1).abs().max())
    assert max_rel(m + torch.log(z), lse_r) <= TOL


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")      # the interpreter's max of the NaN row
def test_cp1_lse_and_slash_sums_in_one_launch_each():
    """cp 1: :func:`probe_softmax_lse` equals the lse of the oracle (and the merge of the tiles' (m, z)
    that the CP path all-reduces); a row without a visible key gets 0; a NaN in a probe whose key
    tiles are all visible gives that row a NaN lse (the merge keeps a tile's NaN max; the stats
    kernel's max over a partly visible tile may skip it, as before). :func:`slash_sums` equals the fp64 sums of the key blocks (block sizes 64 and 48, keys
    of later blocks 0). Negative control: the slash of the next query block differs."""
    E = _ops()
    b, S, hq, hkv, d, L, bs = 2, 256, 4, 2, 32, 64, 64
    q, k = _inputs(b, S, hq, hkv, d, torch.float32, seed=7)
    scale = d ** -0.5
    lse_r, _, slash_r = oracle(q, k, L, bs, scale)
    probe = q[:, S - L:]
    lse = E.probe_softmax_lse(probe, k, torch.arange(S), S, scale)
    assert lse.dtype == F64 and lse.shape == (b, hq, L)
    assert max_rel(lse, lse_r) <= TOL
    m, z = E.probe_softmax_stats(probe, k, torch.arange(S), S, scale)
    assert float((lse - (m + torch.log(z))).abs().max()) <= 1e-12 * float(lse.abs().max())
    lo = torch.zeros(b, L, dtype=torch.int64)
    hi = torch.full((b, L), S - 1, dtype=torch.int64)
    hi[0, 3], lo[0, 3] = 0, 1                                 # row 3 of sample 0 sees no key
    lse_b = E.probe_softmax_lse(probe, k, torch.arange(S), S, scale, bounds=(lo, hi))
    assert bool((lse_b[0, :, 3] == 0).all()) and bool(torch.isfinite(lse_b).all())
    bad = probe.clone()
    bad[1, 5, 2, 0] = float("nan")
    lse_n = E.probe_softmax_lse(bad, k, torch.arange(S), S, scale)
    assert bool(torch.isnan(lse_n[1, 2, 5])) and int(torch.isnan(lse_n).sum()) == 1
    colu = E.probe_column_sums(probe, k, torch.arange(S), S, lse, scale, bs)[:, :, 0]
    u = (S - 1) // bs
    got = E.slash_sums(colu, u, S // bs, bs)
    assert max_rel(got, slash_r) <= TOL
    for block, n in ((64, S), (48, 240)):                   # 240 keys: five blocks of 48
        nb, c = n // block, colu[..., :n]
        want = torch.zeros(b, hq, nb, dtype=F64)
        kb = torch.arange(n) // block
        uu = nb - 1
        want.index_add_(-1, uu - kb, c.to(F64))
        got = E.slash_sums(c, uu, nb, block)
        assert torch.allclose(got, want, rtol=1e-12, atol=0), block
        assert bool((E.slash_sums(c, uu - 1, nb, block)[..., -1] == 0).all())     # no block -1
    assert not torch.allclose(E.slash_sums(colu, u - 1, S // bs, bs), E.slash_sums(colu, u, S // bs, bs), rtol=1e-3)


def test_shifted_key_positions_are_caught():
    """Negative control: keys attributed to the wrong global positions change the scores."""
    b, S, hq, hkv, d, L, bs = 1, 256, 2, 1, 32, 64, 64
    q, k = _inputs(b, S, hq, hkv, d, torch.float32, seed=11)
    scale = d ** -0.5
    lse_r, col_r, slash_r = oracle(q, k, L, bs, scale)
    _, col, slash, _ = simulated_scores(q, k, Layout("striped", 2, 64), L, bs, scale, shift_kpos=1)
    assert max_rel(col, col_r) > 1e-2 and max_rel(slash, slash_r) > 1e-2
    # and the unshifted run on the same inputs passes (the control is the shift alone)
    _, col, slash, _ = simulated_scores(q, k, Layout("striped", 2, 64), L, bs, scale)
    assert max_rel(col, col_r) <= TOL and max_rel(slash, slash_r) <= TOL


def test_rows_without_visible_keys_give_exact_zeros():
    """All queries are probes (L == S): on rank 1 of a striped cp 2 layout, probe rows 0..63 see
    no local key -> m = -inf, z = 0 there; columns and the merged result stay finite and exact."""
    b, S, hq, hkv, d, L, bs = 1, 128, 2, 1, 32, 128, 64
    q, k = _inputs(b, S, hq, hkv, d, torch.float32, seed=5)
    scale = d ** -0.5
    lse_r, col_r, slash_r = oracle(q, k, L, bs, scale)
    lse, col, slash, stats = simulated_scores(q, k, Layout("striped", 2, 64), L, bs, scale)
    m1, z1 = stats[1]
    assert torch.isneginf(m1[..., :64]).all() and (z1[..., :64] == 0).all()
    assert torch.isfinite(m1[..., 64:]).all()
    assert max_rel(lse, lse_r) <= TOL and max_rel(col, col_r) <= TOL and max_rel(slash, slash_r) <= TOL
    # an lse of -inf (a row with no key anywhere) contributes exact zeros, not NaN
    E = _ops()
    colu = E.probe_column_sums(q[:, S - L:], k, torch.arange(S), S, torch.full((b, hq, L), float("-inf")), scale, bs)
    assert torch.equal(colu, torch.zeros_like(colu))


# ------------------------------------------------------------------------------ packed documents
def _doc_ids(docs):
    """``[b, S]`` document id of every token (its document's first position), ``-1`` for padding."""
    return torch.where(docs.hi >= 0, docs.doc_start, torch.full_like(docs.doc_start, -1))


DOC_CASES = [
    # b, S,  hq, hkv, d, L,  bs, dtype, layout, cu_seqlens, cu_seqlens_padded
    # probes in three documents (the rows straddle two query blocks); keys 0..299 skipped as whole tiles
    (1, 512, 4, 2, 32, 100, 64, torch.float32, Layout("striped", 1, 64), [0, 37, 300, 450, 470, 512], None),
    (1, 512, 4, 1, 32, 100, 64, torch.float32, Layout("striped", 2, 64), [0, 37, 300, 450, 470, 512], None),
    # two streams with different documents, fp16, zigzag cp 2, padding between documents and at the end
    (2, 256, 4, 2, 32, 64, 32, torch.float16, Layout("zigzag", 2), [0, 30, 200, 220, 227, 370, 420],
     [0, 40, 220, 256, 300, 460, 512]),
    # the last probes are padding (no visible key: lse -inf, exact zeros), contiguous cp 2
    (1, 384, 2, 2, 32, 64, 64, torch.float32, Layout("contiguous", 2), [0, 100, 330], [0, 128, 384]),
]


@pytest.mark.parametrize("b,S,hq,hkv,d,L,bs,dtype,layout,cu,cu_pad", DOC_CASES)
def test_kernels_with_document_bounds_match_fp64_oracle(b, S, hq, hkv, d, L, bs, dtype, layout, cu, cu_pad):
    from megatron_mtraining.layout import PackedDocuments

    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, batch_size=b,
                                           cu_seqlens_padded=None if cu_pad is None else torch.tensor(cu_pad))
    q, k = _inputs(b, S, hq, hkv, d, dtype, seed=S + L + b)
    scale = d ** -0.5
    lse_r, col_r, slash_r = oracle(q, k, L, bs, scale, doc_ids=_doc_ids(docs))
    bounds = (docs.lo[:, S - L:], docs.hi[:, S - L:])
    lse, col, slash, _ = simulated_scores(q, k, layout, L, bs, scale, bounds=bounds)
    rows = torch.isfinite(lse_r)              # rows without a visible key (padding probes): lse is unused
    assert not torch.isnan(lse).any()
    errs = {"lse": float(((lse - lse_r).abs() / lse_r.abs().clamp_min(1.0))[rows].max()),
            "col": max_rel(col, col_r), "slash": max_rel(slash, slash_r)}
    assert all(e <= TOL for e in errs.values()), errs
    # keys of other documents and padding are exact zeros, not merely small
    assert torch.equal(col == 0, col_r == 0) and torch.equal(slash == 0, slash_r == 0)
    # negative control: the causal kernels on the same inputs ignore the document mask
    _, col_c, _, _ = simulated_scores(q, k, layout, L, bs, scale)
    assert max_rel(col_c, col_r) > 1e-2


def test_document_bounds_shifted_by_one_are_caught():
    """Negative control: bounds one key too wide at the document start change the column scores."""
    from megatron_mtraining.layout import PackedDocuments

    b, S, hq, hkv, d, L, bs = 1, 256, 2, 1, 32, 64, 64
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 150, 256]), S)
    q, k = _inputs(b, S, hq, hkv, d, torch.float32, seed=13)
    scale = d ** -0.5
    _, col_r, _ = oracle(q, k, L, bs, scale, doc_ids=_doc_ids(docs))
    lo, hi = docs.lo[:, S - L:], docs.hi[:, S - L:]
    _, col, _, _ = simulated_scores(q, k, Layout("striped", 1, 64), L, bs, scale, bounds=(lo, hi))
    assert max_rel(col, col_r) <= TOL
    _, col, _, _ = simulated_scores(q, k, Layout("striped", 1, 64), L, bs, scale, bounds=(lo - 1, hi))
    assert col[0, :, 149].abs().min() > 0 and max_rel(col, col_r) > 1e-2


@pytest.mark.parametrize("probes,cfg", [            # each probe mode with one of the two settings (interpreter time)
    ("document", dict(recall=0.9, sink_tokens=4, last_q=100)),
    ("stream", dict(recall=0.9, sink_tokens=8, share_pattern="kv_group"))])
def test_estimator_triton_selects_the_torch_pattern_with_documents(probes, cfg):
    from megatron_mtraining.layout import PackedDocuments

    q, k, _ = make_qkv(2, 512, 4, 2, 32, seed=4, dtype=torch.float32)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 37, 300, 470, 512, 700, 1000]), 512, batch_size=2)
    config = VerticalSlashConfig(**cfg, probes=probes)
    one = Layout("striped", 1, 64)
    got = estimate_vertical_slash(q, k, layout=one, config=config, impl="triton", documents=docs)
    ref = estimate_vertical_slash(q, k, layout=one, config=config, impl="torch", documents=docs)
    assert got.same_selection(ref)
    assert torch.equal(got.slash_count, ref.slash_count) and torch.equal(got.vertical_count, ref.vertical_count)
    assert max_rel(got.est_slash_mass, ref.est_slash_mass) <= TOL
    assert max_rel(got.est_vertical_mass, ref.est_vertical_mass) <= TOL


# ------------------------------------------------------------------------------ per-document probes
DOC_PROBE_CASES = [
    # b, S, hq, hkv, d, L, bs, dtype, layout, cu_seqlens, cu_seqlens_padded
    # short documents (several in one key tile: tiles meet several groups), padding; 16-row blocks (fp32)
    (2, 256, 4, 2, 32, 12, 32, torch.float32, Layout("striped", 1, 64), [0, 5, 30, 90, 91, 130, 190, 230, 330],
     [0, 10, 40, 120, 128, 180, 256, 300, 480]),
    # a long document whose probes straddle two query blocks, fp16 (64-row blocks), simulated cp 2 striped by 16
    (1, 512, 4, 1, 32, 40, 32, torch.float16, Layout("striped", 2, 16), [0, 7, 300, 333, 512], None),
    # zigzag cp 2, MHA, documents shorter than last_q and longer than a row block (L = 20 > 16 rows)
    (1, 256, 2, 2, 32, 20, 64, torch.float32, Layout("zigzag", 2), [0, 3, 70, 71, 200, 256], None),
    # contiguous cp 2, two streams, each ending in padding; rank 0 holds none of the last document's keys
    (2, 256, 4, 2, 32, 16, 32, torch.float32, Layout("contiguous", 2), [0, 100, 110, 300, 350],
     [0, 100, 256, 446, 512]),
]


def _doc_probe_case(b, S, hq, hkv, d, dtype, cu, cu_pad, seed):
    from megatron_mtraining.layout import PackedDocuments

    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, batch_size=b,
                                           cu_seqlens_padded=None if cu_pad is None else torch.tensor(cu_pad))
    q, k = _inputs(b, S, hq, hkv, d, dtype, seed=seed)
    return docs, q, k


@pytest.mark.parametrize("b,S,hq,hkv,d,L,bs,dtype,layout,cu,cu_pad", DOC_PROBE_CASES)
def test_document_probe_kernels_match_fp64_oracle(b, S, hq, hkv, d, L, bs, dtype, layout, cu, cu_pad):
    from tests.helpers.packed_ref import document_probe_oracle
    from tests.workers.gpu_estimator_check import fused_document_scores

    docs, q, k = _doc_probe_case(b, S, hq, hkv, d, dtype, cu, cu_pad, seed=S + L)
    scale = d ** -0.5
    col_r, slash_r, _ = document_probe_oracle(q, k, docs, L, bs, scale, hkv)
    _, col, slash = fused_document_scores(q, k, docs, layout, L, bs, scale)
    errs = {"col": max_rel(col, col_r), "slash": max_rel(slash, slash_r)}
    assert all(e <= TOL for e in errs.values()), errs
    # keys of other documents, padding and the future are exact zeros, not merely small
    assert torch.equal(col == 0, col_r == 0) and torch.equal(slash == 0, slash_r == 0)


def test_document_probe_key_range_one_tile_short_is_caught():
    """Negative control: a row block's key range that starts one key tile late drops the keys of its
    documents there (the stats and the column sums change)."""
    from megatron_mtraining.patterns import estimator as est
    from tests.helpers.packed_ref import document_probe_oracle

    E = _ops()
    b, S, hq, hkv, d, L, bs = 1, 256, 2, 1, 32, 16, 32
    docs, q, k = _doc_probe_case(b, S, hq, hkv, d, torch.float32, [0, 150, 256], None, seed=5)
    scale = d ** -0.5
    col_r, _, _ = document_probe_oracle(q, k, docs, L, bs, scale, hkv)
    spans = est._document_probe_spans(docs, L)[0]
    pos = torch.tensor([t for _, _, p in spans for t in p])
    probe, lo, hi, k_pos = q[0, pos], docs.lo[0, pos], docs.hi[0, pos], torch.arange(S)
    tables = est._document_probe_tables(spans, k_pos, bs, *E.tile_sizes(q.dtype))

    def col_of(key_range):
        m, z = E.document_probe_stats(probe, k[0], k_pos, lo, hi, key_range, scale)
        lse = m + torch.log(z)
        col = torch.zeros(hq, S, dtype=F64)
        est._fused_document_lines(probe, k[0], k_pos, lo, hi, lse, tables, scale, bs, col,
                                  torch.zeros(hq, S // bs, dtype=F64))
        return col[None]

    assert max_rel(col_of(tables[0]), col_r) <= TOL
    short = tables[0].clone()
    short[:, 0] += E.tile_sizes(q.dtype)[1]
    assert max_rel(col_of(short), col_r) > 1e-2


def test_document_probe_lines_in_groups_of_one_slot(monkeypatch):
    """Under a budget of one slot per launch (tiles meeting several groups take several launches) the
    scores equal the one-launch scores to fp64 rounding of the same fp32 sums."""
    from megatron_mtraining.patterns import estimator as est
    from tests.workers.gpu_estimator_check import fused_document_scores

    b, S, hq, hkv, d, L, bs, dtype, layout, cu, cu_pad = DOC_PROBE_CASES[0]
    docs, q, k = _doc_probe_case(b, S, hq, hkv, d, dtype, cu, cu_pad, seed=2)
    E = _ops()
    spans = est._document_probe_spans(docs, L)[0]
    assert est._document_probe_tables(spans, torch.arange(S), bs, *E.tile_sizes(dtype))[4] >= 3
    _, col, slash = fused_document_scores(q, k, docs, layout, L, bs, d ** -0.5)
    monkeypatch.setattr(est, "_LOGIT_BUDGET", 1)
    _, col1, slash1 = fused_document_scores(q, k, docs, layout, L, bs, d ** -0.5)
    assert max_rel(col1, col) <= 1e-12 and max_rel(slash1, slash) <= 1e-12


def test_document_probe_kernel_input_errors():
    E = _ops()
    q, k = _inputs(1, 128, 2, 1, 32, torch.float32, seed=0)
    probe, kk, kp = q[0, :20], k[0], torch.arange(128)
    lo, hi = torch.zeros(20, dtype=torch.long), torch.full((20,), 127)
    with pytest.raises(ValueError, match=r"probe_q \[P, hq, d\]"):
        E.document_probe_stats(q[:, :20], k, kp, lo, hi, torch.zeros(2, 2), 0.1)
    with pytest.raises(ValueError, match="lo and hi"):
        E.document_probe_stats(probe, kk, kp, lo[:5], hi, torch.zeros(2, 2), 0.1)
    with pytest.raises(ValueError, match="key_range"):
        E.document_probe_stats(probe, kk, kp, lo, hi, torch.zeros(3, 2), 0.1)
    with pytest.raises(ValueError, match="tile_groups"):
        E.document_probe_column_sums(probe, kk, kp, lo, hi, torch.zeros(2, 20), torch.zeros(1, 2),
                                     torch.zeros(1, 2), 0, 1, 0.1)
    with pytest.raises(ValueError, match="lse"):
        E.document_probe_column_sums(probe, kk, kp, lo, hi, torch.zeros(2, 19), torch.zeros(1, 2),
                                     torch.zeros(4, 2), 0, 1, 0.1)


def test_probe_block_range():
    E = _ops()
    assert E.probe_block_range(512, 64, 64) == (7, 1)
    assert E.probe_block_range(512, 48, 64) == (7, 1)
    assert E.probe_block_range(512, 48, 32) == (14, 2)
    assert E.probe_block_range(512, 100, 64) == (6, 2)
    assert E.probe_block_range(128, 128, 64) == (0, 2)


def test_kernel_input_errors():
    E = _ops()
    q, k = _inputs(1, 128, 2, 1, 32, torch.float32, seed=0)
    with pytest.raises(ValueError, match="dtype"):
        E.probe_softmax_stats(q[:, -64:].double(), k.double(), torch.arange(128), 128, 0.1)
    with pytest.raises(ValueError, match="k_pos"):
        E.probe_softmax_stats(q[:, -64:], k, torch.arange(64), 128, 0.1)
    with pytest.raises(ValueError, match="lse"):
        E.probe_column_sums(q[:, -64:], k, torch.arange(128), 128, torch.zeros(1, 2, 63), 0.1, 64)


# ------------------------------------------------------------------------------ estimate_vertical_slash
@pytest.mark.parametrize("dtype,cfg", [
    (torch.float32, dict(recall=0.9, sink_tokens=4, max_vertical=256)),
    (torch.float32, dict(recall=0.9, last_q=48, block_size=32, sink_tokens=4)),
    (torch.float16, dict(recall=0.8, sink_tokens=8, local_blocks=1)),
    (torch.float32, dict(recall=0.9, sink_tokens=4, share_pattern="kv_group")),     # one pattern per KV head
])
def test_estimator_triton_selects_the_torch_pattern(dtype, cfg):
    q, k, _ = make_qkv(2, 512, 4, 2, 32, seed=3, dtype=dtype)
    config = VerticalSlashConfig(**cfg)
    one = Layout("striped", 1, 64)
    got = estimate_vertical_slash(q, k, layout=one, config=config, impl="triton")
    ref = estimate_vertical_slash(q, k, layout=one, config=config, impl="torch")
    assert got.same_selection(ref)
    assert torch.equal(got.slash_count, ref.slash_count) and torch.equal(got.vertical_count, ref.vertical_count)
    assert max_rel(got.est_slash_mass, ref.est_slash_mass) <= TOL
    assert max_rel(got.est_vertical_mass, ref.est_vertical_mass) <= TOL
    # on the CPU "auto" is the fp64 torch path, bit for bit
    auto = estimate_vertical_slash(q, k, layout=one, config=config)
    assert torch.equal(auto.est_slash_mass, ref.est_slash_mass) and auto.same_selection(ref)


def test_estimator_impl_errors(monkeypatch):
    q, k, _ = make_qkv(1, 256, 2, 1, 32, seed=1, dtype=torch.float32)
    one = Layout("striped", 1, 64)
    with pytest.raises(ValueError, match="'auto', 'torch', 'triton'"):
        estimate_vertical_slash(q, k, layout=one, impl="cuda")
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        estimate_vertical_slash(q.double(), k.double(), layout=one, impl="triton")
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        estimate_vertical_slash(q, k.half(), layout=one, impl="triton")
    assert resolve_impl("triton", q, k) == "triton"             # CPU under the interpreter
    assert resolve_impl("auto", q, k) == "torch"                # "auto" picks Triton on CUDA only
    assert resolve_impl("torch", q.double(), k.double()) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        estimate_vertical_slash(q, k, layout=one, impl="triton")
    estimate_vertical_slash(q, k, layout=one, impl="auto")      # falls back to torch on the CPU


def test_kernels_compile_for_sm90():
    """The interpreter does not compile: the real Triton compiler builds both kernels for sm_90
    (bf16 and fp32 at head_dim 64/128/80, fp16 at 128) in a subprocess without TRITON_INTERPRET, no GPU needed;
    the 16-bit variants do not spill registers."""
    out = run_aot_worker("estimator_aot.py")
    lines = [x for x in out.splitlines() if x.startswith(("bf16", "fp16"))]
    assert lines and all("STACK:0 " in x for x in lines if "STACK:" in x), out

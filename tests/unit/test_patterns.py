"""Vertical-slash estimator, index conversion and the sparse reference attention (single process).

Independent oracles: ``probe_scores`` (fp64 softmax of the probe queries over the whole sequence,
written without the library) for budgets, ``pattern.dense_mask`` + ``naive_masked_attention``
(fp64 autograd) for attention, and the pattern's token mask for the index conversion.
"""
import dataclasses
import re

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.merge import merge_attention
from megatron_mtraining.ops.sparse_reference import sparse_attention_backward, sparse_attention_forward
from megatron_mtraining.patterns.convert import check_block_layout, convert_pattern, step_key_mask
from megatron_mtraining.patterns.estimator import (VerticalSlashConfig, VerticalSlashPattern,
                                                   estimate_vertical_slash)
from megatron_mtraining.patterns.indices import StepIndices
from tests.workers.vs_data import make_qkv, naive_masked_attention, probe_scores

ONE = Layout("striped", 1, 64)
S, D = 512, 32
SCALE = D ** -0.5


def estimate(q, k, **cfg):
    return estimate_vertical_slash(q, k, layout=ONE, config=VerticalSlashConfig(**cfg), softmax_scale=SCALE)


def causal(s=S):
    return torch.tril(torch.ones(s, s, dtype=torch.bool))


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize("field,kwargs", [
    ("recall", {"recall": 0.0}), ("recall", {"recall": 1.5}), ("recall", {"recall": -0.1}),
    ("recall", {"recall": "0.9"}), ("recall", {"recall": True}), ("recall", {"recall": float("nan")}),
    ("last_q", {"last_q": 0}), ("last_q", {"last_q": 1.5}), ("block_size", {"block_size": 0}),
    ("sink_tokens", {"sink_tokens": -1}), ("local_blocks", {"local_blocks": 0}),
    ("max_vertical", {"max_vertical": 10, "sink_tokens": 64}), ("max_slash", {"max_slash": 1, "local_blocks": 2}),
    ("max_slash", {"max_slash": None}),
])
def test_config_validation_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        VerticalSlashConfig(**kwargs)


def test_estimator_rejects_bad_lengths():
    q, k, _ = make_qkv(1, 96, 2, 1, D)
    with pytest.raises(ValueError, match="block_size"):
        estimate_vertical_slash(q, k, layout=Layout("striped", 1, 32), config=VerticalSlashConfig())
    q, k, _ = make_qkv(1, 128, 2, 1, D)
    with pytest.raises(ValueError, match="last_q"):
        estimate(q, k, last_q=256)
    with pytest.raises(ValueError, match="cp_size"):
        estimate_vertical_slash(q, k, layout=Layout("striped", 2, 64), config=VerticalSlashConfig())


# ------------------------------------------------------------------------------ floors
def _sink_head(s=S, hq=1):
    """Every query puts ~all its mass on key 0 (one sink column)."""
    q = torch.zeros(1, s, hq, D, dtype=torch.float64)
    k = torch.zeros(1, s, 1, D, dtype=torch.float64)
    q[..., 0] = 10.0
    k[:, 0, :, 0] = 10.0
    return q, k


def test_sink_head_keeps_local_window_and_sink():
    q, k = _sink_head()
    pat = estimate(q, k, recall=0.9, sink_tokens=64, local_blocks=2)
    assert pat.vertical_count.item() == 64 and pat.vertical[0, 0, :64].tolist() == list(range(64))
    # without floors the budget would be this single diagonal (block 0 seen from the last block)
    slash = pat.slash[0, 0, :pat.slash_count.item()].tolist()
    assert slash == [0, 1, S // 64 - 1], slash
    m = pat.dense_mask()[0, 0]
    p = torch.arange(S)
    assert m[p, p].all(), "every query must keep its own position"
    assert m[p[1:], p[1:] - 1].all(), "and its previous token (local window)"
    assert m[:, 0].all(), "the sink column is kept"
    assert not (m & ~causal()).any()


def test_single_dominant_line_gets_budget_one_not_zero():
    """count = #(cumsum < p) + 1: a line holding >= p of the mass is selected (reference: budget 0)."""
    q, k = _sink_head()
    pat = estimate(q, k, recall=0.9, sink_tokens=0, local_blocks=1)
    assert pat.vertical[0, 0, :pat.vertical_count.item()].tolist() == [0]
    assert pat.est_vertical_mass.item() > 0.99


def _prev_token_head(s=S):
    """Query p attends (sharply) to key p - 1: unit phasors, query rotated one step back, large scale."""
    pos = torch.arange(s, dtype=torch.float64)
    om = torch.logspace(0, -2, D // 2, dtype=torch.float64)
    ph = lambda x: torch.stack([torch.cos(x[:, None] * om), torch.sin(x[:, None] * om)], -1).reshape(s, D)  # noqa
    return ph(pos - 1)[None, :, None, :] * 3.0, ph(pos)[None, :, None, :] * 3.0


def test_previous_token_head_keeps_its_diagonal():
    q, k = _prev_token_head()
    col, _ = probe_scores(q, k, 64, 64, 1.0)
    assert col[0, 0, S - 65:S - 1].sum() > 0.99 * 64, "construction: mass sits on the previous token"
    for cfg in ({"local_blocks": 1, "sink_tokens": 0}, {"local_blocks": 2, "sink_tokens": 64}):
        pat = estimate_vertical_slash(q, k, layout=ONE, config=VerticalSlashConfig(recall=0.9, **cfg),
                                      softmax_scale=1.0)
        assert 0 in pat.slash[0, 0].tolist()
        m = pat.dense_mask()[0, 0]
        p = torch.arange(1, S)
        if cfg["local_blocks"] >= 2:
            assert m[p, p - 1].all(), "every previous token is in the mask"
        else:   # d=0 only: the previous token of a block's first query lives in the block before
            assert m[p, p - 1][p % 64 != 0].all()
        assert m[torch.arange(S), torch.arange(S)].all()


# ------------------------------------------------------------------------------ causality, budgets, caps
@pytest.fixture(scope="module")
def synth():
    q, k, v = make_qkv(2, S, 4, 2, D, seed=3)
    return q, k, v


def test_pattern_is_causal_and_per_sample(synth):
    q, k, _ = synth
    pat = estimate(q, k, recall=0.9)
    m = pat.dense_mask()
    assert not (m & ~causal()).any(), "no future token admitted"
    assert (pat.slash[pat.slash >= 0] < S // 64).all() and (pat.vertical < S).all()
    assert not torch.equal(m[0], m[1]), "batch of 2 must have its own pattern per sample"
    dens = m.sum((-1, -2)).double() / causal().sum()
    assert (dens < 0.95).all() and (dens > 0.05).all(), dens


@pytest.mark.parametrize("recall", [0.8, 0.9, 0.95])
def test_budgets_reach_recall_with_fewest_lines(synth, recall):
    q, k, _ = synth
    cfg = dict(recall=recall, sink_tokens=64, local_blocks=2)
    pat = estimate(q, k, **cfg)
    col, slash = probe_scores(q, k, 64, 64, SCALE)
    target = recall * 64
    nb = S // 64
    for b in range(2):
        for h in range(4):
            for scores, sel, n_floor, n in (
                    (col[b, h], pat.vertical[b, h, :pat.vertical_count[b, h]], 64, S),
                    (slash[b, h], pat.slash[b, h, :pat.slash_count[b, h]], 2, nb)):
                chosen = torch.zeros(n, dtype=torch.bool)
                chosen[sel] = True
                assert chosen[:n_floor].all(), "floors always selected"
                mass = scores[chosen].sum().item()
                assert mass >= target - 1e-9, (b, h, mass, target)
                extra = chosen.clone()
                extra[:n_floor] = False
                if extra.any():
                    lowest = scores[extra].min().item()
                    assert mass - lowest < target, "one line fewer would still reach the target"
                    rest = ~chosen
                    rest[:n_floor] = False
                    if rest.any():
                        assert scores[rest].max().item() <= lowest + 1e-12, "greedy: best lines first"
            assert abs(pat.est_vertical_mass[b, h].item() * 64 - col[b, h][pat.vertical_mask()[b, h]].sum()) < 1e-9


def test_caps_respected(synth):
    q, k, _ = synth
    pat = estimate(q, k, recall=0.999, sink_tokens=16, local_blocks=2, max_vertical=40, max_slash=3)
    assert (pat.vertical_count <= 40).all() and (pat.slash_count <= 3).all()
    assert (pat.vertical_count == 40).any() and (pat.slash_count == 3).any()
    col, slash = probe_scores(q, k, 64, 64, SCALE)
    for b in range(2):
        for h in range(4):
            v = pat.vertical[b, h, :pat.vertical_count[b, h]]
            assert set(range(16)) <= set(v.tolist())
            top = torch.argsort(col[b, h, 16:], descending=True)[:int(pat.vertical_count[b, h]) - 16] + 16
            assert set(v.tolist()) == set(range(16)) | set(top.tolist())


def test_recall_one_is_the_full_causal_mask(synth):
    q, k, _ = synth
    pat = estimate(q, k, recall=1.0, max_vertical=S, max_slash=S // 64)
    assert pat.dense_mask().equal(causal().expand(2, 4, S, S))


def test_probe_queries_spanning_two_blocks(synth):
    q, k, _ = synth
    pat = estimate(q, k, recall=0.9, last_q=96)
    assert not (pat.dense_mask() & ~causal()).any()
    assert (pat.est_slash_mass >= 0.9 - 1e-9).all() and (pat.est_vertical_mass >= 0.9 - 1e-9).all()


# ------------------------------------------------------------------------------ index conversion
LAYOUTS = [Layout("striped", 1, 64), Layout("striped", 2, 64), Layout("striped", 4, 64), Layout("striped", 2, 128),
           Layout("zigzag", 2), Layout("zigzag", 4), Layout("contiguous", 4)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.kind}-cp{l.cp_size}-g{l.granularity}")
def test_conversion_covers_mask_exactly_once(synth, layout):
    q, k, _ = synth
    pat = estimate(q, k, recall=0.9)
    mask = pat.dense_mask()
    cp, sl = layout.cp_size, S // layout.cp_size
    for r in range(cp):
        steps = convert_pattern(pat, layout, r)
        q_pos = layout.positions(r, S)
        total = torch.zeros(2, 4, sl, S, dtype=torch.int32)
        for o, st in enumerate(steps):
            k_pos = layout.positions(o, S)
            assert st.causal == (o == r) and st.block_size == 64
            assert st.block_index.dtype == torch.int32 and st.column_index.dtype == torch.int32
            for idx, cnt in ((st.block_index, st.block_count), (st.column_index, st.column_count)):
                slot = torch.arange(idx.shape[-1])
                valid = slot < cnt[..., None]
                assert (idx[~valid] == -1).all(), "padding is -1"
                pad_hi = torch.where(valid, idx, torch.full_like(idx, 1 << 30))
                assert ((pad_hi[..., 1:] > pad_hi[..., :-1]) | ~valid[..., 1:]).all(), "ascending"
            # columns never inside an active block of the same query block
            cb = torch.where(torch.arange(st.column_index.shape[-1]) < st.column_count[..., None],
                             st.column_index.long() // 64, -1)
            bb = torch.where(torch.arange(st.block_index.shape[-1]) < st.block_count[..., None],
                             st.block_index.long(), -2)
            assert not (cb[..., :, None] == bb[..., None, :]).any()
            raw = step_key_mask(dataclasses.replace(st, causal=False), sl, counts=True)
            if o != r:   # no mask needed: every listed key is strictly before its query block
                before = k_pos[None, :] < (q_pos // 64 * 64)[:, None]
                assert not (raw.bool() & ~before).any()
            total[..., k_pos] += step_key_mask(st, sl, counts=True)
        assert torch.equal(total, mask[:, :, q_pos].to(torch.int32)), f"rank {r}"


def test_conversion_per_sample_matches_single_sample(synth):
    q, k, _ = synth
    pat = estimate(q, k, recall=0.9)
    lay = Layout("zigzag", 2)
    both = convert_pattern(pat, lay, 1)
    for b in range(2):
        one = VerticalSlashPattern(S, 64, pat.slash[b:b + 1], pat.slash_count[b:b + 1], pat.vertical[b:b + 1],
                                   pat.vertical_count[b:b + 1])
        for st_b, st_1 in zip(both, convert_pattern(one, lay, 1)):
            assert torch.equal(step_key_mask(st_b, S // 2)[b:b + 1], step_key_mask(st_1, S // 2))


@pytest.mark.parametrize("layout,seq,match", [
    (Layout("striped", 2, 32), 512, "granularity"),
    (Layout("zigzag", 4), 256, "zigzag"),
    (Layout("contiguous", 4), 128, "contiguous"),
])
def test_layout_rules_named(layout, seq, match):
    with pytest.raises(ValueError, match=match):
        check_block_layout(layout, seq, 64)
    pat = VerticalSlashPattern.from_lists(seq, 64, [[[0]]], [[[0]]])
    with pytest.raises(ValueError, match=match):
        convert_pattern(pat, layout, 0)


# ------------------------------------------------------------------------------ sparse reference attention
def _simulated_ring(pat, layout, q, k, v, dout, dtype):
    """Run every (rank, owner) step with the sparse reference, merge by LSE, return global out/grads."""
    cp = layout.cp_size
    sh = lambda t, r: layout.shard(t, r, 1).to(dtype)  # noqa: E731
    outs, dqs = [], []
    dks = [torch.zeros_like(sh(k, o), dtype=torch.float64) for o in range(cp)]
    dvs = [torch.zeros_like(sh(v, o), dtype=torch.float64) for o in range(cp)]
    for r in range(cp):
        steps = convert_pattern(pat, layout, r)
        ql, dl = sh(q, r), sh(dout, r)
        out, lse = None, None
        for o in range(cp):
            po, pl = sparse_attention_forward(ql, sh(k, o), sh(v, o), steps[o], SCALE)
            out, lse = (po, pl) if out is None else merge_attention(out, lse, po, pl)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        delta = (dl.to(out.dtype) * out).sum(-1).transpose(1, 2)
        dq = torch.zeros_like(out)
        for o in range(cp):
            gq, gk, gv = sparse_attention_backward(dl, ql, sh(k, o), sh(v, o), lse, delta, steps[o], SCALE)
            dq += gq
            dks[o] += gk.double()
            dvs[o] += gv.double()
        outs.append(out)
        dqs.append(dq)
    return layout.unshard(outs), layout.unshard(dqs), layout.unshard(dks), layout.unshard(dvs)


@pytest.mark.parametrize("layout", [Layout("striped", 1, 64), Layout("striped", 2, 64), Layout("zigzag", 2)],
                         ids=lambda l: f"{l.kind}-cp{l.cp_size}")
@pytest.mark.parametrize("hkv", [4, 1])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_sparse_reference_matches_fp64_masked_attention(layout, hkv, dtype, tol):
    q, k, v = make_qkv(2, S, 4, hkv, D, seed=5 + hkv)
    dout = torch.randn(2, S, 4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    pat = estimate(q.to(dtype), k.to(dtype), recall=0.9)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = naive_masked_attention(qr, kr, vr, pat.dense_mask(), SCALE)
    ref.backward(dout)
    out, dq, dk, dv = _simulated_ring(pat, layout, q, k, v, dout, dtype)
    assert rel(out, ref.detach()) <= tol
    assert rel(dq, qr.grad) <= tol
    assert rel(dk, kr.grad) <= tol
    assert rel(dv, vr.grad) <= tol


def _manual_step(blocks, columns, causal, b=1, hq=2, nqb=2):
    """StepIndices from per-query-block lists (same for every (b, h))."""
    mb = max(1, max(len(x) for x in blocks))
    mc = max(1, max(len(x) for x in columns))
    bi = torch.full((b, hq, nqb, mb), -1, dtype=torch.int32)
    ci = torch.full((b, hq, nqb, mc), -1, dtype=torch.int32)
    for i in range(nqb):
        bi[:, :, i, :len(blocks[i])] = torch.tensor(blocks[i], dtype=torch.int32)
        ci[:, :, i, :len(columns[i])] = torch.tensor(columns[i], dtype=torch.int32)
    bc = torch.tensor([len(x) for x in blocks], dtype=torch.int32).expand(b, hq, nqb).contiguous()
    cc = torch.tensor([len(x) for x in columns], dtype=torch.int32).expand(b, hq, nqb).contiguous()
    return StepIndices(bc, bi, cc, ci, causal)


@pytest.mark.parametrize("name,blocks,columns,causal", [
    ("some_empty_blocks", [[], [0]], [[], [70, 100]], False),
    ("all_empty", [[], []], [[], []], False),
    ("causal_column_after_rows", [[], [1]], [[63], [5]], True),   # rows 0..62 of block 0 see nothing
])
def test_sparse_reference_empty_rows(name, blocks, columns, causal):
    s, hq = 128, 2
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, s, hq, D, generator=g, dtype=torch.float64) for _ in range(4))
    k, v = k[:, :, :1], v[:, :, :1]
    st = _manual_step(blocks, columns, causal)
    assert st.is_empty() == (name == "all_empty")
    mask = step_key_mask(st, s)
    out, lse = sparse_attention_forward(q.float(), k.float(), v.float(), st, SCALE)
    empty = ~mask.any(-1)                                              # [b, hq, s]
    assert empty.any()
    assert torch.isneginf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()
    assert (out.transpose(1, 2)[empty] == 0).all()
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = naive_masked_attention(qr, kr, vr, mask, SCALE)
    ref.backward(dout)
    delta = (dout.float() * out).sum(-1).transpose(1, 2)
    dq, dk, dv = sparse_attention_backward(dout.float(), q.float(), k.float(), v.float(), lse, delta, st, SCALE)
    for t in (out, lse[~empty], dq, dk, dv):
        assert not torch.isnan(t).any()
    assert (dq.transpose(1, 2)[empty] == 0).all()
    if name == "all_empty":
        assert (out == 0).all() and (dq == 0).all() and (dk == 0).all() and (dv == 0).all()
    else:
        assert rel(out, ref.detach()) <= 1e-5
        for a, b in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
            assert rel(a, b) <= 1e-5


def test_shared_vertical_columns_for_every_query():
    """A column chosen by every query (same for all heads) is listed once per query block owner step."""
    s = 256
    pat = VerticalSlashPattern.from_lists(s, 64, [[[0], [0, 1]]], [[[5, 130], [5, 130]]])
    m = pat.dense_mask()
    p = torch.arange(s)
    assert m[0, :, p[5:], 5].all() and m[0, :, p[130:], 130].all()
    lay = Layout("striped", 2, 64)
    for r in range(2):
        steps = convert_pattern(pat, lay, r)
        own = steps[0]                      # owner 0 holds tokens 0..63 and 128..191
        qb = lay.positions(r, s)[::64] // 64
        for i, blk in enumerate(qb.tolist()):
            cols = own.column_index[0, 0, i, :own.column_count[0, 0, i]].tolist()
            # head 0 (d=0 only): 5 is a column unless the query block is block 0 itself (then it is a block)
            assert (5 in cols) == (blk != 0)
            assert lay.global_to_local(130, s) == (0, 66)
            assert (66 in cols) == (blk > 2)    # 130 is local column 66 of owner 0
    q, k, v = make_qkv(1, s, 2, 1, D, seed=2)
    dout = torch.randn(1, s, 2, D, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = naive_masked_attention(qr, kr, vr, m, SCALE)
    ref.backward(dout)
    out, dq, dk, dv = _simulated_ring(pat, lay, q, k, v, dout, torch.float32)
    for a, b in ((out, ref.detach()), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert rel(a, b) <= 1e-5


def test_sparse_step_kernel_skips_empty_steps():
    from megatron_mtraining.ring.sparse import SparseStepKernel

    calls = []

    def fwd(q, k, v, idx, scale):
        calls.append("fwd")
        return sparse_attention_forward(q, k, v, idx, scale)

    def bwd(dout, q, k, v, lse, delta, idx, scale):
        calls.append("bwd")
        return sparse_attention_backward(dout, q, k, v, lse, delta, idx, scale)

    empty, full = _manual_step([[], []], [[], []], False), _manual_step([[0], [0, 1]], [[], []], True)
    kern = SparseStepKernel([full, empty], SCALE, forward_fn=fwd, backward_fn=bwd)
    assert kern.empty == [False, True] and kern.computed_steps == 1
    q = torch.randn(1, 128, 2, D)
    k = v = torch.randn(1, 128, 1, D)
    assert kern.forward(q, k, v, owner=1) is None
    assert kern.backward(q, q, k, v, torch.zeros(1, 2, 128), torch.zeros(1, 2, 128), owner=1) is None
    assert calls == []
    out, lse = kern.forward(q, k, v, owner=0)
    assert calls == ["fwd"] and torch.isfinite(lse).all()


def test_packed_index_lists_match_nonzero_per_row():
    """The one bool-map -> sorted index lists helper (tile maps of coarsen, FA4 block lists, benches)."""
    from megatron_mtraining.patterns.indices import packed_index_lists

    g = torch.Generator().manual_seed(0)
    m = torch.rand(2, 3, 11, generator=g) > 0.6
    m[0, 0] = False                                     # an empty row
    m[1, 2] = True                                      # a full row
    cnt, idx = packed_index_lists(m)
    assert cnt.dtype == idx.dtype == torch.int32 and idx.shape[-1] == int(m.sum(-1).max())
    for a in range(2):
        for b in range(3):
            want = torch.nonzero(m[a, b]).flatten().tolist()
            assert int(cnt[a, b]) == len(want)
            assert idx[a, b, :len(want)].tolist() == want
            assert (idx[a, b, len(want):] == -1).all()
    # a host-known width (longer than any row: padded with fill; shorter: lists cut)
    c2, i2 = packed_index_lists(m, width=13, fill=0, dtype=torch.int64)
    assert i2.dtype == torch.int64 and i2.shape[-1] == 13 and (i2[1, 2, :11] == torch.arange(11)).all()
    assert (i2[..., 11:] == 0).all() and torch.equal(c2, cnt.long())
    _, i3 = packed_index_lists(m, width=1)
    assert torch.equal(i3[..., 0], torch.where(cnt > 0, idx[..., 0], torch.full_like(cnt, -1)))


def _packed_index_lists_by_sort(mask, width=None, fill=-1, dtype=torch.int32):
    """The algorithm packed_index_lists had before (a stable sort on "not set"), kept as the reference."""
    count = mask.sum(-1, dtype=dtype)
    if width is None:
        width = max(1, int(count.max()) if count.numel() else 1)
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[..., :width].to(dtype)
    if order.shape[-1] < width:
        order = torch.nn.functional.pad(order, (0, width - order.shape[-1]), value=fill)
    keep = torch.arange(width, device=mask.device) < count[..., None]
    return count, torch.where(keep, order, torch.full_like(order, fill))


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 130), (4, 1), (3, 0), (0, 9), (2, 0, 5)])
def test_packed_index_lists_match_the_sort_algorithm(shape):
    """cumsum + scatter gives the outputs of the stable sort it replaced, bitwise (values, dtype, shape,
    contiguity): random maps with all-False and all-True rows, the default width, widths that cut the lists,
    wider ones, a non-contiguous map and empty maps; a dropped entry is seen (negative control)."""
    from megatron_mtraining.patterns.indices import packed_index_lists

    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    for p in (0.1, 0.5, 0.9):
        m = torch.rand(shape, generator=g) < p
        if m.numel() and m.dim() >= 2 and m.shape[-2] >= 2:
            m[..., 0, :] = False                                          # all-False rows
            m[..., 1, :] = True                                           # all-True rows
        top = int(m.sum(-1).max()) if m.numel() else 0
        for width in (None, 1, max(1, top // 2), top + 3, shape[-1] + 70):
            for fill, dtype in ((-1, torch.int32), (0, torch.int64)):
                got = packed_index_lists(m, width=width, fill=fill, dtype=dtype)
                want = _packed_index_lists_by_sort(m, width=width, fill=fill, dtype=dtype)
                for a, b in zip(got, want):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (p, width, fill)
                assert got[1].is_contiguous()
    if m.numel() and m.dim() >= 2 and m.shape[-2] >= 2 and shape[-1] > 2:
        t = torch.rand(*shape[:-1], 2 * shape[-1], generator=g) < 0.5
        strided = t[..., ::2]                                             # a map with a stride of 2
        assert all(torch.equal(a, b) for a, b in zip(packed_index_lists(strided),
                                                      _packed_index_lists_by_sort(strided)))
        flipped = m.clone()
        flipped[..., 1, shape[-1] // 2] = False             # negative control: one entry of a full row dropped
        assert not torch.equal(packed_index_lists(flipped, width=shape[-1])[1],
                               _packed_index_lists_by_sort(m, width=shape[-1])[1])


def test_hand_built_patterns_with_a_repeated_column_or_out_of_range_entries_are_refused():
    """convert_pattern checks hand-built patterns (VerticalSlashPattern.check): a vertical position listed
    twice in a row would be counted twice by the kernels (a wrong softmax), an entry out of range would index
    past the sequence; unsorted rows and repeated slash offsets give the same mask and are accepted."""
    S, bs = 128, 64
    lay = Layout("striped", 1, bs)
    one = lambda rows: torch.tensor([[rows]], dtype=torch.int64)               # noqa: E731
    cnt = lambda n: torch.tensor([[n]], dtype=torch.int64)                      # noqa: E731
    cases = ((one([0, -1]), one([5, 5]), "listed twice"), (one([2, -1]), one([5, -1]), "slash entries must be"),
             (one([0, -1]), one([128, -1]), "vertical entries must be -1 (padding) or in [0, 128)"))
    for s, v, needle in cases:
        pat = VerticalSlashPattern(S, bs, s, cnt(1), v, cnt(int((v >= 0).sum())))
        with pytest.raises(ValueError, match=re.escape(needle)):
            convert_pattern(pat, lay, 0)
    ok = VerticalSlashPattern(S, bs, one([1, 0, 0]), cnt(3), one([9, 5, -1]), cnt(2))       # unsorted, repeated slash
    ref = VerticalSlashPattern.from_lists(S, bs, [[[0, 1]]], [[[5, 9]]])
    for a, b in zip(convert_pattern(ok, lay, 0), convert_pattern(ref, lay, 0)):
        assert torch.equal(step_key_mask(a, S, counts=True), step_key_mask(b, S, counts=True))   # multiplicities

"""The fast selection and index conversion return bitwise the same tensors as the code they replaced.

``estimate_vertical_slash`` (budgets and selection after the scores) and ``convert_pattern`` were
rewritten to run fewer torch ops, sorts and host syncs (two segment sorts instead of priority_order's
three sorts, no merge at cp 1, one width sync, compaction over the slash entries instead of every key
block, ...). The old code is kept below, **frozen, as the oracle** (copied from commit f5e4764; do
not "fix" it). Every tensor of the new results must equal the oracle's bit for bit (``torch.equal``
plus dtype and shape) on random cases built to stress the tie-breaking: quantized scores (many equal
scores, exact zeros), duplicated key columns, all-zero queries (uniform rows), all-floor budgets,
recall 1, caps at the floors, batch 2, GQA, striped / zigzag / contiguous layouts; cp 2 and 4 are
simulated in one process (each rank's local candidates, concatenated as the all_gather does).
"""
import random

import pytest
import torch
import torch.distributed as dist

from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.reference import default_softmax_scale
from megatron_mtraining.patterns import estimator as E
from megatron_mtraining.patterns.convert import check_block_layout, convert_pattern, step_indices, without_columns
from megatron_mtraining.patterns.estimator import (VerticalSlashConfig, VerticalSlashPattern,
                                                   estimate_vertical_slash, floor_first_sort, priority_order)
from megatron_mtraining.patterns.indices import StepIndices
from tests.helpers.select_ref import same

F64 = torch.float64
# the selection / conversion tests also run on a GPU when there is one (same scores for both sides:
# the slash index_add_ on CUDA uses atomics, so end-to-end runs are compared on the CPU only)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# =========================================================================================
# FROZEN ORACLE: the selection / conversion code as of f5e4764 (before the fast-selection branch).
# Only renamed (old_ prefix); keep unchanged.
# =========================================================================================
def old_positions(layout, rank, seq_len, device=None):
    c = layout.chunk_len(seq_len)
    ids = torch.tensor(layout.chunk_ids(rank, seq_len), dtype=torch.long, device=device)
    return (ids[:, None] * c + torch.arange(c, device=device)[None, :]).reshape(-1)


def old_priority_order(score, floor, key):
    key = key.expand_as(score)
    floor = floor.expand_as(score)
    order = torch.argsort(key, dim=-1, stable=True)
    s = score.gather(-1, order)
    o2 = torch.argsort(s, dim=-1, descending=True, stable=True)
    order = order.gather(-1, o2)
    f = floor.gather(-1, order).to(torch.int8)
    o3 = torch.argsort(f, dim=-1, descending=True, stable=True)
    return order.gather(-1, o3)


def old_budget(sorted_score, n_floor, cap, target, take_all):
    n = sorted_score.shape[-1]
    shape, dev = sorted_score.shape[:-1], sorted_score.device
    if n == 0:
        return (torch.zeros(shape, dtype=torch.long, device=dev),
                torch.zeros(shape, dtype=sorted_score.dtype, device=dev))
    cum = torch.cumsum(sorted_score, dim=-1)
    if take_all:
        cnt = torch.full(shape, n, dtype=torch.long, device=dev)
    else:
        cnt = (cum < target).sum(-1) + 1
    cnt = cnt.clamp(min=min(n_floor, n), max=min(cap, n))
    covered = cum.gather(-1, (cnt - 1).clamp(min=0)[..., None]).squeeze(-1)
    return cnt, torch.where(cnt > 0, covered, torch.zeros_like(covered))


def old_take_sorted(sorted_vals, cnt, sentinel):
    n = sorted_vals.shape[-1]
    if n == 0:
        return torch.full((*sorted_vals.shape[:-1], 1), -1, dtype=torch.long, device=sorted_vals.device)
    width = max(1, min(n, int(cnt.max()) if cnt.numel() else 1))
    vals = sorted_vals[..., :width]
    slot = torch.arange(width, device=vals.device)
    vals = torch.where(slot < cnt[..., None], vals, torch.full_like(vals, sentinel))
    vals = torch.sort(vals, dim=-1).values
    return torch.where(vals == sentinel, torch.full_like(vals, -1), vals)


def old_gather_probe_queries(q, layout, group, rank, cp, seq_len, last_q):
    b, _, hq, d = q.shape
    glob = torch.arange(seq_len - last_q, seq_len)
    owners, local = layout.global_to_local(glob, seq_len)
    out = torch.empty((b, last_q, hq, d), dtype=q.dtype, device=q.device)
    for o in torch.unique(owners).tolist():
        sel = (owners == o).nonzero().squeeze(1)
        if o == rank:
            buf = q.index_select(1, local[sel].to(q.device)).contiguous()
        else:
            buf = torch.empty((b, sel.numel(), hq, d), dtype=q.dtype, device=q.device)
        if cp > 1:
            dist.broadcast(buf, src=dist.get_global_rank(group, o), group=group)
        out[:, sel.to(q.device)] = buf
    return out


def old_all_reduce(t, op, group, cp):
    if cp > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def old_global_lse(m, z, group, cp):
    gm = old_all_reduce(m.clone(), dist.ReduceOp.MAX, group, cp)
    gsafe = torch.where(torch.isneginf(gm), torch.zeros_like(gm), gm)
    gz = old_all_reduce(z * torch.exp(m - gsafe), dist.ReduceOp.SUM, group, cp)
    return gsafe + torch.log(torch.where(gz > 0, gz, torch.ones_like(gz)))


def old_torch_scores(probe, k, k_pos, q_blocks, S, bs, scale, group, cp, logit_budget=1 << 23):
    b, L, hq, d = probe.shape
    sl, hkv = k.shape[1], k.shape[2]
    rep, nb, dev, f64 = hq // hkv, S // bs, probe.device, torch.float64
    pq = probe.to(f64).view(b, L, hkv, rep, d)
    p_pos = torch.arange(S - L, S, device=dev)
    chunk = max(bs, (logit_budget // max(1, b * hq * L)) // bs * bs)
    spans = [(j, min(sl, j + chunk)) for j in range(0, sl, chunk)]
    cache = {}

    def logits(j0, j1):
        if (j0, j1) in cache:
            return cache[(j0, j1)]
        s = torch.einsum("bqgrd,bkgd->bgrqk", pq, k[:, j0:j1].to(f64)).reshape(b, hq, L, j1 - j0) * scale
        s.masked_fill_(k_pos[None, j0:j1] > p_pos[:, None], float("-inf"))
        if len(spans) == 1:
            cache[(j0, j1)] = s
        return s

    m = torch.full((b, hq, L), float("-inf"), dtype=f64, device=dev)
    z = torch.zeros((b, hq, L), dtype=f64, device=dev)
    for j0, j1 in spans:
        s = logits(j0, j1)
        new_m = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isneginf(new_m), torch.zeros_like(new_m), new_m)
        z = z * torch.exp(m - safe) + torch.exp(s - safe[..., None]).sum(-1)
        m = new_m
    lse = old_global_lse(m, z, group, cp)
    col = torch.zeros((b, hq, sl), dtype=f64, device=dev)
    slash = torch.zeros((b, hq, nb), dtype=f64, device=dev)
    for j0, j1 in spans:
        p = torch.exp(logits(j0, j1) - lse[..., None])
        col[..., j0:j1] = p.sum(-2)
        k_blk = k_pos[j0:j1] // bs
        for u, r0, r1 in q_blocks:
            pu = p[:, :, r0:r1].sum(-2)
            slash.index_add_(-1, (u - k_blk).clamp(min=0), pu)
    cache.clear()
    return col, slash


def old_scores(q, k, *, layout, group=None, config, softmax_scale=None, impl="torch"):
    """The old estimate_vertical_slash up to the scores: ``(slash, col, k_pos, S, L)``."""
    b, sl, hq, d = q.shape
    cp, rank = 1, 0                  # single process (the tests below); group must be None
    S = sl * cp
    bs, L = config.block_size, config.last_q
    fused = E.resolve_impl(impl, q, k) == "triton"
    nb = S // bs
    dev = q.device
    scale = default_softmax_scale(d) if softmax_scale is None else float(softmax_scale)
    f64 = torch.float64
    k_pos = old_positions(layout, rank, S, device=dev)
    probe = old_gather_probe_queries(q, layout, group, rank, cp, S, L)
    q_blocks = [(u, max(0, u * bs - (S - L)), min(L, (u + 1) * bs - (S - L)))
                for u in range((S - L) // bs, nb)]
    if fused:
        from megatron_mtraining.patterns.triton.estimator import probe_column_sums, probe_softmax_stats

        m, z = probe_softmax_stats(probe, k, k_pos, S, scale)
        lse = old_global_lse(m, z, group, cp)
        colu = probe_column_sums(probe, k, k_pos, S, lse, scale, bs).to(f64)
        col = colu[:, :, 0] if colu.shape[2] == 1 else colu.sum(2)
        slash = torch.zeros((b, hq, nb), dtype=f64, device=dev)
        k_blk = k_pos // bs
        for i, (u, _, _) in enumerate(q_blocks):
            slash.index_add_(-1, (u - k_blk).clamp(min=0), colu[:, :, i])
    else:
        col, slash = old_torch_scores(probe, k, k_pos, q_blocks, S, bs, scale, group, cp)
    slash = old_all_reduce(slash, dist.ReduceOp.SUM, group, cp)
    return slash, col, k_pos, S, L


def old_select(slash, col, k_pos, S, L, config, gathered=None):
    """The old selection; ``gathered(cand) -> concatenated cand`` stands for the all_gather (cp > 1)."""
    b, hq, sl = col.shape
    nb, f64, dev = slash.shape[-1], torch.float64, col.device
    target = float(config.recall) * L
    take_all = float(config.recall) >= 1.0
    offs = torch.arange(nb, device=dev)
    s_order = old_priority_order(slash, offs < config.local_blocks, offs)
    s_cnt, s_cov = old_budget(slash.gather(-1, s_order), config.local_blocks, config.max_slash, target, take_all)
    s_sel = old_take_sorted(s_order, s_cnt, sentinel=nb)
    kc = min(config.max_vertical, sl)
    v_floor = k_pos < config.sink_tokens
    l_order = old_priority_order(col, v_floor, k_pos)[..., :kc]
    cand = torch.stack([col.gather(-1, l_order), k_pos.expand(b, hq, sl).gather(-1, l_order).to(f64)])
    if gathered is not None:
        cand = gathered(cand)
    c_score, c_pos = cand[0], cand[1].round().long()
    g_order = old_priority_order(c_score, c_pos < config.sink_tokens, c_pos)
    v_cnt, v_cov = old_budget(c_score.gather(-1, g_order), min(config.sink_tokens, S), config.max_vertical,
                              target, take_all)
    v_sel = old_take_sorted(c_pos.gather(-1, g_order), v_cnt, sentinel=S)
    return VerticalSlashPattern(S, config.block_size, s_sel, s_cnt, v_sel, v_cnt,
                                est_slash_mass=s_cov / L, est_vertical_mass=v_cov / L)


def old_estimate_vertical_slash(q, k, *, layout, group=None, config, softmax_scale=None, impl="torch"):
    slash, col, k_pos, S, L = old_scores(q, k, layout=layout, group=group, config=config,
                                         softmax_scale=softmax_scale, impl=impl)
    return old_select(slash, col, k_pos, S, L, config)


def old_local_block_ids(layout, rank, seq_len, block_size, device=None):
    pos = old_positions(layout, rank, seq_len, device=device)
    return pos[::block_size] // block_size


def old_compact(mask, values):
    cnt = mask.sum(-1)
    width = max(1, int(cnt.max())) if cnt.numel() else 1
    slot = torch.where(mask, mask.cumsum(-1) - 1, torch.full_like(cnt[..., None], width))
    out = torch.full((*mask.shape[:-1], width + 1), -1, dtype=torch.int64, device=mask.device)
    out.scatter_(-1, slot, torch.where(mask, values.expand(mask.shape).long(), -1))
    return cnt.to(torch.int32), out[..., :width].to(torch.int32)


def old_step_indices(pattern, layout, rank, owner):
    S, bs = pattern.seq_len, pattern.block_size
    check_block_layout(layout, S, bs)
    dev = pattern.slash.device
    qB = old_local_block_ids(layout, rank, S, bs, dev)
    kB = old_local_block_ids(layout, owner, S, bs, dev)
    diff = qB[:, None] - kB[None, :]
    active = pattern.slash_mask()[..., diff.clamp(min=0)] & (diff >= 0)
    nkb = kB.numel()
    block_count, block_index = old_compact(active, torch.arange(nkb, device=dev))
    vert = pattern.vertical
    o_rank, _ = layout.global_to_local(vert.clamp(min=0), S)
    _, vert = old_compact((vert >= 0) & (o_rank == owner), vert)
    vert = vert.long()
    owned = vert >= 0
    t = vert.clamp(min=0)
    _, o_loc = layout.global_to_local(t, S)
    lkb = (o_loc // bs).clamp(max=nkb - 1)
    b, hq, nv = vert.shape
    nqb = qB.numel()
    visible = owned[:, :, None, :] & ((t // bs)[:, :, None, :] <= qB[None, None, :, None])
    covered = active.gather(-1, lkb[:, :, None, :].expand(b, hq, nqb, nv))
    column_count, column_index = old_compact(visible & ~covered, o_loc[:, :, None, :])
    return StepIndices(block_count=block_count, block_index=block_index, column_count=column_count,
                       column_index=column_index, causal=(owner == rank), block_size=bs)


def old_convert_pattern(pattern, layout, rank):
    check_block_layout(layout, pattern.seq_len, pattern.block_size)
    return [old_step_indices(pattern, layout, rank, o) for o in range(layout.cp_size)]
# ================================================================================ end of oracle


def assert_same_pattern(new, old, ctx):
    assert (new.seq_len, new.block_size) == (old.seq_len, old.block_size), ctx
    for f in ("slash", "slash_count", "vertical", "vertical_count", "est_slash_mass", "est_vertical_mass"):
        a, b = getattr(new, f), getattr(old, f)
        assert same(a, b), (f, ctx, a, b)


def assert_same_steps(new, old, ctx):
    assert len(new) == len(old), ctx
    for o, (a, b) in enumerate(zip(new, old)):
        assert (a.causal, a.block_size) == (b.causal, b.block_size), (o, ctx)
        for f in ("block_count", "block_index", "column_count", "column_index"):
            assert same(getattr(a, f), getattr(b, f)), (f, o, ctx, getattr(a, f), getattr(b, f))


def random_config(rng, S, bs, L):
    nb = S // bs
    sink = rng.choice([0, 1, 3, bs, S // 3, S, S + 5])
    local = rng.choice([1, 2, 3, nb, nb + 2])
    return VerticalSlashConfig(
        recall=rng.choice([0.3, 0.8, 0.9, 0.95, 0.999, 1.0]), last_q=L, block_size=bs, sink_tokens=sink,
        local_blocks=local, max_vertical=sink + rng.choice([0, 1, 5, S // 4, 4 * S]),
        max_slash=local + rng.choice([0, 1, 3, nb]))


def tie_heavy_scores(gen, shape, kind):
    """Non-negative fp64 scores with many exact ties: small integers / 8 (exact zeros included),
    all zero, or continuous."""
    if kind == "quantized":
        return torch.randint(0, 4, shape, generator=gen).to(F64) / 8
    if kind == "zeros":
        return torch.zeros(shape, dtype=F64)
    if kind == "sparse":
        return torch.rand(shape, generator=gen, dtype=F64) * (torch.rand(shape, generator=gen) < 0.1)
    return torch.rand(shape, generator=gen, dtype=F64)


# ------------------------------------------------------------------------------ floor_first_sort
@pytest.mark.parametrize("seed", range(30))
def test_floor_first_sort_is_priority_order(seed):
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    n = rng.choice([1, 2, 7, 64, 300])
    score = tie_heavy_scores(gen, (2, 3, n), rng.choice(["quantized", "zeros", "sparse", "rand"]))
    nf = rng.choice([0, 1, 2, n // 2, n, n + 3])
    keep = rng.choice([None, n, max(min(nf, n), 1), min(n, nf + 5)])
    idx = torch.arange(n)
    ref = old_priority_order(score, idx < nf, idx)
    assert torch.equal(priority_order(score, idx < nf, idx), ref)      # the general path is unchanged
    v, o = floor_first_sort(score, nf, keep)
    k = n if keep is None else keep
    assert same(o, ref[..., :k]) and same(v, score.gather(-1, ref)[..., :k]), (n, nf, keep)


# ------------------------------------------------------------------------------ end to end, cp 1
def tie_heavy_qkv(gen, rng, b, S, hq, hkv, d):
    q = torch.randn(b, S, hq, d, generator=gen, dtype=F64)
    k = torch.randn(b, S, hkv, d, generator=gen, dtype=F64)
    mode = rng.choice(["plain", "dup", "zero_q", "underflow", "mixed"])
    if mode in ("dup", "mixed"):                     # duplicated key columns: bitwise equal column scores
        src = torch.randint(0, S, (S // 3,), generator=gen)
        dst = torch.randint(0, S, (S // 3,), generator=gen)
        k[:, dst] = k[:, src]
    if mode in ("zero_q", "mixed"):                  # uniform probe rows: many equal column scores
        q[:, S - S // 2:, : max(1, hq // 2)] = 0
    if mode in ("underflow", "mixed"):               # exact-zero scores: exp underflows
        q[..., 0] = 4.0
        k[:, torch.randint(0, S, (S // 4,), generator=gen), :, 0] = -400.0
    return q, k


def cases_cp1(n):
    out = []
    for seed in range(n):
        rng = random.Random(1000 + seed)
        bs = rng.choice([16, 32, 64])
        S = bs * rng.choice([2, 4, 8])
        L = rng.choice([1, bs // 2, bs, min(S, bs + bs // 2), S])
        hq, hkv = rng.choice([(4, 2), (4, 1), (2, 2), (3, 1)])
        kind = rng.choice(["striped", "zigzag", "contiguous"])
        out.append((seed, rng.choice([1, 2]), S, hq, hkv, bs, L, kind))
    return out


@pytest.mark.parametrize("seed,b,S,hq,hkv,bs,L,kind", cases_cp1(60))
def test_estimate_matches_frozen_oracle_cp1(seed, b, S, hq, hkv, bs, L, kind):
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    q, k = tie_heavy_qkv(gen, rng, b, S, hq, hkv, 16)
    layout = Layout(kind, 1, rng.choice([bs, 2 * bs]) if kind == "striped" else 64)
    for _ in range(3):
        cfg = random_config(rng, S, bs, L)
        new = estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="torch")
        old = old_estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="torch")
        assert_same_pattern(new, old, (seed, cfg))
        if S % bs == 0 and (kind != "striped" or layout.granularity % bs == 0):
            assert_same_steps(convert_pattern(new, layout, 0), old_convert_pattern(old, layout, 0), (seed, cfg))


def test_estimate_matches_frozen_oracle_triton_impl():
    """impl='triton' (fp32 scores; CPU interpreter): the same selection after the scores (one probe
    query block: fp32 column scores sorted as fp32)."""
    pytest.importorskip("triton", reason="triton is not installed")
    q0, k0 = tie_heavy_qkv(torch.Generator().manual_seed(5), random.Random(5), 2, 256, 4, 2, 16)
    q, k = q0.float(), k0.float()
    try:
        E.resolve_impl("triton", q, k)
    except ValueError as e:
        pytest.skip(str(e))
    rng = random.Random(7)
    # two probe query blocks (L = 96) on the striped layout, part of one (L = 32: fp32 column scores) on zigzag;
    # the torch impl covers the other (layout, L) pairs above, and tests/kernels the scores kernels themselves
    for layout, L in ((Layout("striped", 1, 64), 96), (Layout("zigzag", 1), 32)):
        cfg = random_config(rng, 256, 64, L)
        new = estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="triton")
        old = old_estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="triton")
        assert_same_pattern(new, old, (layout, cfg))


# ------------------------------------------------------------------------------ selection, simulated cp
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(40))
def test_selection_matches_frozen_oracle_simulated_cp(seed, device):
    """Each rank's local candidates (new code) concatenated in rank order (what the all_gather
    returns), merged: every rank selects the oracle's pattern; cp 1 on the same global scores too."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    cp = rng.choice([2, 4])
    bs = rng.choice([16, 64])
    kind = rng.choice(["striped", "zigzag", "contiguous"])
    layout = Layout(kind, cp, rng.choice([1, 16, 64]) if kind == "striped" else 64)
    S = layout.divisor * bs * rng.choice([1, 2])               # a multiple of bs
    L = rng.choice([1, bs, min(S, 2 * bs)])
    b, hq = rng.choice([(1, 1), (2, 3)])
    kinds = ["quantized", "zeros", "sparse", "rand"]
    col = tie_heavy_scores(gen, (b, hq, S), rng.choice(kinds)).to(device)
    slash = tie_heavy_scores(gen, (b, hq, S // bs), rng.choice(kinds)).to(device)
    cfg = random_config(rng, S, bs, L)
    pos = [layout.positions(r, S, device=device) for r in range(cp)]
    assert all(torch.equal(p, old_positions(layout, r, S, device=device)) for r, p in enumerate(pos))
    col32 = rng.random() < 0.5          # the fused path hands fp32 column scores to the selection
    if col32:
        col = col.float()
    cols = [col[..., p].contiguous() for p in pos]
    ocols = [c.double() for c in cols]  # the old code saw their fp64 copies

    def old_gathered(r):
        def g(cand):
            parts = []
            for o in range(cp):
                sl = ocols[o].shape[-1]
                lo = old_priority_order(ocols[o], pos[o] < cfg.sink_tokens, pos[o])[..., :min(cfg.max_vertical, sl)]
                parts.append(torch.stack([ocols[o].gather(-1, lo), pos[o].expand(b, hq, sl).gather(-1, lo).to(F64)]))
            assert torch.equal(parts[r], cand)
            return torch.cat(parts, -1)
        return g

    def new_gather(r):
        def g(score, p):
            parts = [E._local_candidates(cols[o], pos[o], E._count_below(layout, o, S, cfg.sink_tokens),
                                         min(cfg.max_vertical, cols[o].shape[-1]), False) for o in range(cp)]
            assert same(parts[r][0], score) and same(parts[r][1], p)
            # the all_gather's fp64 round trip of the positions, as in _all_gather_candidates
            return (torch.cat([s for s, _ in parts], -1),
                    torch.cat([q.to(F64) for _, q in parts], -1).round().long())
        return g

    for r in range(cp):
        old = old_select(slash, ocols[r], pos[r], S, L, cfg, gathered=old_gathered(r))
        new = E._select(slash, cols[r], pos[r], layout, r, S, L, cfg, gather=new_gather(r))
        assert_same_pattern(new, old, (seed, r, cfg))
    one = Layout(kind, 1, layout.granularity)
    ar = torch.arange(S, device=device)
    assert_same_pattern(E._select(slash, col, ar, one, 0, S, L, cfg),
                        old_select(slash, col.double(), ar, S, L, cfg), (seed, "cp1", col32, cfg))


# ------------------------------------------------------------------------------ convert_pattern
def random_pattern(gen, rng, b, hq, S, bs, canonical=True):
    nb = S // bs
    slash, vert = [], []
    for _ in range(b):
        srow, vrow = [], []
        for _ in range(hq):
            ns = rng.choice([0, 1, 2, nb // 2, nb])
            nv = rng.choice([0, 1, 3, S // 8, S // 2, S])
            srow.append(torch.randperm(nb, generator=gen)[:ns].tolist())
            vrow.append(torch.randperm(S, generator=gen)[:nv].tolist())
        slash.append(srow)
        vert.append(vrow)
    pat = VerticalSlashPattern.from_lists(S, bs, slash, vert)
    if not canonical:    # outside the documented format: unsorted, duplicated, extra padding
        s = torch.cat([pat.slash, pat.slash.flip(-1), torch.full_like(pat.slash[..., :2], -1)], -1)
        v = torch.cat([pat.vertical.flip(-1), torch.full_like(pat.vertical[..., :3], -1)], -1)
        pat = VerticalSlashPattern(S, bs, s, pat.slash_count, v, pat.vertical_count)
    return pat


def convert_cases(n):
    out = []
    for seed in range(n):
        rng = random.Random(2000 + seed)
        cp = rng.choice([1, 2, 4])
        bs = rng.choice([16, 64])
        kind = rng.choice(["striped", "zigzag", "contiguous"])
        g = bs * rng.choice([1, 2])
        out.append((seed, cp, bs, kind, g, rng.choice([1, 2]), rng.choice([1, 3])))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,cp,bs,kind,g,b,hq", convert_cases(80))
def test_convert_matches_frozen_oracle(seed, cp, bs, kind, g, b, hq, device):
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    layout = Layout(kind, cp, g)
    unit = {"striped": cp * g, "zigzag": 2 * cp * bs, "contiguous": cp * bs}[kind]
    S = unit * rng.choice([1, 2, 3, 8])
    for canonical in (True, False):
        pat = random_pattern(gen, rng, b, hq, S, bs, canonical).to(device)
        for rank in range(cp):
            new = convert_pattern(pat, layout, rank)
            assert_same_steps(new, old_convert_pattern(pat, layout, rank), (seed, rank, canonical))
            for st in new:        # is_empty from the recorded maxima == from the device
                assert st.known_max is not None and st.known_max.valid_for(st.block_count, st.column_count)
                assert st.is_empty() == (int(st.block_count.max()) == 0 and int(st.column_count.max()) == 0)
                nc = without_columns(st)
                assert nc.known_max is not None and nc.is_empty() == (int(st.block_count.max()) == 0)
            o = rng.randrange(cp)
            assert_same_steps([step_indices(pat, layout, rank, o)], [old_step_indices(pat, layout, rank, o)],
                              (seed, rank, o, canonical))


# ------------------------------------------------------------------------------ probe gather
@pytest.mark.parametrize("kind,cp,g,L", [("striped", 1, 64, 64), ("striped", 2, 16, 64), ("striped", 4, 16, 40),
                                         ("striped", 4, 1, 7), ("zigzag", 2, 64, 64), ("zigzag", 4, 64, 48),
                                         ("contiguous", 4, 64, 96), ("striped", 2, 64, 128)])
def test_probe_gather_every_layout(monkeypatch, kind, cp, g, L):
    """The probe queries on every rank are the last L rows of the global q (the broadcast is faked:
    a non-owner receives the owner's rows), as in the old code, for one and several owners."""
    S = 256
    layout = Layout(kind, cp, g)
    gen = torch.Generator().manual_seed(cp * 100 + L)
    q = torch.randn(2, S, 3, 8, generator=gen, dtype=F64)
    shards = [layout.shard(q, r, 1) for r in range(cp)]
    owners, local = layout.global_to_local(torch.arange(S - L, S), S)

    def fake_broadcast(buf, src, group=None):
        rows = local[owners == src]
        buf.copy_(shards[src][:, rows])

    monkeypatch.setattr(dist, "broadcast", fake_broadcast)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, o: o)
    for r in range(cp):
        new = E._gather_probe_queries(shards[r], layout, None, r, cp, S, L)
        old = old_gather_probe_queries(shards[r], layout, None, r, cp, S, L)
        assert same(new, q[:, S - L:]) and same(old, q[:, S - L:]), (r, kind, cp)


def test_global_lse_cp1_bits():
    """cp 1 skips the rescale: same lse bits for every (m, z) the score paths produce (finite m with
    z >= 1; m = -inf with z = 0: no visible key; NaN / +inf from non-finite inputs)."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(2, 3, 50, generator=gen, dtype=F64) * 30
    z = 1 + torch.rand(2, 3, 50, generator=gen, dtype=F64) * 60
    m[0, 0, :5], z[0, 0, :5] = float("-inf"), 0.0
    m[0, 1, :2], z[0, 1, :2] = float("inf"), float("nan")
    m[1, 2, :3], z[1, 2, :3] = float("nan"), float("nan")
    new, old = E._global_lse(m, z, None, 1), old_global_lse(m, z, None, 1)
    assert new.dtype == old.dtype and torch.equal(new.view(torch.int64), old.view(torch.int64))


def test_is_empty_ignores_stale_maxima():
    """The recorded maxima are used only for the count tensors they were read from, unmodified."""
    import dataclasses

    pat = VerticalSlashPattern.from_lists(256, 64, [[[0, 1]]], [[[3, 200]]])
    layout = Layout("contiguous", 2)
    full, empty = convert_pattern(pat, layout, 1)[1], convert_pattern(pat, layout, 0)[1]   # own step; future owner
    assert not full.is_empty() and empty.is_empty()
    other = dataclasses.replace(full, block_count=torch.zeros_like(full.block_count),
                                column_count=torch.zeros_like(full.column_count))
    assert other.is_empty()                                  # replaced counts: read from the tensors
    full.block_count.zero_()
    full.column_count.zero_()
    assert full.is_empty()                                   # modified in place: version changed
    with torch.inference_mode():
        assert convert_pattern(pat, layout, 1)[1].known_max is None


def test_take_sorted_int32_keys_equal_int64_sort():
    """The final re-sort of each row's kept lines (int32 keys when the sentinel fits) returns what an int64
    sort of the same entries returns: int64, ascending, -1 padding past each row's count; a sentinel
    of 2**31 or more keeps int64 keys (values up to just below each sentinel)."""
    gen = torch.Generator().manual_seed(0)
    for sentinel in (300, 2 ** 31 - 1, 2 ** 31, 2 ** 33):
        vals = torch.stack([torch.randperm(300, generator=gen)[:40] for _ in range(6)]).view(2, 3, 40)
        vals = vals * (sentinel // 300)
        cnt = torch.tensor([[0, 5, 40], [17, 1, 39]])
        got = E._take_sorted(vals, cnt, 40, sentinel)
        assert got.dtype == torch.long and got.shape == (2, 3, 40)
        for i in range(2):
            for j in range(3):
                n = int(cnt[i, j])
                assert got[i, j, :n].tolist() == sorted(vals[i, j, :n].tolist())
                assert (got[i, j, n:] == -1).all()
        if sentinel > 2 ** 31:    # negative control: int32 keys would have wrapped these values
            assert not torch.equal(vals.to(torch.int32).long(), vals)

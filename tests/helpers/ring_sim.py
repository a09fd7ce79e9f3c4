"""A dense ring run in one process: every rank's steps, LSE merge, and the backward with the ring's
final ``out``/``lse``, for any step kernel of the ring's protocol. Results are unsharded, so they
compare directly with an attention over the whole sequence."""
from __future__ import annotations

import random

import torch

from megatron_mtraining.ops.merge import merge_attention
from megatron_mtraining.ring import begin_backward


def simulate_dense_ring(layout, q, k, v, dout, make_kernel, acc=torch.float32):
    """``make_kernel(rank) -> kernel`` (``forward(q, k, v, owner)``, ``backward(dout, q, k, v, lse,
    delta, owner)``, optionally ``begin_backward(out)``). q/k/v/dout: whole-sequence bshd. Returns unsharded
    ``(out, lse, dq, dk, dv)`` in ``acc`` (fp32 by default; out in q's dtype, as the ring returns it)."""
    cp, seq = layout.cp_size, q.shape[1]
    sh = lambda t, r: layout.shard(t, r, dim=1).contiguous()
    outs, lses, dqs = [], [], []
    dks = [torch.zeros(sh(k, r).shape, dtype=acc, device=k.device) for r in range(cp)]
    dvs = [torch.zeros_like(x) for x in dks]
    for rank in range(cp):
        kern = make_kernel(rank)
        ql, dol = sh(q, rank), sh(dout, rank)
        b, s, h, d = ql.shape
        out = torch.zeros(b, s, h, d, dtype=acc, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
        for owner in range(cp):
            part = kern.forward(ql, sh(k, owner), sh(v, owner), owner)
            if part is not None:
                out, lse = merge_attention(out, lse, part[0].to(acc), part[1].to(acc))
        out = out.to(q.dtype)
        delta = (dol.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)
        dq = torch.zeros(ql.shape, dtype=acc, device=q.device)
        begin_backward(kern, out)
        for owner in range(cp):
            g = kern.backward(dol, ql, sh(k, owner), sh(v, owner), lse, delta, owner)
            if g is not None:
                dq += g[0].to(acc)
                dks[owner] += g[1].to(acc)
                dvs[owner] += g[2].to(acc)
        outs.append(out)
        lses.append(lse)
        dqs.append(dq)
    un = lambda parts, dim=1: layout.unshard(parts, dim=dim)
    return un(outs).to(acc), un(lses, 2), un(dqs), un(dks), un(dvs)


def random_pattern(seq, bs, b, hq, seed, shared_columns=(), max_slash=3, max_vertical=6):
    """A random vertical-slash pattern: block diagonal 0 plus up to ``max_slash`` other diagonals and
    up to ``max_vertical`` columns per (sample, head), plus ``shared_columns`` in every head."""
    from megatron_mtraining.patterns.estimator import VerticalSlashPattern

    rng = random.Random(seed)
    nb = seq // bs
    slash = [[[0] + rng.sample(range(1, nb), k=min(nb - 1, rng.randint(0, max_slash))) for _ in range(hq)]
             for _ in range(b)]
    vert = [[sorted(set(rng.sample(range(seq), k=rng.randint(0, max_vertical))) | set(shared_columns))
             for _ in range(hq)] for _ in range(b)]
    return VerticalSlashPattern.from_lists(seq, bs, slash, vert)

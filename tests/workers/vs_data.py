"""Synthetic q/k/v with realistic vertical-slash structure (shared by test_patterns and the sparse ring worker).

Keys carry three feature subspaces that query heads weight differently, so that heads sharing one
KV head (GQA) still get different patterns:

* a **sink** direction present only on the first tokens (attention sinks → vertical lines at 0..3);
* a **vertical** direction on a few random "heavy hitter" positions (vertical lines mid-sequence);
* a **local** RoPE-like subspace: unit phasors at several frequencies rotated by position, so
  ``q_p · k_t ∝ Σ_j cos(ω_j (p - t))`` peaks at ``p = t`` (slash lines near the diagonal);
* plus isotropic noise.

Every sample of the batch has its own heavy hitters and its own head weights (different patterns).
"""
from __future__ import annotations

import torch


def make_qkv(batch: int, seq: int, hq: int, hkv: int, d: int, seed: int = 0, noise: float = 0.4,
             dtype=torch.float64):
    """Returns fp64-generated ``q [b, S, hq, d], k, v [b, S, hkv, d]`` cast to ``dtype``."""
    assert d >= 12
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    q = torch.randn(batch, seq, hq, d, generator=g, dtype=f64) * noise
    k = torch.randn(batch, seq, hkv, d, generator=g, dtype=f64) * noise
    v = torch.randn(batch, seq, hkv, d, generator=g, dtype=f64)
    pos = torch.arange(seq, dtype=f64)
    nfreq = (d - 4) // 2                          # local subspace uses dims 4 .. 4 + 2*nfreq
    omega = 0.9 * torch.logspace(0, -1.6, nfreq, dtype=f64)
    ang = pos[:, None] * omega[None, :]            # [S, nfreq]
    phasor = torch.stack([torch.cos(ang), torch.sin(ang)], -1).reshape(seq, 2 * nfreq)
    for bi in range(batch):
        heavy = torch.randperm(seq - 8, generator=g)[:3] + 4
        k[bi, :4, :, 0] += 7.0                                   # sinks
        k[bi, heavy, :, 2] += 7.0                                # heavy hitters
        k[bi, :, :, 4:4 + 2 * nfreq] += 1.6 * phasor[:, None, :]
        # head roles differ per sample: rotate the role table
        roles = [(1.2, 0.0, 0.0), (0.1, 0.0, 3.0), (0.2, 1.1, 0.3), (0.7, 0.6, 2.2)]
        for h in range(hq):
            ws, wv, wl = roles[(h + bi) % len(roles)]
            q[bi, :, h, 0] += ws * 7.0
            q[bi, :, h, 2] += wv * 7.0
            q[bi, :, h, 4:4 + 2 * nfreq] += wl * phasor
    return q.to(dtype), k.to(dtype), v.to(dtype)


def naive_masked_attention(q, k, v, mask, scale):
    """Independent fp64 attention under a token mask ``[b, hq, S, S]`` (GQA by repeat_interleave).

    Rows with an empty mask give 0. Differentiable (use with autograd for reference gradients)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    p = e / torch.where(z == 0, torch.ones_like(z), z)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def probe_scores(q, k, last_q, block_size, scale):
    """Independent estimator scores: fp64 softmax of the last ``last_q`` queries over the whole
    causal sequence; returns ``(col [b, hq, S], slash [b, hq, S/bs])``."""
    b, S, hq, _ = q.shape
    rep = hq // k.shape[2]
    kk = k.double().repeat_interleave(rep, 2)
    qq = q.double()[:, S - last_q:]
    s = torch.einsum("bqhd,bkhd->bhqk", qq, kk) * scale
    qp = torch.arange(S - last_q, S)
    kp = torch.arange(S)
    s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    p = torch.softmax(s, -1)
    col = p.sum(-2)
    nb = S // block_size
    slash = torch.zeros(b, hq, nb, dtype=torch.float64)
    for qi in range(last_q):
        for d in range(nb):
            kb = qp[qi] // block_size - d
            if kb < 0:
                continue
            slash[:, :, d] += p[:, :, qi, kb * block_size:(kb + 1) * block_size].sum(-1)
    return col, slash

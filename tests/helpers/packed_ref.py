"""Independent fp64 reference for packed sequences: every document attended alone, the results
placed at the document's slot, padding rows zero; gradients by autograd."""
from __future__ import annotations

import torch


def per_document_attention(q, k, v, dout, cu_seqlens, scale, cu_seqlens_padded=None, seq_len=None):
    """``q [b, S, hq, d]``, ``k, v [b, S, hkv, d]``, ``dout`` like ``q``; ``cu_seqlens`` (list) over the
    ``b`` rows concatenated (THD). Returns fp64 ``(out, dq, dk, dv)``, whole-sequence shaped."""
    b, S = q.shape[:2]
    pad = list(cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded)
    cu = list(cu_seqlens)
    rep = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.detach().double().reshape(b * S, *t.shape[2:]).requires_grad_(True) for t in (q, k, v))
    out = torch.zeros(b * S, *q.shape[2:], dtype=torch.float64)
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n == 0:
            continue
        a = pad[i]
        qq = qf[a:a + n]
        kk = kf[a:a + n].repeat_interleave(rep, 1)
        vv = vf[a:a + n].repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
        out = out.index_put((torch.arange(a, a + n),), o)
    out.backward(dout.detach().double().reshape(b * S, *q.shape[2:]))
    shape = lambda t, like: t.reshape(like.shape)
    return (shape(out.detach(), q), shape(qf.grad, q), shape(kf.grad, k), shape(vf.grad, v))


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def pattern_document_attention(q, k, v, dout, pattern, docs, scale):
    """fp64 attention of bshd q/k/v under the token mask (``pattern.dense_mask``) ∧ causal ∧ same
    document (``docs.lo <= t <= docs.hi``), a softmax per row (empty rows: zeros), grads by autograd.
    Returns ``(out, dq, dk, dv, mask [b, hq, S, S])``."""
    qd, kd, vd = (t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v))
    b, S, hq, d = q.shape
    rep = hq // k.shape[2]
    m = pattern.dense_mask(S)                                            # [b, h_pattern, S, S]
    m = m.repeat_interleave(hq // m.shape[1], dim=1)
    t = torch.arange(S)
    same = (docs.lo[:, :, None] <= t) & (t <= docs.hi[:, :, None])       # [b, S, S]
    m = m & same[:, None]
    kk, vv = kd.repeat_interleave(rep, 2), vd.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kk) * scale
    s = s.masked_fill(~m, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)
    p = torch.exp(s - mx)
    z = p.sum(-1, keepdim=True)
    p = p / torch.where(z == 0, torch.ones_like(z), z)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    out.backward(dout.to(torch.float64))
    return out.detach(), qd.grad, kd.grad, vd.grad, m


def document_probe_oracle(q, k, docs, L, bs, scale, hkv):
    """fp64 ``(col [b, hq, S], slash [b, hq, S/bs], n_real [b])`` of per-document probes from an explicit
    mask: the last ``L`` real tokens of every document, each row's softmax over causal same-document keys."""
    b, S, hq, _ = q.shape
    ids = torch.where(docs.hi >= 0, docs.doc_start, torch.full_like(docs.doc_start, -1))
    col = torch.zeros(b, hq, S, dtype=torch.float64)
    slash = torch.zeros(b, hq, S // bs, dtype=torch.float64)
    n_real = []
    kk = k.double().repeat_interleave(hq // hkv, 2)
    for i in range(b):
        probes = [p for p in range(S) if ids[i, p] >= 0 and
                  sum(1 for t in range(p + 1, S) if ids[i, t] == ids[i, p]) < L]
        n_real.append(len(probes))
        for p in probes:
            vis = torch.tensor([t <= p and ids[i, t] == ids[i, p] for t in range(S)])
            s = torch.einsum("hd,thd->ht", q[i, p].double(), kk[i]) * scale
            prob = torch.softmax(s.masked_fill(~vis, float("-inf")), -1)
            col[i] += prob
            for t in range(S):
                if vis[t]:
                    slash[i, :, p // bs - t // bs] += prob[:, t]
    return col, slash, torch.tensor(n_real, dtype=torch.float64)

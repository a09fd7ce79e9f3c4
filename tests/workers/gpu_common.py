"""Helpers shared by the Triton kernel tests (CPU interpreter) and the GPU workers.

* :func:`random_step_indices`: random valid :class:`StepIndices` (any block subset, columns outside
  the listed blocks, garbage in the padding, some empty tiles);
* :func:`dense_mask_rows`: the boolean key mask of a range of query rows, built independently of
  the kernels' preprocessing (straight from the lists);
* :func:`oracle`: fp64 masked attention (forward, LSE, and the backward of a step given a global
  ``lse``/``delta``), chunked over query rows, GQA by ``repeat_interleave``;
* :func:`bf16_reference`: the same masked attention in bf16 torch ops (the error bar);
* :func:`merge_fp64`: the LSE merge of two partial results in fp64 (``logaddexp`` form, written
  apart from ``ops.merge``).
"""

from __future__ import annotations

import torch

from megatron_mtraining.patterns.indices import StepIndices

BLOCK = 64


def random_step_indices(b, hq, nqb, nkb, causal, gen, p_block=0.35, p_col=0.04, empty_frac=0.15,
                        above_diag=False):
    """Random valid indices. With ``causal`` blocks are <= the query tile (plus, if ``above_diag``,
    a few blocks past it, which the causal mask must remove) and columns lie before the tile's
    end (some inside the tile itself: partly masked)."""
    max_nb, max_nc = nkb + 2, BLOCK * nkb // 4 + 3
    bc = torch.zeros(b, hq, nqb, dtype=torch.int32)
    bi = torch.full((b, hq, nqb, max_nb), -7, dtype=torch.int32)          # garbage padding
    cc = torch.zeros(b, hq, nqb, dtype=torch.int32)
    ci = torch.full((b, hq, nqb, max_nc), 10 ** 6, dtype=torch.int32)      # out-of-range padding
    r = lambda: torch.rand(1, generator=gen).item()
    for x in range(b):
        for h in range(hq):
            for i in range(nqb):
                if r() < empty_frac:
                    continue
                lim = min(i + 1, nkb) if causal else nkb
                blocks = [j for j in range(lim) if r() < p_block]
                if causal and i < nkb and r() < 0.8 and i not in blocks:
                    blocks.append(i)
                if causal and above_diag and i + 1 < nkb and r() < 0.3:
                    blocks.append(i + 1)
                blocks.sort()
                climit = min((i + 1) * BLOCK, nkb * BLOCK) if causal else nkb * BLOCK
                cols = [t for t in range(climit) if t // BLOCK not in blocks and r() < p_col][:max_nc]
                bc[x, h, i] = len(blocks)
                if blocks:
                    bi[x, h, i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
                cc[x, h, i] = len(cols)
                if cols:
                    ci[x, h, i, :len(cols)] = torch.tensor(cols, dtype=torch.int32)
    return StepIndices(bc, bi, cc, ci, causal)


def dense_mask_rows(idx: StepIndices, r0: int, r1: int, sk: int, device=None) -> torch.Tensor:
    """Key mask ``[b, hq, r1 - r0, sk]`` of query rows ``r0:r1`` (multiples of 64)."""
    bc, bi, cc, ci = (t.to(device) for t in (idx.block_count, idx.block_index, idx.column_count, idx.column_index))
    b, hq = bc.shape[:2]
    q0, q1 = r0 // BLOCK, r1 // BLOCK
    nkb = sk // BLOCK
    bm = torch.zeros(b, hq, q1 - q0, nkb + 1, dtype=torch.bool, device=device)
    slot = torch.arange(bi.shape[-1], device=device)
    ok = slot < bc[:, :, q0:q1, None].long()
    tgt = torch.where(ok, bi[:, :, q0:q1].long(), torch.full_like(bi[:, :, q0:q1], nkb, dtype=torch.long))
    bm.scatter_(3, tgt, True)
    mask = bm[..., :nkb].repeat_interleave(BLOCK, dim=3)                # [b, hq, nq, sk]
    cslot = torch.arange(ci.shape[-1], device=device)
    cok = cslot < cc[:, :, q0:q1, None].long()
    cm = torch.zeros(b, hq, q1 - q0, sk + 1, dtype=torch.bool, device=device)
    ctgt = torch.where(cok, ci[:, :, q0:q1].long(), torch.full_like(ci[:, :, q0:q1], sk, dtype=torch.long))
    cm.scatter_(3, ctgt, True)
    mask = mask | cm[..., :sk]
    mask = mask.repeat_interleave(BLOCK, dim=2)                           # rows
    if idx.causal:
        rows = torch.arange(r0, r1, device=device)
        mask &= torch.arange(sk, device=device)[None, :] <= rows[:, None]
    return mask


def oracle(q, k, v, mask_fn, scale, dout=None, lse_g=None, delta_g=None, chunk=1024):
    """fp64 masked attention. ``mask_fn(r0, r1) -> [b, hq, r1-r0, sk]`` bool.

    Returns ``(out, lse)`` and, with ``dout``, also ``(dq, dk, dv)`` of the step given the global
    ``lse_g``/``delta_g`` (default: this step's own, i.e. the step is the whole attention)."""
    q64, k64, v64 = (t.double() for t in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    kk = k64.repeat_interleave(rep, 2)
    vv = v64.repeat_interleave(rep, 2)
    out = torch.zeros(b, sq, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float64, device=q.device)
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        s = torch.einsum("bqhd,bkhd->bhqk", q64[:, r0:r1], kk) * scale
        s = s.masked_fill(~mask_fn(r0, r1), float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        lse[:, :, r0:r1] = (m + torch.log(l)).squeeze(-1)
        out[:, r0:r1] = torch.einsum("bhqk,bkhd->bqhd", p / torch.where(l == 0, torch.ones_like(l), l), vv)
    if dout is None:
        return out, lse
    do64 = dout.double()
    if lse_g is None:
        lse_g = lse
        delta_g = (do64 * out).sum(-1).transpose(1, 2)
    lse_g = lse_g.double()
    delta_g = delta_g.double()
    lg = torch.where(torch.isinf(lse_g), torch.full_like(lse_g, float("inf")), lse_g)
    dq = torch.zeros_like(q64)
    dk = torch.zeros(b, sk, hq, d, dtype=torch.float64, device=q.device)
    dv = torch.zeros_like(dk)
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        s = torch.einsum("bqhd,bkhd->bhqk", q64[:, r0:r1], kk) * scale
        s = s.masked_fill(~mask_fn(r0, r1), float("-inf"))
        p = torch.exp(s - lg[:, :, r0:r1, None])
        dp = torch.einsum("bqhd,bkhd->bhqk", do64[:, r0:r1], vv)
        ds = p * (dp - delta_g[:, :, r0:r1, None])
        dq[:, r0:r1] = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
        dk += torch.einsum("bhqk,bqhd->bkhd", ds, q64[:, r0:r1]) * scale
        dv += torch.einsum("bhqk,bqhd->bkhd", p, do64[:, r0:r1])
    dk = dk.view(b, sk, hkv, rep, d).sum(3)
    dv = dv.view(b, sk, hkv, rep, d).sum(3)
    return out, lse, dq, dk, dv, lse_g, delta_g


def bf16_reference(q, k, v, mask_fn, scale, dout, chunk=1024):
    """The masked attention computed with bf16 torch ops, chunked over query rows: bf16 matmuls,
    softmax in fp32 rounded to bf16 (as an unfused bf16 attention does), backward by the same
    formulas in bf16 (``dS = P∘(dP − rowsum(dO∘O))``), dK/dV summed over chunks in fp32 and rounded
    to bf16. Returns fp32 copies of ``(out, lse, dq, dk, dv)``."""
    bf = torch.bfloat16
    q, k, v, dout = (t.to(bf) for t in (q, k, v, dout))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = torch.empty(b, sq, hq, d, dtype=bf, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    dq = torch.empty(b, sq, hq, d, dtype=bf, device=q.device)
    dk = torch.zeros(b, sk, hq, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        m = mask_fn(r0, r1)
        s = torch.einsum("bqhd,bkhd->bhqk", q[:, r0:r1], kk) * scale
        s = s.masked_fill(~m, float("-inf"))
        lse[:, :, r0:r1] = torch.logsumexp(s.float(), -1)
        p = torch.softmax(s.float(), -1).nan_to_num(0.0).to(bf)
        o = torch.einsum("bhqk,bkhd->bqhd", p, vv)
        out[:, r0:r1] = o
        delta = (dout[:, r0:r1].float() * o.float()).sum(-1).transpose(1, 2)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout[:, r0:r1], vv)
        ds = (p.float() * (dp.float() - delta[..., None])).to(bf)
        dq[:, r0:r1] = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
        dk += torch.einsum("bhqk,bqhd->bkhd", ds, q[:, r0:r1]).float() * scale
        dv += torch.einsum("bhqk,bqhd->bkhd", p, dout[:, r0:r1]).float()
    dk = dk.view(b, sk, hkv, rep, d).sum(3).to(bf)
    dv = dv.view(b, sk, hkv, rep, d).sum(3).to(bf)
    return out.float(), lse, dq.float(), dk.float(), dv.float()


def merge_fp64(out, lse, out2, lse2):
    """Attention over the union of two disjoint key sets from the partials ``(out [b, s, h, d], lse [b, h, s])``
    and ``(out2, lse2)``, in fp64: ``lse = logaddexp(lse, lse2)``, ``out = out exp(lse - l) + out2 exp(lse2 - l)``
    (an ``-inf`` partial weighs 0; rows where both are ``-inf``: out 0, lse ``-inf``). Independent of
    :func:`~megatron_mtraining.ops.merge.merge_attention` (which subtracts the maximum instead)."""
    o1, l1, o2, l2 = (t.double() for t in (out, lse, out2, lse2))
    new = torch.logaddexp(l1, l2)
    dead = torch.isneginf(new)
    safe = torch.where(dead, torch.zeros_like(new), new)
    w1 = torch.where(torch.isneginf(l1), torch.zeros_like(l1), torch.exp(l1 - safe))
    w2 = torch.where(torch.isneginf(l2), torch.zeros_like(l2), torch.exp(l2 - safe))
    res = o1 * w1.transpose(1, 2)[..., None] + o2 * w2.transpose(1, 2)[..., None]
    return res, torch.where(dead, torch.full_like(new, float("-inf")), new)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``||a - ref|| / ||ref||`` over the finite entries of ``ref`` (``-inf`` LSEs must match exactly)."""
    a, ref = a.double(), ref.double()
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("inf")
    num = (a[fin] - ref[fin]).norm()
    return float(num / ref[fin].norm().clamp_min(1e-300))

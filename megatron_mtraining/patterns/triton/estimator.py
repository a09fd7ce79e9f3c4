"""Fused Triton scores of the online vertical-slash estimator (MTraining §3.2).

The score part of :func:`megatron_mtraining.patterns.estimator.estimate_vertical_slash` — the
probe softmax statistics and the column / block-diagonal probability sums — in two passes over
this rank's keys, each reading K once (the selection stays in torch, in fp64)::

    m, z = probe_softmax_stats(probe_q, k, k_pos, seq_len, softmax_scale)          # pass 1
    # (the caller all-reduces m (MAX) and z (SUM, rescaled) over the CP group -> lse)
    colu = probe_column_sums(probe_q, k, k_pos, seq_len, lse, softmax_scale, block_size)  # pass 2

Notation: ``L = probe_q.shape[1]`` probe queries at global positions ``S - L .. S - 1`` (row
``r`` at ``S - L + r``); ``k_pos [S_local]`` the global positions of the local keys (ascending;
striped layouts are not contiguous). A key is visible to probe row ``r`` iff
``k_pos <= S - L + r`` -- or, for packed documents, iff ``lo[r] <= k_pos <= hi[r]`` (the row's
document; ``bounds=(lo, hi)``), with key tiles outside every row's bounds skipped. GQA: query head ``h`` reads kv head ``h // (hq // hkv)``; one program
owns one (sample, kv head, tile of ``BLOCK_N`` keys), loads the K tile once and loops over the
``hq // hkv`` query heads of the group and over chunks of at most ``MAX_BLOCK_M`` probe rows
(fp32 inputs: ``BLOCK_N_FP32`` / ``MAX_BLOCK_M_FP32``, smaller tiles: the fp32 ``tl.dot`` runs
without tensor cores and the 16-bit tile sizes would spill registers).

Precision: ``tl.dot`` takes the input dtype (bf16/fp16; fp32 inputs use ``input_precision="ieee"``,
no TF32) with fp32 accumulation; softmax arithmetic in fp32 (base-2 exponentials inside the
kernels, natural-log units at the interface); the per-tile partials of pass 1 are merged in fp64.
Fully masked rows / keys give exact zeros (``m = -inf``, ``z = 0``, ``p = 0``), never NaN.

Per-document probes (``VerticalSlashConfig.probes="document"``, one stream at a time): the probe rows
are every document's last queries, ``P`` rows at arbitrary positions with their documents' key bounds.
Each row sees only its own document, so the two passes take small host-built tables instead of
scanning every key for every row::

    m, z = document_probe_stats(probe_q, k, k_pos, lo, hi, key_range, softmax_scale)      # pass 1
    colu = document_probe_column_sums(probe_q, k, k_pos, lo, hi, lse, groups, tile_groups,
                                      slot0, nslot, softmax_scale)                          # pass 2

Pass 1 is query-parallel: one program per (block of rows, query head) runs an online max / sum over
the local key tiles ``key_range`` names for its rows (their documents' local keys), so it writes
``(m, z)`` directly. Pass 2 is key-parallel like :func:`probe_column_sums`: a *group* is a run of
probe rows of one document inside one global query block, and a key tile visits only the groups of
the documents it meets (``tile_groups``), writing one per-key sum per visited group (``slot``). The
work is the documents' probes times their own local keys, not all probes times the stream.

Imported lazily (never at package import): ``triton.jit`` decides at decoration time whether the
kernels run compiled or in the CPU interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


__all__ = ["BLOCK_N", "MAX_BLOCK_M", "BLOCK_N_FP32", "MAX_BLOCK_M_FP32", "NUM_WARPS", "tile_sizes",
           "probe_softmax_stats", "probe_softmax_lse", "probe_column_sums", "slash_sums", "probe_block_range",
           "document_probe_stats", "document_probe_column_sums"]

BLOCK_N = 64        # local keys per program (one K tile, read once per pass); bf16/fp16 inputs
MAX_BLOCK_M = 64    # probe rows per tl.dot (L is processed in chunks of at most this many rows)
BLOCK_N_FP32 = 32   # the same for fp32 inputs
MAX_BLOCK_M_FP32 = 16
NUM_WARPS = 4
MERGE_BLOCK_T = 256  # key tiles per loop step of the (m, z) merge
MERGE_BLOCK_L = 8    # probe rows per merge program

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)     # read inside the kernels: must be a constexpr global


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """``tl.dot`` in the input dtype; fp32 inputs in IEEE fp32 (no TF32)."""
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_k_tile(K, KPos, bi, g, tile, SL, s_kb, s_ks, s_kh,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < SL
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    k = tl.load(K + bi * s_kb + g * s_kh + offs_n[:, None] * s_ks + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)                  # [BLOCK_N, BLOCK_D]
    kpos = tl.load(KPos + offs_n, mask=n_ok, other=0)
    return tl.trans(k), kpos, offs_n, n_ok                                     # K^T [BLOCK_D, BLOCK_N]


@triton.jit
def _probe_logits(Q, Lo, Hi, bi, h, rows, r_ok, kt, kpos, n_ok, p0, scale_log2, s_qb, s_ql, s_qh, s_bb,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, FP32: tl.constexpr, HAS_BOUNDS: tl.constexpr):
    """Base-2 logits ``[BLOCK_M, BLOCK_N]`` of probe rows ``rows`` of head ``h``; -inf where invisible
    (causal, or outside the row's key bounds ``Lo[bi, r] <= kpos <= Hi[bi, r]`` with ``HAS_BOUNDS``)."""
    offs_d = tl.arange(0, BLOCK_D)
    qt = tl.load(Q + bi * s_qb + h * s_qh + rows[:, None] * s_ql + offs_d[None, :],
                 mask=r_ok[:, None] & (offs_d < D)[None, :], other=0.0)        # [BLOCK_M, BLOCK_D]
    s = _dot(qt, kt, FP32) * scale_log2
    if HAS_BOUNDS:
        lo = tl.load(Lo + bi * s_bb + rows, mask=r_ok, other=0)
        hi = tl.load(Hi + bi * s_bb + rows, mask=r_ok, other=-1)
        vis = r_ok[:, None] & n_ok[None, :] & (kpos[None, :] >= lo[:, None]) & (kpos[None, :] <= hi[:, None])
    else:
        vis = r_ok[:, None] & n_ok[None, :] & (kpos[None, :] <= (p0 + rows)[:, None])
    return tl.where(vis, s, float("-inf")), vis


@triton.jit
def _tile_visible(KPos, Span, bi, tile, SL, BLOCK_N: tl.constexpr, HAS_BOUNDS: tl.constexpr):
    """Whether any key of this tile can be visible to a probe row: with ``HAS_BOUNDS``, the tile's
    key range (``k_pos`` ascends) meets ``[Span[bi, 0], Span[bi, 1]]`` (the union of the row bounds)."""
    if HAS_BOUNDS:
        first = tl.load(KPos + tile * BLOCK_N)
        last = tl.load(KPos + tl.minimum(tile * BLOCK_N + BLOCK_N, SL) - 1)
        return (last >= tl.load(Span + 2 * bi)) & (first <= tl.load(Span + 2 * bi + 1))
    else:
        return True


@triton.jit
def _rows_column_sums(Q, Lo, Hi, Lse2, bi, h, r_lo, r_hi, kt, kpos, n_ok, p0, scale_log2,
                      s_qb, s_ql, s_qh, s_bb, s_lb, s_lh,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      FP32: tl.constexpr, HAS_BOUNDS: tl.constexpr):
    """``[BLOCK_N]`` fp32: ``sum_r exp(s[r, key] - lse[r])`` over probe rows ``r_lo .. r_hi - 1`` of head
    ``h`` for the loaded key tile, in chunks of ``BLOCK_M`` rows (invisible keys and ``-inf`` rows add 0)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(r_lo, r_hi, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        r_ok = rows < r_hi
        s, vis = _probe_logits(Q, Lo, Hi, bi, h, rows, r_ok, kt, kpos, n_ok, p0, scale_log2,
                               s_qb, s_ql, s_qh, s_bb, D, BLOCK_D, FP32, HAS_BOUNDS)
        lse2 = tl.load(Lse2 + bi * s_lb + h * s_lh + rows, mask=r_ok, other=float("-inf"))
        ok = vis & (lse2 > float("-inf"))[:, None]
        p = tl.math.exp2(tl.where(ok, s - tl.where(ok, lse2[:, None], 0.0), float("-inf")))
        acc += tl.sum(p, 0)
    return acc


@triton.jit
def _probe_stats_kernel(
    Q, K, KPos, Lo, Hi, Span, MPart, ZPart,
    scale_log2, L, SL, p0, HKV,
    s_qb, s_ql, s_qh,
    s_kb, s_ks, s_kh,
    s_bb,
    s_pb, s_ph, s_pt,
    REP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, FP32: tl.constexpr, HAS_BOUNDS: tl.constexpr,
):
    tile = tl.program_id(0)
    bg = tl.program_id(1)
    bi = bg // HKV
    g = bg % HKV
    # a tile that no probe row can see keeps the pre-filled (m, z) = (-inf, 0) (bounded launches)
    if _tile_visible(KPos, Span, bi, tile, SL, BLOCK_N, HAS_BOUNDS):
        kt, kpos, offs_n, n_ok = _load_k_tile(K, KPos, bi, g, tile, SL, s_kb, s_ks, s_kh, D, BLOCK_D, BLOCK_N)
        for r in range(REP):
            h = g * REP + r
            out = bi * s_pb + h * s_ph + tile * s_pt
            for r0 in range(0, L, BLOCK_M):
                rows = r0 + tl.arange(0, BLOCK_M)
                r_ok = rows < L
                s, vis = _probe_logits(Q, Lo, Hi, bi, h, rows, r_ok, kt, kpos, n_ok, p0, scale_log2,
                                       s_qb, s_ql, s_qh, s_bb, D, BLOCK_D, FP32, HAS_BOUNDS)
                m = tl.max(s, 1)
                m_use = tl.where(m == float("-inf"), 0.0, m)
                z = tl.sum(tl.math.exp2(s - m_use[:, None]), 1)        # exp2(-inf) == 0: masked keys add 0
                tl.store(MPart + out + rows, m * LN2, mask=r_ok)        # natural-log units; -inf stays -inf
                tl.store(ZPart + out + rows, z, mask=r_ok)


@triton.jit
def _probe_colsum_kernel(
    Q, K, KPos, Lo, Hi, Span, Lse2, ColU,
    scale_log2, L, SL, p0, HKV, BS, U0, NU,
    s_qb, s_ql, s_qh,
    s_kb, s_ks, s_kh,
    s_bb,
    s_lb, s_lh,
    s_cb, s_ch, s_cu,
    REP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, FP32: tl.constexpr, HAS_BOUNDS: tl.constexpr,
):
    tile = tl.program_id(0)
    bg = tl.program_id(1)
    bi = bg // HKV
    g = bg % HKV
    # a tile that no probe row can see keeps the pre-filled zeros (bounded launches)
    if _tile_visible(KPos, Span, bi, tile, SL, BLOCK_N, HAS_BOUNDS):
        kt, kpos, offs_n, n_ok = _load_k_tile(K, KPos, bi, g, tile, SL, s_kb, s_ks, s_kh, D, BLOCK_D, BLOCK_N)
        for r in range(REP):
            h = g * REP + r
            for u in range(NU):
                # probe rows of global query block U0 + u: [max(0, (U0+u)*BS - p0), min(L, (U0+u+1)*BS - p0))
                r_lo = tl.maximum((U0 + u) * BS - p0, 0)
                r_hi = tl.minimum((U0 + u + 1) * BS - p0, L)
                acc = _rows_column_sums(Q, Lo, Hi, Lse2, bi, h, r_lo, r_hi, kt, kpos, n_ok, p0, scale_log2,
                                        s_qb, s_ql, s_qh, s_bb, s_lb, s_lh,
                                        D, BLOCK_D, BLOCK_M, BLOCK_N, FP32, HAS_BOUNDS)
                tl.store(ColU + bi * s_cb + h * s_ch + u * s_cu + offs_n, acc, mask=n_ok)


@triton.jit
def _doc_stats_kernel(
    Q, K, KPos, Lo, Hi, KeyRange, M, Z,
    scale_log2, P, SL,
    s_ql, s_qh, s_ks, s_kh, s_mh,
    REP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, FP32: tl.constexpr,
):
    rb = tl.program_id(0)
    h = tl.program_id(1)
    g = h // REP
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < P
    a = tl.load(KeyRange + 2 * rb)
    e = tl.load(KeyRange + 2 * rb + 1)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    z = tl.zeros([BLOCK_M], tl.float32)
    for tile in range(a // BLOCK_N, tl.cdiv(e, BLOCK_N)):      # empty when a == e
        kt, kpos, offs_n, n_ok = _load_k_tile(K, KPos, 0, g, tile, SL, 0, s_ks, s_kh, D, BLOCK_D, BLOCK_N)
        s, vis = _probe_logits(Q, Lo, Hi, 0, h, rows, r_ok, kt, kpos, n_ok, 0, scale_log2, 0, s_ql, s_qh, 0,
                               D, BLOCK_D, FP32, True)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        z = z * tl.math.exp2(m - m_use) + tl.sum(tl.math.exp2(s - m_use[:, None]), 1)
        m = m_new
    tl.store(M + h * s_mh + rows, m * LN2, mask=r_ok)             # natural-log units; -inf stays -inf
    tl.store(Z + h * s_mh + rows, z, mask=r_ok)


@triton.jit
def _doc_colsum_kernel(
    Q, K, KPos, Lo, Hi, Lse2, Groups, TileGroups, ColU,
    scale_log2, P, SL, SLOT0, NSLOT,
    s_ql, s_qh, s_ks, s_kh, s_lh, s_ch, s_cs,
    REP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    g_lo = tl.load(TileGroups + 2 * tile) + SLOT0
    g_hi = tl.load(TileGroups + 2 * tile + 1)
    kt, kpos, offs_n, n_ok = _load_k_tile(K, KPos, 0, g, tile, SL, 0, s_ks, s_kh, D, BLOCK_D, BLOCK_N)
    for r in range(REP):
        h = g * REP + r
        for j in range(NSLOT):
            gi = g_lo + j
            r_lo = 0
            r_hi = 0
            if gi < g_hi:                   # a slot past the tile's groups stays zero
                r_lo = tl.load(Groups + 2 * gi)
                r_hi = tl.load(Groups + 2 * gi + 1)
            acc = _rows_column_sums(Q, Lo, Hi, Lse2, 0, h, r_lo, r_hi, kt, kpos, n_ok, 0, scale_log2,
                                    0, s_ql, s_qh, 0, 0, s_lh, D, BLOCK_D, BLOCK_M, BLOCK_N, FP32, True)
            tl.store(ColU + h * s_ch + j * s_cs + offs_n, acc, mask=n_ok)


# ----------------------------------------------------------------------------------- launchers
@triton.jit
def _probe_merge_kernel(MP, ZP, M, Z, Lse, nt, L, s_pr, s_pt,
                        WRITE_LSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    """Merge the per-tile ``(m, z)`` of :func:`_probe_stats_kernel` (``[rows, nt, L]`` fp32, rows = b *
    hq) in fp64: ``M`` the max over the tiles (NaN if any is NaN), ``Z = sum zp * exp(mp - safe)`` with
    ``safe = M`` (0 where ``M = -inf``); with ``WRITE_LSE`` only ``Lse = safe + log(Z)`` (``log 1`` where
    ``Z <= 0``), the log-sum-exp of :func:`~megatron_mtraining.patterns.estimator._global_lse` at cp 1."""
    row = tl.program_id(0)
    rows_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_t = tl.arange(0, BLOCK_T)
    l_ok = rows_l < L
    m = tl.full([BLOCK_L], float("-inf"), tl.float64)
    nan = tl.zeros([BLOCK_L], tl.int32)
    for t0 in range(0, nt, BLOCK_T):
        t = t0 + offs_t
        ok = (t[:, None] < nt) & l_ok[None, :]
        x = tl.load(MP + row * s_pr + t[:, None] * s_pt + rows_l[None, :], mask=ok, other=float("-inf"))
        m = tl.maximum(m, tl.max(x, 0).to(tl.float64))
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), 0))
    m = tl.where(nan != 0, float("nan"), m)
    safe = tl.where(m == float("-inf"), 0.0, m)
    z = tl.zeros([BLOCK_L], tl.float64)
    for t0 in range(0, nt, BLOCK_T):
        t = t0 + offs_t
        ok = (t[:, None] < nt) & l_ok[None, :]
        ptr = row * s_pr + t[:, None] * s_pt + rows_l[None, :]
        xm = tl.load(MP + ptr, mask=ok, other=float("-inf")).to(tl.float64)
        xz = tl.load(ZP + ptr, mask=ok, other=0.0).to(tl.float64)
        z += tl.sum(xz * tl.exp(xm - safe[None, :]), 0)
    if WRITE_LSE:
        tl.store(Lse + row * L + rows_l, safe + tl.log(tl.where(z > 0, z, 1.0)), mask=l_ok)
    else:
        tl.store(M + row * L + rows_l, m, mask=l_ok)
        tl.store(Z + row * L + rows_l, z, mask=l_ok)


@triton.jit
def _slash_sums_kernel(Colu, Slash, u, nb, sl, s_cr, BS: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """``Slash[row, d]`` = the fp64 sum of ``Colu[row, key]`` (fp32) over the keys of block ``u - d``
    (``key // BS``), 0 for ``d > u``: the block-diagonal scores of one probe query block ``u`` when the
    keys are the sequence in order (cp 1). One program per (row, ``BLOCK_D`` diagonals)."""
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    kk = tl.arange(0, BLOCK_K)
    key = (u - d)[:, None] * BS + kk[None, :]
    ok = (d[:, None] <= u) & (kk[None, :] < BS) & (key < sl)
    x = tl.load(Colu + row * s_cr + key, mask=ok, other=0.0).to(tl.float64)
    tl.store(Slash + row * nb + d, tl.sum(x, 1), mask=d < nb)


def probe_block_range(seq_len: int, last_q: int, block_size: int) -> "tuple[int, int]":
    """``(u0, nu)``: the probe rows (global positions ``S - L .. S - 1``) lie in the global query
    blocks ``u0 .. u0 + nu - 1``; rows of block ``u`` are ``[max(0, u*bs - (S-L)), min(L, (u+1)*bs - (S-L)))``."""
    p0 = seq_len - last_q
    u0 = p0 // block_size
    return u0, (seq_len - 1) // block_size - u0 + 1


def tile_sizes(dtype: torch.dtype) -> "tuple[int, int]":
    """``(max probe rows per tl.dot, keys per program)`` for inputs of ``dtype``."""
    return (MAX_BLOCK_M_FP32, BLOCK_N_FP32) if dtype == torch.float32 else (MAX_BLOCK_M, BLOCK_N)


def _check(probe_q: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor, seq_len: int):
    if probe_q.dim() != 4 or k.dim() != 4 or probe_q.shape[0] != k.shape[0] or probe_q.shape[3] != k.shape[3]:
        raise ValueError(f"probe_q [b, L, hq, d] and k [b, s_local, hkv, d] expected, got "
                         f"{tuple(probe_q.shape)}, {tuple(k.shape)}")
    b, L, hq, d = probe_q.shape
    sl, hkv = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"GQA needs num query heads ({hq}) divisible by num kv heads ({hkv})")
    if probe_q.dtype != k.dtype or probe_q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"probe_q and k must share a dtype among bf16/fp16/fp32, got {probe_q.dtype}, {k.dtype}")
    if probe_q.device != k.device:
        raise ValueError(f"probe_q on {probe_q.device} but k on {k.device}")
    if k_pos.shape != (sl,):
        raise ValueError(f"k_pos must be [s_local] = [{sl}], got {tuple(k_pos.shape)}")
    if not 1 <= L <= seq_len:
        raise ValueError(f"number of probe queries {L} must be in [1, seq_len={seq_len}]")
    if seq_len >= 2 ** 31:
        raise ValueError(f"seq_len {seq_len} does not fit int32 positions")


def _bounds(bounds, b: int, L: int, device):
    """``(lo, hi, span)`` int32 for the kernels from ``bounds = (lo, hi)`` (``[b, L]`` integer key
    bounds of the probe rows) -- ``span [b, 2]``: the smallest ``lo`` and the largest ``hi`` per
    sample, so a tile outside it is skipped -- or ``(None, None, None)``."""
    if bounds is None:
        return None, None, None
    lo, hi = bounds
    if tuple(lo.shape) != (b, L) or tuple(hi.shape) != (b, L):
        raise ValueError(f"bounds must be two [b, L] = {[b, L]} tensors, got {tuple(lo.shape)}, {tuple(hi.shape)}")
    lo = lo.to(device=device, dtype=torch.int32).contiguous()
    hi = hi.to(device=device, dtype=torch.int32).contiguous()
    span = torch.stack([lo.amin(-1), hi.amax(-1)], -1).contiguous()
    return lo, hi, span


def _prep(probe_q, k, k_pos, seq_len):
    _check(probe_q, k, k_pos, seq_len)
    q = probe_q if probe_q.stride(-1) == 1 else probe_q.contiguous()
    kk = k if k.stride(-1) == 1 else k.contiguous()
    kp = k_pos.to(device=k.device, dtype=torch.int32).contiguous()
    b, L, hq, d = q.shape
    sl, hkv = kk.shape[1], kk.shape[2]
    max_m, block_n = tile_sizes(q.dtype)
    meta = dict(REP=hq // hkv, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                BLOCK_M=min(max_m, max(16, triton.next_power_of_2(L))), BLOCK_N=block_n,
                FP32=q.dtype == torch.float32, num_warps=NUM_WARPS)
    grid = (triton.cdiv(sl, block_n), b * hkv)
    return q, kk, kp, meta, grid


def probe_softmax_stats(probe_q: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
                        softmax_scale: float, bounds=None) -> "tuple[torch.Tensor, torch.Tensor]":
    """Local softmax statistics of the probe rows over this rank's keys (pass 1).

    Args:
        probe_q: ``[b, L, hq, d]`` the queries at global positions ``seq_len - L .. seq_len - 1``
            (bf16/fp16/fp32, CUDA, or CPU under ``TRITON_INTERPRET=1``).
        k: ``[b, s_local, hkv, d]`` this rank's keys, same dtype and device (``hq % hkv == 0``).
        k_pos: ``[s_local]`` integer global positions of the local keys.
        seq_len: global sequence length ``S``.
        softmax_scale: logit scale.
        bounds: ``None`` (causal: key ``t`` visible to row ``r`` iff ``t <= seq_len - L + r``) or
            ``(lo, hi)``, two ``[b, L]`` integer tensors: key ``t`` is visible to row ``r`` of sample
            ``i`` iff ``lo[i, r] <= t <= hi[i, r]`` (packed documents; ``hi < lo``: no key). Key tiles
            outside every row's bounds are skipped.

    Returns:
        ``(m, z)``, both ``[b, hq, L]`` fp64: ``m`` the row max of the scaled logits over the
        visible local keys (``-inf`` where none), ``z = sum exp(s - m)`` (0 where none).

    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    return _probe_stats(probe_q, k, k_pos, seq_len, softmax_scale, bounds, lse=False)


def probe_softmax_lse(probe_q: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
                      softmax_scale: float, bounds=None) -> torch.Tensor:
    """The log-sum-exp of the probe rows over this rank's keys: at cp 1 (every key local) the global
    ``lse`` that :func:`probe_column_sums` takes, without the cross-rank merge of ``(m, z)``.

    Args: as in :func:`probe_softmax_stats`.

    Returns:
        ``[b, hq, L]`` fp64 ``m' + log(z)`` with ``(m, z)`` of :func:`probe_softmax_stats`, ``m' = m``
        (0 where ``m = -inf``) and ``log 1`` where ``z <= 0`` (a row without a visible key: 0).

    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    return _probe_stats(probe_q, k, k_pos, seq_len, softmax_scale, bounds, lse=True)


def _probe_stats(probe_q, k, k_pos, seq_len, softmax_scale, bounds, lse: bool):
    q, kk, kp, meta, grid = _prep(probe_q, k, k_pos, seq_len)
    b, L, hq, _ = q.shape
    lo, hi, span = _bounds(bounds, b, L, q.device)
    nt = grid[0]
    if lo is None:
        mp = torch.empty((b, hq, nt, L), dtype=torch.float32, device=q.device)
        zp = torch.empty_like(mp)
    else:                                   # skipped tiles keep these
        mp = torch.full((b, hq, nt, L), float("-inf"), dtype=torch.float32, device=q.device)
        zp = torch.zeros_like(mp)
    _probe_stats_kernel[grid](
        q, kk, kp, kp if lo is None else lo, kp if hi is None else hi, kp if span is None else span, mp, zp,
        float(softmax_scale) * LOG2E, L, kk.shape[1], seq_len - L, kk.shape[2],
        q.stride(0), q.stride(1), q.stride(2),
        kk.stride(0), kk.stride(1), kk.stride(2),
        0 if lo is None else lo.stride(0),
        mp.stride(0), mp.stride(1), mp.stride(2),
        HAS_BOUNDS=lo is not None, **meta)
    # the tiles' partials merged in fp64 (one launch): (m, z), or at cp 1 the lse itself
    out = torch.empty((1 if lse else 2, b, hq, L), dtype=torch.float64, device=q.device)
    _probe_merge_kernel[(b * hq, triton.cdiv(L, MERGE_BLOCK_L))](
        mp, zp, out[0], out[-1], out[0], nt, L, mp.stride(1), mp.stride(2),
        WRITE_LSE=lse, BLOCK_T=MERGE_BLOCK_T, BLOCK_L=MERGE_BLOCK_L, num_warps=4)
    return out[0] if lse else (out[0], out[1])


def slash_sums(colu: torch.Tensor, u: int, num_blocks: int, block_size: int) -> torch.Tensor:
    """Block-diagonal scores of one probe query block at cp 1 (every key local, in sequence order).

    Args:
        colu: ``[b, hq, S]`` fp32 per-key probe sums of query block ``u`` (:func:`probe_column_sums`
            with ``nu = 1``; any strides, copied unless the rows are views with a unit last stride).
        u: the probe query block; num_blocks: ``S / block_size``; block_size: ``bs``.

    Returns:
        ``[b, hq, num_blocks]`` fp64: entry ``d`` sums the keys of block ``u - d`` (0 for ``d > u``; keys
        of later blocks are invisible to the probes, their sums exactly 0), each in one fixed order.
    """
    b, hq, sl = colu.shape
    out = torch.empty((b, hq, num_blocks), dtype=torch.float64, device=colu.device)
    if b * hq * num_blocks == 0:
        return out
    rows = colu.reshape(b * hq, sl)                # a view where the strides allow it
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block_k = max(16, triton.next_power_of_2(block_size))
    block_d = max(1, 4096 // block_k)              # a [block_d, block_k] tile per program
    _slash_sums_kernel[(b * hq, triton.cdiv(num_blocks, block_d))](
        rows, out, u, num_blocks, sl, rows.stride(0), BS=block_size, BLOCK_D=block_d, BLOCK_K=block_k, num_warps=4)
    return out


def probe_column_sums(probe_q: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor, seq_len: int,
                      lse: torch.Tensor, softmax_scale: float, block_size: int, bounds=None) -> torch.Tensor:
    """Probe probabilities summed per local key, split by global query block (pass 2).

    Args:
        probe_q, k, k_pos, seq_len, softmax_scale, bounds: as in :func:`probe_softmax_stats`.
        lse: ``[b, hq, L]`` the (global) log-sum-exp of the probe rows (any float dtype; used in
            fp32); ``-inf`` rows contribute zero.
        block_size: the slash block size ``bs``.

    Returns:
        ``colu [b, hq, nu, s_local]`` fp32: ``colu[.., u, j] = sum_r exp(s[r, j] - lse[r])`` over the
        probe rows of global query block ``u0 + u`` (``(u0, nu) = probe_block_range(S, L, bs)``);
        invisible (future) keys get exactly 0.

    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    q, kk, kp, meta, grid = _prep(probe_q, k, k_pos, seq_len)
    b, L, hq, _ = q.shape
    if lse.shape != (b, hq, L):
        raise ValueError(f"lse must be [b, hq, L] = {[b, hq, L]}, got {tuple(lse.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    u0, nu = probe_block_range(seq_len, L, block_size)
    sl = kk.shape[1]
    lse2 = (lse.to(device=q.device, dtype=torch.float64) * LOG2E).float().contiguous()
    lo, hi, span = _bounds(bounds, b, L, q.device)
    # skipped tiles (bounded launches) keep the zeros
    colu = (torch.empty if lo is None else torch.zeros)((b, hq, nu, sl), dtype=torch.float32, device=q.device)
    _probe_colsum_kernel[grid](
        q, kk, kp, kp if lo is None else lo, kp if hi is None else hi, kp if span is None else span, lse2, colu,
        float(softmax_scale) * LOG2E, L, sl, seq_len - L, kk.shape[2], block_size, u0, nu,
        q.stride(0), q.stride(1), q.stride(2),
        kk.stride(0), kk.stride(1), kk.stride(2),
        0 if lo is None else lo.stride(0),
        lse2.stride(0), lse2.stride(1),
        colu.stride(0), colu.stride(1), colu.stride(2),
        HAS_BOUNDS=lo is not None, **meta)
    return colu


def _check_document(probe_q: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    if probe_q.dim() != 3 or k.dim() != 3 or probe_q.shape[2] != k.shape[2]:
        raise ValueError(f"probe_q [P, hq, d] and k [s_local, hkv, d] of one stream expected, got "
                         f"{tuple(probe_q.shape)}, {tuple(k.shape)}")
    _check(probe_q[None], k[None], k_pos, max(1, probe_q.shape[0]))
    if probe_q.numel() >= 2 ** 31 or k.numel() >= 2 ** 31:
        raise ValueError("probe_q or k of 2**31 or more elements is not supported (int32 offsets)")
    if tuple(lo.shape) != (probe_q.shape[0],) or tuple(hi.shape) != (probe_q.shape[0],):
        raise ValueError(f"lo and hi must be [P] = [{probe_q.shape[0]}], got {tuple(lo.shape)}, {tuple(hi.shape)}")


def _document_prep(probe_q, k, k_pos, lo, hi):
    _check_document(probe_q, k, k_pos, lo, hi)
    q = probe_q if probe_q.stride(-1) == 1 else probe_q.contiguous()
    kk = k if k.stride(-1) == 1 else k.contiguous()
    dev = q.device
    i32 = lambda t: t.to(device=dev, dtype=torch.int32).contiguous()  # noqa: E731
    P, hq, d = q.shape
    max_m, block_n = tile_sizes(q.dtype)
    meta = dict(REP=hq // kk.shape[1], D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_M=max_m,
                BLOCK_N=block_n, FP32=q.dtype == torch.float32, num_warps=NUM_WARPS)
    return q, kk, i32(k_pos), i32(lo), i32(hi), meta


def document_probe_stats(probe_q: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor, lo: torch.Tensor,
                         hi: torch.Tensor, key_range: torch.Tensor, softmax_scale: float
                         ) -> "tuple[torch.Tensor, torch.Tensor]":
    """Local softmax statistics of per-document probe rows over this rank's keys (pass 1, one stream).

    Args:
        probe_q: ``[P, hq, d]`` the probe queries (bf16/fp16/fp32, CUDA, or CPU under
            ``TRITON_INTERPRET=1``), rows in stream order.
        k: ``[s_local, hkv, d]`` this rank's keys of the stream, same dtype and device.
        k_pos: ``[s_local]`` ascending integer global positions of the local keys.
        lo, hi: ``[P]`` integer key bounds of the rows: key ``t`` is visible to row ``r`` iff
            ``lo[r] <= t <= hi[r]`` (``hi < lo``: no key).
        key_range: ``[ceil(P / BLOCK_M), 2]`` integer local key index range ``[a, e)`` per block of
            ``BLOCK_M = tile_sizes(dtype)[0]`` rows; it must hold every local key the block's rows see
            (keys outside it are not read).
        softmax_scale: logit scale.

    Returns:
        ``(m, z)``, both ``[hq, P]`` fp64: the row max of the scaled logits over the visible local keys
        (``-inf`` where none) and ``z = sum exp(s - m)`` (0 where none).

    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    q, kk, kp, lo, hi, meta = _document_prep(probe_q, k, k_pos, lo, hi)
    P, hq, _ = q.shape
    nrb = triton.cdiv(P, meta["BLOCK_M"])
    if tuple(key_range.shape) != (nrb, 2):
        raise ValueError(f"key_range must be [ceil(P / {meta['BLOCK_M']}), 2] = [{nrb}, 2], "
                         f"got {tuple(key_range.shape)}")
    kr = key_range.to(device=q.device, dtype=torch.int32).contiguous()
    m = torch.empty((hq, P), dtype=torch.float32, device=q.device)
    z = torch.empty_like(m)
    _doc_stats_kernel[(nrb, hq)](
        q, kk, kp, lo, hi, kr, m, z,
        float(softmax_scale) * LOG2E, P, kk.shape[0],
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), m.stride(0), **meta)
    return m.double(), z.double()


def document_probe_column_sums(probe_q: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor, lo: torch.Tensor,
                               hi: torch.Tensor, lse: torch.Tensor, groups: torch.Tensor, tile_groups: torch.Tensor,
                               slot0: int, nslot: int, softmax_scale: float) -> torch.Tensor:
    """Per-document probe probabilities summed per local key, one sum per visited row group (pass 2).

    Args:
        probe_q, k, k_pos, lo, hi, softmax_scale: as in :func:`document_probe_stats`.
        lse: ``[hq, P]`` the rows' global log-sum-exp (any float dtype; used in fp32; ``-inf`` rows
            contribute zero).
        groups: ``[G, 2]`` integer probe row ranges ``[r0, r1)``, in row order (a group: the rows of
            one document in one global query block).
        tile_groups: ``[ceil(s_local / BLOCK_N), 2]`` integer group range ``[g0, g1)`` of each tile of
            ``BLOCK_N = tile_sizes(dtype)[1]`` local keys: the groups whose rows can see a key of it.
        slot0, nslot: this launch writes the groups ``g0 + slot0 .. g0 + slot0 + nslot - 1`` of every
            tile (those past ``g1`` as zeros), so that a caller bounds the output's memory.

    Returns:
        ``colu [hq, nslot, s_local]`` fp32: ``colu[h, j, t] = sum_r exp(s[r, t] - lse[r])`` over the
        rows of group ``g0(tile(t)) + slot0 + j``; invisible keys give exactly 0.

    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    q, kk, kp, lo, hi, meta = _document_prep(probe_q, k, k_pos, lo, hi)
    P, hq, _ = q.shape
    sl = kk.shape[0]
    nt = triton.cdiv(sl, meta["BLOCK_N"])
    if tuple(lse.shape) != (hq, P):
        raise ValueError(f"lse must be [hq, P] = {[hq, P]}, got {tuple(lse.shape)}")
    if groups.dim() != 2 or groups.shape[1] != 2 or tuple(tile_groups.shape) != (nt, 2):
        raise ValueError(f"groups must be [G, 2] and tile_groups [ceil(s_local / {meta['BLOCK_N']}), 2] = [{nt}, 2], "
                         f"got {tuple(groups.shape)}, {tuple(tile_groups.shape)}")
    if slot0 < 0 or nslot < 1:
        raise ValueError(f"need slot0 >= 0 and nslot >= 1, got {slot0}, {nslot}")
    lse2 = (lse.to(device=q.device, dtype=torch.float64) * LOG2E).float().contiguous()
    grp = groups.to(device=q.device, dtype=torch.int32).contiguous()
    if grp.numel() == 0:
        grp = torch.zeros((1, 2), dtype=torch.int32, device=q.device)
    tg = tile_groups.to(device=q.device, dtype=torch.int32).contiguous()
    colu = torch.empty((hq, nslot, sl), dtype=torch.float32, device=q.device)
    if sl:
        _doc_colsum_kernel[(nt, kk.shape[1])](
            q, kk, kp, lo, hi, lse2, grp, tg, colu,
            float(softmax_scale) * LOG2E, P, sl, int(slot0), int(nslot),
            q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), lse2.stride(0), colu.stride(0), colu.stride(1),
            **meta)
    return colu

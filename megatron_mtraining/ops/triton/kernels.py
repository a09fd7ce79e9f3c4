"""Triton kernels of the vertical-slash sparse attention (forward, backward dQ, dK/dV).

Imported lazily by :mod:`.launch` (never at package import): ``triton.jit`` decides at decoration
time whether a kernel runs compiled or in the CPU interpreter (``TRITON_INTERPRET=1``).

Notation. One program owns a 64-row query tile (forward, dQ) or one 64-key group (dK/dV). With
per-group indices (one index row per KV head, ``share_pattern="kv_group"``) a forward / dQ program
can own the same 64 queries of ``HPP`` query heads of one group, packed head-major as ``HPP * 64``
rows (``_tile_rows``), so each K/V tile it loads serves all of them. With ``PAIR`` a loop step takes two
listed 64-key blocks (forward, dQ: ``_pair_kv``) or two inverted-index entries (dK/dV: ``_dkdv_pair``),
so the matrix products are 128 wide while the pattern stays 64-granular; a missing second block or
entry (odd counts) is masked. With ``TMA`` the single-block loops load a listed block's K/V (forward,
dQ: ``_kv_tile``) and an entry's q/dO (dK/dV) by bulk tensor copies through tensor descriptors.
Scores are kept in base-2 units: ``qk2 = (q·k) * softmax_scale * log2(e)``, so the softmax is
``exp2(qk2 - m2)`` and the natural-log LSE is ``(m2 + log2(l)) * ln(2)``. Accumulation is fp32
whatever the input dtype; matrix products take bf16/fp16 operands (fp32 inputs: ieee fp32).

Masks (``MASK_MODE``):
    0  none (every listed key is visible to every row of the tile);
    1  local causal: key local index <= query local index (``StepIndices.causal``);
    2  positions: key position <= query position, read from ``QPos``/``KPos`` (dense ring steps of
       any layout);
    3  position bounds (packed documents): ``QPos[sq + row] <= key position <= QPos[row]``, i.e.
       ``QPos`` holds ``[hi; lo]`` of every query (``sq = num_q_blocks * BLOCK_M``); a padding query
       has ``lo > hi`` and sees nothing.
Document mask (``DOC``, orthogonal to the mode; the sparse steps of packed documents,
``StepIndices.has_documents``): every masked tile and column chunk is also masked by per-query key
bounds, ``DocLo[b, row] <= KPos[key] <= DocHi[b, row]`` (int32, batch stride ``s_dlb``, 0 when the
bounds are shared by the batch); a padding query has ``lo > hi`` and sees nothing. The caller's
splits count only slots every row of the tile sees whole; the dK/dV kernels mask only the entries
of slots past the split (their inverted index lists those last).
Blocks are visited in two loops: slots ``[0, split)`` need no mask (the caller guarantees it),
slots ``[split, count)`` are masked. Vertical columns are visited the same way (``COL_SPLIT``): whole
64-column chunks among the first ``column_split`` slots (columns every row of the tile sees) run
unmasked, the rest are masked by their validity (slot < count) and, in mode 1, causally. Rows
that see no key end with ``out = 0`` and ``lse = -inf``; the backward treats ``lse = -inf`` as
"probability 0" so such rows give exact zero gradients.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _online_step(qk, m_i, l_i, acc, v, MASKED: tl.constexpr, FP32: tl.constexpr):
    # qk: [M, N] fp32 in log2 units (-inf where masked); v: [N, D]
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32)
    return m_new, l_i, acc


@triton.jit
def _doc_inside(KPos, cols, cvalid, d_lo, d_hi, COLS: tl.constexpr):
    """``[M, N]`` bool: key ``cols[n]`` lies inside the document bounds ``[d_lo[m], d_hi[m]]`` of row
    ``m`` (``COLS``: gathered columns, read where ``cvalid``)."""
    if COLS:
        k_pos = tl.load(KPos + cols, mask=cvalid, other=0)
    else:
        k_pos = tl.load(KPos + cols)
    return (k_pos[None, :] >= d_lo[:, None]) & (k_pos[None, :] <= d_hi[:, None])


@triton.jit
def _pair_cols(idx_ptr, i, end, offs_p, BLOCK_N: tl.constexpr):
    """Key columns of slots ``i`` and ``i + 1`` of a block list, side by side (``2 * BLOCK_N`` lanes
    ``offs_p``), and which lanes are real: slot ``i + 1`` only when ``i + 1 < end``; its lanes then
    repeat slot ``i``'s columns (a valid address) and must be masked by the caller."""
    kb0 = tl.load(idx_ptr + i)
    has1 = i + 1 < end
    kb1 = tl.load(idx_ptr + i + 1, mask=has1, other=0)
    kb1 = tl.where(has1, kb1, kb0)
    second = offs_p >= BLOCK_N
    cols = tl.where(second, kb1, kb0) * BLOCK_N + offs_p % BLOCK_N
    return cols, (offs_p < BLOCK_N) | has1


@triton.jit
def _pair_kv(idx_ptr, i, end, offs_p, offs_d, k_base, v_base, s_ks, s_vs, BLOCK_N: tl.constexpr):
    """K and V rows (``[2 * BLOCK_N, D]``) of slots ``i`` and ``i + 1`` (:func:`_pair_cols`), with their
    columns and which lanes are real."""
    cols, pvalid = _pair_cols(idx_ptr, i, end, offs_p, BLOCK_N)
    k = tl.load(k_base + cols[:, None] * s_ks + offs_d[None, :])
    v = tl.load(v_base + cols[:, None] * s_vs + offs_d[None, :])
    return k, v, cols, pvalid


@triton.jit
def _kv_tile(kb, offs_n, offs_d, k_base, v_base, s_ks, s_vs, KD, VD, bz, g, BLOCK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """K and V rows ``[BLOCK_N, HEAD_DIM]`` of listed key block ``kb`` and their token indices: pointer
    loads, or with ``TMA`` one bulk tensor copy each through the descriptors ``KD``/``VD`` over K/V as
    ``[b, s, hkv, d]`` in ``[1, BLOCK_N, 1, d]`` boxes."""
    cols = kb * BLOCK_N + offs_n
    if TMA:
        k = tl.reshape(KD.load([bz, kb * BLOCK_N, g, 0]), [BLOCK_N, HEAD_DIM])
        v = tl.reshape(VD.load([bz, kb * BLOCK_N, g, 0]), [BLOCK_N, HEAD_DIM])
    else:
        k = tl.load(k_base + cols[:, None] * s_ks + offs_d[None, :])
        v = tl.load(v_base + cols[:, None] * s_vs + offs_d[None, :])
    return k, v, cols


@triton.jit
def _block_valid(cols, offs_m, bz, QPos, KPos, DocLo, DocHi, s_dlb, num_q_blocks,
                 MASK_MODE: tl.constexpr, DOC: tl.constexpr, BLOCK_M: tl.constexpr):
    """``[M, N]`` bool: key columns ``cols`` visible to query rows ``offs_m`` by the mode's mask and,
    with DOC, the document bounds (all true in mode 0 without DOC)."""
    valid = cols[None, :] >= 0
    if MASK_MODE == 1:
        valid = cols[None, :] <= offs_m[:, None]
    if MASK_MODE >= 2:
        k_pos = tl.load(KPos + cols)
        valid = k_pos[None, :] <= tl.load(QPos + offs_m)[:, None]
        if MASK_MODE == 3:
            valid = valid & (k_pos[None, :] >= tl.load(QPos + num_q_blocks * BLOCK_M + offs_m)[:, None])
    if DOC:
        d_lo = tl.load(DocLo + bz * s_dlb + offs_m)
        d_hi = tl.load(DocHi + bz * s_dlb + offs_m)
        valid = valid & _doc_inside(KPos, cols, None, d_lo, d_hi, False)
    return valid


@triton.jit
def _tile_rows(hp, qb, rep, hchunks, idx_rep, HPP: tl.constexpr, TILE_M: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of the tile of head program ``hp`` (forward, dQ): ``HPP`` query heads of KV head ``g``
    (heads ``h0 .. h0 + HPP - 1``, ``h0 = g * rep + c * HPP`` for head chunk ``c`` of ``hchunks``)
    packed head-major as ``TILE_M = HPP * BLOCK_M`` rows (row ``i``: head ``h0 + i // BLOCK_M``, query
    ``qb * BLOCK_M + i % BLOCK_M``). Returns ``(g, ih, hrow, hvalid, offs_m)``: the KV head, the index
    row (``h0 // idx_rep``: the query head, or the group with per-group indices), each row's head,
    whether it is a head of the group (the last chunk may be partial) and each row's query index."""
    g = hp // hchunks
    h0 = g * rep + (hp - g * hchunks) * HPP
    rows = tl.arange(0, TILE_M)
    hrow = h0 + rows // BLOCK_M
    return g, h0 // idx_rep, hrow, hrow < g * rep + rep, qb * BLOCK_M + rows % BLOCK_M


@triton.jit
def _sparse_fwd_kernel(
    Q, K, V, Out, Lse,
    BlockCount, BlockSplit, BlockIndex, ColCount, ColSplit, ColIndex, QPos, KPos, DocLo, DocHi,
    scale_log2,
    s_qb, s_qs, s_qh,
    s_kb, s_ks, s_kh,
    s_vb, s_vs, s_vh,
    s_ob, s_os, s_oh,
    s_lb, s_lh,
    s_bcb, s_bch,
    s_bsb, s_bsh,
    s_bib, s_bih, s_biq,
    s_ccb, s_cch,
    s_csb, s_csh,
    s_cib, s_cih, s_ciq, s_dlb,
    num_hp, num_q_blocks, rep, hchunks, idx_rep,
    MASK_MODE: tl.constexpr, HAS_COLS: tl.constexpr, COL_SPLIT: tl.constexpr, FP32: tl.constexpr,
    DOC: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    HPP: tl.constexpr, TILE_M: tl.constexpr, HEAD_MASK: tl.constexpr, PAIR: tl.constexpr = False,
    TMA: tl.constexpr = False, KD=None, VD=None,
):
    pid = tl.program_id(0)
    bz = tl.program_id(1)
    hp = pid % num_hp
    qb = num_q_blocks - 1 - pid // num_hp             # heaviest (latest) tiles first
    g, ih, hrow, hvalid, offs_m = _tile_rows(hp, qb, rep, hchunks, idx_rep, HPP, TILE_M, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = Q + bz * s_qb + hrow[:, None] * s_qh + offs_m[:, None] * s_qs + offs_d[None, :]
    if HEAD_MASK:
        q = tl.load(q_ptrs, mask=hvalid[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs)
    k_base = K + bz * s_kb + g * s_kh
    v_base = V + bz * s_vb + g * s_vh

    m_i = tl.full([TILE_M], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, HEAD_DIM], tl.float32)

    cnt = tl.load(BlockCount + bz * s_bcb + ih * s_bch + qb)
    if MASK_MODE == 0 and not DOC:
        split = cnt
    else:
        split = tl.load(BlockSplit + bz * s_bsb + ih * s_bsh + qb)
    idx_ptr = BlockIndex + bz * s_bib + ih * s_bih + qb * s_biq
    if MASK_MODE >= 2:
        q_pos = tl.load(QPos + offs_m)
    if MASK_MODE == 3:
        q_lo = tl.load(QPos + num_q_blocks * BLOCK_M + offs_m)
    if DOC:
        d_lo = tl.load(DocLo + bz * s_dlb + offs_m)
        d_hi = tl.load(DocHi + bz * s_dlb + offs_m)

    if PAIR:    # two listed 64-key blocks per step: 128-wide products, the pattern stays 64-granular
        offs_p = tl.arange(0, 2 * BLOCK_N)
        split2 = (split // 2) * 2
        for i in range(0, split2, 2):
            k, v, cols, pvalid = _pair_kv(idx_ptr, i, split2, offs_p, offs_d, k_base, v_base, s_ks, s_vs, BLOCK_N)
            qk = _dot(q, tl.trans(k), FP32) * scale_log2
            m_i, l_i, acc = _online_step(qk, m_i, l_i, acc, v, False, FP32)
        for i in range(split2, cnt, 2):     # the masked slots, and an odd unmasked one (its mask is all true)
            k, v, cols, pvalid = _pair_kv(idx_ptr, i, cnt, offs_p, offs_d, k_base, v_base, s_ks, s_vs, BLOCK_N)
            qk = _dot(q, tl.trans(k), FP32) * scale_log2
            valid = pvalid[None, :] & _block_valid(cols, offs_m, bz, QPos, KPos, DocLo, DocHi, s_dlb, num_q_blocks,
                                                   MASK_MODE, DOC, BLOCK_M)
            qk = tl.where(valid, qk, float("-inf"))
            m_i, l_i, acc = _online_step(qk, m_i, l_i, acc, v, True, FP32)
    else:
        # blocks that need no mask
        for i in range(0, split):
            k, v, cols = _kv_tile(tl.load(idx_ptr + i), offs_n, offs_d, k_base, v_base, s_ks, s_vs, KD, VD, bz, g,
                                  BLOCK_N, HEAD_DIM, TMA)
            qk = _dot(q, tl.trans(k), FP32) * scale_log2
            m_i, l_i, acc = _online_step(qk, m_i, l_i, acc, v, False, FP32)
        # blocks that straddle the causal boundary (or lie past it)
        for i in range(split, cnt):  # empty when MASK_MODE == 0 without DOC (split == cnt)
            k, v, cols = _kv_tile(tl.load(idx_ptr + i), offs_n, offs_d, k_base, v_base, s_ks, s_vs, KD, VD, bz, g,
                                  BLOCK_N, HEAD_DIM, TMA)
            qk = _dot(q, tl.trans(k), FP32) * scale_log2
            if MASK_MODE == 1:
                qk = tl.where(cols[None, :] <= offs_m[:, None], qk, float("-inf"))
            if MASK_MODE == 2:
                k_pos = tl.load(KPos + cols)
                qk = tl.where(k_pos[None, :] <= q_pos[:, None], qk, float("-inf"))
            if MASK_MODE == 3:
                k_pos = tl.load(KPos + cols)
                inside = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= q_lo[:, None])
                qk = tl.where(inside, qk, float("-inf"))
            if DOC:
                qk = tl.where(_doc_inside(KPos, cols, None, d_lo, d_hi, False), qk, float("-inf"))
            m_i, l_i, acc = _online_step(qk, m_i, l_i, acc, v, True, FP32)

    if HAS_COLS:
        ccnt = tl.load(ColCount + bz * s_ccb + ih * s_cch + qb)
        cptr = ColIndex + bz * s_cib + ih * s_cih + qb * s_ciq
        if COL_SPLIT:   # whole chunks of columns visible to every row of the tile: no mask
            nsafe = (tl.load(ColSplit + bz * s_csb + ih * s_csh + qb) // BLOCK_C) * BLOCK_C
        else:
            nsafe = 0
        for j in range(0, nsafe, BLOCK_C):
            cols = tl.load(cptr + j + tl.arange(0, BLOCK_C))
            k = tl.load(k_base + cols[:, None] * s_ks + offs_d[None, :])
            v = tl.load(v_base + cols[:, None] * s_vs + offs_d[None, :])
            qk = _dot(q, tl.trans(k), FP32) * scale_log2
            m_i, l_i, acc = _online_step(qk, m_i, l_i, acc, v, False, FP32)
        for j in range(nsafe, ccnt, BLOCK_C):
            offs_c = j + tl.arange(0, BLOCK_C)
            cvalid = offs_c < ccnt
            cols = tl.load(cptr + offs_c, mask=cvalid, other=0)
            k = tl.load(k_base + cols[:, None] * s_ks + offs_d[None, :], mask=cvalid[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * s_vs + offs_d[None, :], mask=cvalid[:, None], other=0.0)
            qk = _dot(q, tl.trans(k), FP32) * scale_log2
            valid = cvalid[None, :]
            if MASK_MODE == 1:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            if DOC:
                valid = valid & _doc_inside(KPos, cols, cvalid, d_lo, d_hi, True)
            qk = tl.where(valid, qk, float("-inf"))
            m_i, l_i, acc = _online_step(qk, m_i, l_i, acc, v, True, FP32)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_ptrs = Out + bz * s_ob + hrow[:, None] * s_oh + offs_m[:, None] * s_os + offs_d[None, :]
    l_ptrs = Lse + bz * s_lb + hrow * s_lh + offs_m
    if HEAD_MASK:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=hvalid[:, None])
        tl.store(l_ptrs, lse, mask=hvalid)
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
        tl.store(l_ptrs, lse)


@triton.jit
def _load_query_tile(Q, DO, Lse, Delta, offs_m, offs_d, h, bz, s_qb, s_qs, s_qh, s_dob, s_dos, s_doh, s_lb, s_lh,
                     row0=0, QD=None, DOD=None, TMA: tl.constexpr = False):
    """The backward's query-side operands of rows ``offs_m`` of head ``h``: ``q``, ``do``, the LSE in
    base-2 units (``+inf`` for rows that saw no key: probability 0) and ``delta``. With ``TMA``, q and dO
    (rows ``row0 ..``) by bulk tensor copies through the descriptors ``QD``/``DOD`` (see :func:`_kv_tile`)."""
    if TMA:
        q = tl.reshape(QD.load([bz, row0, h, 0]), [offs_m.shape[0], offs_d.shape[0]])
        do = tl.reshape(DOD.load([bz, row0, h, 0]), [offs_m.shape[0], offs_d.shape[0]])
    else:
        q = tl.load(Q + bz * s_qb + h * s_qh + offs_m[:, None] * s_qs + offs_d[None, :])
        do = tl.load(DO + bz * s_dob + h * s_doh + offs_m[:, None] * s_dos + offs_d[None, :])
    lse = tl.load(Lse + bz * s_lb + h * s_lh + offs_m)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(Delta + bz * s_lb + h * s_lh + offs_m)
    return q, do, lse2, delta


@triton.jit
def _load_query_rows(Q, DO, Lse, Delta, offs_m, offs_d, hrow, hvalid, bz, s_qb, s_qs, s_qh, s_dob, s_dos, s_doh,
                     s_lb, s_lh, HEAD_MASK: tl.constexpr):
    """:func:`_load_query_tile` for a packed tile: row ``i`` of head ``hrow[i]``; rows with
    ``hvalid`` false (``HEAD_MASK``) read zeros and an LSE of ``+inf`` (probability 0)."""
    q_ptrs = Q + bz * s_qb + hrow[:, None] * s_qh + offs_m[:, None] * s_qs + offs_d[None, :]
    do_ptrs = DO + bz * s_dob + hrow[:, None] * s_doh + offs_m[:, None] * s_dos + offs_d[None, :]
    l_off = bz * s_lb + hrow * s_lh + offs_m
    if HEAD_MASK:
        q = tl.load(q_ptrs, mask=hvalid[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=hvalid[:, None], other=0.0)
        lse = tl.load(Lse + l_off, mask=hvalid, other=float("-inf"))
        delta = tl.load(Delta + l_off, mask=hvalid, other=0.0)
    else:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse = tl.load(Lse + l_off)
        delta = tl.load(Delta + l_off)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    return q, do, lse2, delta


@triton.jit
def _bwd_tile_dq(q, do, lse2, delta, k, v, scale_log2, valid, MASKED: tl.constexpr, FP32: tl.constexpr):
    # returns p [M, N] (fp32) and ds [M, N] (fp32) of one tile; valid: [M, N] bool (MASKED only)
    qk = _dot(q, tl.trans(k), FP32) * scale_log2
    p = tl.math.exp2(qk - lse2[:, None])
    if MASKED:
        p = tl.where(valid, p, 0.0)
    dp = _dot(do, tl.trans(v), FP32)
    ds = p * (dp - delta[:, None])
    return p, ds


@triton.jit
def _sparse_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, DK, DV,
    BlockCount, BlockSplit, BlockIndex, ColCount, ColSplit, ColIndex, QPos, KPos, DocLo, DocHi,
    scale_log2, sm_scale,
    s_qb, s_qs, s_qh,
    s_kb, s_ks, s_kh,
    s_vb, s_vs, s_vh,
    s_dob, s_dos, s_doh,
    s_dqb, s_dqs, s_dqh,
    s_dkb, s_dks, s_dkh,
    s_lb, s_lh,
    s_bcb, s_bch,
    s_bsb, s_bsh,
    s_bib, s_bih, s_biq,
    s_ccb, s_cch,
    s_csb, s_csh,
    s_cib, s_cih, s_ciq, s_dlb,
    num_hp, num_q_blocks, rep, hchunks, idx_rep,
    MASK_MODE: tl.constexpr, DO_BLOCKS: tl.constexpr, HAS_COLS: tl.constexpr, COL_SPLIT: tl.constexpr,
    COL_ATOMIC: tl.constexpr,
    ACCUM_DQ: tl.constexpr, FP32: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    HPP: tl.constexpr, TILE_M: tl.constexpr, HEAD_MASK: tl.constexpr, DOC: tl.constexpr,
    PAIR: tl.constexpr = False, TMA: tl.constexpr = False, KD=None, VD=None,
):
    """dQ of one query tile (row-parallel, no atomics on dQ). With COL_ATOMIC the vertical
    columns' dK/dV are also added here with fp32 atomics (fast, non-deterministic mode)."""
    pid = tl.program_id(0)
    bz = tl.program_id(1)
    hp = pid % num_hp
    qb = num_q_blocks - 1 - pid // num_hp
    g, ih, hrow, hvalid, offs_m = _tile_rows(hp, qb, rep, hchunks, idx_rep, HPP, TILE_M, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)

    q, do, lse2, delta = _load_query_rows(Q, DO, Lse, Delta, offs_m, offs_d, hrow, hvalid, bz,
                                          s_qb, s_qs, s_qh, s_dob, s_dos, s_doh, s_lb, s_lh, HEAD_MASK)
    k_base = K + bz * s_kb + g * s_kh
    v_base = V + bz * s_vb + g * s_vh
    dq = tl.zeros([TILE_M, HEAD_DIM], tl.float32)
    if DOC:
        d_lo = tl.load(DocLo + bz * s_dlb + offs_m)
        d_hi = tl.load(DocHi + bz * s_dlb + offs_m)

    if DO_BLOCKS:
        cnt = tl.load(BlockCount + bz * s_bcb + ih * s_bch + qb)
        if MASK_MODE == 0 and not DOC:
            split = cnt
        else:
            split = tl.load(BlockSplit + bz * s_bsb + ih * s_bsh + qb)
        idx_ptr = BlockIndex + bz * s_bib + ih * s_bih + qb * s_biq
        if MASK_MODE >= 2:
            q_pos = tl.load(QPos + offs_m)
        if MASK_MODE == 3:
            q_lo = tl.load(QPos + num_q_blocks * BLOCK_M + offs_m)
        if PAIR:    # two listed 64-key blocks per step (see the forward)
            offs_p = tl.arange(0, 2 * BLOCK_N)
            split2 = (split // 2) * 2
            for i in range(0, split2, 2):
                k, v, cols, pvalid = _pair_kv(idx_ptr, i, split2, offs_p, offs_d, k_base, v_base, s_ks, s_vs, BLOCK_N)
                p, ds = _bwd_tile_dq(q, do, lse2, delta, k, v, scale_log2, None, False, FP32)
                dq += _dot(ds.to(k.dtype), k, FP32)
            for i in range(split2, cnt, 2):
                k, v, cols, pvalid = _pair_kv(idx_ptr, i, cnt, offs_p, offs_d, k_base, v_base, s_ks, s_vs, BLOCK_N)
                valid = pvalid[None, :] & _block_valid(cols, offs_m, bz, QPos, KPos, DocLo, DocHi, s_dlb, num_q_blocks,
                                                   MASK_MODE, DOC, BLOCK_M)
                p, ds = _bwd_tile_dq(q, do, lse2, delta, k, v, scale_log2, valid, True, FP32)
                dq += _dot(ds.to(k.dtype), k, FP32)
        else:
            for i in range(0, split):
                k, v, cols = _kv_tile(tl.load(idx_ptr + i), offs_n, offs_d, k_base, v_base, s_ks, s_vs, KD, VD, bz,
                                      g, BLOCK_N, HEAD_DIM, TMA)
                p, ds = _bwd_tile_dq(q, do, lse2, delta, k, v, scale_log2, None, False, FP32)
                dq += _dot(ds.to(k.dtype), k, FP32)
            if MASK_MODE != 0 or DOC:
                for i in range(split, cnt):
                    k, v, cols = _kv_tile(tl.load(idx_ptr + i), offs_n, offs_d, k_base, v_base, s_ks, s_vs, KD, VD,
                                          bz, g, BLOCK_N, HEAD_DIM, TMA)
                    if MASK_MODE == 0:
                        valid = _doc_inside(KPos, cols, None, d_lo, d_hi, False)
                    else:
                        if MASK_MODE == 1:
                            valid = cols[None, :] <= offs_m[:, None]
                        else:
                            k_pos = tl.load(KPos + cols)
                            valid = k_pos[None, :] <= q_pos[:, None]
                            if MASK_MODE == 3:
                                valid = valid & (k_pos[None, :] >= q_lo[:, None])
                        if DOC:
                            valid = valid & _doc_inside(KPos, cols, None, d_lo, d_hi, False)
                    p, ds = _bwd_tile_dq(q, do, lse2, delta, k, v, scale_log2, valid, True, FP32)
                    dq += _dot(ds.to(k.dtype), k, FP32)

    if HAS_COLS:
        ccnt = tl.load(ColCount + bz * s_ccb + ih * s_cch + qb)
        cptr = ColIndex + bz * s_cib + ih * s_cih + qb * s_ciq
        nsafe = 0
        if COL_SPLIT and not COL_ATOMIC:   # whole chunks visible to every row: no mask
            nsafe = (tl.load(ColSplit + bz * s_csb + ih * s_csh + qb) // BLOCK_C) * BLOCK_C
            for j in range(0, nsafe, BLOCK_C):
                cols = tl.load(cptr + j + tl.arange(0, BLOCK_C))
                k = tl.load(k_base + cols[:, None] * s_ks + offs_d[None, :])
                v = tl.load(v_base + cols[:, None] * s_vs + offs_d[None, :])
                p, ds = _bwd_tile_dq(q, do, lse2, delta, k, v, scale_log2, None, False, FP32)
                dq += _dot(ds.to(k.dtype), k, FP32)
        for j in range(nsafe, ccnt, BLOCK_C):
            offs_c = j + tl.arange(0, BLOCK_C)
            cvalid = offs_c < ccnt
            cols = tl.load(cptr + offs_c, mask=cvalid, other=0)
            k = tl.load(k_base + cols[:, None] * s_ks + offs_d[None, :], mask=cvalid[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * s_vs + offs_d[None, :], mask=cvalid[:, None], other=0.0)
            valid = cvalid[None, :]
            if MASK_MODE == 1:
                valid = valid & (cols[None, :] <= offs_m[:, None])
            if DOC:
                valid = valid & _doc_inside(KPos, cols, cvalid, d_lo, d_hi, True)
            p, ds = _bwd_tile_dq(q, do, lse2, delta, k, v, scale_log2, valid, True, FP32)
            dq += _dot(ds.to(k.dtype), k, FP32)
            if COL_ATOMIC:
                dv_c = _dot(tl.trans(p.to(do.dtype)), do, FP32)
                dk_c = _dot(tl.trans(ds.to(q.dtype)), q, FP32) * sm_scale
                dst = bz * s_dkb + g * s_dkh + cols[:, None] * s_dks + offs_d[None, :]
                tl.atomic_add(DV + dst, dv_c, mask=cvalid[:, None], sem="relaxed")
                tl.atomic_add(DK + dst, dk_c, mask=cvalid[:, None], sem="relaxed")

    dq = dq * sm_scale
    dq_ptrs = DQ + bz * s_dqb + hrow[:, None] * s_dqh + offs_m[:, None] * s_dqs + offs_d[None, :]
    if HEAD_MASK:
        if ACCUM_DQ:
            dq += tl.load(dq_ptrs, mask=hvalid[:, None], other=0.0)
        tl.store(dq_ptrs, dq, mask=hvalid[:, None])
    else:
        if ACCUM_DQ:
            dq += tl.load(dq_ptrs)
        tl.store(dq_ptrs, dq)


@triton.jit
def _bwd_tile_dkdv(k, v, q, do, lse2, delta, scale_log2, valid, MASKED: tl.constexpr, FP32: tl.constexpr):
    # transposed tile [N keys, M rows]: returns pT, dsT (fp32)
    qkT = _dot(k, tl.trans(q), FP32) * scale_log2
    pT = tl.math.exp2(qkT - lse2[None, :])
    if MASKED:
        pT = tl.where(valid, pT, 0.0)
    dpT = _dot(v, tl.trans(do), FP32)
    dsT = pT * (dpT - delta[None, :])
    return pT, dsT


@triton.jit
def _dkdv_update(dk, dv, k, v, q, do, lse2, delta, scale_log2, valid, MASKED: tl.constexpr, FP32: tl.constexpr):
    """One query tile's share of ``dk``, ``dv`` for a key block (``valid``: its mask when ``MASKED``).
    Returns ``(dk, dv, dsT)``; ``dsT`` [keys, rows] fp32 for the tile's dQ."""
    pT, dsT = _bwd_tile_dkdv(k, v, q, do, lse2, delta, scale_log2, valid, MASKED, FP32)
    dv += _dot(pT.to(do.dtype), do, FP32)
    dk += _dot(dsT.to(q.dtype), q, FP32)
    return dk, dv, dsT


@triton.jit
def _dkdv_entry(e, dk, dv, k, v, k_pos, offs_n, offs_d, offs_r, g, bz, Q, DO, Lse, Delta, DQ, KvEntries, QPos,
                DocLo, DocHi, scale_log2, sm_scale, s_qb, s_qs, s_qh, s_dob, s_dos, s_doh, s_dqb, s_dqs, s_dqh,
                s_lb, s_lh, s_dlb, num_q_blocks, rep,
                MASKED: tl.constexpr, MASK_MODE: tl.constexpr, DQ_ATOMIC: tl.constexpr, FP32: tl.constexpr,
                DOC: tl.constexpr, BLOCK_M: tl.constexpr, DQ_TMA: tl.constexpr = False, TMA: tl.constexpr = False,
                QD=None, DOD=None):
    """One entry ``e`` of the inverted index (a query tile of one head that lists this key block):
    adds its share to ``dk``, ``dv`` (and with DQ_ATOMIC its dQ to DQ); ``MASKED``: by the mode's
    mask and, with DOC, the document bounds; ``TMA``: q and dO by bulk tensor copies through the
    descriptors ``QD``/``DOD`` (see :func:`_kv_tile`). Returns ``(dk, dv)``."""
    ent = tl.load(KvEntries + e)
    r = ent // num_q_blocks
    qb = ent - r * num_q_blocks
    h = g * rep + r
    offs_m = qb * BLOCK_M + offs_r
    q, do, lse2, delta = _load_query_tile(Q, DO, Lse, Delta, offs_m, offs_d, h, bz,
                                          s_qb, s_qs, s_qh, s_dob, s_dos, s_doh, s_lb, s_lh, qb * BLOCK_M, QD, DOD, TMA)
    if MASKED:
        if DOC:
            d_lo = tl.load(DocLo + bz * s_dlb + offs_m)
            d_hi = tl.load(DocHi + bz * s_dlb + offs_m)
            inside = (k_pos[:, None] >= d_lo[None, :]) & (k_pos[:, None] <= d_hi[None, :])
        if MASK_MODE == 0:
            valid = inside
        else:
            if MASK_MODE == 1:
                valid = offs_n[:, None] <= offs_m[None, :]
            else:
                q_pos = tl.load(QPos + offs_m)
                valid = k_pos[:, None] <= q_pos[None, :]
                if MASK_MODE == 3:
                    q_lo = tl.load(QPos + num_q_blocks * BLOCK_M + offs_m)
                    valid = valid & (k_pos[:, None] >= q_lo[None, :])
            if DOC:
                valid = valid & inside
    else:
        valid = None
    dk, dv, dsT = _dkdv_update(dk, dv, k, v, q, do, lse2, delta, scale_log2, valid, MASKED, FP32)
    if DQ_ATOMIC:
        dq_part = _dot(tl.trans(dsT.to(k.dtype)), k, FP32) * sm_scale
        if DQ_TMA:     # DQ: a descriptor over dQ as [b * sq, hq * d] (one bulk reduction per tile)
            DQ.atomic_add([(bz * num_q_blocks + qb) * BLOCK_M, h * offs_d.shape[0]], dq_part)
        else:
            tl.atomic_add(DQ + bz * s_dqb + h * s_dqh + offs_m[:, None] * s_dqs + offs_d[None, :], dq_part,
                          sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_pair(e, end, dk, dv, k, v, k_pos, offs_n, offs_d, offs_p, g, bz, Q, DO, Lse, Delta, DQ, KvEntries, QPos,
               DocLo, DocHi, scale_log2, sm_scale, s_qb, s_qs, s_qh, s_dob, s_dos, s_doh, s_dqb, s_dqs, s_dqh,
               s_lb, s_lh, s_dlb, num_q_blocks, rep,
               MASKED: tl.constexpr, MASK_MODE: tl.constexpr, DQ_ATOMIC: tl.constexpr, FP32: tl.constexpr,
               DOC: tl.constexpr, BLOCK_M: tl.constexpr, DQ_TMA: tl.constexpr = False):
    """:func:`_dkdv_entry` for entries ``e`` and ``e + 1`` at once (``2 * BLOCK_M`` query rows, 128-wide
    products); entry ``e + 1`` only when ``e + 1 < end``, else its rows repeat entry ``e``'s with
    probability 0. ``MASKED``: by the mode's mask and the document bounds (mode 0 without DOC: only the
    missing second entry)."""
    has1 = e + 1 < end
    ent0 = tl.load(KvEntries + e)
    ent1 = tl.load(KvEntries + e + 1, mask=has1, other=0)
    ent1 = tl.where(has1, ent1, ent0)
    second = offs_p >= BLOCK_M
    ent = tl.where(second, ent1, ent0)
    r = ent // num_q_blocks
    qb = ent - r * num_q_blocks
    h = g * rep + r
    offs_m = qb * BLOCK_M + offs_p % BLOCK_M
    q_ptrs = Q + bz * s_qb + h[:, None] * s_qh + offs_m[:, None] * s_qs + offs_d[None, :]
    do_ptrs = DO + bz * s_dob + h[:, None] * s_doh + offs_m[:, None] * s_dos + offs_d[None, :]
    q = tl.load(q_ptrs)
    do = tl.load(do_ptrs)
    l_off = bz * s_lb + h * s_lh + offs_m
    lse = tl.load(Lse + l_off)
    delta = tl.load(Delta + l_off)
    rvalid = (offs_p < BLOCK_M) | (e + 1 + 0 * offs_p < end)      # a block mask (atomics need one)
    lse2 = tl.where((lse == float("-inf")) | (~rvalid), float("inf"), lse * 1.4426950408889634)
    if MASKED:
        valid = rvalid[None, :]
        if MASK_MODE == 1:
            valid = valid & (offs_n[:, None] <= offs_m[None, :])
        if MASK_MODE >= 2:
            q_pos = tl.load(QPos + offs_m)
            valid = valid & (k_pos[:, None] <= q_pos[None, :])
            if MASK_MODE == 3:
                q_lo = tl.load(QPos + num_q_blocks * BLOCK_M + offs_m)
                valid = valid & (k_pos[:, None] >= q_lo[None, :])
        if DOC:
            d_lo = tl.load(DocLo + bz * s_dlb + offs_m)
            d_hi = tl.load(DocHi + bz * s_dlb + offs_m)
            valid = valid & (k_pos[:, None] >= d_lo[None, :]) & (k_pos[:, None] <= d_hi[None, :])
    else:
        valid = None
    dk, dv, dsT = _dkdv_update(dk, dv, k, v, q, do, lse2, delta, scale_log2, valid, MASKED, FP32)
    if DQ_ATOMIC:
        dq_part = _dot(tl.trans(dsT.to(k.dtype)), k, FP32) * sm_scale
        if DQ_TMA:     # one bulk reduction per entry (see _dkdv_entry)
            dq0, dq1 = tl.split(tl.permute(tl.reshape(dq_part, [2, BLOCK_M, offs_d.shape[0]]), [1, 2, 0]))
            r0 = ent0 // num_q_blocks
            DQ.atomic_add([(bz * num_q_blocks + ent0 - r0 * num_q_blocks) * BLOCK_M, (g * rep + r0) * offs_d.shape[0]],
                          dq0)
            if has1:
                r1 = ent1 // num_q_blocks
                DQ.atomic_add([(bz * num_q_blocks + ent1 - r1 * num_q_blocks) * BLOCK_M,
                               (g * rep + r1) * offs_d.shape[0]], dq1)
        else:
            tl.atomic_add(DQ + bz * s_dqb + h[:, None] * s_dqh + offs_m[:, None] * s_dqs + offs_d[None, :], dq_part,
                          mask=rvalid[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _sparse_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DQ, DK, DV,
    KvOffsets, KvMids, KvEntries, QPos, KPos, DocLo, DocHi,
    scale_log2, sm_scale,
    s_qb, s_qs, s_qh,
    s_kb, s_ks, s_kh,
    s_vb, s_vs, s_vh,
    s_dob, s_dos, s_doh,
    s_dqb, s_dqs, s_dqh,
    s_dkb, s_dks, s_dkh,
    s_lb, s_lh,
    s_ofb, s_ofg, s_dlb,
    num_kv_heads, num_q_blocks, rep,
    MASK_MODE: tl.constexpr, DQ_ATOMIC: tl.constexpr, FP32: tl.constexpr, DOC: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIR: tl.constexpr = False,
    DQ_TMA: tl.constexpr = False, TMA: tl.constexpr = False, QD=None, DOD=None,
):
    """dK, dV of one 64-key block for one KV head (column-parallel, inverted block index).

    Visits, in the fixed order of ``KvEntries``, every (query head of the group, query tile) that
    lists this key block, so the sum over GQA heads happens in registers: no atomics, bitwise
    deterministic. The entries ``[offset, mid)`` are slots their tiles run unmasked (``slot <
    split``), ``[mid, end)`` the masked ones. Overwrites DK/DV rows of the block (blocks with no entry
    get zeros). With DQ_ATOMIC the tile's dQ is also added to DQ with fp32 atomics (fast mode); with
    DQ_TMA, ``DQ`` is a tensor descriptor over dQ viewed as ``[b * sq, hq * d]`` with ``[BLOCK_M, d]``
    blocks, and each tile's dQ is one bulk reduction (TMA on Hopper) instead of one atomic per element."""
    pid = tl.program_id(0)
    bz = tl.program_id(1)
    g = pid % num_kv_heads
    kb = pid // num_kv_heads
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, BLOCK_M)

    k = tl.load(K + bz * s_kb + g * s_kh + offs_n[:, None] * s_ks + offs_d[None, :])
    v = tl.load(V + bz * s_vb + g * s_vh + offs_n[:, None] * s_vs + offs_d[None, :])
    if MASK_MODE >= 2 or DOC:
        k_pos = tl.load(KPos + offs_n)
    else:
        k_pos = offs_n                   # unused
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    off_ptr = KvOffsets + bz * s_ofb + g * s_ofg + kb
    start = tl.load(off_ptr)
    end = tl.load(off_ptr + 1)
    if MASK_MODE == 0 and not DOC:
        mid = end
    else:
        # int64 loop bounds below: the unpaired loops then run about 10-18 % faster on an H100 than with
        # int32 ones (same results)
        mid = tl.load(KvMids + bz * s_ofb + g * s_ofg + kb).to(tl.int64)
    if PAIR:      # two entries per step: 128 query rows, 128-wide products
        offs_p = tl.arange(0, 2 * BLOCK_M)
        mid2 = start + ((mid - start) // 2) * 2
        for e in range(start, mid2, 2):
            dk, dv = _dkdv_pair(e, mid2, dk, dv, k, v, k_pos, offs_n, offs_d, offs_p, g, bz, Q, DO, Lse, Delta, DQ,
                                KvEntries, QPos, DocLo, DocHi, scale_log2, sm_scale, s_qb, s_qs, s_qh, s_dob, s_dos,
                                s_doh, s_dqb, s_dqs, s_dqh, s_lb, s_lh, s_dlb, num_q_blocks, rep,
                                False, MASK_MODE, DQ_ATOMIC, FP32, DOC, BLOCK_M, DQ_TMA)
        for e in range(mid2, end, 2):    # the masked entries, and an odd unmasked one (its mask is all true)
            dk, dv = _dkdv_pair(e, end, dk, dv, k, v, k_pos, offs_n, offs_d, offs_p, g, bz, Q, DO, Lse, Delta, DQ,
                                KvEntries, QPos, DocLo, DocHi, scale_log2, sm_scale, s_qb, s_qs, s_qh, s_dob, s_dos,
                                s_doh, s_dqb, s_dqs, s_dqh, s_lb, s_lh, s_dlb, num_q_blocks, rep,
                                True, MASK_MODE, DQ_ATOMIC, FP32, DOC, BLOCK_M, DQ_TMA)
    else:
        for e in range(start, mid):          # tiles that see the whole block: no mask
            dk, dv = _dkdv_entry(e, dk, dv, k, v, k_pos, offs_n, offs_d, offs_r, g, bz, Q, DO, Lse, Delta, DQ,
                                 KvEntries, QPos, DocLo, DocHi, scale_log2, sm_scale, s_qb, s_qs, s_qh, s_dob, s_dos,
                                 s_doh, s_dqb, s_dqs, s_dqh, s_lb, s_lh, s_dlb, num_q_blocks, rep,
                                 False, MASK_MODE, DQ_ATOMIC, FP32, DOC, BLOCK_M, DQ_TMA, TMA, QD, DOD)
        if MASK_MODE != 0 or DOC:
            for e in range(mid, end):
                dk, dv = _dkdv_entry(e, dk, dv, k, v, k_pos, offs_n, offs_d, offs_r, g, bz, Q, DO, Lse, Delta, DQ,
                                     KvEntries, QPos, DocLo, DocHi, scale_log2, sm_scale, s_qb, s_qs, s_qh, s_dob,
                                     s_dos, s_doh, s_dqb, s_dqs, s_dqh, s_lb, s_lh, s_dlb, num_q_blocks, rep,
                                     True, MASK_MODE, DQ_ATOMIC, FP32, DOC, BLOCK_M, DQ_TMA, TMA, QD, DOD)

    dst = bz * s_dkb + g * s_dkh + offs_n[:, None] * s_dks + offs_d[None, :]
    tl.store(DK + dst, dk * sm_scale)
    tl.store(DV + dst, dv)


@triton.jit
def _col_tile_dkdv(k, v, dk, dv, Q, DO, Lse, Delta, qb, h, bz, cols, member, scale_log2,
                   s_qb, s_qs, s_qh, s_dob, s_dos, s_doh, s_lb, s_lh, k_pos, DocLo, DocHi, s_dlb,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, FP32: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, DOC: tl.constexpr):
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q, do, lse2, delta = _load_query_tile(Q, DO, Lse, Delta, offs_m, offs_d, h, bz,
                                          s_qb, s_qs, s_qh, s_dob, s_dos, s_doh, s_lb, s_lh)
    if MASKED or DOC:
        if DOC:      # the document bounds mask every entry, those listing all 64 columns too
            d_lo = tl.load(DocLo + bz * s_dlb + offs_m)
            d_hi = tl.load(DocHi + bz * s_dlb + offs_m)
            inside = (k_pos[:, None] >= d_lo[None, :]) & (k_pos[:, None] <= d_hi[None, :])
        if MASKED:
            valid = member[:, None]
            if CAUSAL:
                valid = valid & (cols[:, None] <= offs_m[None, :])
            if DOC:
                valid = valid & inside
        else:
            valid = inside
        dk, dv, _ = _dkdv_update(dk, dv, k, v, q, do, lse2, delta, scale_log2, valid, True, FP32)
    else:
        dk, dv, _ = _dkdv_update(dk, dv, k, v, q, do, lse2, delta, scale_log2, None, False, FP32)
    return dk, dv


@triton.jit
def _sparse_bwd_col_kernel(
    Q, K, V, DO, Lse, Delta, DKP, DVP,
    ColU, ColUCount, ColOffsets, ColMid, ColEntries, ColBits, KPos, DocLo, DocHi,
    scale_log2, sm_scale,
    s_qb, s_qs, s_qh,
    s_kb, s_ks, s_kh,
    s_vb, s_vs, s_vh,
    s_dob, s_dos, s_doh,
    s_lb, s_lh,
    s_pp, s_pb, s_ph, s_pu,
    s_ub, s_uh,
    s_ucb, s_uch,
    s_ofb, s_ofh, s_dlb,
    num_heads, num_chunks, num_splits, rep, heads_per_row,
    CAUSAL: tl.constexpr, FP32: tl.constexpr, DOC: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Deterministic dK/dV of the vertical columns.

    Program (chunk c of the union U of index row ih's columns, query-tile split sp; an index row is
    a query head, or with per-group indices a GQA group whose ``heads_per_row`` query heads are
    visited one after another, their dK/dV summed in registers): gathers the
    64 keys U[c*64:(c+1)*64] and visits the query tiles of split sp that list at least one of them
    (``ColEntries``), accumulating dK/dV in registers. Entries ``[start, mid)`` list all 64 columns
    (causal steps: all left of the tile's first row): no mask; entries ``[mid, end)`` are masked by ``ColBits`` (which
    of the 64 columns the tile lists) and, causally, by position; each range in ascending tile order.
    Programs are ordered chunk-fastest, so the programs running together read the same query tiles
    (Q, dO) of one (head, split) from L2. Writes one partial per split, DKP[sp, b, h, u, :]; the caller
    sums the splits and scatters to key rows in a fixed order."""
    pid = tl.program_id(0)
    bz = tl.program_id(1)
    c = pid % num_chunks
    hs = pid // num_chunks
    sp = hs % num_splits
    ih = hs // num_splits                 # index row: a query head, or a GQA group (per-group indices)
    g = (ih * heads_per_row) // rep
    ucount = tl.load(ColUCount + bz * s_ucb + ih * s_uch)
    offs_u = c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, HEAD_DIM)
    uvalid = offs_u < ucount
    cols = tl.load(ColU + bz * s_ub + ih * s_uh + offs_u, mask=uvalid, other=0)
    k = tl.load(K + bz * s_kb + g * s_kh + cols[:, None] * s_ks + offs_d[None, :], mask=uvalid[:, None], other=0.0)
    v = tl.load(V + bz * s_vb + g * s_vh + cols[:, None] * s_vs + offs_d[None, :], mask=uvalid[:, None], other=0.0)
    dk = tl.zeros([BLOCK_C, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_C, HEAD_DIM], tl.float32)
    lanes = tl.arange(0, BLOCK_C).to(tl.int64)
    if DOC:
        k_pos = tl.load(KPos + cols, mask=uvalid, other=0)
    else:
        k_pos = cols

    seg = bz * s_ofb + ih * s_ofh + c * num_splits + sp
    start = tl.load(ColOffsets + seg)
    mid = tl.load(ColMid + seg)
    end = tl.load(ColOffsets + seg + 1)
    for r in range(0, heads_per_row):     # the query heads reading this index row (1 per head, rep per group)
        h = ih * heads_per_row + r
        for e in range(start, mid):
            qb = tl.load(ColEntries + e)
            dk, dv = _col_tile_dkdv(k, v, dk, dv, Q, DO, Lse, Delta, qb, h, bz, cols, None, scale_log2,
                                    s_qb, s_qs, s_qh, s_dob, s_dos, s_doh, s_lb, s_lh, k_pos, DocLo, DocHi,
                                    s_dlb, False, CAUSAL, FP32, HEAD_DIM, BLOCK_M, DOC)
        for e in range(mid, end):
            qb = tl.load(ColEntries + e)
            bits = tl.load(ColBits + e)
            member = ((bits >> lanes) & 1) != 0
            dk, dv = _col_tile_dkdv(k, v, dk, dv, Q, DO, Lse, Delta, qb, h, bz, cols, member, scale_log2,
                                    s_qb, s_qs, s_qh, s_dob, s_dos, s_doh, s_lb, s_lh, k_pos, DocLo, DocHi,
                                    s_dlb, True, CAUSAL, FP32, HEAD_DIM, BLOCK_M, DOC)

    dst = sp * s_pp + bz * s_pb + ih * s_ph + offs_u[:, None] * s_pu + offs_d[None, :]
    tl.store(DKP + dst, dk * sm_scale)
    tl.store(DVP + dst, dv)


@triton.jit
def _col_scatter_kernel(
    DK, DV, DKP, DVP, ColU, ColUCount, r,
    s_dkb, s_dks, s_dkh,
    s_pp, s_pb, s_ph, s_pu,
    s_ub, s_uh, s_ucb, s_uch,
    num_splits, rep,
    HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """dK/dV rows of the vertical columns of index row ``g * rep + r`` (``rep``: index rows per KV
    head; a query head, or the group itself with per-group indices): sums the per-split partials
    in ascending split order and adds them to the key rows (launched once per ``r``, so every key
    row receives at most one update per launch: deterministic, no atomics)."""
    c = tl.program_id(0)
    g = tl.program_id(1)
    bz = tl.program_id(2)
    h = g * rep + r
    offs_u = c * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, HEAD_DIM)
    uvalid = offs_u < tl.load(ColUCount + bz * s_ucb + h * s_uch)
    cols = tl.load(ColU + bz * s_ub + h * s_uh + offs_u, mask=uvalid, other=0)
    src = bz * s_pb + h * s_ph + offs_u[:, None] * s_pu + offs_d[None, :]
    acc_k = tl.zeros([BLOCK_C, HEAD_DIM], tl.float32)
    acc_v = tl.zeros([BLOCK_C, HEAD_DIM], tl.float32)
    for sp in range(0, num_splits):
        acc_k += tl.load(DKP + sp * s_pp + src, mask=uvalid[:, None], other=0.0)
        acc_v += tl.load(DVP + sp * s_pp + src, mask=uvalid[:, None], other=0.0)
    dst = bz * s_dkb + g * s_dkh + cols[:, None] * s_dks + offs_d[None, :]
    m = uvalid[:, None]
    tl.store(DK + dst, tl.load(DK + dst, mask=m, other=0.0) + acc_k, mask=m)
    tl.store(DV + dst, tl.load(DV + dst, mask=m, other=0.0) + acc_v, mask=m)


@triton.jit
def _delta_kernel(DO, O, Delta, s_db, s_ds, s_dh, s_ob, s_os, s_oh, s_lb, s_lh, seqlen, num_heads,
                  HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """``delta[b, h, s] = sum_d dout[b, s, h, d] * out[b, s, h, d]`` in fp32 (FlashAttention-2's
    backward preprocessing, Dao 2023, Algorithm 2 line 4), read in the inputs' own dtype."""
    ps = tl.program_id(0)
    bh = tl.program_id(1)
    bz = bh // num_heads
    h = bh % num_heads
    offs_s = ps * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    m = offs_s < seqlen
    do = tl.load(DO + bz * s_db + h * s_dh + offs_s[:, None] * s_ds + offs_d[None, :], mask=m[:, None], other=0.0)
    o = tl.load(O + bz * s_ob + h * s_oh + offs_s[:, None] * s_os + offs_d[None, :], mask=m[:, None], other=0.0)
    tl.store(Delta + bz * s_lb + h * s_lh + offs_s, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1), mask=m)


@triton.jit
def _merge_kernel(O1, L1, O2, L2, Out, Lse,
                  s_1b, s_1s, s_1h, s_l1b, s_l1h, s_l1s,
                  s_2b, s_2s, s_2h, s_l2b, s_l2h, s_l2s,
                  s_ob, s_os, s_oh, s_lb, s_lh,
                  seqlen, num_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """LSE merge of two partial attention results (``ops.merge.merge_attention``'s formula, in one pass):
    ``m = max(l1, l2)`` (0 where both are ``-inf``), ``w_i = exp(l_i - m)``, ``lse = m + log(w1 + w2)``,
    ``out = (o1 w1 + o2 w2) / (w1 + w2)`` (the divisor 1 where it is 0: two empty rows give out 0, lse
    ``-inf``). ``O1``/``O2`` ``[b, s, h, d]`` read in their own dtype (unit stride in d), the LSEs
    ``[b, h, s]`` in fp32 with any strides; ``Out`` and ``Lse`` fp32. One program: ``BLOCK_S`` rows of one
    (batch, head)."""
    ps = tl.program_id(0)
    bh = tl.program_id(1)
    bz = bh // num_heads
    h = bh % num_heads
    offs_s = ps * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ms = offs_s < seqlen
    if BLOCK_D == HEAD_DIM:
        m2 = ms[:, None]
    else:
        m2 = ms[:, None] & (offs_d[None, :] < HEAD_DIM)
    l1 = tl.load(L1 + bz * s_l1b + h * s_l1h + offs_s * s_l1s, mask=ms, other=float("-inf")).to(tl.float32)
    l2 = tl.load(L2 + bz * s_l2b + h * s_l2h + offs_s * s_l2s, mask=ms, other=float("-inf")).to(tl.float32)
    m = tl.maximum(l1, l2)
    m = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(l1 - m)
    w2 = tl.exp(l2 - m)
    total = w1 + w2
    lse = m + tl.log(total)
    total = tl.where(total == 0.0, 1.0, total)
    w1 = w1 / total
    w2 = w2 / total
    o1 = tl.load(O1 + bz * s_1b + h * s_1h + offs_s[:, None] * s_1s + offs_d[None, :], mask=m2, other=0.0)
    o2 = tl.load(O2 + bz * s_2b + h * s_2h + offs_s[:, None] * s_2s + offs_d[None, :], mask=m2, other=0.0)
    out = o1.to(tl.float32) * w1[:, None] + o2.to(tl.float32) * w2[:, None]
    tl.store(Out + bz * s_ob + h * s_oh + offs_s[:, None] * s_os + offs_d[None, :], out, mask=m2)
    tl.store(Lse + bz * s_lb + h * s_lh + offs_s, lse, mask=ms)


@triton.jit
def _index_row(bz, g, r, rep, num_rows, ROWS: tl.constexpr):
    """The index row that query head ``r`` of KV head ``g`` (batch entry ``bz``) reads: one row shared by
    every head (``ROWS == 0``), one per group (1) or one per query head (2)."""
    if ROWS == 0:
        return bz * num_rows
    elif ROWS == 1:
        return bz * num_rows + g
    else:
        return bz * num_rows + g * rep + r


@triton.jit
def _union_pad_kernel(Union, ColU, UCount, nv, upad, s_ub, s_uh, num_h, BLOCK: tl.constexpr):
    """The column plan's union from a given one (``launch._col_plan`` with a ``ColumnUnion``), one program per
    row ``(b', h')`` of ``Union [B', H', nv]`` (ascending, -1 padded; any strides of its first two
    dimensions): ``ColU[row, :upad]`` its entries with padding (-1, and past ``nv``) as 0, ``UCount[row]``
    the number of entries ``>= 0``."""
    row = tl.program_id(0)
    src = Union + (row // num_h) * s_ub + (row % num_h) * s_uh
    cnt = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)
    for j0 in range(0, upad, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        u = tl.load(src + j, mask=j < nv, other=-1)
        ok = u >= 0
        cnt += tl.sum(ok.to(tl.int32), 0)
        tl.store(ColU + row * upad + j, tl.where(ok, u, 0), mask=j < upad)
    tl.store(UCount + row, cnt)


@triton.jit
def _diagonal_rows_kernel(BI, BC, Last, N, H0, Split, num_h, nqb, width,
                          s_bb, s_bh, s_bq, s_bw, s_cb, s_ch, s_cq,
                          BLOCK_W: tl.constexpr, BLOCK_Q: tl.constexpr):
    """``launch._diagonal_rows`` of a causal diagonal plan and its causal split; program ``(row, c)`` for index
    row ``(b', h')`` of ``BI [B', H', nqb, W]`` / ``BC [B', H', nqb]`` (any strides) and query tiles
    ``[c * BLOCK_Q, (c + 1) * BLOCK_Q)``: ``Split[row, q] = BC[row, q] - H0[row]`` (the diagonal tile is each
    query tile's one masked slot); programs ``(row, 0)`` also write ``N[row]`` the count of the last query
    tile, ``Last[row, :W]`` its key blocks with int32 max past the count and ``H0[row]``, 1 iff that list
    ends with the tile's own block ``nqb - 1`` (offset 0; 0 for a count past ``W``, which the torch path
    refuses)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    b = (row // num_h).to(tl.int64)
    h = (row % num_h).to(tl.int64)
    bi = BI + b * s_bb + h * s_bh
    bc = BC + b * s_cb + h * s_ch
    last = bi + (nqb - 1) * s_bq                  # within one (b', h') row: int32 offsets suffice
    n = tl.load(bc + (nqb - 1) * s_cq)
    listed = (n > 0) & (n <= width)
    top = tl.load(last + (tl.maximum(n, 1) - 1).to(tl.int64) * s_bw, mask=listed, other=-1)
    h0 = (listed & (top == nqb - 1)).to(tl.int32)
    q = chunk * BLOCK_Q + tl.arange(0, BLOCK_Q)
    c = tl.load(bc + q.to(tl.int64) * s_cq, mask=q < nqb, other=0)
    tl.store(Split + row.to(tl.int64) * nqb + q, c - h0, mask=q < nqb)
    if chunk == 0:
        tl.store(N + row, n)
        tl.store(H0 + row, h0)
        for w0 in range(0, width, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            v = tl.load(last + w.to(tl.int64) * s_bw, mask=(w < n) & (w < width), other=2147483647)
            tl.store(Last + row.to(tl.int64) * width + w, v, mask=w < width)


@triton.jit
def _kv_csr_diagonal_count_kernel(Last, N, H0, Lo, Total, Unmasked, width, num_kb, rep, num_rows,
                                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr, LOG_W: tl.constexpr):
    """Segment sizes of ``launch._kv_csr_diagonal``, one program per (key block range, KV head, batch
    entry): per index row ``Lo[row, kb]``, the first slot of ``Last[row]`` (ascending, padded with
    int32 max) at or past ``kb`` (``torch.searchsorted``, by a binary search per key block); per
    segment the tiles listing the block summed over the group's query heads (``ROWS`` as in
    :func:`_kv_csr_diagonal_kernel`; a row shared by ``rep`` heads counts ``rep`` times) in ``Total``, and
    their unmasked part in ``Unmasked``."""
    kb = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    g = tl.program_id(1)
    bz = tl.program_id(2)
    live = kb < num_kb
    tot = kb * 0
    unm = kb * 0
    nrows = rep if ROWS == 2 else 1
    for r in range(nrows):
        row = _index_row(bz, g, r, rep, num_rows, ROWS)
        n = tl.load(N + row)
        h0 = tl.load(H0 + row)
        lo = kb * 0
        hi = lo + width
        for _ in range(LOG_W):      # first slot with Last >= kb in [lo, hi)
            mid = (lo + hi) // 2
            v = tl.load(Last + row * width + mid, mask=live & (mid < hi), other=2147483647)
            go = (v < kb) & (mid < hi)
            lo = tl.where(go, mid + 1, lo)
            hi = tl.where(go, hi, mid)
        tl.store(Lo + row * num_kb + kb, lo, mask=live)
        tot += n - lo
        unm += n - lo - h0
    if ROWS != 2:
        tot = tot * rep
        unm = unm * rep
    seg = (bz * tl.num_programs(1) + g) * num_kb + kb
    tl.store(Total + seg, tot, mask=live)
    tl.store(Unmasked + seg, unm, mask=live)


@triton.jit
def _csr_offsets_kernel(Total, Unmasked, Offsets, Mids, num_seg, BLOCK: tl.constexpr):
    """One program: ``Offsets[0] = 0``, ``Offsets[s + 1]`` the running total of ``Total[:s + 1]`` and ``Mids[s]
    = Offsets[s] + Unmasked[s]`` (the end of segment ``s``'s unmasked entries)."""
    offs = tl.arange(0, BLOCK)
    carry = tl.sum(offs * 0, 0)
    tl.store(Offsets, carry)
    for s0 in range(0, num_seg, BLOCK):
        s = s0 + offs
        live = s < num_seg
        tot = tl.load(Total + s, mask=live, other=0)
        incl = carry + tl.cumsum(tot, 0)
        tl.store(Offsets + s + 1, incl, mask=live)
        tl.store(Mids + s, incl - tot + tl.load(Unmasked + s, mask=live, other=0), mask=live)
        carry += tl.sum(tot, 0)


@triton.jit
def _kv_csr_diagonal_kernel(Last, N, Lo, H0, Offsets, Mids, Entries, width, num_kb, num_q_blocks, rep, num_rows,
                            ROWS: tl.constexpr, BLOCK_J: tl.constexpr):
    """Entries of the inverted block index of diagonal block lists (``launch._kv_csr_diagonal``): one
    program per (key block, KV head, batch entry) segment. ``Last [B', H', width]``: the key blocks of
    each row's last query tile, ascending (``d = num_q_blocks - 1 - kb'``; padding past ``N``);
    ``Lo [B', H', num_kb]``: the first slot of ``Last`` at or past the key block, so the row's tiles
    listing key block ``kb`` are ``kb + d`` for the slots ``[Lo, N)``, the highest slot (offset 0) being
    the masked diagonal tile where ``H0``. For each query head ``r`` of the group (index row: 0 with
    ``ROWS == 0``, the group with 1, ``g * rep + r`` with 2) the unmasked entries ``r * num_q_blocks + qb``
    go in ascending ``qb`` from ``Offsets[seg]``, the masked ones from ``Mids[seg]``."""
    kb = tl.program_id(0)
    g = tl.program_id(1)
    bz = tl.program_id(2)
    seg = (bz * tl.num_programs(1) + g) * num_kb + kb
    pos = tl.load(Offsets + seg)
    mpos = tl.load(Mids + seg)
    offs = tl.arange(0, BLOCK_J)
    for r in range(rep):
        row = _index_row(bz, g, r, rep, num_rows, ROWS)
        n = tl.load(N + row)
        h0 = tl.load(H0 + row)
        lo = tl.load(Lo + row * num_kb + kb)
        u = n - h0 - lo                                  # unmasked tiles listing kb
        top = n - 1 - h0                                 # their slots: top, top - 1, ... (ascending qb)
        base = r * num_q_blocks + kb + num_q_blocks - 1  # entry = base - Last[slot]
        for j0 in range(0, u, BLOCK_J):
            jj = j0 + offs
            ok = jj < u
            kbp = tl.load(Last + row * width + top - jj, mask=ok, other=0)
            tl.store(Entries + pos + jj, base - kbp, mask=ok)
        pos += u
        tl.store(Entries + mpos, r * num_q_blocks + kb, mask=h0 != 0)
        mpos += h0


@triton.jit
def _leading_below_kernel(Index, Count, Out, s_ib, s_ih, s_iq, s_is, s_cb, s_ch, s_cq, num_heads, num_q,
                          SCALE: tl.constexpr, BLOCK_J: tl.constexpr):
    """``launch._leading_below``: per (query tile, index row, batch entry) the number of leading slots
    ``j < Count`` with ``Index[j] < tile * SCALE``, i.e. the first slot that fails (or the count),
    reading the row's slots in chunks only up to that slot (any order of the lists)."""
    qb = tl.program_id(0)
    h = tl.program_id(1)
    bz = tl.program_id(2)
    cnt = tl.load(Count + bz * s_cb + h * s_ch + qb * s_cq)
    limit = qb * SCALE
    base = Index + bz * s_ib + h * s_ih + qb * s_iq
    offs = tl.arange(0, BLOCK_J)
    split = cnt
    j0 = cnt * 0
    while j0 < split:
        slot = j0 + offs
        live = slot < cnt
        idx = tl.load(base + slot * s_is, mask=live, other=0)
        split = tl.minimum(split, tl.min(tl.where(live & (idx >= limit), slot, cnt)))
        j0 += BLOCK_J
    tl.store(Out + (bz * num_heads + h) * num_q + qb, split)


@triton.jit
def _col_present_kernel(Cols, Count, Present, s_cb, s_ch, s_cq, s_cs, s_nb, s_nh, s_nq, width,
                        BLOCK_J: tl.constexpr):
    """``launch._col_plan``: ``Present[b, h, t] = 1`` for every column ``t`` that query tile ``qb`` of row
    ``(b, h)`` lists (slots ``< Count``); one program per (tile, row, batch entry). Programs that list
    the same column store the same value, once it is there they leave it."""
    qb = tl.program_id(0)
    h = tl.program_id(1)
    bz = tl.program_id(2)
    cnt = tl.load(Count + bz * s_nb + h * s_nh + qb * s_nq)
    base = Cols + bz * s_cb + h * s_ch + qb * s_cq
    dst = Present + (bz * tl.num_programs(1) + h) * width
    offs = tl.arange(0, BLOCK_J)
    for j0 in range(0, cnt, BLOCK_J):
        live = j0 + offs < cnt
        t = tl.load(base + (j0 + offs) * s_cs, mask=live, other=0)
        # most columns are listed by many tiles: store only where no program has yet (a read is cheaper
        # than a store that many SMs make to one line)
        seen = tl.load(dst + t, mask=live, other=1)
        tl.store(dst + t, tl.full([BLOCK_J], 1, tl.int32), mask=live & (seen == 0))


@triton.jit
def _col_union_kernel(Present, Rank, ColU, UCount, width, sk, upad, WRITE_U: tl.constexpr, BLOCK: tl.constexpr):
    """``launch._col_plan``, one program per index row: ``Rank[row, t]`` = (columns ``< sk`` present at or
    before ``t``) - 1 for every ``t < width`` (the union slot of a present column), ``UCount[row]`` the
    union size and, with ``WRITE_U``, the union ``ColU[row, :upad]`` ascending with zeros past it (slots
    ``>= upad``, a union bound below the real union, are dropped). ``Present`` past ``sk`` is ignored."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = tl.sum(offs * 0, 0)
    for j0 in range(0, width, BLOCK):
        t = j0 + offs
        p = tl.load(Present + row * width + t, mask=t < sk, other=0)
        rank = base + tl.cumsum(p, 0) - 1
        tl.store(Rank + row * width + t, rank, mask=t < width)
        if WRITE_U:
            tl.store(ColU + row * upad + rank, t, mask=(p != 0) & (rank < upad))
        base += tl.sum(p, 0)
    tl.store(UCount + row, base)
    if WRITE_U:
        for j0 in range(0, upad, BLOCK):
            t = j0 + offs
            tl.store(ColU + row * upad + t, offs * 0, mask=(t >= base) & (t < upad))


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _col_bits_kernel(Cols, Count, Rank, Bits, s_cb, s_ch, s_cq, s_cs, s_nb, s_nh, s_nq, width, num_chunks,
                     BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr, SPAN: tl.constexpr):
    """``launch._col_plan``: per query tile the 64-bit masks of the union chunks it lists, ``Bits[b, h, qb,
    slot // BLOCK_C] |= 1 << (slot % BLOCK_C)`` with ``slot = Rank[b, h, t]`` the union slot of each listed
    column ``t`` (``Bits`` zeroed before; an OR, so the order of the updates does not matter). A step of
    ``BLOCK_J`` listed columns whose slots fall in at most ``SPAN`` consecutive chunks (ascending lists of
    nearby columns: nearly always) ORs each chunk's bits in registers and adds them with one atomic per
    chunk; other steps take one atomic per column (64 atomics on one address queue behind each other)."""
    qb = tl.program_id(0)
    h = tl.program_id(1)
    bz = tl.program_id(2)
    cnt = tl.load(Count + bz * s_nb + h * s_nh + qb * s_nq)
    base = Cols + bz * s_cb + h * s_ch + qb * s_cq
    row = (bz * tl.num_programs(1) + h)
    rank = Rank + row * width
    dst = Bits + (row * tl.num_programs(0) + qb) * num_chunks
    offs = tl.arange(0, BLOCK_J)
    span = tl.arange(0, SPAN)
    for j0 in range(0, cnt, BLOCK_J):
        live = j0 + offs < cnt
        t = tl.load(base + (j0 + offs) * s_cs, mask=live, other=0)
        slot = tl.load(rank + t, mask=live, other=0)
        # a union slot past the buffer (a union bound below the real union) is dropped, as by the torch ops
        ok = live & (slot < num_chunks * BLOCK_C)
        chunk = slot // BLOCK_C
        bit = tl.where(ok, tl.full([BLOCK_J], 1, tl.int64) << (slot % BLOCK_C).to(tl.int64), 0)
        lo = tl.min(tl.where(ok, chunk, num_chunks), 0)
        hi = tl.max(tl.where(ok, chunk, -1), 0)
        if hi - lo < SPAN:          # [SPAN] ORs of the chunks lo, lo + 1, ... (no live column: all zero)
            acc = tl.reduce(tl.where(chunk[None, :] == lo + span[:, None], bit[None, :], 0), 1, _or)
            tl.atomic_or(dst + lo + span, acc, mask=acc != 0)
        else:
            tl.atomic_or(dst + chunk, bit, mask=ok)


@triton.jit
def _col_tiles(Bits, ColU, qbps, num_q_blocks, num_chunks, upad,
               CAUSAL: tl.constexpr, QBPS: tl.constexpr, BLOCK_C: tl.constexpr):
    # this program's segment (split sp, chunk c, index row) and its query tiles: their chunk-c masks, which
    # list a column of the chunk, which list all BLOCK_C of them left of the tile's first row (run unmasked)
    sp = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.program_id(2)
    seg = (row * num_chunks + c) * tl.num_programs(0) + sp
    offs = tl.arange(0, QBPS)
    qb = sp * qbps + offs
    live = (offs < qbps) & (qb < num_q_blocks)
    bits = tl.load(Bits + (row * num_q_blocks + qb) * num_chunks + c, mask=live, other=0)
    listed = bits != 0
    full = bits == -1
    if CAUSAL:
        last = tl.load(ColU + row * upad + c * BLOCK_C + BLOCK_C - 1)
        full = full & (last < qb * BLOCK_C)
    return seg, qb, bits, listed, full


@triton.jit
def _col_entry_count_kernel(Bits, ColU, Counts, Fulls, qbps, num_q_blocks, num_chunks, upad,
                            CAUSAL: tl.constexpr, QBPS: tl.constexpr, BLOCK_C: tl.constexpr):
    """``launch._col_entries``: per segment (row, chunk, split) the number of its query tiles that list a
    column of the chunk and of those that list all of it (one program per segment)."""
    seg, qb, bits, listed, full = _col_tiles(Bits, ColU, qbps, num_q_blocks, num_chunks, upad, CAUSAL, QBPS, BLOCK_C)
    tl.store(Counts + seg, tl.sum(listed.to(tl.int32), 0))
    tl.store(Fulls + seg, tl.sum(full.to(tl.int32), 0))


@triton.jit
def _col_entry_fill_kernel(Bits, ColU, Offsets, Mids, EntriesQb, EntriesBits, qbps, num_q_blocks, num_chunks, upad,
                           CAUSAL: tl.constexpr, QBPS: tl.constexpr, BLOCK_C: tl.constexpr):
    """``launch._col_entries``: a segment's entries, the tiles that list the whole chunk from ``Offsets`` and
    the others from ``Mids``, each group in ascending tile order (prefix sums of the flags)."""
    seg, qb, bits, listed, full = _col_tiles(Bits, ColU, qbps, num_q_blocks, num_chunks, upad, CAUSAL, QBPS, BLOCK_C)
    part = listed & (full == 0)
    full_i = full.to(tl.int32)
    part_i = part.to(tl.int32)
    dst = tl.where(full, tl.load(Offsets + seg) + tl.cumsum(full_i, 0) - 1,
                   tl.load(Mids + seg) + tl.cumsum(part_i, 0) - 1)
    tl.store(EntriesQb + dst, qb, mask=listed)
    tl.store(EntriesBits + dst, bits, mask=listed)

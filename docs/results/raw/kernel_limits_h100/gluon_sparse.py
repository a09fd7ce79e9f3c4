"""Prototype (not part of the package): the 64-token slash-block kernels (forward, dK/dV, dQ) in Gluon
(Triton >= 3.9) for Hopper, with FA3-style intra-warpgroup overlap. Measured by gluon_check.py (record
kernel_limits_h100).

One program = one 64-row query tile of one head; it walks the tile's listed 64-key blocks (BlockCount /
BlockSplit / BlockIndex of a 64-row SparsePlan, no vertical columns) with FA3's intra-warpgroup overlap:
  iteration i: issue S_{i+1} = Q K_{i+1}^T and O += P_i V_i (both async wgmma), wait(1) -> S_{i+1} ready,
  softmax(S_{i+1}) while P_i V_i runs, wait(0), rescale O by alpha_{i+1}.
K/V stages by TMA with one mbarrier per stage (STAGES deep). Slots >= split get the causal mask (key <= query).
q/k/v are viewed as 2-D [b * s, h * d] (contiguous [b, s, h, d]); TMA boxes [64, d].
Outputs: out [b, s, hq, d] (q's dtype), lse [b, hq, s] fp32 natural log; empty rows: out 0, lse -inf.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, warpgroup_mma, warpgroup_mma_wait

BLOCK = 64


def _check_inputs(q, k, v, *more):
    """the kernels assume [b, s, h, d] contiguous 16-bit tensors (2-D TMA views), s % 64 == 0, d 64 / 128
    (instr N = d, TMA box [64, d] split in 64-column boxes by Triton), hq % hkv == 0."""
    import torch
    b, s, hq, d = q.shape
    assert k.shape == v.shape and k.shape[0] == b and k.shape[1] == s and k.shape[3] == d and hq % k.shape[2] == 0
    assert s % BLOCK == 0 and d in (64, 128), (s, d)
    for t in (q, k, v, *more):
        assert t.is_contiguous() and t.dtype == q.dtype and t.dtype in (torch.bfloat16, torch.float16), t.dtype
    return gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16


def _check_rows(index_heads, hq):
    # the forward / dQ kernels read index row h (the query head): per-group rows (kv_group, hkv rows) are
    # not supported (they would read the wrong rows, out of bounds for h >= hkv)
    assert index_heads in (1, hq), f"index rows per query head (or one shared row) expected, got {index_heads}"


def _check_plan(plan):
    assert plan.row_block == BLOCK and plan.mask_mode in (0, 1) and not plan.has_columns \
        and not plan.has_documents, "64-row causal (local) plans without columns or documents only"


@gluon.jit
def _softmax_step(s_raw, m_i, l_i, j, split, idx_ptr, qb, scale_log2,
                  BLOCK: gl.constexpr, s_layout: gl.constexpr):
    """Scores of slot j -> (p fp32, alpha, m_new, l_new); slots >= split causally masked."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    kb = gl.load(idx_ptr + j)
    rows = qb * BLOCK + gl.arange(0, BLOCK, layout=row_s)
    cols = kb * BLOCK + gl.arange(0, BLOCK, layout=col_s)
    s = s_raw * scale_log2
    valid = (cols[None, :] <= rows[:, None]) | (j < split)
    s = gl.where(valid, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, idx_ptr, j, row0, g,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, BLOCK: gl.constexpr):
    st = j % STAGES
    kb = gl.load(idx_ptr + j)
    bar = bars.index(st)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_load(k_desc, [row0 + kb * BLOCK, g * HEAD_DIM], bar, k_smem.index(st))
    tma.async_load(v_desc, [row0 + kb * BLOCK, g * HEAD_DIM], bar, v_smem.index(st))


@gluon.jit
def sparse_fwd_gluon(q_desc, k_desc, v_desc, Out, Lse, BlockCount, BlockSplit, BlockIndex,
                     s_ob, s_os, s_oh, s_lb, s_lh, s_bcb, s_bch, s_bsb, s_bsh, s_bib, s_bih, s_biq,
                     seq_len, num_heads, num_q_blocks, rep, scale_log2,
                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK: gl.constexpr = 64
    gl.static_assert(STAGES >= 2, "STAGES == 1 deadlocks: slot i + 1 is waited before it is issued")
    pid = gl.program_id(0)
    bz = gl.program_id(1)
    h = pid % num_heads
    qb = num_q_blocks - 1 - pid // num_heads            # heaviest tiles first
    g = h // rep

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    mbarrier.init(qbar, count=1)

    cnt = gl.load(BlockCount + bz * s_bcb + h * s_bch + qb)
    split = gl.load(BlockSplit + bz * s_bsb + h * s_bsh + qb)
    idx_ptr = BlockIndex + bz * s_bib + h * s_bih + qb * s_biq
    row0 = bz * seq_len

    mbarrier.expect(qbar, q_desc.block_type.nbytes)
    tma.async_load(q_desc, [row0 + qb * BLOCK, h * HEAD_DIM], qbar, q_smem)
    for j in gl.static_range(STAGES - 1):               # prologue: the first STAGES - 1 blocks in flight
        if j < cnt:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, idx_ptr, j, row0, g, HEAD_DIM, STAGES, BLOCK)

    m_i = gl.full([BLOCK], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)
    p_op = gl.zeros([BLOCK, BLOCK], q_desc.dtype, layout=p_layout)
    mbarrier.wait(qbar, phase=0)

    if cnt > 0:
        if STAGES - 1 < cnt:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, idx_ptr, STAGES - 1, row0, g, HEAD_DIM, STAGES, BLOCK)
        mbarrier.wait(bars.index(0), phase=0)
        s_raw = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_raw = warpgroup_mma_wait(num_outstanding=0, deps=(s_raw, ))
        p, alpha, m_i, l_i = _softmax_step(s_raw, m_i, l_i, 0, split, idx_ptr, qb, scale_log2, BLOCK, s_layout)
        p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)

        for i in range(0, cnt - 1):
            nxt = i + 1
            st_n = nxt % STAGES
            mbarrier.wait(bars.index(st_n), phase=(nxt // STAGES) & 1)
            s_raw = warpgroup_mma(q_smem, k_smem.index(st_n).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index(i % STAGES), acc, is_async=True)
            s_raw = warpgroup_mma_wait(num_outstanding=1, deps=(s_raw, ))
            p, alpha, m_i, l_i = _softmax_step(s_raw, m_i, l_i, nxt, split, idx_ptr, qb, scale_log2, BLOCK,
                                               s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
            # stage i % STAGES is free now (its K and V were read): load slot i + STAGES into it
            if i + STAGES < cnt:
                _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, idx_ptr, i + STAGES, row0, g, HEAD_DIM, STAGES,
                          BLOCK)
        last = cnt - 1
        acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))
    mbarrier.invalidate(qbar)

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    rows_o = qb * BLOCK + gl.arange(0, BLOCK, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=col_o)
    o_ptrs = Out + bz * s_ob + h * s_oh + rows_o[:, None] * s_os + cols_o[None, :]
    gl.store(o_ptrs, out.to(Out.dtype.element_ty))
    rows_l = qb * BLOCK + gl.arange(0, BLOCK, layout=row_s)
    gl.store(Lse + bz * s_lb + h * s_lh + rows_l, lse)


def sparse_forward_gluon(q, k, v, block_count, block_split, block_index, softmax_scale, stages=3):
    """q [b, s, hq, d], k/v [b, s, hkv, d] bf16 contiguous; block_* of a 64-row plan, index rows per query head
    ([b or 1, hq or 1, nqb(, max)] int32). Returns (out [b, s, hq, d] bf16, lse [b, hq, s] fp32)."""
    import torch
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    gdt = _check_inputs(q, k, v)
    _check_rows(block_count.shape[1], hq)
    assert stages >= 2
    lay = gl.NVMMASharedLayout.get_default_for([BLOCK, d], gdt)
    descs = [TensorDescriptor(t.view(b * s, t.shape[2] * d), [b * s, t.shape[2] * d], [t.shape[2] * d, 1],
                              [BLOCK, d], lay) for t in (q, k, v)]
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    nqb = s // BLOCK

    def st(t, i):
        return t.stride(i) if t.shape[i] > 1 else 0
    bc, bs_, bi = block_count, block_split, block_index
    grid = (nqb * hq, b)
    sparse_fwd_gluon[grid](*descs, out, lse, bc, bs_, bi,
                           out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
                           st(bc, 0), st(bc, 1), st(bs_, 0), st(bs_, 1), st(bi, 0), st(bi, 1), bi.stride(2),
                           s, hq, nqb, hq // hkv, softmax_scale * 1.4426950408889634,
                           HEAD_DIM=d, STAGES=stages, num_warps=4)
    return out, lse


@gluon.jit
def sparse_dkdv_gluon(q_desc, do_desc, k_desc, v_desc, Lse, Delta, DK, DV, KvOffsets, KvMids, KvEntries,
                      s_lb, s_lh, s_dkb, s_dks, s_dkh, s_ofb, s_ofg,
                      seq_len, num_kv_heads, num_q_blocks, rep, scale_log2, sm_scale,
                      HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """dK, dV of one 64-key block of one KV head over the query tiles of its inverted index (entries r * nqb + qb,
    [start, mid) unmasked, [mid, end) causal), transposed tiles [keys, rows]. Per entry: qkT and dpT issued
    together; exp overlaps dpT; dv += pT dO issued; dsT overlaps it; dk += dsT Q issued (runs under the next
    entry's waits). Writes DK (x sm_scale) and DV rows of the block, fp32."""
    BLOCK: gl.constexpr = 64
    pid = gl.program_id(0)
    bz = gl.program_id(1)
    g = pid % num_kv_heads
    kb = pid // num_kv_heads

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)       # keys
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)       # query rows
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK, HEAD_DIM], do_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kvbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    mbarrier.init(kvbar, count=1)

    row0 = bz * seq_len
    off_ptr = KvOffsets + bz * s_ofb + g * s_ofg + kb
    start = gl.load(off_ptr)
    end = gl.load(off_ptr + 1)
    mid = gl.load(KvMids + bz * s_ofb + g * s_ofg + kb)
    n = end - start

    mbarrier.expect(kvbar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_load(k_desc, [row0 + kb * BLOCK, g * HEAD_DIM], kvbar, k_smem)
    tma.async_load(v_desc, [row0 + kb * BLOCK, g * HEAD_DIM], kvbar, v_smem)
    for j in gl.static_range(STAGES - 1):
        if j < n:
            _issue_qdo(q_desc, do_desc, q_smem, do_smem, bars, KvEntries, start + j, j, row0, g, rep, num_q_blocks,
                       HEAD_DIM, STAGES, BLOCK)

    dk = gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout)
    dv = gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)
    keys = kb * BLOCK + gl.arange(0, BLOCK, layout=row_s)
    offs_r = gl.arange(0, BLOCK, layout=col_s)
    mbarrier.wait(kvbar, phase=0)

    for i in range(0, n):
        if i + STAGES - 1 < n:        # stage (i - 1) % STAGES: its dk/dv products were waited below
            _issue_qdo(q_desc, do_desc, q_smem, do_smem, bars, KvEntries, start + i + STAGES - 1, i + STAGES - 1,
                       row0, g, rep, num_q_blocks, HEAD_DIM, STAGES, BLOCK)
        stg = i % STAGES
        mbarrier.wait(bars.index(stg), phase=(i // STAGES) & 1)
        q_t = q_smem.index(stg)
        do_t = do_smem.index(stg)
        qkT = warpgroup_mma(k_smem, q_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpT = warpgroup_mma(v_smem, do_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        ent = gl.load(KvEntries + start + i)
        r = ent // num_q_blocks
        qb = ent - r * num_q_blocks
        h = g * rep + r
        rows = qb * BLOCK + offs_r
        lse = gl.load(Lse + bz * s_lb + h * s_lh + rows)
        delta = gl.load(Delta + bz * s_lb + h * s_lh + rows)
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        qkT = warpgroup_mma_wait(num_outstanding=1, deps=(qkT, ))
        pT = gl.exp2(qkT * scale_log2 - lse2[None, :])
        pT = gl.where((keys[:, None] <= rows[None, :]) | (start + i < mid), pT, 0.0)
        pT_op = gl.convert_layout(pT.to(q_desc.dtype), a_layout)
        dv = warpgroup_mma(pT_op, do_t, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT, ))
        dsT = pT * (dpT - delta[None, :])
        dsT_op = gl.convert_layout(dsT.to(q_desc.dtype), a_layout)
        dk = warpgroup_mma(dsT_op, q_t, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))

    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))
    mbarrier.invalidate(kvbar)
    rows_o = kb * BLOCK + gl.arange(0, BLOCK, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=col_o)
    dst = bz * s_dkb + g * s_dkh + rows_o[:, None] * s_dks + cols_o[None, :]
    gl.store(DK + dst, dk * sm_scale)
    gl.store(DV + dst, dv)


@gluon.jit
def _issue_qdo(q_desc, do_desc, q_smem, do_smem, bars, KvEntries, e, j, row0, g, rep, num_q_blocks,
               HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, BLOCK: gl.constexpr):
    st = j % STAGES
    ent = gl.load(KvEntries + e)
    r = ent // num_q_blocks
    qb = ent - r * num_q_blocks
    h = g * rep + r
    bar = bars.index(st)
    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_load(q_desc, [row0 + qb * BLOCK, h * HEAD_DIM], bar, q_smem.index(st))
    tma.async_load(do_desc, [row0 + qb * BLOCK, h * HEAD_DIM], bar, do_smem.index(st))


def sparse_dkdv_gluon_launch(q, k, v, dout, lse, delta, plan, softmax_scale, stages=3):
    """dK, dV (fp32 [b, s, hkv, d]) of the slash blocks of a 64-row causal plan without columns, through the same
    inverted index as the Triton dK/dV kernel (launch._kv_csr)."""
    import torch
    from megatron_mtraining.ops.triton import launch
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    nkb = s // BLOCK
    gdt = _check_inputs(q, k, v, dout)
    _check_plan(plan.kv_source)
    offsets, mids, entries, B_, G_ = launch._kv_csr(plan.kv_source, nkb, hq, hkv)
    lay = gl.NVMMASharedLayout.get_default_for([BLOCK, d], gdt)
    mk = lambda t: TensorDescriptor(t.view(b * s, t.shape[2] * d), [b * s, t.shape[2] * d],  # noqa: E731
                                    [t.shape[2] * d, 1], [BLOCK, d], lay)
    dk = torch.empty((b, s, hkv, d), dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    lse = lse.float().contiguous()
    delta = delta.float().contiguous()
    sparse_dkdv_gluon[(nkb * hkv, b)](
        mk(q), mk(dout), mk(k), mk(v), lse, delta, dk, dv, offsets, mids, entries,
        lse.stride(0), lse.stride(1), dk.stride(0), dk.stride(1), dk.stride(2),
        (G_ * nkb) if B_ > 1 else 0, nkb if G_ > 1 else 0,
        s, hkv, s // BLOCK, hq // hkv, softmax_scale * 1.4426950408889634, softmax_scale,
        HEAD_DIM=d, STAGES=stages, num_warps=4)
    return dk, dv


@gluon.jit
def sparse_dq_gluon(q_desc, do_desc, k_desc, v_desc, Lse, Delta, DQ, BlockCount, BlockSplit, BlockIndex,
                    s_lb, s_lh, s_dqb, s_dqs, s_dqh, s_bcb, s_bch, s_bsb, s_bsh, s_bib, s_bih, s_biq,
                    seq_len, num_heads, num_q_blocks, rep, scale_log2, sm_scale,
                    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """dQ of one 64-row query tile of one head over its listed 64-key blocks (the forward's lists; slots >= split
    causal). Per block: qk and dp issued together; exp overlaps dp; ds; dq += ds K issued (waited before the next
    block's scores are used). Writes DQ rows (x sm_scale), fp32."""
    BLOCK: gl.constexpr = 64
    pid = gl.program_id(0)
    bz = gl.program_id(1)
    h = pid % num_heads
    qb = num_q_blocks - 1 - pid // num_heads
    g = h // rep

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [BLOCK, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for sb in gl.static_range(STAGES):
        mbarrier.init(bars.index(sb), count=1)
    mbarrier.init(qbar, count=1)

    cnt = gl.load(BlockCount + bz * s_bcb + h * s_bch + qb)
    split = gl.load(BlockSplit + bz * s_bsb + h * s_bsh + qb)
    idx_ptr = BlockIndex + bz * s_bib + h * s_bih + qb * s_biq
    row0 = bz * seq_len

    mbarrier.expect(qbar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_load(q_desc, [row0 + qb * BLOCK, h * HEAD_DIM], qbar, q_smem)
    tma.async_load(do_desc, [row0 + qb * BLOCK, h * HEAD_DIM], qbar, do_smem)
    for j in gl.static_range(STAGES - 1):
        if j < cnt:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, idx_ptr, j, row0, g, HEAD_DIM, STAGES, BLOCK)

    rows = qb * BLOCK + gl.arange(0, BLOCK, layout=row_s)
    lse = gl.load(Lse + bz * s_lb + h * s_lh + rows)
    delta = gl.load(Delta + bz * s_lb + h * s_lh + rows)
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq = gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)
    mbarrier.wait(qbar, phase=0)

    for i in range(0, cnt):
        if i + STAGES - 1 < cnt:      # stage (i - 1) % STAGES: block i - 1's products were waited below
            _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, idx_ptr, i + STAGES - 1, row0, g, HEAD_DIM, STAGES,
                      BLOCK)
        stg = i % STAGES
        mbarrier.wait(bars.index(stg), phase=(i // STAGES) & 1)
        k_t = k_smem.index(stg)
        qk = warpgroup_mma(q_smem, k_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_smem.index(stg).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        kb = gl.load(idx_ptr + i)
        cols = kb * BLOCK + gl.arange(0, BLOCK, layout=col_s)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))
        p = gl.exp2(qk * scale_log2 - lse2[:, None])
        p = gl.where((cols[None, :] <= rows[:, None]) | (i < split), p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
        ds = p * (dp - delta[:, None])
        ds_op = gl.convert_layout(ds.to(q_desc.dtype), a_layout)
        dq = warpgroup_mma(ds_op, k_t, dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))

    for sb in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(sb))
    mbarrier.invalidate(qbar)
    rows_o = qb * BLOCK + gl.arange(0, BLOCK, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=col_o)
    gl.store(DQ + bz * s_dqb + h * s_dqh + rows_o[:, None] * s_dqs + cols_o[None, :], dq * sm_scale)


def sparse_dq_gluon_launch(q, k, v, dout, lse, delta, plan, softmax_scale, stages=3):
    """dQ (fp32 [b, s, hq, d]) of the slash blocks of a 64-row causal plan without columns (per-head index rows)."""
    import torch
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    gdt = _check_inputs(q, k, v, dout)
    _check_plan(plan)
    _check_rows(plan.block_count.shape[1], hq)
    lay = gl.NVMMASharedLayout.get_default_for([BLOCK, d], gdt)
    mk = lambda t: TensorDescriptor(t.view(b * s, t.shape[2] * d), [b * s, t.shape[2] * d],  # noqa: E731
                                    [t.shape[2] * d, 1], [BLOCK, d], lay)
    dq = torch.empty((b, s, hq, d), dtype=torch.float32, device=q.device)
    lse = lse.float().contiguous()
    delta = delta.float().contiguous()
    bc, bs_, bi = plan.block_count, plan.block_split, plan.block_index

    def st(t, i):
        return t.stride(i) if t.shape[i] > 1 else 0
    nqb = s // BLOCK
    sparse_dq_gluon[(nqb * hq, b)](
        mk(q), mk(dout), mk(k), mk(v), lse, delta, dq, bc, bs_, bi,
        lse.stride(0), lse.stride(1), dq.stride(0), dq.stride(1), dq.stride(2),
        st(bc, 0), st(bc, 1), st(bs_, 0), st(bs_, 1), st(bi, 0), st(bi, 1), bi.stride(2),
        s, hq, nqb, hq // hkv, softmax_scale * 1.4426950408889634, softmax_scale,
        HEAD_DIM=d, STAGES=stages, num_warps=4)
    return dq

"""Warp-specialized Gluon forward over 64-token slash blocks (Hopper, Triton 3.9), one K/V stream for two heads.

One program = query heads 2p and 2p+1 at one query block, which must have the same block list (head 2p's list is
read for both). Partitions: consumer 0 (default, 4 warps) and consumer 1 (4 warps), one per head; one producer warp
loads both Q tiles and one ring of STAGES K/V stages by TMA; each stage is released when both consumers arrive on
its empty mbarrier (count 2). Each consumer runs the loop of gluon_sparse.sparse_fwd_gluon (async wgmma: S_{i+1}
issued before P_i V_i, waited with one group pending). Each K/V block crosses from L2 to shared memory once for
128 query rows.
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, warpgroup_mma, warpgroup_mma_wait,
                                                              fence_async_shared)
from gluon_sparse import _softmax_step, _check_inputs, _check_rows

BLOCK = gl.constexpr(64)


@gluon.jit
def _tile_of(pid, num_heads, num_q_blocks, T: gl.constexpr):
    # heads 2p and 2p + 1 at one query block; both read head 2p's list (the plan must give them the same one)
    hp = num_heads // 2
    h = 2 * (pid % hp) + T
    qb = num_q_blocks - 1 - pid // hp
    return h, qb


@gluon.jit
def _producer(smem, bars, ptrs, scal, T: gl.constexpr):
    q_desc, k_desc, v_desc = ptrs[0], ptrs[1], ptrs[2]
    BlockCount, BlockIndex = ptrs[3], ptrs[4]
    q_smem, k_smem, v_smem = smem
    ready, empty, qbar = bars
    (s_bcb, s_bch, s_bib, s_bih, s_biq, seq_len, num_heads, num_q_blocks, rep, scale_log2, bz, pid) = scal
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    h0, qb = _tile_of(pid, num_heads, num_q_blocks, 0)
    g = h0 // rep
    row0 = bz * seq_len
    cnt = gl.load(BlockCount + bz * s_bcb + h0 * s_bch + qb)
    idx_ptr = BlockIndex + bz * s_bib + h0 * s_bih + qb * s_biq
    for t in gl.static_range(2):
        mbarrier.expect(qbar.index(t), q_desc.block_type.nbytes)
        tma.async_load(q_desc, [row0 + qb * BLOCK, (h0 + t) * HEAD_DIM], qbar.index(t), q_smem.index(t))
    for i in range(cnt):
        st = i % STAGES
        mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
        kb = gl.load(idx_ptr + i)
        mbarrier.expect(ready.index(st), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_load(k_desc, [row0 + kb * BLOCK, g * HEAD_DIM], ready.index(st), k_smem.index(st))
        tma.async_load(v_desc, [row0 + kb * BLOCK, g * HEAD_DIM], ready.index(st), v_smem.index(st))


@gluon.jit
def _consumer(smem, bars, ptrs, scal, T: gl.constexpr):
    q_desc = ptrs[0]
    BlockCount, BlockIndex, BlockSplit, Out, Lse = ptrs[3], ptrs[4], ptrs[5], ptrs[6], ptrs[7]
    s_ob, s_os, s_oh, s_lb, s_lh, s_bsb, s_bsh = ptrs[8], ptrs[9], ptrs[10], ptrs[11], ptrs[12], ptrs[13], ptrs[14]
    q_smem, k_smem, v_smem = smem
    ready, empty, qbar = bars
    (s_bcb, s_bch, s_bib, s_bih, s_biq, seq_len, num_heads, num_q_blocks, rep, scale_log2, bz, pid) = scal
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    STAGES: gl.constexpr = k_smem.type.shape[0]
    h, qb = _tile_of(pid, num_heads, num_q_blocks, T)
    hl = h - T
    cnt = gl.load(BlockCount + bz * s_bcb + hl * s_bch + qb)
    split = gl.load(BlockSplit + bz * s_bsb + hl * s_bsh + qb)
    idx_ptr = BlockIndex + bz * s_bib + hl * s_bih + qb * s_biq

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    qs = q_smem.index(T)

    m_i = gl.full([BLOCK], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)
    p_op = gl.zeros([BLOCK, BLOCK], q_desc.dtype, layout=p_layout)
    mbarrier.wait(qbar.index(T), 0)
    if cnt > 0:
        st0 = 0
        mbarrier.wait(ready.index(st0), 0)
        s_raw = warpgroup_mma(qs, k_smem.index(st0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_raw = warpgroup_mma_wait(num_outstanding=0, deps=(s_raw, ))
        p, alpha, m_i, l_i = _softmax_step(s_raw, m_i, l_i, 0, split, idx_ptr, qb, scale_log2, BLOCK, s_layout)
        p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
        for i in range(0, cnt - 1):
            nxt = i + 1
            st_n = nxt % STAGES
            st_i = i % STAGES
            mbarrier.wait(ready.index(st_n), (nxt // STAGES) & 1)
            s_raw = warpgroup_mma(qs, k_smem.index(st_n).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index(st_i), acc, is_async=True)
            s_raw = warpgroup_mma_wait(num_outstanding=1, deps=(s_raw, ))
            p, alpha, m_i, l_i = _softmax_step(s_raw, m_i, l_i, nxt, split, idx_ptr, qb, scale_log2, BLOCK,
                                               s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(st_i), count=1)       # K_i and V_i read
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
        last = (cnt - 1) % STAGES
        acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(last), count=1)

    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    rows_o = qb * BLOCK + gl.arange(0, BLOCK, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=col_o)
    gl.store(Out + bz * s_ob + h * s_oh + rows_o[:, None] * s_os + cols_o[None, :], out.to(Out.dtype.element_ty))
    rows_l = qb * BLOCK + gl.arange(0, BLOCK, layout=row_s)
    gl.store(Lse + bz * s_lb + h * s_lh + rows_l, lse)


@gluon.jit
def sparse_fwd_ws(q_desc, k_desc, v_desc, Out, Lse, BlockCount, BlockSplit, BlockIndex,
                  s_ob, s_os, s_oh, s_lb, s_lh, s_bcb, s_bch, s_bsb, s_bsh, s_bib, s_bih, s_biq,
                  seq_len, num_heads, num_q_blocks, rep, scale_log2,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                  num_warps: gl.constexpr):
    pid = gl.program_id(0)
    bz = gl.program_id(1)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)       # both consumers release each stage
    for i in gl.static_range(2):
        mbarrier.init(qbar.index(i), count=1)
    smem = (q_smem, k_smem, v_smem)
    bars = (ready, empty, qbar)
    ptrs = (q_desc, k_desc, v_desc, BlockCount, BlockIndex, BlockSplit, Out, Lse,
            s_ob, s_os, s_oh, s_lb, s_lh, s_bsb, s_bsh)
    scal = (s_bcb, s_bch, s_bib, s_bih, s_biq, seq_len, num_heads, num_q_blocks, rep, scale_log2, bz, pid)
    gl.warp_specialize([
        (_consumer, (smem, bars, ptrs, scal, 0)),
        (_consumer, (smem, bars, ptrs, scal, 1)),
        (_producer, (smem, bars, ptrs, scal, 0)),
    ], [4, 1], [CONSUMER_REGS, 24])


def sparse_forward_ws(q, k, v, block_count, block_split, block_index, softmax_scale, stages=2, consumer_regs=232,
                      maxnreg=None):
    import torch
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    gdt = _check_inputs(q, k, v)
    _check_rows(block_count.shape[1], hq)
    assert stages >= 2 and hq % 2 == 0 and (hq // hkv) % 2 == 0
    lay = gl.NVMMASharedLayout.get_default_for([64, d], gdt)
    descs = [TensorDescriptor(t.view(b * s, t.shape[2] * d), [b * s, t.shape[2] * d], [t.shape[2] * d, 1],
                              [64, d], lay) for t in (q, k, v)]
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    nqb = s // 64

    def st(t, i):
        return t.stride(i) if t.shape[i] > 1 else 0
    bc, bs_, bi = block_count, block_split, block_index
    grid = (nqb * (hq // 2), b)
    kw = {} if maxnreg is None else {"maxnreg": maxnreg}
    sparse_fwd_ws[grid](*descs, out, lse, bc, bs_, bi,
                        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
                        st(bc, 0), st(bc, 1), st(bs_, 0), st(bs_, 1), st(bi, 0), st(bi, 1), bi.stride(2),
                        s, hq, nqb, hq // hkv, softmax_scale * 1.4426950408889634,
                        HEAD_DIM=d, STAGES=stages, CONSUMER_REGS=consumer_regs, num_warps=4, **kw)
    return out, lse

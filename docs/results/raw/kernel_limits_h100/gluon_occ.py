"""Gluon forward over 64-token slash blocks with minimal shared memory for occupancy: one warp group, one K and one
V buffer with their own mbarriers (V_i loads while S_i = Q K_i^T runs; K_{i+1} loads while softmax and P_i V_i run),
no overlap inside the warp group. At head_dim 128 a program holds 48 KB of shared memory, so up to four programs
fit on an SM when the registers allow (maxnreg)."""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, warpgroup_mma, warpgroup_mma_wait
from gluon_sparse import _softmax_step, _check_inputs, _check_rows


@gluon.jit
def sparse_fwd_occ(q_desc, k_desc, v_desc, Out, Lse, BlockCount, BlockSplit, BlockIndex,
                   s_ob, s_os, s_oh, s_lb, s_lh, s_bcb, s_bch, s_bsb, s_bsh, s_bib, s_bih, s_biq,
                   seq_len, num_heads, num_q_blocks, rep, scale_log2,
                   HEAD_DIM: gl.constexpr, num_warps: gl.constexpr):
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
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK, HEAD_DIM], v_desc.layout)
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    vbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qbar, count=1)
    mbarrier.init(kbar, count=1)
    mbarrier.init(vbar, count=1)

    cnt = gl.load(BlockCount + bz * s_bcb + h * s_bch + qb)
    split = gl.load(BlockSplit + bz * s_bsb + h * s_bsh + qb)
    idx_ptr = BlockIndex + bz * s_bib + h * s_bih + qb * s_biq
    row0 = bz * seq_len

    m_i = gl.full([BLOCK], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout)
    mbarrier.expect(qbar, q_desc.block_type.nbytes)
    tma.async_load(q_desc, [row0 + qb * BLOCK, h * HEAD_DIM], qbar, q_smem)
    if cnt > 0:
        kb0 = gl.load(idx_ptr)
        mbarrier.expect(kbar, k_desc.block_type.nbytes)
        tma.async_load(k_desc, [row0 + kb0 * BLOCK, g * HEAD_DIM], kbar, k_smem)
    mbarrier.wait(qbar, 0)
    for i in range(cnt):
        kb = gl.load(idx_ptr + i)
        mbarrier.expect(vbar, v_desc.block_type.nbytes)
        tma.async_load(v_desc, [row0 + kb * BLOCK, g * HEAD_DIM], vbar, v_smem)
        mbarrier.wait(kbar, i & 1)
        s_raw = warpgroup_mma(q_smem, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_raw = warpgroup_mma_wait(num_outstanding=0, deps=(s_raw, ))
        if i + 1 < cnt:
            kn = gl.load(idx_ptr + i + 1)
            mbarrier.expect(kbar, k_desc.block_type.nbytes)
            tma.async_load(k_desc, [row0 + kn * BLOCK, g * HEAD_DIM], kbar, k_smem)
        p, alpha, m_i, l_i = _softmax_step(s_raw, m_i, l_i, i, split, idx_ptr, qb, scale_log2, BLOCK, s_layout)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
        mbarrier.wait(vbar, i & 1)
        acc = warpgroup_mma(p_op, v_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.invalidate(qbar)
    mbarrier.invalidate(kbar)
    mbarrier.invalidate(vbar)

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    rows_o = qb * BLOCK + gl.arange(0, BLOCK, layout=row_o)
    cols_o = gl.arange(0, HEAD_DIM, layout=col_o)
    gl.store(Out + bz * s_ob + h * s_oh + rows_o[:, None] * s_os + cols_o[None, :], out.to(Out.dtype.element_ty))
    rows_l = qb * BLOCK + gl.arange(0, BLOCK, layout=row_s)
    gl.store(Lse + bz * s_lb + h * s_lh + rows_l, lse)


def sparse_forward_occ(q, k, v, block_count, block_split, block_index, softmax_scale, maxnreg=None):
    import torch
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    gdt = _check_inputs(q, k, v)
    _check_rows(block_count.shape[1], hq)
    lay = gl.NVMMASharedLayout.get_default_for([64, d], gdt)
    descs = [TensorDescriptor(t.view(b * s, t.shape[2] * d), [b * s, t.shape[2] * d], [t.shape[2] * d, 1],
                              [64, d], lay) for t in (q, k, v)]
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    nqb = s // 64

    def st(t, i):
        return t.stride(i) if t.shape[i] > 1 else 0
    bc, bs_, bi = block_count, block_split, block_index
    kw = {} if maxnreg is None else {"maxnreg": maxnreg}
    sparse_fwd_occ[(nqb * hq, b)](*descs, out, lse, bc, bs_, bi,
                                  out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
                                  st(bc, 0), st(bc, 1), st(bs_, 0), st(bs_, 1), st(bi, 0), st(bi, 1), bi.stride(2),
                                  s, hq, nqb, hq // hkv, softmax_scale * 1.4426950408889634,
                                  HEAD_DIM=d, num_warps=4, **kw)
    return out, lse

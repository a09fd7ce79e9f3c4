"""Writes three copies of the package whose sparse forward kernel differs only in the online-softmax step
(megatron_mtraining/ops/triton/kernels.py, ``_online_step`` and its six calls in ``_sparse_fwd_kernel``):

* ``v1_fma``: the scores leave the dot unscaled; the scale is folded into the exponent (one FMA per score);
* ``v2_lazy``: FlashAttention-4's lazy rescaling: a row's running max moves only when the block's max exceeds it
  by more than 8 (log2 units, so p <= 2**8), and the accumulator is rescaled only when some row moved (a branch);
* ``v3_lazy_nobranch``: the same without the branch (the accumulator is always multiplied, by 1 for unmoved rows).

    python forward_variants.py OUT_DIR          # from the repository root; then run_forward_variants.sh
"""
import os
import shutil
import sys

src = open("megatron_mtraining/ops/triton/kernels.py").read()
old_step = src[src.index("@triton.jit\ndef _online_step"):src.index("@triton.jit\ndef _doc_inside")]

FMA = '''@triton.jit
def _online_step(qk, sc, m_i, l_i, acc, v, MASKED: tl.constexpr, FP32: tl.constexpr):
    # qk: [M, N] fp32 unscaled (-inf where masked); sc: softmax scale * log2(e); v: [N, D]
    m_new = tl.maximum(m_i, tl.max(qk, 1) * sc)
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk * sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32)
    return m_new, l_i, acc


'''
LAZY = '''@triton.jit
def _online_step(qk, sc, m_i, l_i, acc, v, MASKED: tl.constexpr, FP32: tl.constexpr):
    # lazy rescale: the running max moves only when a row's max grows by more than 8 (log2 units);
    # p <= 2**8 otherwise. The accumulator is rescaled only when some row moved.
    m_blk = tl.max(qk, 1) * sc
    upd = m_blk > m_i + 8.0
    m_keep = tl.where(upd, m_blk, m_i)
    if MASKED:
        m_use = tl.where(m_keep == float("-inf"), 0.0, m_keep)
    else:
        m_use = m_keep
    p = tl.math.exp2(qk * sc - m_use[:, None])
    if tl.max(upd.to(tl.int32), 0) > 0:
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
    l_i = l_i + tl.sum(p, 1)
    acc = acc + _dot(p.to(v.dtype), v, FP32)
    return m_keep, l_i, acc


'''
LAZY_NOBRANCH = LAZY.replace('''    if tl.max(upd.to(tl.int32), 0) > 0:
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
    l_i = l_i + tl.sum(p, 1)
    acc = acc + _dot(p.to(v.dtype), v, FP32)''', '''    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32)''')


def variant(step: str) -> str:
    a, b = src.index("def _sparse_fwd_kernel("), src.index("def _load_query_tile(")
    body = src[a:b].replace("qk = _dot(q, tl.trans(k), FP32) * scale_log2", "qk = _dot(q, tl.trans(k), FP32)")
    body = body.replace("_online_step(qk, m_i,", "_online_step(qk, scale_log2, m_i,")
    assert body.count("scale_log2, m_i") == 6
    return src[:a].replace(old_step, step) + body + src[b:]


if __name__ == "__main__":
    out = sys.argv[1]
    for name, step in (("v1_fma", FMA), ("v2_lazy", LAZY), ("v3_lazy_nobranch", LAZY_NOBRANCH)):
        d = os.path.join(out, name)
        shutil.copytree("megatron_mtraining", os.path.join(d, "megatron_mtraining"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        open(os.path.join(d, "megatron_mtraining/ops/triton/kernels.py"), "w").write(variant(step))

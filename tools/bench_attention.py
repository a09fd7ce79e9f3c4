#!/usr/bin/env python
"""Benchmark: our Triton vertical-slash kernels vs cuDNN dense causal SDPA vs FlexAttention.

    python tools/bench_attention.py --json out.json --seqs 32768,131072 --sparsity 0.9,0.95,0.98 \\
        --head-dims 128,64 --heads 16 --kv-heads 2

All in one process, same inputs (bf16, batch 1, Qwen2.5-3B attention: 16 query heads, 2 KV heads):

* ``cudnn``: ``F.scaled_dot_product_attention(is_causal=True)`` through the cuDNN backend (dense);
* ``flex``: FlexAttention (``torch.compile``d) with the *equivalent* BlockMask of our pattern:
  128x128 blocks (``--flex-block 64`` for 64x64), a block is listed if it contains a listed 64x64
  tile or a vertical column; full blocks run unmasked, the others apply the exact mask
  (causal & (slash tile or vertical column)) through a ``mask_mod``;
* ``ours``: :func:`megatron_mtraining.ops.triton.sparse_forward` / ``sparse_backward`` (plan built
  once, outside the timing; the time to build it as training does, from the block diagonals, is
  reported as ``prep_ms``, and from sorted lists as ``prep_sorted_ms``), deterministic backward
  and the fast one (the same kernels unless the :class:`KernelConfig` enables atomics);
* ``ours_dense``: the dense position-mask kernel on a causal shard (``--dense``);
* ``fa4_dense``: FlashAttention-4 dense causal (``--impls ...,fa4``);
* ``fa4_sparse128``: our sparse step at 128-token slash blocks: slash lines rounded up to the
  128x128 tiles they touch (:meth:`~megatron_mtraining.patterns.estimator.VerticalSlashPattern.coarsen`)
  through FA4's block sparsity, token-level columns through our Triton column kernels, merged by LSE
  (:class:`~megatron_mtraining.ops.fa4.FA4SparseStepKernel`, the ``fa4`` backend's sparse step);
* ``ours_fast128``: our Triton kernels on the same 128-rounded pattern (64-row tiles);
* ``fa4_round128``: FA4 alone, the pattern's slash lines *and* columns rounded up to 128x128 blocks
  (what FA4's block sparsity can express by itself).

Patterns: :func:`megatron_mtraining.patterns.synthetic.vertical_slash_indices` (sinks, local
window, heavy-tailed vertical positions and slash offsets; documented there). Sparsity is relative to
causal work. Effective TFLOP/s count the tiles each implementation computes (ours: 64x64 block tiles
+ 64-column gathered tiles; flex: its listed blocks; dense: half the square), with
``fwd = 4*d*pairs`` and ``fwd+bwd = 3.5 * fwd``. ``tflops_useful`` counts only the pattern's useful
pairs. Times: :func:`megatron_mtraining.bench.measure` (median of CUDA-event timings after warm-up).

``--share-pattern kv_group`` (or ``both``) adds, on the same q/k/v, rows for one pattern per GQA group
(``vertical_slash.share_pattern: kv_group``): a synthetic pattern of ``--kv-heads`` heads (with
``--pattern-file``: ``--kv-heads`` rows per layer, e.g. a file saved by ``tools/pattern_recall.py
--share-pattern kv_group --save-pattern``), timed as ``ours_{det,fast}_kvg_head`` (the same pattern
repeated per query head: per-head programs, each K/V tile loaded once per query head),
``ours_{det,fast}_kvg_nopack`` (per-group indices, one program per query head) and
``ours_{det,fast}_kvg_default`` (per-group indices, the default :class:`KernelConfig` packing),
``ours_{det,fast}_kvg_pack{128,256}`` (the group's heads packed into 128- / 256-row forward tiles,
partial tiles allowed, dQ unpacked) and ``ours_{det,fast}_kvg_pack256_dq{128,256}`` (dQ packed too).
The work (pairs) is identical in all of them; ``speedup_vs_head`` compares with the first.
``both`` also keeps the per-head rows of the default run.

``--pattern-file P`` times the kernels on a saved pattern instead (e.g. one the online estimator made on real text
with ``tools/pattern_recall.py --save-pattern``): layer by layer, ``--heads`` rows of the file per layer, the file's
sequence length, random q/k/v; cuDNN dense causal on one layer of the same shape is the comparison.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback

import torch
import torch.nn.functional as F

from megatron_mtraining.bench import environment, measure, write_json
from megatron_mtraining.ops.triton import launch
from megatron_mtraining.ops.triton.launch import KernelConfig
from megatron_mtraining.patterns.synthetic import vertical_slash_indices
from megatron_mtraining.patterns.indices import packed_index_lists


# ----------------------------------------------------------------------------- timing
_DRY_RUN = False          # --cpu-dry-run


def bench(fn, budget_s=2.0, max_reps=50, min_reps=3, warmup=2):
    """``(median ms, samples)`` of ``fn`` (:func:`megatron_mtraining.bench.measure`: CUDA events),
    repetitions adapted to ``budget_s``; ``warmup`` untimed calls, cut to one when a call takes over 1 s.
    A CPU dry run (``--cpu-dry-run``) calls ``fn`` once: its times mean nothing."""
    if _DRY_RUN:
        return measure(fn, device="cpu", warmup=0, repeats=1).median_ms, 1
    t = measure(fn, device="cuda" if torch.cuda.is_available() else "cpu", warmup=max(1, warmup), budget_s=budget_s,
                min_repeats=min_reps, max_repeats=max_reps, long_call_ms=1000)
    return t.median_ms, t.reps


def tflops(flop, ms):
    return flop / (ms * 1e-3) / 1e12 if ms and ms > 0 else None


# ----------------------------------------------------------------------------- baselines
def cudnn_fns(q, k, v, dout):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_(True) for t in (q, k, v))   # [b, h, s, d]
    dot = dout.transpose(1, 2)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        gqa = True
    except Exception:
        gqa = False
    if not gqa:
        rep = q.shape[2] // k.shape[2]
        kt = kt.detach().repeat_interleave(rep, 1).requires_grad_(True)
        vt = vt.detach().repeat_interleave(rep, 1).requires_grad_(True)

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)

    def fwd_bwd():
        o = fwd()
        o.backward(dot)
        qt.grad = kt.grad = vt.grad = None

    return fwd, fwd_bwd, ("enable_gqa" if gqa else "expanded K/V")


def flex_block_mask(pats, s, hq, block, device):
    """Equivalent FlexAttention BlockMask of the synthetic pattern (per-head offsets/columns)."""
    from torch.nn.attention.flex_attention import BlockMask
    nqb64 = s // 64
    is_off = torch.zeros(hq, nqb64 + 2, dtype=torch.bool, device=device)
    is_col = torch.zeros(hq, s, dtype=torch.bool, device=device)
    for h, (offs, cols) in enumerate(pats):
        is_off[h, offs.to(device)] = True
        is_col[h, cols.to(device)] = True
    nb = s // block
    f = block // 64
    i = torch.arange(nb, device=device)
    delta = (i[:, None] - i[None, :])                                   # [nb, nb] q-block - kv-block
    # 64-tile offsets covered by a (block x block) tile with block-offset delta: f*delta + (a - c)
    sub = torch.arange(-(f - 1), f, device=device)
    offs = (f * delta[..., None] + sub).clamp(min=0, max=nqb64 + 1)     # [nb, nb, 2f-1]
    valid_sub = (f * delta[..., None] + sub) >= 0
    listed = is_off[:, offs] & valid_sub[None]                          # [hq, nb, nb, 2f-1]
    any_tile = listed.any(-1)
    full = listed.all(-1) & (delta >= 1)[None] if f > 1 else listed[..., 0] & (delta >= 1)[None]
    col_blk = is_col.view(hq, nb, block).any(-1)                        # [hq, nb]
    active = (any_tile | col_blk[:, None, :]) & (delta >= 0)[None]
    partial = active & ~full

    def to_kv(m):
        cnt, idx = packed_index_lists(m, width=m.shape[-1], fill=0)
        return cnt[None], idx[None]

    kv_num, kv_idx = to_kv(partial)
    full_num, full_idx = to_kv(full)
    off_tab, col_tab = is_off, is_col

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = q_idx // 64, kv_idx // 64
        d = (qb - kb).clamp(min=0)
        return (kv_idx <= q_idx) & (off_tab[h, d] | col_tab[h, kv_idx])

    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod)
    computed_blocks = int(active.sum())
    return bm, computed_blocks


def flex_fns(q, k, v, dout, block_mask, block):
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    dot = dout.transpose(1, 2).contiguous()
    kw = dict(block_mask=block_mask, enable_gqa=True)
    if block == 64:
        kw["kernel_options"] = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64,
                                "BLOCK_N2": 64}

    def fwd():
        with torch.no_grad():
            return flex(qt, kt, vt, **kw)

    def fwd_bwd():
        o = flex(qt, kt, vt, **kw)
        o.backward(dot)
        qt.grad = kt.grad = vt.grad = None

    return fwd, fwd_bwd


# ----------------------------------------------------------------------------- ours
def ours_fns(q, k, v, dout, plan, scale, deterministic, config=None, stats=None):
    state = {}

    def fwd():
        state["o"], state["lse"] = launch.sparse_forward(q, k, v, plan, scale, out_dtype=q.dtype, config=config,
                                                         stats=stats)
        return state["o"]

    def fwd_bwd():
        o, lse = launch.sparse_forward(q, k, v, plan, scale, out_dtype=q.dtype, config=config, stats=stats)
        delta = launch.attention_delta(dout, o)          # as the ring computes it
        return launch.sparse_backward(dout, q, k, v, lse, delta, plan, scale, deterministic, config=config,
                                      stats=stats)

    return fwd, fwd_bwd


def pattern_from_sets(pats, s, device, block=64):
    """The :class:`VerticalSlashPattern` (batch 1) of per-head ``(block offsets, token columns)`` sets."""
    from megatron_mtraining.patterns.estimator import VerticalSlashPattern

    slash = [[sorted(int(x) for x in o.tolist()) for o, _ in pats]]
    vert = [[sorted(int(x) for x in c.tolist()) for _, c in pats]]
    return VerticalSlashPattern.from_lists(s, block, slash, vert).to(device)


def fa4_sparse_fns(q, k, v, dout, idx, scale, columns=True):
    """FA4 slash blocks (+ Triton columns when ``columns``) of one causal step: the ``fa4`` backend's kernel."""
    from megatron_mtraining.ops.fa4 import FA4SparseStepKernel
    from megatron_mtraining.ops.triton import make_sparse_step_kernel

    kern = FA4SparseStepKernel([idx], scale, fallback=make_sparse_step_kernel([idx], scale, deterministic=False),
                               deterministic=False)
    kern.expect_backward = True

    def fwd():
        return kern.forward(q, k, v, 0)

    def fwd_bwd():
        out, lse = kern.forward(q, k, v, 0)
        o = out.to(q.dtype)
        delta = launch.attention_delta(dout, o)
        kern.begin_backward(o)
        return kern.backward(dout, q, k, v, lse, delta, 0)

    return fwd, fwd_bwd


def round_to_blocks(idx):
    """``idx`` (128-token blocks, causal, cp 1) with its columns rounded up to whole 128x128 tiles."""
    from megatron_mtraining.patterns.indices import StepIndices

    b, h, m = idx.block_count.shape
    dev = idx.block_count.device
    tile = torch.zeros(b, h, m, m + 1, dtype=torch.bool, device=dev)
    w = idx.block_index.shape[-1]
    ok = torch.arange(w, device=dev) < idx.block_count[..., None].long()
    tile.scatter_(-1, torch.where(ok, idx.block_index.long(), torch.full_like(idx.block_index.long(), m)), True)
    wc = idx.column_index.shape[-1]
    okc = torch.arange(wc, device=dev) < idx.column_count[..., None].long()
    cb = torch.where(okc, idx.column_index.long() // 128, torch.full_like(idx.column_index.long(), m))
    tile.scatter_(-1, cb, True)
    tile = tile[..., :m] & torch.ones(m, m, dtype=torch.bool, device=dev).tril()
    cnt, order = packed_index_lists(tile, fill=-1)
    return StepIndices(cnt, order.contiguous(), torch.zeros_like(cnt),
                       torch.full((b, h, m, 1), -1, dtype=torch.int32, device=dev), True, 128)


def fa4_rows(q, k, v, dout, pat64, scale, budget, cud, emit, base):
    """``ours_fast128``, ``fa4_sparse128`` and ``fa4_round128`` rows for a 64-block pattern (cp 1).
    Returns ``{impl: (fwd_ms, fwd_bwd_ms, computed pairs)}``."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns.convert import convert_pattern, refine_indices

    s, d = q.shape[1], q.shape[3]
    idx = convert_pattern(pat64.coarsen(128), Layout("striped", 1, 128), 0)[0]
    fine = refine_indices(idx, 64)
    col_pairs = int(((fine.column_count.long() + 63) // 64).sum()) * 64 * 64
    block_pairs = int(idx.block_count.sum()) * 128 * 128
    rounded = round_to_blocks(idx)
    runs = {
        "ours_fast128": (lambda: ours_fns(q, k, v, dout, launch.plan_from_indices(
            fine.block_count, fine.block_index, fine.column_count, fine.column_index, True), scale, False),
            block_pairs + col_pairs),
        "fa4_sparse128": (lambda: fa4_sparse_fns(q, k, v, dout, idx, scale), block_pairs + col_pairs),
        "fa4_round128": (lambda: fa4_sparse_fns(q, k, v, dout, rounded, scale), int(rounded.block_count.sum()) * 128 * 128),
    }
    got = {}
    for impl, (make, pairs) in runs.items():
        try:
            f1, f2 = make()
            t1, _ = bench(f1, budget)
            t2, n2 = bench(f2, budget)
            got[impl] = (t1, t2, pairs)
            emit(dict(base, impl=impl, seq=s, d=d, fwd_ms=t1, fwd_bwd_ms=t2, tflops_fwd=tflops(4 * d * pairs, t1),
                      tflops_fwd_bwd=tflops(3.5 * 4 * d * pairs, t2), reps=n2,
                      computed_over_causal=pairs / (q.shape[2] * s * (s + 1) / 2),
                      speedup_fwd_bwd_vs_cudnn=(cud / t2) if cud else None))
        except Exception as e:
            traceback.print_exc()
            emit(dict(base, impl=impl, seq=s, d=d, error=repr(e)[:300]))
        torch.cuda.empty_cache()
    return got


def fa4_dense_row(q, k, v, dout, budget, cud):
    from megatron_mtraining.ops.fa4 import fa4_attention

    s, hq, d = q.shape[1], q.shape[2], q.shape[3]
    qa, ka, va = (t.detach().requires_grad_(True) for t in (q, k, v))
    f1 = lambda: fa4_attention(q, k, v, softmax_scale=d ** -0.5, causal=True)
    f2 = lambda: torch.autograd.grad(fa4_attention(qa, ka, va, softmax_scale=d ** -0.5, causal=True), (qa, ka, va), dout)
    t1, _ = bench(f1, budget, warmup=1)
    t2, n2 = bench(f2, budget, warmup=1)
    dense_pairs = hq * s * (s + 1) / 2
    return dict(impl="fa4_dense", seq=s, d=d, fwd_ms=t1, fwd_bwd_ms=t2, tflops_fwd=tflops(4 * d * dense_pairs, t1),
                tflops_fwd_bwd=tflops(3.5 * 4 * d * dense_pairs, t2), reps=n2,
                speedup_fwd_bwd_vs_cudnn=(cud / t2) if cud else None)


def kv_group_rows(q, k, v, dout, idx_g, scale, budget, emit, base, cud=None):
    """``share_pattern kv_group`` rows (module docstring) of the per-group indices ``idx_g`` (``hkv`` heads).
    Returns ``{impl: (fwd_ms, fwd_bwd_ms)}``."""
    import dataclasses

    hq, d = q.shape[2], q.shape[3]
    s = q.shape[1]
    pairs = (int(idx_g.block_count.sum()) + int(((idx_g.column_count + 63) // 64).sum())) * 64 * 64 * (hq // k.shape[2])
    full = idx_g.per_query_head(hq)
    cfg0 = launch.DEFAULT_CONFIG
    anyp = dict(pack_gqa_partial=True, pack_gqa_min_heads=1)           # every packing, whatever the group size
    variants = [("head", full, None), ("nopack", idx_g, dataclasses.replace(cfg0, pack_gqa=False)),
                ("default", idx_g, cfg0),
                ("pack128", idx_g, dataclasses.replace(cfg0, pack_gqa_rows=128, pack_gqa_dq_rows=64, **anyp)),
                ("pack256", idx_g, dataclasses.replace(cfg0, pack_gqa_rows=256, pack_gqa_dq_rows=64, **anyp)),
                ("pack256_dq128", idx_g, dataclasses.replace(cfg0, pack_gqa_rows=256, pack_gqa_dq_rows=128, **anyp)),
                ("pack256_dq256", idx_g, dataclasses.replace(cfg0, pack_gqa_rows=256, pack_gqa_dq_rows=256, **anyp))]
    out, ref = {}, {}
    for name, idx, cfg in variants:
        plan = launch.plan_from_indices(idx.block_count, idx.block_index, idx.column_count, idx.column_index, True)
        for det in (True, False):
            impl = f"ours_{'det' if det else 'fast'}_kvg_{name}"
            try:
                stats: dict = {}
                f1, f2 = ours_fns(q, k, v, dout, plan, scale, det, config=cfg, stats=stats)
                t1, _ = bench(f1, budget)
                t2, n2 = bench(f2, budget)
                if name == "head":
                    ref[det] = t2
                out[impl] = (t1, t2)
                regs = {kn: st.get("n_regs") for kn, st in stats.items()}
                emit(dict(impl=impl, seq=s, d=d, fwd_ms=t1, fwd_bwd_ms=t2, tflops_fwd=tflops(4 * d * pairs, t1),
                          tflops_fwd_bwd=tflops(3.5 * 4 * d * pairs, t2), reps=n2, kernel_regs=regs,
                          speedup_vs_head=(ref[det] / t2) if det in ref else None,
                          speedup_fwd_bwd_vs_cudnn=(cud / t2) if cud else None, **base))
            except Exception as e:
                traceback.print_exc()
                emit(dict(impl=impl, seq=s, d=d, error=repr(e)[:300], **base))
        del plan
        torch.cuda.empty_cache()
    return out


def prep_ms(idx, q_shape, k_shape, union: int, diagonal: bool = True):
    """Time to build a fresh plan of ``idx`` as training does, once per step: the forward plan and its
    column split, then the deterministic backward's index plans (inverted block index, column union) at
    static sizes (``union``: the most columns of one head). ``diagonal``: from the block diagonals'
    offsets (the training path of patterns converted at cp 1); False: the sorted plans of any lists."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    plan = launch.plan_from_indices(idx.block_count, idx.block_index, idx.column_count, idx.column_index, True,
                                    static=True, column_union_max=max(1, union), diagonal=diagonal)
    plan.column_split()
    launch.prebuild_backward_plans(plan, q_shape, k_shape, deterministic=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


# ----------------------------------------------------------------------------- main
IMPLS = ("cudnn", "flex", "ours", "fa4")
DTYPES = ("bfloat16", "float16", "float32")


def check_args(ap, args) -> None:
    """``ap.error`` (exit 2) naming the flag of an argument the benchmark cannot run with."""
    from megatron_mtraining.bench.cli import check_heads, check_output_dir, number_list
    from megatron_mtraining.ops.backends import TRITON_HEAD_DIMS

    impls = args.impls.split(",")
    bad = [x for x in impls if x not in IMPLS]
    if bad:
        ap.error(f"--impls {args.impls!r}: unknown {bad}; choose from {', '.join(IMPLS)}")
    check_heads(ap, args.heads, args.kv_heads)
    for d in number_list(ap, "--head-dims", args.head_dims, int):
        if d not in TRITON_HEAD_DIMS:
            ap.error(f"--head-dims: {d} is not a head_dim the sparse kernels support "
                     f"({', '.join(map(str, TRITON_HEAD_DIMS))})")
    if not args.pattern_file:      # with a pattern file its seq_len is used and --seqs/--sparsity are ignored
        for s in number_list(ap, "--seqs", args.seqs, int):
            if s < 64 or s % 64:
                ap.error(f"--seqs: {s} must be a positive multiple of 64 (the 64-token blocks)")
        for sp in number_list(ap, "--sparsity", args.sparsity, float):
            if not 0.0 <= sp < 1.0:
                ap.error(f"--sparsity: {sp} must lie in [0, 1) (the skipped share of the causal work)")
    if not 0.0 <= args.detail_sparsity < 1.0:
        ap.error(f"--detail-sparsity {args.detail_sparsity} must lie in [0, 1)")
    if not args.budget > 0:
        ap.error(f"--budget must be > 0 seconds, got {args.budget}")
    if args.layers < 0:
        ap.error(f"--layers must be >= 0 (0: all), got {args.layers}")
    if args.dtype not in DTYPES:
        ap.error(f"--dtype {args.dtype!r}: choose from {', '.join(DTYPES)}")
    check_output_dir(ap, "--json", args.json)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--seqs", default="32768,131072")
    ap.add_argument("--sparsity", default="0.9,0.95,0.98")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--impls", default="cudnn,flex,ours")
    ap.add_argument("--flex-block", type=int, default=128)
    ap.add_argument("--flex-max-seq", type=int, default=1 << 30)
    ap.add_argument("--cudnn-max-seq", type=int, default=1 << 30)
    ap.add_argument("--dense", action="store_true", help="also time our dense position-mask kernel")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed repetitions per measurement")
    ap.add_argument("--sweep", action="store_true", help="launch-config sweep at the first seq/sparsity/head_dim")
    ap.add_argument("--sweep-only", default="",
                    help="comma list: run only the sweep variants whose name contains one of these (and the default)")
    ap.add_argument("--breakdown", action="store_true", help="time blocks-only / columns-only")
    ap.add_argument("--flex-slash", action="store_true",
                    help="also FlexAttention on the slash blocks alone (columns removed), vs ours blocks-only")
    ap.add_argument("--detail-sparsity", type=float, default=0.95,
                    help="sparsity of --breakdown / --flex-slash / --profile")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel CUDA time of our deterministic fwd+bwd (torch.profiler) with executed TFLOP/s")
    ap.add_argument("--pattern-file", default=None, metavar="NPZ",
                    help="time ours (and cuDNN) on a saved pattern instead of synthetic ones: a file of "
                         "tools/pattern_recall.py / tools/imbalance.py --save-pattern, whose rows are layers x "
                         "heads (--heads per layer); its seq_len is used, --seqs/--sparsity are ignored")
    ap.add_argument("--layers", type=int, default=0, help="with --pattern-file: only the first N layers (0: all)")
    ap.add_argument("--regroup-heads", action="store_true",
                    help="with --pattern-file: take the file's head rows in order, --heads at a time, as layers of "
                         "another model's shape (e.g. SmolLM2's 30 x 9 rows as 16 layers of 16 Qwen2.5-3B heads); "
                         "the rows left over are dropped")
    ap.add_argument("--once", action="store_true",
                    help="run our deterministic fwd+bwd once per case, no timing (for ncu)")
    ap.add_argument("--share-pattern", choices=["head", "kv_group", "both"], default="head",
                    help="kv_group: time one pattern per GQA group (per-head expansion vs per-group indices, "
                         "packed or not) instead of the per-head rows; both: the two")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    ap.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)   # CPU + Triton interpreter
    args = ap.parse_args(argv)
    check_args(ap, args)

    torch._dynamo.config.cache_size_limit = 64
    dev = torch.device("cuda")
    if args.cpu_dry_run:
        dev = _cpu_dry_run()
    elif not torch.cuda.is_available():
        ap.error("times GPU kernels: needs a CUDA device")
    dt = getattr(torch, args.dtype)
    impls = args.impls.split(",")
    rows = []
    meta = environment(device=dev, tool="bench_attention")

    def save():
        write_json(args.json, dict(meta=meta, rows=rows))

    def emit(row):
        rows.append(row)
        save()
        f = lambda x: "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))
        print(f"ROW {row['impl']:14s} S={row['seq']:>7d} d={row['d']:3d} sp={f(row.get('sparsity'))} "
              f"fwd={f(row.get('fwd_ms'))}ms fb={f(row.get('fwd_bwd_ms'))}ms "
              f"TF fwd={f(row.get('tflops_fwd'))} fb={f(row.get('tflops_fwd_bwd'))} "
              f"useful fb={f(row.get('tflops_useful_fwd_bwd'))} speedup={f(row.get('speedup_fwd_bwd_vs_cudnn'))} "
              + (f"kernel={f(row['kernel_ms'])}ms share={f(row.get('share'))} "
                 f"TF exec={f(row.get('tflops_executed'))} regs={f(row.get('n_regs'))} "
                 f"spills={f(row.get('n_spills'))} " if 'kernel_ms' in row else "")
              + f"{row.get('note', '')}", flush=True)

    if args.pattern_file:
        for d in [int(x) for x in args.head_dims.split(",")]:
            file_bench(args, d, dev, dt, impls, emit)
        summary(rows)
        return
    for s in [int(x) for x in args.seqs.split(",")]:
        for d in [int(x) for x in args.head_dims.split(",")]:
            hq, hkv = args.heads, args.kv_heads
            scale = d ** -0.5
            g = torch.Generator(device=dev).manual_seed(args.seed)
            q = torch.randn(1, s, hq, d, device=dev, generator=g).to(dt)
            k = torch.randn(1, s, hkv, d, device=dev, generator=g).to(dt)
            v = torch.randn(1, s, hkv, d, device=dev, generator=g).to(dt)
            dout = torch.randn(1, s, hq, d, device=dev, generator=g).to(dt)
            dense_pairs = hq * s * (s + 1) / 2
            cud = None
            if "cudnn" in impls and s <= args.cudnn_max_seq:
                try:
                    row = cudnn_row(q, k, v, dout, args.budget)
                    cud = row["fwd_bwd_ms"]
                    emit(row)
                except Exception as e:
                    traceback.print_exc()
                    emit(dict(impl="cudnn_dense", seq=s, d=d, error=repr(e)[:300]))
                torch.cuda.empty_cache()
            if "fa4" in impls:
                try:
                    emit(fa4_dense_row(q, k, v, dout, args.budget, cud))
                except Exception as e:
                    traceback.print_exc()
                    emit(dict(impl="fa4_dense", seq=s, d=d, error=repr(e)[:300]))
                torch.cuda.empty_cache()
            if args.dense:
                for rb in (64, 128):
                    try:
                        pos = torch.arange(s, device=dev)
                        plan = launch.dense_plan(pos, pos, True, row_block=rb)
                        f1, f2 = ours_fns(q, k, v, dout, plan, scale, True)
                        t1, _ = bench(f1, args.budget)
                        t2, n2 = bench(f2, args.budget)
                        emit(dict(impl=f"ours_dense{rb}", seq=s, d=d, fwd_ms=t1, fwd_bwd_ms=t2,
                                  tflops_fwd=tflops(4 * d * dense_pairs, t1),
                                  tflops_fwd_bwd=tflops(3.5 * 4 * d * dense_pairs, t2), reps=n2,
                                  speedup_fwd_bwd_vs_cudnn=(cud / t2) if cud else None))
                        del plan
                    except Exception as e:
                        traceback.print_exc()
                        emit(dict(impl=f"ours_dense{rb}", seq=s, d=d, error=repr(e)[:300]))
                    torch.cuda.empty_cache()
            for sp in [float(x) for x in args.sparsity.split(",")]:
                if args.share_pattern != "head":
                    idx_g, st_g = vertical_slash_indices(s, hkv, sp, seed=args.seed, device=dev)
                    kv_group_rows(q, k, v, dout, idx_g, scale, args.budget, emit, dict(sparsity=sp), cud)
                    del idx_g
                    if args.share_pattern == "kv_group":
                        continue
                t0 = time.time()
                idx, st, pats = vertical_slash_indices(s, hq, sp, seed=args.seed, device=dev, return_sets=True)
                gen_s = time.time() - t0
                useful = st.keep * dense_pairs
                plan = launch.plan_from_indices(idx.block_count, idx.block_index, idx.column_count,
                                                idx.column_index, True)
                union = max(int(c.numel()) for _, c in pats)
                pms = {}
                for diag in (True, False):
                    prep_ms(idx, q.shape, k.shape, union, diag)       # first call: lazy CUDA module loads
                    pms[diag] = prep_ms(idx, q.shape, k.shape, union, diag)
                pattern = dict(keep=st.keep, mean_offsets=st.mean_offsets, mean_columns=st.mean_columns,
                               block_tiles=st.block_tiles, column_tiles=st.column_tiles, gen_s=round(gen_s, 1))
                if args.once:
                    f1, f2 = ours_fns(q, k, v, dout, plan, scale, True)
                    f2()
                    torch.cuda.synchronize()
                    print(f"ONCE S={s} d={d} sp={sp} done", flush=True)
                    del idx, plan
                    continue
                if "ours" in impls:
                    pairs = st.computed_pairs
                    for det in (True, False):
                        try:
                            f1, f2 = ours_fns(q, k, v, dout, plan, scale, det)
                            t1, _ = bench(f1, args.budget)
                            t2, n2 = bench(f2, args.budget)
                            emit(dict(impl="ours_det" if det else "ours_fast", seq=s, d=d, sparsity=sp, fwd_ms=t1,
                                      fwd_bwd_ms=t2, tflops_fwd=tflops(4 * d * pairs, t1),
                                      tflops_fwd_bwd=tflops(3.5 * 4 * d * pairs, t2),
                                      tflops_useful_fwd_bwd=tflops(3.5 * 4 * d * useful, t2),
                                      speedup_fwd_bwd_vs_cudnn=(cud / t2) if cud else None, reps=n2,
                                      prep_ms=pms[True], prep_sorted_ms=pms[False], pattern=pattern))
                        except Exception as e:
                            traceback.print_exc()
                            emit(dict(impl="ours", seq=s, d=d, sparsity=sp, error=repr(e)[:300]))
                    if args.breakdown and sp == args.detail_sparsity:
                        breakdown(q, k, v, dout, plan, scale, s, d, sp, emit, st)
                    if args.profile and sp == args.detail_sparsity:
                        profile(q, k, v, dout, plan, scale, s, d, sp, emit, st)
                    if args.sweep:
                        sweep(q, k, v, dout, plan, scale, s, d, sp, pairs, emit, args.budget, args.sweep_only)
                        args.sweep = False
                if "fa4" in impls:
                    fa4_rows(q, k, v, dout, pattern_from_sets(pats, s, dev), scale, args.budget, cud, emit,
                             dict(sparsity=sp))
                flex_runs = [("", pats)]
                if args.flex_slash and sp == args.detail_sparsity:
                    flex_runs.append(("_slash_only", [(o, c[:0]) for o, c in pats]))
                for tag, pp in (flex_runs if "flex" in impls and s <= args.flex_max_seq else []):
                    try:
                        bm, nblk = flex_block_mask(pp, s, hq, args.flex_block, dev)
                        f1, f2 = flex_fns(q, k, v, dout, bm, args.flex_block)
                        tc = time.time()
                        f1()
                        f2()
                        torch.cuda.synchronize()
                        compile_s = time.time() - tc
                        t1, _ = bench(f1, args.budget)
                        t2, n2 = bench(f2, args.budget)
                        fp = nblk * args.flex_block ** 2
                        emit(dict(impl=f"flex{args.flex_block}{tag}", seq=s, d=d, sparsity=sp, fwd_ms=t1, fwd_bwd_ms=t2,
                                  tflops_fwd=tflops(4 * d * fp, t1), tflops_fwd_bwd=tflops(3.5 * 4 * d * fp, t2),
                                  tflops_useful_fwd_bwd=tflops(3.5 * 4 * d * useful, t2) if not tag else None,
                                  speedup_fwd_bwd_vs_cudnn=(cud / t2) if cud else None, reps=n2,
                                  computed_over_causal=fp / dense_pairs, compile_s=round(compile_s, 1)))
                        del bm
                    except Exception as e:
                        traceback.print_exc()
                        emit(dict(impl="flex", seq=s, d=d, sparsity=sp, error=repr(e)[:300]))
                del idx, plan
                torch.cuda.empty_cache()
    summary(rows)


def cudnn_row(q, k, v, dout, budget, note=""):
    """Time SDPA cuDNN dense causal fwd and fwd+bwd on ``q`` ``[1, s, hq, d]``; the JSON row."""
    s, hq, d = q.shape[1], q.shape[2], q.shape[3]
    dense_pairs = hq * s * (s + 1) / 2
    f1, f2, how = cudnn_fns(q, k, v, dout)
    t1, _ = bench(f1, budget, warmup=1)
    t2, n2 = bench(f2, budget, warmup=1)
    return dict(impl="cudnn_dense", seq=s, d=d, fwd_ms=t1, fwd_bwd_ms=t2, tflops_fwd=tflops(4 * d * dense_pairs, t1),
                tflops_fwd_bwd=tflops(3.5 * 4 * d * dense_pairs, t2), reps=n2, note=note + how)


def file_bench(args, d, dev, dt, impls, emit):
    """Ours (deterministic and fast) per layer on the layers of a saved pattern, and cuDNN dense causal on the
    same shape; the last row sums the layers. Random q/k/v: the pattern alone decides the kernels' work."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns.convert import convert_pattern
    from megatron_mtraining.patterns.estimator import VerticalSlashPattern
    from megatron_mtraining.patterns.io import load_pattern

    try:
        pat, meta = load_pattern(args.pattern_file)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --pattern-file {e}") from None
    s, hq, hkv = pat.seq_len, args.heads, args.kv_heads
    rows = pat.slash.shape[1]
    if args.share_pattern != "head":
        return file_bench_kv_group(args, pat, meta, d, dev, dt, impls, emit)
    if hq % hkv:
        raise SystemExit(f"error: --heads {hq} is not a multiple of --kv-heads {hkv}")
    if rows < hq:
        raise SystemExit(f"error: {args.pattern_file} has {rows} head rows, fewer than --heads {hq}")
    if rows % hq and not args.regroup_heads:
        raise SystemExit(f"error: {args.pattern_file} has {rows} head rows: not layers x --heads {hq} "
                         f"(--regroup-heads takes them {hq} at a time)")
    nl = rows // hq if args.layers <= 0 else min(args.layers, rows // hq)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    q = torch.randn(1, s, hq, d, device=dev, generator=g).to(dt)
    k = torch.randn(1, s, hkv, d, device=dev, generator=g).to(dt)
    v = torch.randn(1, s, hkv, d, device=dev, generator=g).to(dt)
    dout = torch.randn(1, s, hq, d, device=dev, generator=g).to(dt)
    scale = d ** -0.5
    dense_pairs = hq * s * (s + 1) / 2
    cud = None
    if "cudnn" in impls:
        row = cudnn_row(q, k, v, dout, args.budget, note="one layer; ")
        cud = row["fwd_bwd_ms"]
        emit(row)
    if "fa4" in impls:
        emit(fa4_dense_row(q, k, v, dout, args.budget, cud))
    tot = {True: [0.0, 0.0], False: [0.0, 0.0]}
    tot128: dict = {}
    tiles_sum = 0
    for layer in range(nl):
        hs = slice(layer * hq, (layer + 1) * hq)
        sub = VerticalSlashPattern(s, pat.block_size, pat.slash[:, hs], pat.slash_count[:, hs], pat.vertical[:, hs],
                                   pat.vertical_count[:, hs]).to(dev)
        idx = convert_pattern(sub, Layout("striped", 1, 64), 0)[0]
        plan = launch.plan_from_indices(idx.block_count, idx.block_index, idx.column_count, idx.column_index, True)
        block_tiles = int(idx.block_count.sum())
        column_tiles = int(((idx.column_count + 63) // 64).sum())
        tiles = block_tiles + column_tiles
        tiles_sum += tiles
        pairs = tiles * 64 * 64
        if "fa4" in impls:
            for impl, (t1, t2, pairs128) in fa4_rows(q, k, v, dout, sub, scale, args.budget, cud, emit,
                                                     dict(layer=layer, note=f"layer {layer}")).items():
                acc = tot128.setdefault(impl, [0.0, 0.0, 0])
                acc[0] += t1
                acc[1] += t2
                acc[2] += pairs128
        for det in (True, False):
            f1, f2 = ours_fns(q, k, v, dout, plan, scale, det)
            t1, _ = bench(f1, args.budget)
            t2, n2 = bench(f2, args.budget)
            tot[det][0] += t1
            tot[det][1] += t2
            emit(dict(impl="ours_det" if det else "ours_fast", seq=s, d=d, layer=layer, fwd_ms=t1, fwd_bwd_ms=t2,
                      tflops_fwd=tflops(4 * d * pairs, t1), tflops_fwd_bwd=tflops(3.5 * 4 * d * pairs, t2), reps=n2,
                      computed_over_causal=pairs / dense_pairs, block_tiles=block_tiles, column_tiles=column_tiles,
                      speedup_fwd_bwd_vs_cudnn=(cud / t2) if cud else None, note=f"layer {layer}"))
    for impl, (t1, t2, pairs) in tot128.items():
        emit(dict(impl=impl + "_all_layers", seq=s, d=d, layers=nl, fwd_ms=t1, fwd_bwd_ms=t2,
                  tflops_fwd=tflops(4 * d * pairs, t1), tflops_fwd_bwd=tflops(3.5 * 4 * d * pairs, t2),
                  computed_over_causal=pairs / (nl * dense_pairs),
                  speedup_fwd_bwd_vs_cudnn=(nl * cud / t2) if cud else None, note=f"{nl} layers"))
    for det in (True, False):
        t1, t2 = tot[det]
        pairs = tiles_sum * 64 * 64
        emit(dict(impl=("ours_det" if det else "ours_fast") + "_all_layers", seq=s, d=d, layers=nl, fwd_ms=t1,
                  fwd_bwd_ms=t2, tflops_fwd=tflops(4 * d * pairs, t1), tflops_fwd_bwd=tflops(3.5 * 4 * d * pairs, t2),
                  computed_over_causal=pairs / (nl * dense_pairs),
                  speedup_fwd_bwd_vs_cudnn=(nl * cud / t2) if cud else None, pattern_meta=meta,
                  note=f"{nl} layers of {args.pattern_file}" + (f" regrouped {hq} rows per layer, {rows % hq} "
                                                                  f"rows left over" if args.regroup_heads else "")))


def file_bench_kv_group(args, pat, meta, d, dev, dt, impls, emit):
    """``--share-pattern kv_group`` on a saved pattern: ``--kv-heads`` rows per layer (a per-group pattern file)."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns.convert import convert_pattern
    from megatron_mtraining.patterns.estimator import VerticalSlashPattern

    s, hq, hkv = pat.seq_len, args.heads, args.kv_heads
    rows = pat.slash.shape[1]
    if hq % hkv or rows % hkv:
        raise SystemExit(f"error: --share-pattern kv_group needs --heads {hq} a multiple of --kv-heads {hkv} and "
                         f"{args.pattern_file}'s {rows} head rows a multiple of --kv-heads (a per-group file)")
    nl = rows // hkv if args.layers <= 0 else min(args.layers, rows // hkv)
    g = torch.Generator(device=dev).manual_seed(args.seed)
    q = torch.randn(1, s, hq, d, device=dev, generator=g).to(dt)
    k = torch.randn(1, s, hkv, d, device=dev, generator=g).to(dt)
    v = torch.randn(1, s, hkv, d, device=dev, generator=g).to(dt)
    dout = torch.randn(1, s, hq, d, device=dev, generator=g).to(dt)
    cud = None
    if "cudnn" in impls:
        row = cudnn_row(q, k, v, dout, args.budget, note="one layer; ")
        cud = row["fwd_bwd_ms"]
        emit(row)
    tot: dict = {}
    for layer in range(nl):
        hs = slice(layer * hkv, (layer + 1) * hkv)
        sub = VerticalSlashPattern(s, pat.block_size, pat.slash[:, hs], pat.slash_count[:, hs], pat.vertical[:, hs],
                                   pat.vertical_count[:, hs]).to(dev)
        idx = convert_pattern(sub, Layout("striped", 1, 64), 0)[0]
        for impl, (t1, t2) in kv_group_rows(q, k, v, dout, idx, d ** -0.5, args.budget, emit,
                                            dict(layer=layer, note=f"layer {layer}"), cud).items():
            acc = tot.setdefault(impl, [0.0, 0.0])
            acc[0] += t1
            acc[1] += t2
    for impl, (t1, t2) in tot.items():
        head = tot.get(impl.rsplit("_kvg_", 1)[0] + "_kvg_head")
        emit(dict(impl=impl + "_all_layers", seq=s, d=d, layers=nl, fwd_ms=t1, fwd_bwd_ms=t2,
                  speedup_vs_head=(head[1] / t2) if head else None, pattern_meta=meta,
                  speedup_fwd_bwd_vs_cudnn=(nl * cud / t2) if cud else None,
                  note=f"{nl} layers of {args.pattern_file}"))


def breakdown(q, k, v, dout, plan, scale, s, d, sp, emit, st):
    """Blocks only / columns only (same plan, the other half removed)."""
    zero = torch.zeros_like(plan.block_count)
    blocks_only = launch.SparsePlan(plan.block_count, plan.block_split, plan.block_index, None, None, plan.mask_mode)
    cols_only = launch.SparsePlan(zero, zero, plan.block_index[..., :1], plan.column_count, plan.column_index,
                                  plan.mask_mode)
    for name, p, tiles in (("blocks_only", blocks_only, st.block_tiles), ("columns_only", cols_only, st.column_tiles)):
        for det in (True, False):
            f1, f2 = ours_fns(q, k, v, dout, p, scale, det)
            t1, _ = bench(f1, 1.0)
            t2, n2 = bench(f2, 1.0)
            pairs = tiles * 64 * 64
            emit(dict(impl=f"ours_{name}_{'det' if det else 'fast'}", seq=s, d=d, sparsity=sp, fwd_ms=t1,
                      fwd_bwd_ms=t2, tflops_fwd=tflops(4 * d * pairs, t1), tflops_fwd_bwd=tflops(3.5 * 4 * d * pairs, t2),
                      reps=n2))


def profile(q, k, v, dout, plan, scale, s, d, sp, emit, st, iters=5):
    """Per-kernel CUDA time of our deterministic fwd+bwd (``torch.profiler``), mean per iteration.

    Executed TFLOP/s count the matrix products each kernel runs per 64x64 tile (2·64·64·d FLOP each):
    forward 2 (QK^T, PV) on block + column tiles; dQ 3 (QK^T, dO·V^T, dS·K) on block + column tiles;
    dK/dV 4 (K·Q^T, V·dO^T, P^T·dO, dS^T·Q) on block tiles; column dK/dV 4 on the (union chunk,
    query tile) pairs of the deterministic column plan. Other kernels (the column scatter, the
    ``delta`` of the benchmark, fills) get their time only."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    stats = {}                                   # registers / spills of each launched kernel
    ours_fns(q, k, v, dout, plan, scale, True, stats=stats)[1]()
    torch.cuda.synchronize()
    _, f2 = ours_fns(q, k, v, dout, plan, scale, True)
    col = launch._col_plan(plan, s, q.shape[0], q.shape[2]) if plan.has_columns else None
    col_pairs = int(col[2][-1]) if col is not None else 0           # offsets[-1] = number of entries
    tile_flop = 2 * 64 * 64 * d
    gemms = {"_sparse_fwd_kernel": (2, st.block_tiles + st.column_tiles),
             "_sparse_bwd_dq_kernel": (3, st.block_tiles + st.column_tiles),
             "_sparse_bwd_dkdv_kernel": (4, st.block_tiles),
             "_sparse_bwd_col_kernel": (4, col_pairs)}
    acts = [ProfilerActivity.CUDA] if q.is_cuda else [ProfilerActivity.CPU]     # CPU: --cpu-dry-run
    with tprofile(activities=acts) as prof:
        for _ in range(iters):
            f2()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0)
        if t and ev.key not in ("ProfilerStep*",):
            per[ev.key] = per.get(ev.key, 0.0) + t / 1e3 / iters          # us -> ms per iteration
    total = sum(per.values())
    for name, ms in sorted(per.items(), key=lambda x: -x[1]):
        if ms < 0.005 * total:
            continue
        short = next((g for g in gemms if g in name), name[:60])
        n_gemm, tiles = gemms.get(short, (0, 0))
        emit(dict(impl="profile", seq=s, d=d, sparsity=sp, note=short, kernel_ms=ms, share=ms / total,
                  tiles=tiles or None, tflops_executed=tflops(n_gemm * tile_flop * tiles, ms) if tiles else None,
                  **stats.get(short, {})))
    emit(dict(impl="profile", seq=s, d=d, sparsity=sp, note="total (sum of kernels)", kernel_ms=total,
              column_kernel_pairs=col_pairs, block_tiles=st.block_tiles, column_tiles=st.column_tiles))


def sweep(q, k, v, dout, plan, scale, s, d, sp, pairs, emit, budget, only=""):
    """One kernel's launch parameters at a time, the others at their defaults."""
    base = KernelConfig()
    variants = [("default", {}, True)]
    variants += [(f"fwd w{w} s{st}", dict(fwd_warps=w, fwd_stages=st), True) for w, st in [(4, 3), (4, 4), (8, 2)]]
    variants += [(f"dkdv w{w} s{st}", dict(dkdv_warps=w, dkdv_stages=st), True)
                 for w, st in [(4, 1), (4, 3), (8, 2)]]
    variants += [(f"dq w{w} s{st}", dict(dq_warps=w, dq_stages=st), True) for w, st in [(4, 3), (8, 2)]]
    variants += [(f"col w{w} s{st}", dict(col_warps=w, col_stages=st), True)
                 for w, st in [(4, 1), (4, 2), (4, 3), (8, 2), (8, 3)]]
    variants += [("fast col_atomic", dict(col_atomic_fast=True, dq_atomic_fast=False), False),
                 ("fast dq_atomic", dict(col_atomic_fast=False, dq_atomic_fast=True), False),
                 ("fast dq_atomic+col_atomic", dict(col_atomic_fast=True, dq_atomic_fast=True), False)]
    variants += [("column_split off (every column chunk masked)", dict(column_split=False), True)]
    variants += [(f"pair fwd w{w} s{st}", dict(fwd_pair=True, fwd_warps=w, fwd_stages=st), True)
                 for w, st in [(4, 2), (4, 3), (8, 2), (8, 3)]]
    variants += [(f"pair dq w{w} s{st}", dict(dq_pair=True, dq_warps=w, dq_stages=st), True)
                 for w, st in [(4, 2), (8, 2), (8, 3)]]
    variants += [(f"pair dkdv w{w} s{st}", dict(dkdv_pair=True, dkdv_warps=w, dkdv_stages=st), True)
                 for w, st in [(4, 2), (8, 1), (8, 2), (8, 3)]]
    variants += [("pair col_chunk 128", dict(col_chunk=128), True), ("fast pair col_chunk 128", dict(col_chunk=128), False)]
    variants += [(f"fast dq_atomic tma w{w} s{st}", dict(dq_atomic_fast=True, dq_tma=True, dkdv_warps=w,
                                                             dkdv_stages=st), False) for w, st in [(4, 2), (8, 2), (8, 3)]]
    variants += [("fast pair fwd+dq w8 + dq_atomic tma", dict(fwd_pair=True, fwd_warps=8, fwd_stages=3, dq_pair=True,
                                                              dq_warps=8, dq_stages=2, dq_atomic_fast=True, dq_tma=True,
                                                              dkdv_warps=8, dkdv_stages=2), False),
                 ("fast pair fwd+dq w8", dict(fwd_pair=True, fwd_warps=8, fwd_stages=3, dq_pair=True, dq_warps=8,
                                              dq_stages=2), False)]
    variants += [("pointer loads", dict(tma_loads=False), True), ("fast pointer loads", dict(tma_loads=False), False)]
    variants += [("tma loads", dict(tma_loads=True), True), ("fast tma loads", dict(tma_loads=True), False),
                 ("tma loads fwd w8 s2", dict(tma_loads=True, fwd_warps=8, fwd_stages=2), True),
                 ("tma loads s3", dict(tma_loads=True, fwd_stages=4, dq_stages=3, dkdv_stages=3), True)]
    variants += [(f"fast dq w{w} s{st}", dict(dq_warps=w, dq_stages=st), False) for w, st in [(8, 1), (8, 2)]]
    # stages and warps with the tensor-descriptor loads (the default for CUDA bf16/fp16 at head_dim 64 / 128)
    variants += [(f"tma+ {k} w{w} s{st}", {f"{k}_warps": w, f"{k}_stages": st}, True)
                 for k, w, st in [("fwd", 4, 2), ("dq", 4, 3), ("dkdv", 4, 1), ("dkdv", 4, 3), ("dkdv", 8, 2)]]
    variants += [("fast tma+ dq w4 s3", dict(dq_stages=3), False)]
    variants += [("fast default", {}, False),
                 ("fast pair all w8", dict(fwd_pair=True, dq_pair=True, dkdv_pair=True, fwd_warps=8, fwd_stages=2,
                                           dq_warps=8, dq_stages=2, dkdv_warps=8, dkdv_stages=2), False),
                 ("pair all w8", dict(fwd_pair=True, dq_pair=True, dkdv_pair=True, fwd_warps=8, fwd_stages=2,
                                      dq_warps=8, dq_stages=2, dkdv_warps=8, dkdv_stages=2), True)]
    keep = [x for x in only.split(",") if x]
    if keep:
        variants = [v for v in variants if v[0] == "default" or any(x in v[0] for x in keep)]
    for name, kw, det in variants:
        cfg = KernelConfig(**{**base.__dict__, **kw})
        try:
            f1, f2 = ours_fns(q, k, v, dout, plan, scale, det, config=cfg)
            t1, _ = bench(f1, budget / 2)
            t2, n2 = bench(f2, budget / 2)
            emit(dict(impl="sweep", seq=s, d=d, sparsity=sp, note=name, config=cfg.__dict__, fwd_ms=t1, fwd_bwd_ms=t2,
                      tflops_fwd=tflops(4 * d * pairs, t1), tflops_fwd_bwd=tflops(3.5 * 4 * d * pairs, t2)))
        except Exception as e:
            traceback.print_exc()
            emit(dict(impl="sweep", seq=s, d=d, sparsity=sp, note=name, error=repr(e)[:300]))


def _cpu_dry_run():
    """Exercise this script's Python on a CPU (Triton interpreter; the timer runs each call once on the wall
    clock, the other CUDA calls are stubbed)."""
    global _DRY_RUN
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1"
    _DRY_RUN = True

    torch.cuda.is_available = lambda: False            # the timer: wall clock
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.get_device_name = lambda *a, **k: "cpu-dry-run"
    return torch.device("cpu")


def summary(rows):
    print("\n| impl | seq | d | sparsity | fwd ms | fwd+bwd ms | TFLOP/s fwd | TFLOP/s fwd+bwd | useful fwd+bwd | "
          "speedup vs cuDNN (fwd+bwd) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    f = lambda x: "" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))
    for r in rows:
        if r["impl"] == "sweep" or "error" in r:
            continue
        print(f"| {r['impl']} | {r['seq']} | {r['d']} | {f(r.get('sparsity'))} | {f(r.get('fwd_ms'))} | "
              f"{f(r.get('fwd_bwd_ms'))} | {f(r.get('tflops_fwd'))} | {f(r.get('tflops_fwd_bwd'))} | "
              f"{f(r.get('tflops_useful_fwd_bwd'))} | {f(r.get('speedup_fwd_bwd_vs_cudnn'))} |")


if __name__ == "__main__":
    main()

"""Multi-rank check of the vertical-slash sparse ring over packed documents (torchrun, gloo).

Every rank builds the same q, k, v and document offsets, shards them with the layout and runs
``sparse_ring_attention(..., documents=...)`` (the estimator's collectives included; with 4 ranks
also over Megatron's 2 x 2 hierarchical CP groups). Its out, dQ, dK, dV shards are compared with an
fp64 reference built from the returned pattern (pattern ∧ causal ∧ same document, softmax per
row). The pattern must equal the one estimated at cp 1 on the whole sequence, padding must get
exact zeros and a single document must equal the unpacked sparse ring bitwise. Rank 0 prints one
``RESULT {json}`` line per case with the worst relative error over all ranks.

With ``--backend triton`` (set ``TRITON_INTERPRET=1`` on the CPU) the ring steps run the Triton
sparse kernels with their document mask instead: 64-token blocks on 512-token streams, fp32, the
flat ring, striped and zigzag; every step kernel must be the Triton one.

    torchrun --nproc-per-node 2 tests/workers/packed_sparse_ring_check.py [--backend triton]
"""
import dataclasses
import itertools
import json
import sys

import torch
import torch.distributed as dist

from megatron_mtraining.layout import Layout, PackedDocuments
from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash
from megatron_mtraining.ring.sparse import sparse_ring_attention
from tests.helpers.packed_ref import pattern_document_attention

S, D, BS = 128, 16, 16
SCALE = D ** -0.5
CFG = VerticalSlashConfig(recall=0.6, last_q=16, block_size=BS, sink_tokens=2, local_blocks=1, max_vertical=6,
                          max_slash=3)
DOCS = {
    "mixed": ([0, 1, 8, 41, 43, 107, 128], None),          # lengths 1, 7, 33, 2, 64, 21: straddle stripes
    "padded": ([0, 5, 30, 31], [0, 8, 40, 112]),           # padded slots and a padded tail (probes: padding)
    "padded_real_tail": ([0, 5, 30, 118], [0, 8, 40, 128]),  # padded slots, the last document real to the end
}
TRITON = "--backend" in sys.argv and sys.argv[sys.argv.index("--backend") + 1] == "triton"
if TRITON:      # the Triton kernels' 64-token blocks
    S, BS = 512, 64
    CFG = dataclasses.replace(CFG, last_q=64, block_size=BS, max_vertical=24)
    DOCS = {
        "mixed": ([0, 1, 40, 170, 180, 400, 512], None),   # lengths 1, 39, 130, 10, 220, 112: straddle blocks
        "padded": ([0, 5, 130, 300], [0, 64, 200, 448]),   # padded slots and a padded tail
    }


def _data(hq, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(1, S, h, D, generator=g, dtype=torch.float64) * 1.5  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _gather_worst(res):
    allres = [None] * dist.get_world_size()
    dist.all_gather_object(allres, res)
    return {k: (max(r[k] for r in allres) if isinstance(res[k], float) else all(r[k] for r in allres)) for k in res}


def run_case(group, hier, layout, name, hq, hkv, dtype, cfg=None):
    cfg = CFG if cfg is None else cfg
    rank = dist.get_rank(group)
    cu, padded = DOCS[name]
    q, k, v, do = (t.to(dtype) for t in _data(hq, hkv))
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, cu_seqlens_padded=padded)
    sh = lambda t: layout.shard(t, rank, 1)  # noqa: E731
    ql, kl, vl = (sh(t).contiguous().requires_grad_(True) for t in (q, k, v))
    backend, kernels = None, []
    if TRITON:
        from megatron_mtraining.ops.backends import select_backend

        tri = select_backend("triton", device="cpu", dtype=dtype, head_dim=D, seq_len_local=ql.shape[1],
                             cp_size=layout.cp_size, sparse=True, packed=True)
        backend = dataclasses.replace(tri, sparse_step=lambda st, sc: kernels.append(tri.sparse_step(st, sc))
                                      or kernels[-1])
    out, pat = sparse_ring_attention(ql, kl, vl, layout=layout, group=group, config=cfg, softmax_scale=SCALE,
                                     documents=docs, return_pattern=True, hierarchical_groups=hier, backend=backend)
    out.backward(sh(do))
    whole = estimate_vertical_slash(q.double(), k.double(), layout=Layout("striped", 1, BS), config=cfg,
                                    softmax_scale=SCALE, documents=docs)
    ref = pattern_document_attention(q, k, v, do, pat, docs, SCALE)[:4]
    got = (out, ql.grad, kl.grad, vl.grad)
    real = docs.real(layout, rank)[0]
    res = {key: (g.double() - sh(r)).abs().max().item() / r.abs().max().item()
           for key, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    res["finite"] = all(bool(torch.isfinite(g).all()) for g in got)
    res["padding_zero"] = all(bool((g[0, ~real] == 0).all()) for g in got)
    res["same_pattern"] = pat.same_selection(whole)
    if TRITON:
        from megatron_mtraining.ops.triton import TritonSparseStepKernel

        res["triton_steps"] = len(kernels) == 1 and isinstance(kernels[0], TritonSparseStepKernel) and all(
            st.has_documents for st in kernels[0].steps)
    return res


def single_document_bitwise(group, layout):
    rank = dist.get_rank(group)
    q, k, v, do = _data(4, 2, seed=5)
    docs = PackedDocuments.from_cu_seqlens([0, S], S)
    runs = []
    for documents in (None, docs):
        xs = [layout.shard(t, rank, 1).contiguous().requires_grad_(True) for t in (q, k, v)]
        out = sparse_ring_attention(*xs, layout=layout, group=group, config=CFG, documents=documents)
        out.backward(layout.shard(do, rank, 1))
        runs.append((out, *(x.grad for x in xs)))
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(*runs))}


def main():
    from tests.helpers.dist import finish_process_group, start_process_group

    start_process_group("gloo")
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    emit = lambda case, res: dist.get_rank() == 0 and print("RESULT " + json.dumps({"case": case, **res}),  # noqa: E731
                                                           flush=True)
    layouts = [Layout("striped", world, BS), Layout("zigzag", world)]
    dtypes = [torch.float32] if TRITON else [torch.float64, torch.float32]
    for layout, name, (hq, hkv), dtype in itertools.product(layouts, DOCS, [(2, 2), (4, 1)], dtypes):
        res = _gather_worst(run_case(group, None, layout, name, hq, hkv, dtype))
        emit(dict(ring="flat", layout=layout.kind, docs=name, hq=hq, hkv=hkv, dtype=str(dtype).split(".")[1]), res)
    if TRITON:
        finish_process_group()
        return
    per_doc = dataclasses.replace(CFG, probes="document")     # every document's probes, gathered across ranks
    for layout in layouts:
        res = _gather_worst(run_case(group, None, layout, "mixed", 4, 1, torch.float64, cfg=per_doc))
        emit(dict(ring="flat", layout=layout.kind, docs="mixed", hq=4, hkv=1, dtype="float64", probes="document"),
             res)
    if world == 4:
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
        hier = tuple(ps.get_hierarchical_context_parallel_groups())
        cp_group = ps.get_context_parallel_group()
        for name, dtype in itertools.product(DOCS, [torch.float64, torch.float32]):
            res = _gather_worst(run_case(cp_group, hier, Layout("striped", 4, BS), name, 4, 1, dtype))
            emit(dict(ring="hierarchical", layout="striped", docs=name, hq=4, hkv=1, dtype=str(dtype).split(".")[1]),
                 res)
    emit({"check": "single_document"}, _gather_worst(single_document_bitwise(group, Layout("striped", world, BS))))
    finish_process_group()


if __name__ == "__main__":
    main()

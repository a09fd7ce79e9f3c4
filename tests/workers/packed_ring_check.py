"""Multi-rank check of packed sequences on the dense ring (run under torchrun, gloo).

Every rank builds the same q, k, v and document offsets, shards them with the layout, runs
``ring_attention`` (and, with 4 ranks, ``hierarchical_ring_attention`` over Megatron's 2 x 2
hierarchical CP groups) with :class:`PackedDocuments`, and compares out, dQ, dK, dV of its shard with
an fp64 per-document reference (each document attended alone). It also checks that a single
document gives the unpacked ring's results bitwise, that padding gives exact zeros, and that
documents differing across ranks are an error on every rank. Rank 0 prints one ``RESULT {json}``
line per case with the worst relative error over all ranks.

    torchrun --nproc-per-node 4 tests/workers/packed_ring_check.py
"""
import itertools
import json

import torch
import torch.distributed as dist

from megatron_mtraining.layout import Layout, PackedDocuments
from megatron_mtraining.ring import ring_attention
from megatron_mtraining.ring.hierarchical import hierarchical_ring_attention
from tests.helpers.packed_ref import per_document_attention

S, D = 128, 16
DOCS = {
    "mixed": ([0, 1, 8, 41, 43, 107, 128], None),
    "padded": ([0, 5, 30, 31], [0, 8, 40, 48]),
}


def _data(b, hq, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, S, hq, D, generator=g, dtype=torch.float64),
            torch.randn(b, S, hkv, D, generator=g, dtype=torch.float64),
            torch.randn(b, S, hkv, D, generator=g, dtype=torch.float64),
            torch.randn(b, S, hq, D, generator=g, dtype=torch.float64))


def _gather_worst(res):
    allres = [None] * dist.get_world_size()
    dist.all_gather_object(allres, res)
    out = {k: (max(r[k] for r in allres) if isinstance(res[k], float) else all(r[k] for r in allres))
           for k in res}
    return out


def run_case(group, hier, layout, name, hq, hkv, dtype):
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    cu, padded = DOCS[name]
    q, k, v, do = (t.to(dtype) for t in _data(1, hq, hkv))      # the reference sees the same (rounded) inputs
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, cu_seqlens_padded=padded)
    ref = per_document_attention(q, k, v, do, cu, D ** -0.5, padded)
    sh = lambda t: layout.shard(t, rank, 1)
    ql, kl, vl = (sh(t).requires_grad_(True) for t in (q, k, v))
    if hier is None:
        out = ring_attention(ql, kl, vl, layout=layout, group=group, documents=docs)
    else:
        out = hierarchical_ring_attention(ql, kl, vl, layout=layout, inner_group=hier[0], outer_group=hier[1],
                                          documents=docs)
    out.backward(sh(do))
    got = (out, ql.grad, kl.grad, vl.grad)
    real = docs.real(layout, rank)[0]
    # relative to the largest magnitude of the whole reference tensor (a shard may hold only keys whose
    # gradient is 0 in exact arithmetic, e.g. one-token documents, so its own maximum is no scale)
    res = {key: (g.double() - sh(r)).abs().max().item() / r.abs().max().item()
           for key, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    res["finite"] = all(bool(torch.isfinite(g).all()) for g in got)
    res["padding_zero"] = all(bool((g[0, ~real] == 0).all()) for g in got)
    return res


def single_document_bitwise(group, layout):
    rank = dist.get_rank(group)
    q, k, v, do = _data(1, 4, 2, seed=5)
    docs = PackedDocuments.from_cu_seqlens([0, S], S)
    runs = []
    for documents in (None, docs):
        xs = [layout.shard(t, rank, 1).requires_grad_(True) for t in (q, k, v)]
        out = ring_attention(*xs, layout=layout, group=group, documents=documents)
        out.backward(layout.shard(do, rank, 1))
        runs.append((out, *(x.grad for x in xs)))
    return {"bitwise": all(torch.equal(a, b) for a, b in zip(*runs))}


def disagreement(group, layout):
    rank = dist.get_rank(group)
    q, k, v, _ = _data(1, 4, 2)
    cu = [0, 50, 128] if rank == 0 else [0, 51, 128]
    docs = PackedDocuments.from_cu_seqlens(cu, S)
    try:
        ring_attention(*(layout.shard(t, rank, 1) for t in (q, k, v)), layout=layout, group=group, documents=docs)
        return {"error": ""}
    except ValueError as e:
        return {"error": str(e)}


def plan_disagreement(group):
    """MTrainingAttention's check (CPPlan.check_documents): offsets malformed on rank 0 only must be an
    error on every rank, not a hang of the others in the ring."""
    from megatron_mtraining.plan import resolve

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    plan = resolve({"granularity": 16}, cp_group=group)
    q = torch.zeros(1, S // world, 4, D)
    error, docs = None, None
    try:
        docs = PackedDocuments.from_cu_seqlens([0, 200] if rank == 0 else [0, 50, 128], S)
    except ValueError as e:
        error = str(e)
    try:
        plan.check_documents(docs, q, error=error)
        return ""
    except ValueError as e:
        return str(e)


def main():
    from tests.helpers.dist import finish_process_group, start_process_group

    start_process_group("gloo")
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    emit = lambda case, res: dist.get_rank() == 0 and print("RESULT " + json.dumps({"case": case, **res}), flush=True)
    layouts = [Layout("striped", world, 16), Layout("striped", world, 1), Layout("zigzag", world)]
    for layout, name, (hq, hkv), dtype in itertools.product(layouts, DOCS, [(4, 4), (4, 1)],
                                                            [torch.float64, torch.float32]):
        res = _gather_worst(run_case(group, None, layout, name, hq, hkv, dtype))
        emit(dict(ring="flat", layout=layout.kind, granularity=layout.granularity, docs=name, hq=hq, hkv=hkv,
                  dtype=str(dtype).split(".")[1]), res)
    if world == 4:
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
        hier = tuple(ps.get_hierarchical_context_parallel_groups())
        cp_group = ps.get_context_parallel_group()
        for name, dtype in itertools.product(DOCS, [torch.float64, torch.float32]):
            res = _gather_worst(run_case(cp_group, hier, Layout("striped", 4, 16), name, 4, 1, dtype))
            emit(dict(ring="hierarchical", layout="striped", granularity=16, docs=name, hq=4, hkv=1,
                      dtype=str(dtype).split(".")[1]), res)
    emit({"check": "single_document"}, _gather_worst(single_document_bitwise(group, Layout("striped", world, 16))))
    errs = [None] * world
    dist.all_gather_object(errs, disagreement(group, Layout("striped", world, 16))["error"])
    emit({"check": "disagreement"}, {"errors": errs})
    errs = [None] * world
    dist.all_gather_object(errs, plan_disagreement(group))
    emit({"check": "plan_disagreement"}, {"errors": errs})
    finish_process_group()


if __name__ == "__main__":
    main()

"""Multi-rank check of the dense ring against an independent fp64 attention (run under torchrun).

Every rank builds the same global q, k, v (fixed seed), shards them with the layout, runs
``ring_attention`` forward and backward, and compares out, dQ, dK, dV of its shard with the
matching rows of a naive fp64 causal attention computed on the whole sequence. Rank 0 prints
one line ``RESULT {json}`` with the worst relative error of each quantity over all ranks.

    torchrun --nproc-per-node 2 tests/workers/ring_check.py --layout striped --granularity 16

``--backend nccl`` runs the ring on ``cuda:LOCAL_RANK`` over NCCL (multi-GPU machines); the fp64
reference stays on the CPU.
"""
import argparse
import itertools
import json

import torch
import torch.distributed as dist

from megatron_mtraining.layout import Layout
from megatron_mtraining.ring import ring_attention


def naive_attention(q, k, v, scale):
    """fp64 causal softmax attention, GQA by repeat_interleave: independent of the library."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    n = q.shape[1]
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def masked_attention(q, k, v, mask, scale):
    """fp64 attention with an explicit boolean mask [b, h, s, s] (True = attend)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def rel_err(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="striped", choices=["striped", "zigzag", "contiguous"])
    ap.add_argument("--granularity", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--wrong-layout", default=None, help="negative control: the ring is told this layout")
    ap.add_argument("--mismatch-rank", type=int, default=-1, help="this rank passes a shorter shard")
    ap.add_argument("--tp", type=int, default=1, help="build Megatron TPxCPxDP groups; the ring runs on the CP group")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--hier", type=int, nargs=2, default=None, metavar=("INNER", "OUTER"),
                    help="hierarchical ring over Megatron's hierarchical CP groups (also compared with the flat ring)")
    ap.add_argument("--sparse", action="store_true",
                    help="with --hier: the vertical-slash sparse ring (recall 0.9), flat vs hierarchical vs fp64 masked")
    ap.add_argument("--columns", default="in_ring", choices=["in_ring", "out_of_ring"],
                    help="with --sparse: where the vertical columns are computed (both runs use it)")
    ap.add_argument("--matrix", action="store_true",
                    help="run the whole test matrix (layouts x GQA x batch x head_dim x dtype) in this launch")
    ap.add_argument("--kernel-backend", default="auto", choices=["auto", "torch", "triton"],
                    help="with --hier (dense): the kernels of the flat and the hierarchical ring (select_backend)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                    help="nccl: the ring runs on cuda:LOCAL_RANK (the reference stays on the CPU)")
    ap.add_argument("--cases", default=None,
                    help="JSON list of {\"name\": ..., option: value}: run each case in turn in this process group "
                         "(options as above, e.g. \"hier\": [2, 2]); its RESULT lines are tagged with the name")
    args = ap.parse_args()

    from tests.helpers.dist import start_process_group

    args.device = start_process_group(args.backend)
    args.tag = None
    if args.cases is None:
        run(args)
    else:
        from megatron.core import parallel_state as ps

        for case in json.loads(args.cases):
            over = {k.replace("-", "_"): v for k, v in case.items() if k != "name"}
            unknown = set(over) - set(vars(args))
            if unknown:
                raise SystemExit(f"unknown case options {sorted(unknown)}")
            run(argparse.Namespace(**{**vars(args), **over, "cases": None, "tag": case["name"]}))
            ps.destroy_model_parallel()
    from tests.helpers.dist import finish_process_group

    finish_process_group()


def run(args):
    """One check (or the whole ``--matrix``) on the groups ``args`` asks for."""
    world = dist.get_world_size()
    args.hier_groups = None
    if args.hier:
        group, args.hier_groups = megatron_hierarchical_groups(args.tp, args.hier)
    elif args.tp > 1 or args.dp > 1:
        group = megatron_cp_group(args.tp, args.dp)
    else:
        group = dist.new_group(list(range(world))) if world > 1 else None
    if not args.matrix:
        check(args, group)
    else:
        layouts = [("striped", 1), ("striped", 16), ("striped", 64), ("zigzag", 64)]
        for (lay, gran), (h, hkv), bsz, hd, dt in itertools.product(
                layouts, [(4, 4), (4, 1)], [1, 2], [64, 128], ["float64", "float32"]):
            cfg = argparse.Namespace(**{**vars(args), "layout": lay, "granularity": gran, "heads": h,
                                        "kv_heads": hkv, "batch": bsz, "head_dim": hd, "dtype": dt})
            check(cfg, group)


def megatron_cp_group(tp, dp):
    """CP sub-group of a TPxCPxDP world built by Megatron (order tp-cp-ep-dp-pp: CP ranks strided by TP)."""
    from megatron.core import parallel_state as ps

    cp = dist.get_world_size() // (tp * dp)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    ranks = ps.get_context_parallel_global_ranks()
    base = dist.get_rank() % tp + (dist.get_rank() // (tp * cp)) * tp * cp
    assert ranks == [base + i * tp for i in range(cp)], ranks
    return ps.get_context_parallel_group()


def megatron_hierarchical_groups(tp, sizes):
    """CP group + [inner, outer] groups from Megatron's --hierarchical-context-parallel-sizes."""
    from megatron.core import parallel_state as ps

    inner_size, outer_size = sizes
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=inner_size * outer_size,
                                 hierarchical_context_parallel_sizes=[inner_size, outer_size])
    inner, outer = ps.get_hierarchical_context_parallel_groups()
    assert ps.get_context_parallel_rank() == dist.get_rank(outer) * inner_size + dist.get_rank(inner)
    return ps.get_context_parallel_group(), (inner, outer)


def _result_prefix(args) -> str:
    return f"RESULT {args.tag} " if getattr(args, "tag", None) else "RESULT "


def check(args, group):
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    dtype = getattr(torch, args.dtype)
    # a different problem per CP group, so traffic crossing groups would show up as a mismatch
    g = torch.Generator().manual_seed(1234 + (min(dist.get_process_group_ranks(group)) if group is not None else 0))
    b, s, h, hkv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    if getattr(args, "sparse", False):          # sink / local / previous-token heads: a strictly sparse pattern
        from tests.workers.vs_data import make_qkv

        q, k, v = make_qkv(b, s, h, hkv, d, seed=1234)
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    scale = d ** -0.5

    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = naive_attention(qr, kr, vr, scale)
    ref.backward(dout)

    layout = Layout(args.layout, world, args.granularity)
    ring_layout = Layout(args.wrong_layout, world, args.granularity) if args.wrong_layout else layout
    dev = getattr(args, "device", torch.device("cpu"))
    ql, kl, vl, dl = (layout.shard(t, rank, 1).to(dev, dtype).requires_grad_(True) for t in (q, k, v, dout))
    if rank == args.mismatch_rank:
        ql, kl, vl = (t[:, :-layout.granularity].detach().requires_grad_(True) for t in (ql, kl, vl))
    flat = None
    try:
        if args.hier_groups and args.sparse:
            from megatron_mtraining.patterns.estimator import VerticalSlashConfig
            from megatron_mtraining.ring.sparse import sparse_ring_attention

            cfg = VerticalSlashConfig(recall=0.9, local_blocks=1)
            flat, pattern = sparse_ring_attention(ql, kl, vl, layout=ring_layout, group=group, config=cfg,
                                                  softmax_scale=scale, return_pattern=True, columns=args.columns)
            flat_grads = torch.autograd.grad(flat, (ql, kl, vl), dl.detach())
            out = sparse_ring_attention(ql, kl, vl, layout=ring_layout, group=group, config=cfg, softmax_scale=scale,
                                        hierarchical_groups=args.hier_groups, columns=args.columns)
            # the reference becomes fp64 attention masked with the same (global) pattern
            qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (qr, kr, vr))
            mask = pattern.dense_mask().cpu()
            ref = masked_attention(qr, kr, vr, mask, scale)
            ref.backward(dout)
            args.density = (mask.sum() / (mask.shape[0] * mask.shape[1] * s * (s + 1) / 2)).item()
        elif args.hier_groups:
            from megatron_mtraining.ops.backends import select_backend
            from megatron_mtraining.ring.hierarchical import hierarchical_ring_attention

            kb = select_backend(args.kernel_backend, device=ql.device, dtype=ql.dtype, head_dim=ql.shape[-1],
                                seq_len_local=ql.shape[1], cp_size=world)
            args.step_kernel = type(kb.dense_step(ring_layout, rank, ql.shape[1] * world, scale, True,
                                                  device=ql.device)).__name__
            flat = ring_attention(ql, kl, vl, layout=ring_layout, group=group, softmax_scale=scale, backend=kb)
            flat_grads = torch.autograd.grad(flat, (ql, kl, vl), dl.detach())
            out = hierarchical_ring_attention(ql, kl, vl, layout=ring_layout, inner_group=args.hier_groups[0],
                                              outer_group=args.hier_groups[1], softmax_scale=scale, backend=kb)
        else:
            out = ring_attention(ql, kl, vl, layout=ring_layout, group=group, softmax_scale=scale)
    except ValueError as e:
        msg = str(e).splitlines()[0]
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, msg)
        if dist.get_rank() == 0:
            print(_result_prefix(args) + json.dumps({"error": errs}), flush=True)
        return
    out.backward(dl.detach())
    res = {
        "out": rel_err(out, layout.shard(ref.detach(), rank, 1)),
        "dq": rel_err(ql.grad, layout.shard(qr.grad, rank, 1)),
        "dk": rel_err(kl.grad, layout.shard(kr.grad, rank, 1)),
        "dv": rel_err(vl.grad, layout.shard(vr.grad, rank, 1)),
        "vs_flat": (max(rel_err(a, b) for a, b in zip((out, ql.grad, kl.grad, vl.grad), (flat, *flat_grads)))
                    if flat is not None else None),
        "finite": bool(torch.isfinite(out).all() and torch.isfinite(ql.grad).all()
                       and torch.isfinite(kl.grad).all() and torch.isfinite(vl.grad).all()),
    }
    allres = [None] * dist.get_world_size()
    dist.all_gather_object(allres, res)
    if dist.get_rank() == 0:
        worst = {key: max(r[key] for r in allres) for key in ("out", "dq", "dk", "dv")}
        worst["finite"] = all(r["finite"] for r in allres)
        worst["density"] = getattr(args, "density", 1.0)
        worst["step_kernel"] = getattr(args, "step_kernel", None)
        if allres[0]["vs_flat"] is not None:
            worst["vs_flat"] = max(r["vs_flat"] for r in allres)
        worst["config"] = {k: getattr(args, k) for k in ("layout", "granularity", "seq", "batch", "heads",
                                                          "kv_heads", "head_dim", "dtype", "wrong_layout")}
        print(_result_prefix(args) + json.dumps(worst), flush=True)


if __name__ == "__main__":
    main()

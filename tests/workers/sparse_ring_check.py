"""Multi-rank checks of the sparse (vertical-slash) ring, run under torchrun (gloo).

One launch runs the whole matrix for its world size (layouts striped g=64 and zigzag x GQA group 1
and 4, batch 2 with different patterns per sample) and prints one ``RESULT {json}`` line per check
on global rank 0:

* ``kind="masked"``: sparse ring (recall 0.9) out / dQ / dK / dV vs an independent fp64 attention
  masked with the cp=1 pattern (computed in-process with ``group=None`` on the whole sequence);
  ``same_pattern``: the ring's pattern equals that cp=1 pattern on every rank (so it is identical
  across cp sizes and layouts); ``density``: fraction of causal pairs kept (must be < 1).
  Every masked check runs twice: columns in the ring, and ``columns="out_of_ring"`` (config key
  ``columns``; ``columns_in_steps``: the columns the converter put into this rank's ring steps,
  all of which the column phase must carry instead).
* ``kind="oracle"``: recall 1.0 and huge caps → sparse ring vs the dense ring.
* ``kind="negative"``: deliberately broken indices (own step with ``causal=False``; own step with
  block indices shifted by one; the ring steps' columns dropped with no column phase) must NOT match the masked reference.
* ``kind="subgroup"`` (world 4 only, ``--subgroups``): two strided CP groups [0, 2] and [1, 3] with
  different data each (group-local → global rank translation in the estimator and the ring).

    torchrun --nproc-per-node 2 tests/workers/sparse_ring_check.py --seq 512

``--backend nccl`` runs the rings on ``cuda:LOCAL_RANK`` over NCCL (the Triton kernels and the GPU
estimator); the problems, patterns and fp64 references stay on the CPU.
"""
import argparse
import dataclasses
import itertools
import json

import torch
import torch.distributed as dist

from megatron_mtraining.layout import Layout
from megatron_mtraining.patterns.convert import convert_pattern
from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash
from megatron_mtraining.ring import RingAttentionFunc, ring_attention
from megatron_mtraining.ring.sparse import SparseStepKernel, sparse_ring_attention
from tests.workers.vs_data import make_qkv, naive_masked_attention


DEVICE = torch.device("cpu")      # where the rings run (--backend nccl: cuda:LOCAL_RANK)


def rel_err(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def make_layout(kind, cp):
    return Layout("striped", cp, 64) if kind == "striped" else Layout("zigzag", cp)


class Problem:
    """Global fp64 problem, its cp=1 pattern and the fp64 masked reference with gradients."""

    def __init__(self, seq, batch, hq, hkv, d, seed, cfg):
        self.q, self.k, self.v = make_qkv(batch, seq, hq, hkv, d, seed=seed)
        g = torch.Generator().manual_seed(seed + 7)
        self.dout = torch.randn(batch, seq, hq, d, generator=g, dtype=torch.float64)
        self.scale = d ** -0.5
        self.cfg = cfg
        # the pattern as a single process would estimate it from the fp32 inputs the ring sees
        self.pattern = estimate_vertical_slash(self.q.float(), self.k.float(), layout=Layout("striped", 1, 64),
                                               group=None, config=cfg, softmax_scale=self.scale)
        mask = self.pattern.dense_mask()                # [b, hq or hkv (share_pattern kv_group), S, S]
        mask = mask.repeat_interleave(hq // mask.shape[1], 1)
        causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        self.density = (mask.sum() / (causal.sum() * batch * hq)).item()
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (self.q, self.k, self.v))
        self.ref = naive_masked_attention(qr, kr, vr, mask, self.scale)
        self.ref.backward(self.dout)
        self.grads = (qr.grad, kr.grad, vr.grad)

    def shards(self, layout, rank, dtype=torch.float32):
        return [layout.shard(t, rank, 1).to(DEVICE, dtype).requires_grad_(True) for t in (self.q, self.k, self.v)] + \
               [layout.shard(self.dout, rank, 1).to(DEVICE, dtype)]

    def errors(self, layout, rank, out, ql, kl, vl):
        sh = lambda t: layout.shard(t.detach(), rank, 1)  # noqa: E731
        return {"out": rel_err(out, sh(self.ref)), "dq": rel_err(ql.grad, sh(self.grads[0])),
                "dk": rel_err(kl.grad, sh(self.grads[1])), "dv": rel_err(vl.grad, sh(self.grads[2])),
                "finite": bool(all(torch.isfinite(t).all() for t in (out, ql.grad, kl.grad, vl.grad)))}


def emit(res, kind, config):
    allres = [None] * dist.get_world_size()
    dist.all_gather_object(allres, res)
    if dist.get_rank() == 0:
        worst = {"kind": kind, "config": config}
        for key in allres[0]:
            vals = [r[key] for r in allres]
            worst[key] = max(vals) if isinstance(vals[0], float) else all(vals) if isinstance(vals[0], bool) \
                else vals
        print("RESULT " + json.dumps(worst), flush=True)


def masked_check(prob, layout, group, config, columns="in_ring"):
    rank = dist.get_rank(group) if group is not None else 0
    ql, kl, vl, dl = prob.shards(layout, rank)
    out, pat = sparse_ring_attention(ql, kl, vl, layout=layout, group=group, config=prob.cfg,
                                     softmax_scale=prob.scale, return_pattern=True, columns=columns)
    out.backward(dl)
    res = prob.errors(layout, rank, out, ql, kl, vl)
    if columns == "out_of_ring":     # the ring steps carry no columns; the column phase carries them all
        steps = convert_pattern(pat.to("cpu"), layout, rank)
        ring_cols = sum(int(st.column_count.sum()) for st in steps)
        res["columns_in_steps"] = float(ring_cols)      # max over ranks in emit()
        config = {**config, "columns": columns}
    res["same_pattern"] = bool(pat.to("cpu").same_selection(prob.pattern))
    res["density"] = prob.density
    res["distinct_samples"] = bool(prob.pattern.batch < 2 or not torch.equal(
        prob.pattern.dense_mask()[0], prob.pattern.dense_mask()[1]))
    emit(res, "masked", config)


def oracle_check(seq, batch, hq, hkv, d, seed, layout, group, config):
    cfg = VerticalSlashConfig(recall=1.0, max_vertical=seq, max_slash=seq // 64)
    q, k, v = make_qkv(batch, seq, hq, hkv, d, seed=seed)
    dout = torch.randn(batch, seq, hq, d, generator=torch.Generator().manual_seed(seed + 3), dtype=torch.float64)
    rank = dist.get_rank(group) if group is not None else 0
    runs = []
    for sparse in (True, False):
        ql, kl, vl = (layout.shard(t, rank, 1).to(DEVICE, torch.float32).requires_grad_(True) for t in (q, k, v))
        if sparse:
            out = sparse_ring_attention(ql, kl, vl, layout=layout, group=group, config=cfg, softmax_scale=d ** -0.5)
        else:
            out = ring_attention(ql, kl, vl, layout=layout, group=group, softmax_scale=d ** -0.5)
        out.backward(layout.shard(dout, rank, 1).to(DEVICE, torch.float32))
        runs.append((out.detach(), ql.grad, kl.grad, vl.grad))
    res = {key: rel_err(a, b) for key, a, b in zip(("out", "dq", "dk", "dv"), runs[0], runs[1])}
    emit(res, "oracle", config)


def negative_check(prob, layout, group, config):
    rank = dist.get_rank(group) if group is not None else 0
    for mode in ("no_causal_on_own_step", "shifted_block_index", "columns_dropped"):
        ql, kl, vl, dl = prob.shards(layout, rank)
        steps = [dataclasses.replace(st, known_max=None, **{f: getattr(st, f).to(DEVICE) for f in (
            "block_count", "block_index", "column_count", "column_index")})
            for st in convert_pattern(prob.pattern, layout, rank)]
        own = steps[rank]
        if mode == "no_causal_on_own_step":
            steps[rank] = dataclasses.replace(own, causal=False)
        elif mode == "columns_dropped":       # out-of-ring schedule without its column phase
            from megatron_mtraining.ring.sparse import without_columns

            steps = [without_columns(st) for st in steps]
        else:
            slot = torch.arange(own.block_index.shape[-1], device=own.block_index.device)
            valid = slot < own.block_count[..., None]
            shifted = torch.where(valid, (own.block_index - 1).clamp(min=0), own.block_index)
            steps[rank] = dataclasses.replace(own, block_index=shifted.to(own.block_index.dtype))
        out = RingAttentionFunc.apply(ql, kl, vl, SparseStepKernel(steps, prob.scale), group)
        out.backward(dl)
        emit(prob.errors(layout, rank, out, ql, kl, vl), "negative", {**config, "mode": mode})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--subgroups", action="store_true", help="also run on strided CP sub-groups (world 4)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args()
    from tests.helpers.dist import start_process_group

    global DEVICE
    DEVICE = start_process_group(args.backend)
    world = dist.get_world_size()
    group = dist.new_group(list(range(world))) if world > 1 else None
    cfg = VerticalSlashConfig(recall=0.9)
    seq, d, batch = args.seq, args.head_dim, 2
    for (kind, (hq, hkv)) in itertools.product(["striped", "zigzag"], [(4, 4), (4, 1)]):
        layout = make_layout(kind, world)
        seed = 11 + hkv
        config = {"cp": world, "layout": kind, "hq": hq, "hkv": hkv, "seq": seq, "batch": batch}
        prob = Problem(seq, batch, hq, hkv, d, seed, cfg)
        masked_check(prob, layout, group, config)
        masked_check(prob, layout, group, config, columns="out_of_ring")
        if hkv == hq:     # the oracle is the costliest check (a dense pattern): once per layout
            oracle_check(seq, batch, hq, hkv, d, seed, layout, group, config)
        if kind == "striped" and hkv == 1:
            negative_check(prob, layout, group, config)
    if args.subgroups and world == 4:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]   # every rank creates both, in order
        mine = groups[dist.get_rank() % 2]
        lo = min(dist.get_process_group_ranks(mine))
        layout = Layout("striped", 2, 64)
        prob = Problem(seq, batch, 4, 2, d, 100 + lo, cfg)          # different data per CP group
        masked_check(prob, layout, mine, {"cp": 2, "groups": [[0, 2], [1, 3]], "layout": "striped",
                                          "hq": 4, "hkv": 2, "seq": seq, "batch": batch})
        masked_check(prob, layout, mine, {"cp": 2, "groups": [[0, 2], [1, 3]], "layout": "striped",
                                          "hq": 4, "hkv": 2, "seq": seq, "batch": batch}, columns="out_of_ring")
    from tests.helpers.dist import finish_process_group

    finish_process_group()


if __name__ == "__main__":
    main()

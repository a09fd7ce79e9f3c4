"""torchrun worker: invalid or inconsistent CP inputs must fail on every rank alike, never hang.

Usage (from tests/distributed/test_agreement.py)::

    torchrun --nproc-per-node N tests/distributed/agreement_worker.py SCENARIO [SCENARIO ...]

The scenarios run one after the other in the same process group. For each, every rank calls the
entry point inside ``try``/``except ValueError`` and then, like a caller that catches the error and
carries on, gathers the outcomes and goes on to the next scenario (so a rank that an error left in a
collective also breaks the scenarios after it). Rank 0 prints
``RESULT SCENARIO [{"rank": r, "error": <the error or null>, ...}, ...]`` per scenario. A rank left in
the check's collective while another moved on is a hang (the test's timeout).

Scenarios:
    gqa_one_rank            rank 1 passes kv heads that do not divide its query heads (flat ring)
    length_one_rank         rank 1 passes a local length its layout cannot split (flat ring)
    layout_cp_one_rank      rank 1's layout has cp_size 4 in a 2-rank group (flat ring)
    scale_one_rank          rank 1 passes another softmax_scale (flat ring)
    sparse_scale_one_rank   rank 1 passes another softmax_scale (sparse ring)
    hier_swapped            4 ranks, 2 x 2 dense hierarchical ring with inner and outer groups swapped
    hier_swapped_sparse     the same for the sparse ring given the CP group
    hier_gqa_one_rank       dense hierarchical ring, rank 3 passes bad heads
    hier_ok                 4 ranks, correct groups: runs and matches the flat ring; a second backward
                            through the flat and the hierarchical ring raises on every rank
    plan_once               the CP plan's check communicates once per shape signature (2 ranks); then
                            ranks with different document offsets of equal weighted checksum are an
                            error on every rank (ring_attention and the plan's document check), and
                            so is softmax_scale=nan on rank 1
    plan_gqa_one_rank       the plan's check, rank 1 passes bad heads
    layer_policy_one_rank   rank 1's config keeps another layer dense (per-layer policy); the check
                            runs from the view of layer 2, which is sparse on both ranks
    auto_policy_timings_differ  dense_layers: auto where the two ranks' own times point different ways:
                            one decision (from the summed times) on both ranks
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megatron_mtraining.layout import Layout
from megatron_mtraining.ring import ring_attention
from tests.helpers.dist import finish_process_group, start_process_group


def _qkv(s_local=64, hq=4, hkv=2, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed + 17 * dist.get_rank())
    return (torch.randn(1, s_local, hq, d, generator=g, dtype=dtype),
            torch.randn(1, s_local, hkv, d, generator=g, dtype=dtype),
            torch.randn(1, s_local, hkv, d, generator=g, dtype=dtype))


def _groups_2x2(swapped: bool):
    """Megatron's hierarchical numbering on 4 ranks: inner {0,1},{2,3}, outer {0,2},{1,3}."""
    consecutive = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    r = dist.get_rank()
    inner, outer = consecutive[r // 2], strided[r % 2]
    return (outer, inner) if swapped else (inner, outer)


def _double_backward_errors(q, k, v, lay, world, inner, outer) -> list:
    """The error of a second backward through the flat and the hierarchical ring (``None``: no error)."""
    from megatron_mtraining.ring.hierarchical import hierarchical_ring_attention

    errors = []
    for attend in (lambda q, k, v: ring_attention(q, k, v, layout=lay, group=world),
                   lambda q, k, v: hierarchical_ring_attention(q, k, v, layout=lay, inner_group=inner,
                                                               outer_group=outer)):
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        (dq,) = torch.autograd.grad(attend(qg, kg, vg), qg, torch.ones_like(qg), create_graph=True)
        try:
            torch.autograd.grad(dq, kg, torch.ones_like(dq))
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return errors


def _colliding_documents_errors(plan) -> list:
    """Rank 0 packs [0,10,256,300,512], rank 1 [0,13,254,300,512] (the same weighted checksum mod
    1000003): the error of ring_attention and of the plan's document check (``None``: accepted)."""
    from megatron_mtraining.layout import PackedDocuments

    cu = [0, 10, 256, 300, 512] if dist.get_rank() == 0 else [0, 13, 254, 300, 512]
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), seq_len=512)
    lay = Layout("striped", dist.get_world_size(), 16)
    q, k, v = _qkv(s_local=256)
    errors = []
    for attend in (lambda: ring_attention(q, k, v, layout=lay, group=dist.group.WORLD, documents=docs),
                   lambda: resolve_plan(lay).check_documents(docs, q)):
        try:
            attend()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _nan_scale_error():
    """Rank 1 passes softmax_scale=nan to ring_attention: the error (``None``: accepted)."""
    q, k, v = _qkv()
    try:
        ring_attention(q, k, v, layout=Layout("striped", dist.get_world_size(), 16), group=dist.group.WORLD,
                       softmax_scale=float("nan") if dist.get_rank() == 1 else 0.25)
    except ValueError as e:
        return str(e)
    return None


def resolve_plan(lay):
    from megatron_mtraining.plan import resolve

    return resolve({"granularity": lay.granularity}, cp_group=dist.group.WORLD, seq_len=512)


def run(scenario: str) -> dict:
    rank = dist.get_rank()
    world = dist.group.WORLD
    lay = Layout("striped", dist.get_world_size(), 16)
    extra: dict = {}
    if scenario == "gqa_one_rank":
        q, k, v = _qkv(hkv=3 if rank == 1 else 2)
        ring_attention(q, k, v, layout=lay, group=world)
    elif scenario == "length_one_rank":
        q, k, v = _qkv(s_local=40 if rank == 1 else 64)
        ring_attention(q, k, v, layout=lay, group=world)
    elif scenario == "layout_cp_one_rank":
        q, k, v = _qkv()
        ring_attention(q, k, v, layout=Layout("striped", 4, 16) if rank == 1 else lay, group=world)
    elif scenario == "scale_one_rank":
        q, k, v = _qkv()
        ring_attention(q, k, v, layout=lay, group=world, softmax_scale=0.3 if rank == 1 else 0.25)
    elif scenario == "sparse_scale_one_rank":
        from megatron_mtraining.patterns.estimator import VerticalSlashConfig
        from megatron_mtraining.ring.sparse import sparse_ring_attention

        q, k, v = _qkv(s_local=128)
        cfg = VerticalSlashConfig(last_q=16, block_size=16, sink_tokens=16, local_blocks=1, max_vertical=64,
                                  max_slash=16)
        sparse_ring_attention(q, k, v, layout=lay, group=world, config=cfg,
                              softmax_scale=0.3 if rank == 1 else 0.25)
    elif scenario in ("hier_swapped", "hier_gqa_one_rank", "hier_ok"):
        from megatron_mtraining.ring.hierarchical import hierarchical_ring_attention

        inner, outer = _groups_2x2(swapped=scenario == "hier_swapped")
        q, k, v = _qkv(hkv=3 if (scenario == "hier_gqa_one_rank" and rank == 3) else 2)
        out = hierarchical_ring_attention(q, k, v, layout=lay, inner_group=inner, outer_group=outer)
        flat = ring_attention(q, k, v, layout=lay, group=world)
        extra["vs_flat"] = float((out - flat).abs().max() / flat.abs().max())
        if scenario == "hier_ok":
            extra["double_backward"] = _double_backward_errors(q, k, v, lay, world, inner, outer)
    elif scenario == "hier_swapped_sparse":
        from megatron_mtraining.patterns.estimator import VerticalSlashConfig
        from megatron_mtraining.ring.sparse import sparse_ring_attention

        q, k, v = _qkv(s_local=128)
        cfg = VerticalSlashConfig(last_q=16, block_size=16, sink_tokens=16, local_blocks=1, max_vertical=64,
                                  max_slash=16)
        sparse_ring_attention(q, k, v, layout=lay, group=world, config=cfg,
                              hierarchical_groups=_groups_2x2(swapped=True))
    elif scenario in ("plan_once", "plan_gqa_one_rank"):
        from megatron_mtraining.plan import resolve

        plan = resolve({"granularity": 16}, cp_group=world, seq_len=64 * dist.get_world_size())
        calls = []
        real = dist.all_gather

        def counting_all_gather(*a, **kw):
            calls.append(1)
            return real(*a, **kw)

        dist.all_gather = counting_all_gather
        try:
            q, k, v = _qkv(hkv=3 if (scenario == "plan_gqa_one_rank" and rank == 1) else 2)
            for _ in range(3):
                plan.check_inputs(q, k, v, softmax_scale=0.25)
            q2, k2, v2 = _qkv(s_local=32)
            plan.check_inputs(q2, k2, v2, softmax_scale=0.25)     # a new signature: checked again
            plan.check_inputs(q2, k2, v2, softmax_scale=0.25)
        finally:
            dist.all_gather = real
        extra["collectives"] = len(calls)
        if scenario == "plan_once":
            extra["documents_differ"] = _colliding_documents_errors(plan)
            extra["nan_scale"] = _nan_scale_error()
    elif scenario == "layer_policy_one_rank":
        from megatron_mtraining.plan import resolve

        cfg = {"granularity": 64, "pattern": "vertical_slash", "dense_layers": [1 if rank == 0 else 3]}
        plan = resolve(cfg, cp_group=world, seq_len=64 * dist.get_world_size(), num_layers=3)
        q, k, v = _qkv()
        plan.for_layer(2).check_inputs(q, k, v, softmax_scale=0.25)
    elif scenario == "auto_policy_timings_differ":
        extra.update(_auto_policy_decisions())
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    return extra


def _auto_policy_decisions() -> dict:
    """dense_layers: auto with per-rank times that point different ways: rank 0 measures its sparse
    attention faster (1 ms against 3), rank 1 its dense one (5 against 2); the sums (6 against 5) choose
    dense on both ranks, which then run the same dense ring. A second call does not measure again."""
    from megatron_mtraining.layer_policy import AutoLayerRunner
    from megatron_mtraining.plan import resolve

    rank, world = dist.get_rank(), dist.group.WORLD
    cfg = {"granularity": 64, "pattern": "vertical_slash", "dense_layers": "auto", "kernel_backend": "torch",
           "vertical_slash": {"last_q": 64, "block_size": 64, "sink_tokens": 0, "local_blocks": 1,
                              "max_vertical": 64, "max_slash": 2, "recall": 0.5}}
    plan = resolve(cfg, cp_group=world, seq_len=128 * dist.get_world_size(), num_layers=1)
    view = plan.for_layer(1)
    mine = {0: (1.0, 3.0), 1: (5.0, 2.0)}[rank]
    timed = []

    def timer(attention, q, k, v):
        attention(q, k, v)                 # the real ring runs (a collective): every rank calls it alike
        timed.append(1)
        return mine[(len(timed) - 1) % 2]

    runner = AutoLayerRunner(view, view.dense_view(), (), timer=timer)
    q, k, v = _qkv(s_local=128)
    out = runner(q, k, v, softmax_scale=0.25)
    again = runner(q, k, v, softmax_scale=0.25)
    dense = ring_attention(q, k, v, layout=plan.layout, group=world, softmax_scale=0.25)
    d = plan.layer_decisions(world)
    return {"decisions": [x.to_dict() for x in d], "timed": len(timed), "groups": len(runner.groups),
            "is_dense_ring": bool(torch.equal(out, dense) and torch.equal(again, dense))}


def main(argv: list[str]) -> int:
    start_process_group("gloo")
    for scenario in argv:
        res = {"rank": dist.get_rank(), "error": None}
        try:
            res.update(run(scenario))
        except ValueError as e:
            res["error"] = str(e)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, res)
        if dist.get_rank() == 0:
            print(f"RESULT {scenario} " + json.dumps(rows), flush=True)
    finish_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Sparse ring with one pattern per GQA group (``share_pattern="kv_group"``), run under torchrun (gloo).

Per launch (world size = cp): striped g=64, GQA 4/2 and 6/2, batch 2, S = 256, d = 16; prints one
``RESULT {json}`` line per check on global rank 0 (``kind="kv_group"``):

* out / dQ / dK / dV of the sparse ring (fp32) vs the fp64 attention masked with the cp=1
  kv_group pattern repeated per query head (tests/workers/sparse_ring_check.py ``Problem``);
  ``same_pattern``: the ring's pattern equals the cp=1 one; ``pattern_heads``: hkv;
  ``headwise_differs``: the per-head pattern (``share_pattern="head"``) of the same inputs is a
  different mask (negative control: the option changes the selection);
* columns in the ring and out of it; kernels: the torch reference (``--kernels torch``: steps repeated
  per query head) or the Triton kernels in the CPU interpreter (``--kernels triton``: per-group
  indices read by the kernels, every group's heads packed into one forward / dQ tile; the pattern is
  estimated by the fp64 torch path in both).

    torchrun --nproc-per-node 2 tests/workers/kv_group_ring_check.py --kernels triton
"""
import os
import sys

if "triton" in sys.argv:                   # before triton is imported (interpreted kernels on the CPU)
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_mtraining.layout import Layout  # noqa: E402
from megatron_mtraining.ops.backends import select_backend  # noqa: E402
from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash  # noqa: E402
from megatron_mtraining.ring.sparse import sparse_ring_attention  # noqa: E402
from tests.workers.sparse_ring_check import Problem, emit  # noqa: E402


def check(prob, layout, group, kernels, columns, config):
    rank = dist.get_rank(group) if group is not None else 0
    cp = layout.cp_size
    ql, kl, vl, dl = prob.shards(layout, rank)
    kcfg = None
    if kernels == "triton":       # pack every group (4/2: 2 heads; 6/2: 3 heads in a 4-slot tile, one masked)
        from megatron_mtraining.ops.triton.launch import KernelConfig

        kcfg = KernelConfig(pack_gqa_partial=True, pack_gqa_min_heads=1, pack_gqa_dq_rows=256)
    backend = select_backend(kernels, device=ql.device, dtype=ql.dtype, head_dim=ql.shape[-1],
                             seq_len_local=ql.shape[1], cp_size=cp, sparse=True, kernel_config=kcfg)
    backend = dataclasses.replace(backend, estimator_impl="torch", convert_impl="torch")
    out, pat = sparse_ring_attention(ql, kl, vl, layout=layout, group=group, config=prob.cfg,
                                     softmax_scale=prob.scale, return_pattern=True, columns=columns,
                                     backend=backend)
    out.backward(dl)
    res = prob.errors(layout, rank, out, ql, kl, vl)
    res["same_pattern"] = bool(pat.to("cpu").same_selection(prob.pattern))
    res["pattern_heads"] = float(pat.num_heads)
    res["density"] = prob.density
    headwise = estimate_vertical_slash(prob.q.float(), prob.k.float(), layout=Layout("striped", 1, 64),
                                       config=dataclasses.replace(prob.cfg, share_pattern="head"),
                                       softmax_scale=prob.scale)
    hq = prob.q.shape[2]
    shared = prob.pattern.dense_mask().repeat_interleave(hq // prob.pattern.num_heads, 1)
    res["headwise_differs"] = bool(not torch.equal(headwise.dense_mask(), shared))
    emit(res, "kv_group", {**config, "columns": columns, "kernels": kernels})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--kernels", nargs="+", default=["torch"], choices=["torch", "triton"],
                    help="kernels to check, each in turn in this process group")
    args = ap.parse_args()
    from tests.helpers.dist import finish_process_group, start_process_group

    start_process_group("gloo")
    world = dist.get_world_size()
    group = dist.new_group(list(range(world))) if world > 1 else None
    cfg = VerticalSlashConfig(recall=0.9, sink_tokens=16, local_blocks=1, share_pattern="kv_group")
    layout = Layout("striped", world, 64)
    for hq, hkv in ((4, 2), (6, 2)):
        prob = Problem(args.seq, 2, hq, hkv, args.head_dim, 21 + hq, cfg)
        config = {"cp": world, "hq": hq, "hkv": hkv, "seq": args.seq}
        for kernels in args.kernels:
            for columns in ("in_ring", "out_of_ring"):
                check(prob, layout, group, kernels, columns, config)
    finish_process_group()


if __name__ == "__main__":
    main()

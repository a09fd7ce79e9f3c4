"""Overlap of the outer (inter-node) transfer with the inner ring, under an injected slow link.

Run on 4 ranks = 2 "nodes" x 2 (Megatron hierarchical CP groups [2, 2]). Every outer transfer
is made to take ``--delay`` seconds (DelayedComm). Forward wall time (max over ranks, median of
``--reps``) is measured for:
  * hier_overlap: hierarchical ring, outer transfer posted before the inner ring (Algorithm 2);
  * hier_serial: the same ring but waiting for the outer transfer before the inner ring;
  * flat: the flat ring over the same 4 ranks where every step's exchange takes ``--delay``
    (each step of a flat ring crosses the slow link somewhere, and the ring moves in lock step);
  * inner_only: the hierarchical ring with no delay (the inner work).
Rank 0 prints ``RESULT {json}``.
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from megatron_mtraining.distributed import RingComm
from megatron_mtraining.layout import Layout
from megatron_mtraining.ring import DenseStepKernel, RingAttentionFunc
from megatron_mtraining.ring.hierarchical import DelayedComm, hierarchical_ring_attention


def timed(fn, reps):
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            fn()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay", type=float, default=0.0,
                    help="seconds per outer transfer; 0 = the measured inner-ring time of one outer step")
    ap.add_argument("--seq-local", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    inner, outer = ps.get_hierarchical_context_parallel_groups()
    cp_group = ps.get_context_parallel_group()
    cp_rank = ps.get_context_parallel_rank()
    layout = Layout("striped", 4, 64)
    torch.manual_seed(cp_rank)
    q, k, v = (torch.randn(1, args.seq_local, args.heads, 64) for _ in range(3))
    seq = args.seq_local * 4
    scale = 64 ** -0.5

    def hier(delay, overlap):
        return lambda: hierarchical_ring_attention(q, k, v, layout=layout, inner_group=inner, outer_group=outer,
                                                   overlap=overlap, outer_link_delay_s=delay)

    def flat(delay):
        kernel = DenseStepKernel(layout, cp_rank, seq, scale)
        comm = DelayedComm(cp_group, delay) if delay > 0 else RingComm(cp_group)
        return lambda: RingAttentionFunc.apply(q, k, v, kernel, comm)

    for fn in (hier(0.0, True), hier(0.0, True), hier(0.0, False), flat(0.0)):   # warm-up of every path timed
        fn()
    inner_only = timed(hier(0.0, True), args.reps)
    delay = args.delay or inner_only / 2                       # transfer time = one inner ring: largest contrast
    args.delay = round(delay, 3)
    res = {
        "delay_s": args.delay,
        "inner_only": inner_only,
        "hier_overlap": timed(hier(args.delay, True), args.reps),
        "hier_serial": timed(hier(args.delay, False), args.reps),
        "flat_no_delay": timed(flat(0.0), args.reps),
        "flat": timed(flat(args.delay), args.reps),
    }
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(res), flush=True)
    from tests.helpers.dist import finish_process_group

    finish_process_group()


if __name__ == "__main__":
    main()

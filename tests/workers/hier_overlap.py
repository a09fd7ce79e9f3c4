"""Overlap of the outer (inter-node) transfer with the inner ring, under an injected slow link.

Run on 4 ranks = 2 "nodes" x 2 (Megatron hierarchical CP groups [2, 2]). Every outer transfer
is made to take ``--delay`` seconds (DelayedComm). For the hierarchical ring with the outer
transfer posted before the inner ring (Algorithm 2, ``overlap``) and with it awaited first
(``serial``), the worker measures per forward (max over ranks, median of ``--reps``) the slow-link
time that was not hidden (DelayedComm.exposed_delay_s) and the whole time blocked in the outer
wait (DelayedComm.blocked_s). These measure the schedule, not the machine's speed: slower compute
only hides more of the link. Wall times are reported for information. Rank 0 prints ``RESULT {json}``.
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from megatron_mtraining.distributed import RingComm
from megatron_mtraining.layout import Layout
from megatron_mtraining.ring import DenseStepKernel
from megatron_mtraining.ring.hierarchical import DelayedComm, HierarchicalRingAttentionFunc


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, outer, reps):
    """Median wall, exposed-delay and blocked seconds per call, each the max over ranks."""
    walls, exposed, blocked = [], [], []
    for _ in range(reps):
        dist.barrier()
        if isinstance(outer, DelayedComm):
            outer.blocked_s = outer.exposed_delay_s = 0.0
        t0 = time.perf_counter()
        with torch.no_grad():
            fn()
        walls.append(_max_over_ranks(time.perf_counter() - t0))
        exposed.append(_max_over_ranks(getattr(outer, "exposed_delay_s", 0.0)))
        blocked.append(_max_over_ranks(getattr(outer, "blocked_s", 0.0)))
    return statistics.median(walls), statistics.median(exposed), statistics.median(blocked)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay", type=float, default=0.0,
                    help="seconds per outer transfer; 0 = a third of the measured inner-ring time of one outer step")
    ap.add_argument("--seq-local", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])
    inner_group, outer_group = ps.get_hierarchical_context_parallel_groups()
    cp_rank = ps.get_context_parallel_rank()
    layout = Layout("striped", 4, 64)
    torch.manual_seed(cp_rank)
    q, k, v = (torch.randn(1, args.seq_local, args.heads, 64) for _ in range(3))
    kernel = DenseStepKernel(layout, cp_rank, args.seq_local * 4, 64 ** -0.5)
    inner = RingComm(inner_group, "inner")

    def hier(outer, overlap):
        return lambda: HierarchicalRingAttentionFunc.apply(q, k, v, kernel, inner, outer, overlap)

    plain = RingComm(outer_group, "outer")
    for overlap in (True, True, False):                                 # warm-up of every path timed
        hier(plain, overlap)()
    inner_only, _, _ = timed(hier(plain, True), plain, args.reps)
    # 2 outer steps: one outer transfer per forward, hidden behind the first outer step's inner ring
    # (inner_only / 2). A third of that leaves room for an overestimated inner_only on a busy machine.
    delay = round(args.delay or inner_only / 6, 3)
    slow = DelayedComm(outer_group, delay, "outer")
    overlap_wall, overlap_exposed, overlap_blocked = timed(hier(slow, True), slow, args.reps)
    serial_wall, serial_exposed, serial_blocked = timed(hier(slow, False), slow, args.reps)
    res = {"delay_s": delay, "inner_only": inner_only,
           "overlap_exposed": overlap_exposed, "serial_exposed": serial_exposed,
           "overlap_blocked": overlap_blocked, "serial_blocked": serial_blocked,
           "overlap_wall": overlap_wall, "serial_wall": serial_wall}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(res), flush=True)
    from tests.helpers.dist import finish_process_group

    finish_process_group()


if __name__ == "__main__":
    main()

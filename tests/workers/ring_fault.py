"""One rank fails at a chosen point of a ring; the others must end on their own (launched by
``tests.helpers.dist.run_ranks``, one process per rank, ``env://``).

The process groups get ``--timeout-s`` through the API users call: ``init_process_group(timeout=...)``
for the default group (the flat and sparse rings run on it) and ``new_group(ranks, timeout=...)`` for
the hierarchical inner and outer groups. The victim rank fails, by ``--how``:

* ``exit``: ``os._exit(17)`` (a crash: no clean-up, sockets closed by the OS);
* ``sigkill``: ``SIGKILL`` to itself;
* ``raise``: a Python exception (the process exits through the interpreter, status 1);
* ``hang``: sleeps (alive but stuck: the others can only notice through the timeout).

Where, by one of:

* ``--at LABEL``: when it is about to post the exchange whose name (``"{ring} ring {where}"`` of
  :class:`~megatron_mtraining.distributed.RingComm`) starts with ``LABEL``, e.g.
  ``"flat ring forward step 0"``: before it sends anything for that step;
* ``--kernel forward:N`` / ``backward:N``: inside its ``N``-th (from 0) call of the step kernel of
  that pass (the ring step's compute; the exchange for the next step is already posted);
* ``--estimator``: on entering the vertical-slash estimator (sparse ring: before its collectives).

Every rank prints ``RING_START <time.time()>`` just before the attention call, and on an exception
``ERROR {json}`` (type, ``where``/``peers``/``timeout_s`` of a ``CommError``, message) before the
exception ends the process. Without a fault every rank prints ``DONE`` and exits 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_mtraining.distributed import CommError, RingComm
from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.reference import DenseStepKernel


def fault(how: str, where: str) -> None:
    print(f"VICTIM rank {dist.get_rank()} fails ({how}) at {where}", file=sys.stderr, flush=True)
    if how == "exit":
        os._exit(17)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "raise":
        raise RuntimeError(f"injected fault at {where}")
    if how == "hang":
        time.sleep(3600)
    raise SystemExit(f"unknown --how {how}")


def install_fault(args) -> None:
    if args.at:
        orig = RingComm.exchange

        def exchange(self, send, recv, where="exchange"):
            if f"{self.name} ring {where}".startswith(args.at):
                fault(args.how, f"{self.name} ring {where}")
            return orig(self, send, recv, where)

        RingComm.exchange = exchange
    if args.kernel:
        phase, n = args.kernel.split(":")
        calls = {"forward": 0, "backward": 0}
        for name in ("forward", "backward"):
            orig = getattr(DenseStepKernel, name)

            def wrapped(self, *a, _orig=orig, _name=name):
                if _name == phase and calls[_name] == int(n):
                    fault(args.how, f"step kernel {_name}:{n}")
                calls[_name] += 1
                return _orig(self, *a)

            setattr(DenseStepKernel, name, wrapped)
    if args.estimator:
        import megatron_mtraining.ring.sparse as sparse

        orig_est = sparse.estimate_vertical_slash

        def estimate(*a, **kw):
            fault(args.how, "vertical-slash estimator")
            return orig_est(*a, **kw)

        sparse.estimate_vertical_slash = estimate


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ring", choices=["flat", "hier", "sparse"], default="flat")
    p.add_argument("--victim", type=int, default=None, help="rank that fails (none: a run without a fault)")
    p.add_argument("--how", choices=["exit", "sigkill", "raise", "hang"], default="exit")
    p.add_argument("--at", default=None)
    p.add_argument("--kernel", default=None)
    p.add_argument("--estimator", action="store_true")
    p.add_argument("--timeout-s", type=float, default=20.0)
    args = p.parse_args()

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = None
    if args.ring == "hier":              # Megatron's numbering: inner = consecutive ranks, outer = stride 2
        inner_groups = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
        outer_groups = [dist.new_group([0, 2], timeout=timeout), dist.new_group([1, 3], timeout=timeout)]
        groups = (inner_groups[rank // 2], outer_groups[rank % 2])
    torch.manual_seed(rank)
    sparse = args.ring == "sparse"
    seq_local, heads, d = (128, 2, 16) if sparse else (32, 2, 16)
    q, k, v = (torch.randn(1, seq_local, heads, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    layout = Layout("striped", world, 64 if sparse else 16)
    if args.victim == rank:
        install_fault(args)
    print(f"RING_START {time.time()}", flush=True)
    try:
        if args.ring == "flat":
            from megatron_mtraining.ring import ring_attention

            out = ring_attention(q, k, v, layout=layout, group=dist.group.WORLD)
        elif args.ring == "hier":
            from megatron_mtraining.ring.hierarchical import hierarchical_ring_attention

            out = hierarchical_ring_attention(q, k, v, layout=layout, inner_group=groups[0], outer_group=groups[1])
        else:
            from megatron_mtraining.patterns.estimator import VerticalSlashConfig
            from megatron_mtraining.ring.sparse import sparse_ring_attention

            out = sparse_ring_attention(q, k, v, layout=layout, group=dist.group.WORLD, columns="out_of_ring",
                                        config=VerticalSlashConfig(recall=0.9, sink_tokens=16, max_vertical=64))
        out.backward(torch.ones_like(out))
        dist.barrier()
    except Exception as e:
        info = {"type": type(e).__name__, "message": str(e)}
        if isinstance(e, CommError):
            info.update(where=e.where, peers=list(e.peers), rank=e.rank,
                        timeout_s=e.timeout.total_seconds() if e.timeout is not None else None)
        print("ERROR " + json.dumps(info), flush=True)
        raise
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

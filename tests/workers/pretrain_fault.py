"""The example trainer (``examples/pretrain_gpt.py``'s ``main``) with one rank failing inside the ring.

    python tests/workers/pretrain_fault.py --victim 1 --kernel forward:0 --how raise -- <trainer flags>

The victim's dense step kernel fails (``--how``, as in ``tests/workers/ring_fault.py``) at its
``N``-th call of the pass; every other rank runs the trainer unchanged. Launched one process per
rank by ``tests.helpers.dist.run_ranks`` (not torchrun, which would stop the survivors itself).
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_mtraining.ops.reference import DenseStepKernel


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--kernel", required=True, help="forward:N or backward:N")
    p.add_argument("--how", choices=["exit", "sigkill", "raise", "hang"], default="raise")
    args = p.parse_args(argv[:split])
    if int(os.environ["RANK"]) == args.victim:
        from tests.workers.ring_fault import fault

        phase, n = args.kernel.split(":")
        calls = [0]
        orig = getattr(DenseStepKernel, phase)

        def wrapped(self, *a):
            if calls[0] == int(n):
                fault(args.how, f"step kernel {phase}:{n}")
            calls[0] += 1
            return orig(self, *a)

        setattr(DenseStepKernel, phase, wrapped)
    from megatron_mtraining.training import main as train_main

    return train_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())

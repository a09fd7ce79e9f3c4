"""Compile the fused LSE merge kernel (ops/triton/kernels.py ``_merge_kernel``) ahead of time for sm_90, no GPU needed.

    python3 tests/workers/merge_aot.py        # one line per (dtypes, head_dim), then RESULT

The Triton interpreter (tests/kernels/test_triton_merge.py) checks the numbers but not that the kernel compiles:
this runs the real compiler (TTIR -> PTX -> cubin with the ptxas shipped in the triton wheel) at the launcher's
tile sizes (``launch.merge_launch_shape``) for the partial dtypes the callers pass (FlashAttention-4's bf16 or
fp16 output with the column kernel's fp32 one, fp32 with fp32, bf16 with bf16) at head_dim 64, 96 (a padded
tile) and 128, and prints the cubin's register / stack use (stack > 0 means register spills) when cuobjdump is
there. Must run without ``TRITON_INTERPRET``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("merge_aot.py: unset TRITON_INTERPRET (the interpreter does not compile)")

from megatron_mtraining.ops.triton import kernels as K  # noqa: E402
from megatron_mtraining.ops.triton.launch import MERGE_WARPS, merge_launch_shape  # noqa: E402
from tests.workers.estimator_aot import compile_report  # noqa: E402


def signature(dt1: str, dt2: str, consts: dict) -> dict:
    ptr = {"O1": "*" + dt1, "O2": "*" + dt2, "L1": "*fp32", "L2": "*fp32", "Out": "*fp32", "Lse": "*fp32"}
    return {n: "constexpr" if n in consts else ptr.get(n, "i32") for n in K._merge_kernel.arg_names}


def main() -> int:
    ok = True
    for dt1, dt2 in (("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "fp32"), ("bf16", "bf16")):
        for d in (64, 96, 128):
            block_d, block_s = merge_launch_shape(d)
            consts = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s)
            ok &= compile_report(f"{dt1}+{dt2} d={d} BLOCK_S={block_s}", K._merge_kernel, signature(dt1, dt2, consts),
                                 consts, MERGE_WARPS)
    print("RESULT", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Compile the Triton selection kernel (patterns/triton/select.py) ahead of time for sm_90, no GPU needed.

    python3 tests/workers/select_aot.py        # one line per (kind dtypes, loop step), then RESULT

The Triton interpreter (tests/kernels/test_select_triton.py) checks the selections but not that the kernel
compiles: this runs the real compiler (TTIR -> PTX -> cubin with the ptxas shipped in the triton wheel) for
the launches the estimator makes (fp64 block-diagonal scores with fp32 or fp64 column scores, and one kind
alone) at the loop steps of :func:`~megatron_mtraining.patterns.triton.select.launch_shape`, and prints the
cubin's register / stack use (stack > 0 means register spills) when cuobjdump is there. Must run without
``TRITON_INTERPRET``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("select_aot.py: unset TRITON_INTERPRET (the interpreter does not compile)")

from megatron_mtraining.patterns.triton import select as S  # noqa: E402
from tests.workers.estimator_aot import compile_report  # noqa: E402

FLOATS = ("targetA", "LA", "targetB", "LB")


def signature(fp64_a: bool, fp64_b: bool, consts: dict) -> dict:
    sig = {}
    for n in S._select_kernel.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ("ScoreA", "ScoreB"):
            sig[n] = "*fp64" if (fp64_a if n.endswith("A") else fp64_b) else "*fp32"
        elif n.startswith(("Sel", "Cnt", "Ck")):
            sig[n] = "*i64"
        elif n.startswith(("Mass", "Cx")):
            sig[n] = "*fp64"
        elif n in FLOATS:
            sig[n] = "fp64"
        else:
            sig[n] = "i32"
    return sig


def main() -> int:
    ok = True
    short, long = S.launch_shape(S.LONG_ROW), S.launch_shape(S.LONG_ROW + 1)
    # the estimator's launches: fp64 block diagonals with fp32 columns (one probe block) at either step, and
    # with fp64 columns (several probe blocks, kv_group) or alone (cp > 1: the second kind repeats the first)
    for fa, fb, (chunk, warps) in ((True, False, short), (True, False, long), (True, True, short)):
        consts = dict(FP64_A=fa, FP64_B=fb, CHUNK=chunk, CAND=S.CAND, DIGIT=S.DIGIT)
        name = f"A={'fp64' if fa else 'fp32'} B={'fp64' if fb else 'fp32'} CHUNK={chunk} warps={warps}"
        ok &= compile_report(name, S._select_kernel, signature(fa, fb, consts), consts, warps, **S.launch_registers(warps))
    print("RESULT", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

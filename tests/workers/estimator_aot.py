"""Compile the fused estimator kernels (patterns/triton/estimator.py) ahead of time for sm_90, no GPU needed.

    python3 tests/workers/estimator_aot.py        # one line per (dtype, head_dim, BLOCK_M), then RESULT

The Triton interpreter (tests/kernels/test_estimator_triton.py) checks the numbers but not that the kernels
compile: this runs the real compiler (TTIR -> PTX -> cubin with the ptxas shipped in the triton
wheel) for bf16/fp32 inputs at head_dim 64/128/80 (padded to 128), fp16 at 128, and the launcher's tile
sizes (probe-row chunks of the maximum and of 16), causal and with document bounds, the per-document
probe kernels, and prints the cubin's register / stack use
(stack > 0 means register spills) when cuobjdump is there. Must run without ``TRITON_INTERPRET``.
"""

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("estimator_aot.py: unset TRITON_INTERPRET (the interpreter does not compile)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron_mtraining.patterns.triton import estimator as E  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTRS = {E._probe_stats_kernel: ("Q", "K", "KPos", "MPart", "ZPart"),
        E._probe_colsum_kernel: ("Q", "K", "KPos", "Lse2", "ColU"),
        E._doc_stats_kernel: ("Q", "K", "KPos", "M", "Z"),                 # per-document probes (always bounded)
        E._doc_colsum_kernel: ("Q", "K", "KPos", "Lse2", "ColU")}
INT_PTRS = ("Lo", "Hi", "Span", "KeyRange", "Groups", "TileGroups")


def signature(fn, dt: str, consts: dict) -> dict:
    q, k, kpos, o1, o2 = PTRS[fn]
    ptr = {q: "*" + dt, k: "*" + dt, kpos: "*i32", o1: "*fp32", o2: "*fp32", **{n: "*i32" for n in INT_PTRS}}
    return {n: "constexpr" if n in consts else ptr.get(n, "fp32" if n == "scale_log2" else "i32")
            for n in fn.arg_names}


def resources(cubin: bytes) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "(no cuobjdump)"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = [x for x in out.splitlines() if "REG:" in x]
    return " ".join(line[-1].split()[:3]) if line else "(no resource line)"


def compile_report(name: str, fn, sig: dict, consts: dict, num_warps: int, **options) -> bool:
    """Compile ``fn`` for sm_90 with this signature and constants (and other launch ``options``, e.g.
    ``maxnreg``); print ``name: ok <registers / stack>`` or ``name: FAILED <error>``; True when it compiled."""
    try:
        k = triton.compile(ASTSource(fn, sig, consts), target=TARGET, options={"num_warps": num_warps, **options})
    except Exception as e:  # noqa: BLE001 - report every failing variant
        print(f"{name}: FAILED {type(e).__name__}: {e}")
        return False
    print(f"{name}: ok {resources(k.asm['cubin'])}")
    return True


def main() -> int:
    ok = True
    for dt in ("bf16", "fp16", "fp32"):
        # fp16 compiles the bf16 code with another element type: its largest head dim (the register
        # bound) is enough; bf16 and fp32 (another tile shape) compile every head dim
        for d, bd in ((128, 128),) if dt == "fp16" else ((128, 128), (64, 64), (80, 128)):
            max_m, block_n = (E.MAX_BLOCK_M_FP32, E.BLOCK_N_FP32) if dt == "fp32" else (E.MAX_BLOCK_M, E.BLOCK_N)
            for bm in sorted({max_m, 16}, reverse=True):
                for bounds in (False, True):
                    consts = dict(REP=8, D=d, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=block_n, FP32=dt == "fp32",
                                  HAS_BOUNDS=bounds)
                    name = f"{dt} d={d} BLOCK_M={bm} bounds={int(bounds)}"
                    for fn in PTRS:
                        if "HAS_BOUNDS" not in fn.arg_names and (not bounds or bm != max_m):
                            continue         # the per-document kernels: bounded, the launcher's row block only
                        cst = {n: v for n, v in consts.items() if n in fn.arg_names}
                        ok &= compile_report(f"{name} {fn.__name__}", fn, signature(fn, dt, cst), cst, E.NUM_WARPS)
    print("RESULT", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

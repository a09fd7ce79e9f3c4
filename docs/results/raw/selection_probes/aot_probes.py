"""Registers and stack (spills) of the selection kernel with PROBES keys per pass, compiled ahead of time for
sm_90 (no GPU needed; the fp64 block-diagonal + fp32 column launch). Needs the kernel of commit 54118c8; run
from the repository root without TRITON_INTERPRET."""
import os, sys
sys.path.insert(0, os.getcwd())
from megatron_mtraining.patterns.triton import select as S
from tests.workers.estimator_aot import compile_report
from tests.workers.select_aot import signature
for probes, (chunk, warps) in [(1, (2048, 8)), (2, (2048, 8)), (4, (2048, 8)), (8, (1024, 8)),
                               (1, (8192, 16)), (4, (8192, 16)), (4, (4096, 16)), (8, (2048, 16))]:
    consts = dict(FP64_A=True, FP64_B=False, CHUNK=chunk, CAND=S.CAND, PROBES=probes)
    compile_report(f"PROBES={probes} CHUNK={chunk} warps={warps}", S._select_kernel, signature(True, False, consts), consts, warps)

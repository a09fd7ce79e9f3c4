"""Triton index conversion on a GPU (marker ``gpu``; skipped without CUDA): bitwise the torch path.

Check: tests/workers/gpu_convert_check.py. Per length (8K, 64K, 128K; q ``[1, S, 16, 128]``, k
``[1, S, 2, 128]``, bf16 structured inputs, ``configs/e2e_sparse.yaml``, CP=1), the estimated
pattern converted by ``convert_pattern(impl="triton")`` equals ``impl="torch"`` bit for bit (four
index tensors per step, dtype, shape, recorded maxima). On the CPU the same check runs at 1K in
the Triton interpreter, and a changed index must be detected (negative control).
"""
import dataclasses

import pytest
import torch

from tests.helpers.triton_interp import requires_interpreter
from tests.workers import gpu_convert_check as gc


@pytest.mark.gpu
@pytest.mark.parametrize("seq", gc.SEQS, ids=lambda s: f"S{s}")
def test_triton_convert_bitwise_equals_torch_on_gpu(seq):
    try:
        row, _, _ = gc.convert_case(seq, "cuda")
    finally:
        torch.cuda.empty_cache()
    assert row["bitwise_equal"], row


@requires_interpreter
def test_convert_check_on_cpu_interpreter():
    row, pat, layout = gc.convert_case(1024, "cpu")
    assert row["bitwise_equal"], row
    # negative control: one changed column index must be reported
    from megatron_mtraining.patterns.convert import convert_pattern

    ref = convert_pattern(pat, layout, 0, impl="torch")
    steps = list(ref)
    bad_ci = steps[0].column_index.clone()
    bad_ci.view(-1)[0] += 1
    steps[0] = dataclasses.replace(steps[0], column_index=bad_ci)
    assert gc.same_steps(ref, ref) and not gc.same_steps(steps, ref)

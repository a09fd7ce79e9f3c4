"""Sparse ring column placement on a GPU (marker ``gpu``; skipped without CUDA).

Check: tests/workers/gpu_column_phase_check.py. The sparse ring at CP=1 (Triton kernels, bf16,
S=4096, 4/2 heads, head_dim 128, recall 0.9) with the vertical columns in the ring and out of the
ring: out, dQ, dK, dV each within 2x the error of a bf16 torch reference against fp64 attention
masked with the same pattern; backward plans built in the forward (side stream) bitwise equal to
plans built in the backward. One run, one test per quantity. On the CPU the same check runs at
S=512 with fp16 inputs in the Triton interpreter (slow).
"""
import pytest
import torch

from tests.helpers.triton_interp import requires_interpreter
from tests.workers import gpu_column_phase_check as cp


@pytest.fixture(scope="module")
def gpu_result():
    try:
        return cp.column_phase_check("cuda")
    finally:
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("quantity", cp.QUANTITIES)
def test_columns_in_and_out_of_ring_within_bf16_error_on_gpu(gpu_result, quantity):
    e = gpu_result["errors"][quantity]
    assert e["in_ring"] <= 2 * e["ref"], (quantity, e, gpu_result)
    assert e["out_of_ring"] <= 2 * e["ref"], (quantity, e, gpu_result)


@pytest.mark.gpu
def test_backward_plans_built_in_forward_are_bitwise_the_same_on_gpu(gpu_result):
    assert gpu_result["prebuild_bitwise"], gpu_result
    assert gpu_result["density"] < 1.0, gpu_result


@requires_interpreter
@pytest.mark.slow
def test_column_phase_check_on_cpu_interpreter():
    r = cp.column_phase_check("cpu", s=512, hq=4, hkv=2, d=64, dtype=torch.float16)
    assert r["prebuild_bitwise"], r
    assert 0.0 < r["density"] < 1.0, r
    for name in cp.QUANTITIES:
        assert cp.quantity_ok(r["errors"][name]), (name, r)

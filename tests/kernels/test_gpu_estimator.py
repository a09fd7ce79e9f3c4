"""Fused estimator kernels on a GPU (marker ``gpu``; skipped without CUDA) against the fp64 torch scores.

Check: tests/workers/gpu_estimator_check.py. Cases: 8K, 64K and 128K at CP=1 and a simulated CP=2
striped at 8K, packed documents at 128K (CP=1) and 8K (simulated CP=2), with the stream's probes and with
every document's (the per-document kernels against the fp64 torch per-document path) (Qwen2.5-3B shape: q ``[1, S, 16, 128]``, k ``[1, S, 2, 128]``, bf16 structured inputs,
``configs/e2e_sparse.yaml``). The Triton probe LSE, column sums and block-diagonal sums must be
within 1e-5 of the fp64 torch path (``col``/``slash``: max error relative to the largest value;
``lse``: absolute, scaled by ``max(1, max|lse|)``), with no NaN. Whether the two implementations
select the same lines is recorded as a test property, not failed (near-ties may legitimately
differ). On the CPU the same code runs at 512 tokens (4/2 heads, head_dim 64, fp32; two packed documents) in the
interpreter.
"""
import pytest
import torch

from tests.helpers.triton_interp import requires_interpreter
from tests.workers import gpu_estimator_check as ge

GPU_SEQS = (8192, 65536, 131072)


def _id(case):
    S, layout, packed = case
    suffix = {True: "-packed", "document": "-packed-docprobes"}.get(packed, "")
    return f"S{S}-cp{layout.cp_size}-{layout.kind}{suffix}"


def assert_scores_ok(row: dict) -> None:
    assert "error" not in row, row
    assert not row["nan"], row
    assert row["col_err"] <= ge.TOL, ("col", row)
    assert row["slash_err"] <= ge.TOL, ("slash", row)
    assert row["lse_abs_err"] <= ge.TOL * max(1.0, row["lse_ref_absmax"]), ("lse", row)
    assert row["scores_ok"], row


def _record_selection(row, record_property):
    for key in ("pattern_equal", "slash_lines_differing", "vertical_lines_differing"):
        if key in row:
            record_property(key, row[key])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ge.cases(list(GPU_SEQS)), ids=_id)
def test_estimator_scores_on_gpu(case, record_property):
    S, layout, packed = case
    args = ge.parse_args([])                     # the defaults: cuda, bf16, 16/2 heads, head_dim 128
    try:
        row = ge.check_len(S, args, torch.device("cuda"), None, layout, packed)
    finally:
        torch.cuda.empty_cache()
    _record_selection(row, record_property)
    print(row)
    assert_scores_ok(row)


def _cpu_params():
    """CP=1 also estimates the pattern twice in the interpreter (tens of seconds): marked slow."""
    for case in ge.cases([512]):
        yield pytest.param(case, id=_id(case), marks=[pytest.mark.slow] if case[1].cp_size == 1 else [])


@requires_interpreter
@pytest.mark.parametrize("case", list(_cpu_params()))
def test_estimator_check_on_cpu_interpreter(case, record_property):
    S, layout, packed = case
    args = ge.parse_args(["--device", "cpu", "--heads", "4", "--kv-heads", "2", "--head-dim", "64"])
    assert args.dtype == "fp32"                  # bf16 tl.dot is wrong in the interpreter
    row = ge.check_len(S, args, torch.device("cpu"), None, layout, packed)
    _record_selection(row, record_property)
    assert_scores_ok(row)

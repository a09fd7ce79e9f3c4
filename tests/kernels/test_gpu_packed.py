"""Triton dense ring with packed documents (THD) on a GPU (marker ``gpu``; skipped without CUDA).

Cases and checks: tests/workers/gpu_packed_check.py (one test per case of its ``CASES``): a CP ring
of 1, 2 or 4 ranks simulated on one GPU, bf16, against every document attended alone in fp64; out,
LSE, dQ, dK, dV each within 2x the error of a bf16 torch reference; documents of length 1, lengths
not divisible by 64, documents straddling stripes, padded slots and trailing padding (exact zeros
in out, dQ, dK, dV; no NaN).

The one-rank cases also run through ``ring_attention`` itself (autograd and delta kernel, the
backend ``auto`` picks with documents: Triton). On the CPU the same code path runs on tiny fp16 cases in the Triton interpreter (``SMOKE_CASES``),
and ring steps without the documents must fail the criterion (negative control).

The vertical-slash sparse ring over documents (``gp.SPARSE_CASES``): the Triton sparse step kernels
with their document mask, bf16 (and one fp16 case), against fp64 attention under (pattern) ∧ causal
∧ same document, the same 2x-of-bf16 criterion; tiny fp16 cases and a negative control (the steps
without their document bounds) in the interpreter.
"""
import pytest
import torch

from tests.helpers.triton_interp import requires_interpreter
from tests.workers import gpu_packed_check as gp


def assert_case_passes(row: dict) -> None:
    assert not row["nan"], row
    assert row["padding_exact_zero"], row
    for name in row["ratio"]:
        assert row["ratio"][name] <= 2.0, (name, row["err_ours"][name], row["err_bf16_ref"][name], row)
    assert row["ok"], row


@pytest.mark.gpu
@pytest.mark.parametrize("case", gp.CASES, ids=lambda c: c.id)
def test_packed_ring_case_on_gpu(case):
    try:
        row = gp.run_case(case, "cuda")
    finally:
        torch.cuda.empty_cache()
    print(gp.describe(row))
    assert_case_passes(row)


@pytest.mark.gpu
@pytest.mark.parametrize("case", gp.RING_CASES, ids=lambda c: c.id)
def test_packed_ring_attention_on_gpu(case):
    """One rank through ring_attention itself (autograd, delta kernel), kernel_backend auto."""
    try:
        row = gp.run_ring_case(case, "cuda")
    finally:
        torch.cuda.empty_cache()
    print(gp.describe(row))
    assert row["backend"] == "triton", row
    assert_case_passes(row)


def test_cases_cover_the_rules():
    """Lengths 1, not multiples of 64, straddling stripes, padding; cp 1, 2, 4; ids unique; offsets fit."""
    ids = [c.id for c in gp.CASES + gp.SMOKE_CASES]
    assert len(ids) == len(set(ids))
    assert {c.layout[1] for c in gp.CASES} == {1, 2, 4} and {c.layout[0] for c in gp.CASES} == {"striped", "zigzag"}
    lengths = [n for c in gp.CASES for n in c.lengths]
    assert 1 in lengths and any(n % 64 for n in lengths if n > 64)
    assert any(c.slots is not None for c in gp.CASES)
    for c in gp.CASES + gp.SMOKE_CASES:
        cu, pad = gp.offsets(c)
        assert pad[-1] <= c.seq * c.batch, c.id
        assert all(n <= (c.slots[i] if c.slots else n) for i, n in enumerate(c.lengths)), c.id


@requires_interpreter
@pytest.mark.parametrize("case", gp.SMOKE_CASES, ids=lambda c: c.id)
def test_smoke_case_on_cpu_interpreter(case):
    """The GPU check's code path (per-document oracle, bf16 reference, criterion) on the CPU, tiny fp16."""
    row = gp.run_case(case, "cpu")
    assert row["padding_lse_neginf"] or row["padding_tokens"] == 0, row
    assert_case_passes(row)


@requires_interpreter
def test_ring_case_on_cpu_interpreter():
    """The ring_attention path of the check on the CPU (kernel_backend auto there: the torch reference)."""
    c = gp.SMOKE_CASES[0]
    row = gp.run_ring_case(gp.Case("smoke-ring", ("striped", 1, 64), c.seq, c.lengths, hq=2, hkv=1, d=64,
                                   dtype=torch.float16), "cpu")
    assert_case_passes(row)


@requires_interpreter
def test_steps_without_documents_fail_the_criterion(monkeypatch):
    """Negative control: the same ring steps without the document mask must fail."""
    real = gp.DenseGpuStepKernel

    def unmasked(*a, documents=None, **kw):
        return real(*a, **kw)

    monkeypatch.setattr(gp, "DenseGpuStepKernel", unmasked)
    row = gp.run_case(gp.SMOKE_CASES[0], "cpu")
    assert not row["ok"] and row["ratio"]["out"] > 2.0, row


@pytest.mark.gpu
@pytest.mark.parametrize("case", gp.SPARSE_CASES, ids=lambda c: c.id)
def test_packed_sparse_case_on_gpu(case):
    """The Triton sparse steps with the document mask, bf16/fp16, within 2x the error of bf16 torch."""
    try:
        row = gp.run_sparse_case(case, "cuda")
    finally:
        torch.cuda.empty_cache()
    print(gp.describe(row))
    assert row["padding_tokens"] == 0 or row["padding_lse_neginf"], row
    assert_case_passes(row)


@requires_interpreter
@pytest.mark.parametrize("case", gp.SPARSE_SMOKE_CASES, ids=lambda c: c.id)
def test_sparse_smoke_case_on_cpu_interpreter(case):
    """The sparse GPU check's code path on the CPU, tiny fp16."""
    row = gp.run_sparse_case(case, "cpu")
    assert row["padding_tokens"] > 0 or case.slots is None, row
    assert row["padding_tokens"] == 0 or row["padding_lse_neginf"], row
    assert_case_passes(row)


@requires_interpreter
def test_sparse_steps_without_document_bounds_fail_the_criterion():
    """Negative control: the same restricted indices without the document bounds must fail."""
    row = gp.run_sparse_case(gp.SPARSE_SMOKE_CASES[0], "cpu", use_documents=False)
    assert not row["ok"] and row["ratio"]["out"] > 2.0, row

"""Triton dense ring with packed documents (THD) on a GPU (marker ``gpu``; skipped without CUDA).

Cases and checks: tests/workers/gpu_packed_check.py (one test per case of its ``CASES``): a CP ring
of 1, 2 or 4 ranks simulated on one GPU, bf16, against every document attended alone in fp64; out,
LSE, dQ, dK, dV each within 2x the error of a bf16 torch reference; documents of length 1, lengths
not divisible by 64, documents straddling stripes, padded slots and trailing padding (exact zeros
in out, dQ, dK, dV; no NaN).

The one-rank cases also run through ``ring_attention`` itself (autograd and delta kernel,
``kernel_backend='triton'``).

FlashAttention-4 varlen at CP=1 (``gp.FA4_VARLEN_CASES``, skipped without a Hopper/Blackwell GPU and
``flash-attn-4``): ``kernel_backend='fa4'`` with documents through ``ring_attention``, LSE from
``fa4_varlen_attention``, against the same per-document fp64 oracle and criterion (GQA, padded
slots and a padding tail, two streams, 201 short documents, fp16), its deterministic backward
bitwise repeatable, and ``auto`` choosing it. On the CPU the same code path runs on tiny fp16 cases in the Triton interpreter (``SMOKE_CASES``),
and ring steps without the documents must fail the criterion (negative control).

The vertical-slash sparse ring over documents (``gp.SPARSE_CASES``): the Triton sparse step kernels
with their document mask, bf16 (and one fp16 case), against fp64 attention under (pattern) ∧ causal
∧ same document, the same 2x-of-bf16 criterion; tiny fp16 cases and a negative control (the steps
without their document bounds) in the interpreter.
"""
import pytest
import torch

from megatron_mtraining.layout import PackedDocuments
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
    """One rank through ring_attention itself (autograd, delta kernel), kernel_backend triton."""
    try:
        row = gp.run_ring_case(case, "cuda")
    finally:
        torch.cuda.empty_cache()
    print(gp.describe(row))
    assert row["backend"] == "triton", row
    assert_case_passes(row)


def _fa4_reason():
    if not torch.cuda.is_available():
        return "needs CUDA"
    from megatron_mtraining.ops.fa4 import fa4_unavailable_reason

    return fa4_unavailable_reason("cuda")


needs_fa4 = pytest.mark.skipif(_fa4_reason() is not None, reason="needs a Hopper/Blackwell GPU with flash-attn-4")


def _assert_fa4_varlen_ran(row: dict) -> None:
    assert row["backend"] == "fa4" and row["varlen"], (
        f"kernel_backend 'fa4' did not run FA4 varlen for {row['case']} (backend {row['backend']!r}); "
        f"the varlen self-check says: {row['self_check']}")


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("case", gp.FA4_VARLEN_CASES, ids=lambda c: c.id)
def test_fa4_varlen_case_on_gpu(case):
    """FA4 varlen (packed dense attention at CP=1): out, LSE, dQ, dK, dV within 2x the bf16 reference."""
    try:
        row = gp.run_fa4_varlen_case(case, "cuda")
    finally:
        torch.cuda.empty_cache()
    print(gp.describe(row), "self_check:", row["self_check"])
    _assert_fa4_varlen_ran(row)
    assert row["padding_tokens"] == 0 or row["padding_lse_neginf"], row
    assert_case_passes(row)


@pytest.mark.gpu
@needs_fa4
def test_fa4_varlen_deterministic_on_gpu():
    """The deterministic varlen backward (the backend's default): accurate and bitwise repeatable."""
    case = gp.FA4_VARLEN_CASES[1]
    row = gp.run_fa4_varlen_case(case, "cuda", deterministic=True)
    print(gp.describe(row), "self_check:", row["self_check"])
    _assert_fa4_varlen_ran(row)
    assert row["bitwise_repeatable"], row
    assert_case_passes(row)


@pytest.mark.gpu
@needs_fa4
def test_auto_picks_fa4_varlen_for_packed_dense_at_cp1_on_gpu():
    from megatron_mtraining.ops.backends import select_backend
    from megatron_mtraining.ops.fa4 import fa4_varlen_self_check

    kw = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, seq_len_local=8192, packed=True)
    b = select_backend("auto", **kw)
    assert b.name == "fa4" and b.packed_cp1 is not None, fa4_varlen_self_check("cuda", torch.bfloat16, 128, 4, 2, True)
    assert select_backend("auto", cp_size=2, **kw).name == "triton"      # the ring steps keep Triton


def test_cases_cover_the_rules():
    """Lengths 1, not multiples of 64, straddling stripes, padding; cp 1, 2, 4; ids unique; offsets fit."""
    ids = [c.id for c in gp.CASES + gp.SMOKE_CASES + gp.FA4_VARLEN_CASES]
    assert len(ids) == len(set(ids))
    assert {c.layout[1] for c in gp.CASES} == {1, 2, 4} and {c.layout[0] for c in gp.CASES} == {"striped", "zigzag"}
    lengths = [n for c in gp.CASES for n in c.lengths]
    assert 1 in lengths and any(n % 64 for n in lengths if n > 64)
    assert any(c.slots is not None for c in gp.CASES)
    fa4 = gp.FA4_VARLEN_CASES
    assert all(c.layout[1] == 1 for c in fa4) and any(c.batch > 1 for c in fa4) and any(c.hq > c.hkv for c in fa4)
    assert any(c.slots is not None for c in fa4) and any(c.slots is None for c in fa4)      # index and view paths
    for c in gp.CASES + gp.SMOKE_CASES + fa4:
        cu, pad = gp.offsets(c)
        assert pad[-1] <= c.seq * c.batch, c.id
        PackedDocuments.from_cu_seqlens(torch.tensor(cu), c.seq, batch_size=c.batch,
                                        cu_seqlens_padded=torch.tensor(pad))            # valid offsets
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

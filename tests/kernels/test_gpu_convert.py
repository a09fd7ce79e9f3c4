"""Triton index conversion on a GPU (marker ``gpu``; skipped without CUDA): bitwise the torch path.

Check: tests/workers/gpu_convert_check.py. Per length (8K, 64K, 128K; q ``[1, S, 16, 128]``, k
``[1, S, 2, 128]``, bf16 structured inputs, ``configs/e2e_sparse.yaml``, CP=1), the estimated
pattern converted by ``convert_pattern(impl="triton")`` equals ``impl="torch"`` bit for bit (four
index tensors per step, dtype, shape, recorded maxima); at 32K and 128K the column masks the
conversion records for the backward (``ColumnUnion``) decode to exactly each block's column list. On
the CPU the same checks run at 1K in the Triton interpreter, and a changed index or cleared mask
bits must be detected (negative controls).
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
    # the column masks' decoding of the GPU test below, and its negative control: cleared mask bits
    st = convert_pattern(pat, layout, 0, impl="triton")[0]
    assert torch.equal(listed_positions(st, pat.vertical), st.column_index)
    bits = st.column_union.bits
    bits[0, :, int((bits != 0).nonzero()[0, 2])] = 0
    assert not torch.equal(listed_positions(st, pat.vertical), st.column_index)


def listed_positions(step, union):
    """Each query block's listed columns decoded from ``step.column_union`` masks over ``union`` ([b, h, nv]),
    ascending, padded with -1 to the column lists' width (``[b, h, nqb, width]`` int32)."""
    bits = step.column_union.bits                                            # [b, h, nqb, nw] int64
    nv = union.shape[-1]
    on = ((bits[..., None] >> torch.arange(64, device=bits.device)) & 1).bool().flatten(-2)[..., :nv]
    big = torch.iinfo(torch.int32).max
    pos = torch.where(on, union.to(torch.int32)[:, :, None, :], big).sort(-1).values
    w = step.column_index.shape[-1]
    pos = torch.nn.functional.pad(pos, (0, max(0, w - nv)), value=big)[..., :w]
    return torch.where(pos == big, -1, pos)


@pytest.mark.gpu
@pytest.mark.parametrize("seq", (32768, 131072), ids=lambda s: f"S{s}")
def test_triton_convert_column_union_masks_on_gpu(seq):
    """The conversion's per-block column masks (ColumnUnion) decode to exactly each block's column list,
    on an estimated pattern (configs/e2e_sparse.yaml, Qwen2.5-3B heads) at 32K and 128K."""
    try:
        _, pat, layout = gc.convert_case(seq, "cuda")
        from megatron_mtraining.patterns.convert import convert_pattern

        st = convert_pattern(pat, layout, 0, impl="triton")[0]
        assert pat.vertical_ascending and st.given_column_union is not None
        assert torch.equal(listed_positions(st, pat.vertical), st.column_index)
    finally:
        torch.cuda.empty_cache()


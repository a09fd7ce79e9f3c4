"""Triton dense ring steps with packed documents (mask mode 3), run by the Triton CPU interpreter.

A simulated ring (every rank's steps and the LSE merge) of :class:`DenseGpuStepKernel` with
:class:`PackedDocuments` against an fp64 per-document reference (each document attended alone):
out, dQ, dK, dV separately (fp32 inputs, <= 1e-5 relative to the largest reference magnitude);
striped and zigzag, cp 1, 2 and 4, GQA 1 and 4, padded documents (exact zeros), two streams with
different documents; tiles of other documents are not listed in the plan.
"""

import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers.triton_interp import rerun_in_fresh_interpreter, use_interpreted_kernels  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from megatron_mtraining.layout import Layout, PackedDocuments  # noqa: E402
from megatron_mtraining.ops.dense_gpu import DenseGpuStepKernel  # noqa: E402
from megatron_mtraining.ops.triton import document_plan  # noqa: E402
from tests.helpers.packed_ref import per_document_attention  # noqa: E402
from tests.helpers.ring_sim import simulate_dense_ring  # noqa: E402

S, D = 256, 32


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.ops.triton.kernels", "_sparse_fwd_kernel")
    yield


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


def _data(b, hq, hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(b, S, h, D, generator=g).float()
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


def _err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


CASES = [
    (Layout("striped", 1, 64), [0, 1, 9, 70, 71, 200, 256], None),
    (Layout("striped", 2, 64), [0, 1, 9, 70, 71, 200, 256], None),
    (Layout("striped", 4, 16), [0, 1, 9, 70, 71, 200, 256], None),
    (Layout("zigzag", 2), [0, 5, 60, 61], [0, 8, 100, 128]),            # tokens 128..255 padding
    (Layout("striped", 2, 64), [0, 5, 60, 61], [0, 8, 100, 128]),
]


@pytest.mark.parametrize("layout, cu, padded", CASES)
@pytest.mark.parametrize("hkv", [4, 1])
def test_triton_packed_steps_match_per_document_reference(layout, cu, padded, hkv):
    q, k, v, do = _data(1, 4, hkv)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, cu_seqlens_padded=padded)
    scale = D ** -0.5
    out, _, dq, dk, dv = simulate_dense_ring(layout, q, k, v, do,
                                             lambda r: DenseGpuStepKernel(layout, r, S, scale, documents=docs))
    ref = per_document_attention(q, k, v, do, cu, scale, padded)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
        assert torch.isfinite(got).all(), name
        assert _err(got, want) <= 1e-5, (name, _err(got, want))
    pad = ~docs.real()[0]
    for got in (out, dq, dk, dv):
        assert torch.equal(got[0, pad], torch.zeros_like(got[0, pad]))


def test_triton_packed_two_streams_with_different_documents():
    q, k, v, do = _data(2, 4, 2, seed=1)
    cu = [0, 30, 200, 256, 257, 400, 450]
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, batch_size=2)
    lay = Layout("striped", 2, 64)
    out, _, dq, dk, dv = simulate_dense_ring(lay, q, k, v, do,
                                             lambda r: DenseGpuStepKernel(lay, r, S, 0.2, documents=docs))
    ref = per_document_attention(q, k, v, do, cu, 0.2)
    for got, want in zip((out, dq, dk, dv), ref):
        assert _err(got, want) <= 1e-5
    # negative control: the same steps without the documents
    bad = simulate_dense_ring(lay, q, k, v, do, lambda r: DenseGpuStepKernel(lay, r, S, 0.2))
    assert _err(bad[0], ref[0]) > 1e-2 and _err(bad[2], ref[1]) > 1e-2


def test_document_plan_lists_only_blocks_of_the_tiles_documents():
    pos = torch.arange(256)
    docs = PackedDocuments.from_cu_seqlens([0, 64, 150, 256], 256)
    lo, hi = docs.key_bounds(Layout("striped", 1, 64), 0)
    plan = document_plan(lo[0], hi[0], pos)
    count, split, index = plan.block_count[0, 0], plan.block_split[0, 0], plan.block_index[0, 0]
    assert count.tolist() == [1, 1, 2, 2] and plan.mask_mode == 3
    assert split.tolist() == [0, 0, 0, 0]                  # every listed block has a boundary or the diagonal
    assert index[0, :1].tolist() == [0] and index[2].tolist() == [1, 2] and index[3].tolist() == [2, 3]
    docs = PackedDocuments.from_cu_seqlens([0, 200, 256], 256)   # blocks wholly inside the past run unmasked
    lo, hi = docs.key_bounds(Layout("striped", 1, 64), 0)
    plan = document_plan(lo[0], hi[0], pos)
    assert plan.block_count[0, 0].tolist() == [1, 2, 3, 4] and plan.block_split[0, 0].tolist() == [0, 1, 2, 0]
    pad = PackedDocuments.from_cu_seqlens([0, 10], 256)      # tokens 10..255 padding
    lo, hi = pad.key_bounds(Layout("striped", 1, 64), 0)
    assert document_plan(lo[0], hi[0], pos).block_count[0, 0].tolist() == [1, 0, 0, 0]

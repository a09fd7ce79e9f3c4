"""Triton sparse kernels with one pattern per GQA group (``share_pattern: kv_group``), run by the
Triton CPU interpreter (TRITON_INTERPRET=1).

The step indices hold one row per KV head; the kernels read them per group (forward / dQ: the
group's query heads packed into one tile, or one program per head reading the group's row; dK/dV
of blocks and of vertical columns: the group's heads summed in registers). Checked against the
fp64 masked attention of tests/workers/gpu_common.py with the indices repeated per query head:
out, LSE, dQ, dK, dV separately, fp32 inputs, GQA group sizes 1, 3 and 4, causal and non-causal
steps, deterministic and fast backward (the columns' dK/dV by atomics, ``col_atomic_fast``); plus the
negative control that a per-head reading of the same tensors gives different results. See
tests/kernels/test_triton_kernels.py for why the interpreter is set here and how a pre-imported triton
is handled.
"""

import dataclasses
import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.triton_interp import rerun_in_fresh_interpreter, use_interpreted_kernels

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from megatron_mtraining.ops.triton import launch, sparse_attention_backward, sparse_attention_forward  # noqa: E402
from megatron_mtraining.ops.triton import plan_for  # noqa: E402
from tests.workers.gpu_common import dense_mask_rows, oracle, random_step_indices, rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.ops.triton.kernels", "_sparse_fwd_kernel")
    yield


TOL = 1e-5          # fp32 inputs, fp32 accumulation


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


def _case(b, s, hq, hkv, d, causal, seed):
    gen = torch.Generator().manual_seed(seed)
    idx = random_step_indices(b, hkv, s // 64, s // 64, causal, gen, p_col=0.06, above_diag=causal)
    mk = lambda h: torch.randn(b, s, h, d, generator=gen) * 1.5  # noqa: E731
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    full = idx.per_query_head(hq)                       # the reference mask: each group row per query head
    scale = d ** -0.5
    o_ref, l_ref = oracle(q, k, v, lambda r0, r1: dense_mask_rows(full, r0, r1, s), scale)
    lse_g = torch.where(torch.isinf(l_ref), l_ref, l_ref + 0.25 * torch.rand(l_ref.shape, generator=gen,
                                                                              dtype=torch.float64))
    delta_g = torch.randn(l_ref.shape, generator=gen, dtype=torch.float64)
    *_, dq_r, dk_r, dv_r, _, _ = oracle(q, k, v, lambda r0, r1: dense_mask_rows(full, r0, r1, s), scale,
                                        dout, lse_g, delta_g)
    return idx, (q, k, v, dout), scale, (o_ref, l_ref, dq_r, dk_r, dv_r), (lse_g, delta_g)


def _errs(got, ref, names):
    for n, g in zip(names, got):
        assert not torch.isnan(g).any(), f"NaN in {n}"
    return {n: rel_err(g, r) for n, g, r in zip(names, got, ref)}


_PACKINGS = {                                      # KernelConfig overrides: every tile mapping
    "default": {},
    "partial256": dict(pack_gqa_partial=True, pack_gqa_rows=256, pack_gqa_dq_rows=256, pack_gqa_min_heads=1),
    "partial128": dict(pack_gqa_partial=True, pack_gqa_rows=128, pack_gqa_dq_rows=128, pack_gqa_min_heads=1),
    "nopack": dict(pack_gqa=False),
}


@pytest.mark.parametrize("b,s,hq,hkv,d,causal", [
    (1, 128, 2, 2, 16, True),       # group size 1 (per-group == per-head)
    (1, 192, 3, 1, 16, True),       # group size 3, MQA (one index row for every head)
    (2, 128, 6, 2, 32, True),       # group size 3: partial packed tiles (a masked head), batch 2
    (1, 128, 8, 2, 16, False),      # group size 4, non-causal step (another owner)
])
@pytest.mark.parametrize("packing", list(_PACKINGS))
def test_kv_group_kernels_match_fp64(b, s, hq, hkv, d, causal, packing, monkeypatch):
    idx, (q, k, v, dout), scale, ref, (lse_g, delta_g) = _case(b, s, hq, hkv, d, causal, seed=hq * 10 + s + d)
    o_ref, l_ref, dq_r, dk_r, dv_r = ref
    monkeypatch.setattr(launch, "DEFAULT_CONFIG", dataclasses.replace(launch.DEFAULT_CONFIG, col_atomic_fast=True,
                                                                      **_PACKINGS[packing]))
    out, lse = sparse_attention_forward(q, k, v, idx, scale)
    errs = _errs((out, lse), (o_ref, l_ref), ("out", "lse"))
    for det in (True, False):
        dq, dk, dv = sparse_attention_backward(dout, q, k, v, lse_g.float(), delta_g.float(), idx, scale,
                                               deterministic=det)
        errs.update({f"{n}/{det}": e for n, e in _errs((dq, dk, dv), (dq_r, dk_r, dv_r), ("dq", "dk", "dv")).items()})
    assert all(e <= TOL for e in errs.values()), errs


def test_tile_mapping_packs_the_group():
    """The launch parameters: per-group indices pack up to pack_gqa_rows / 64 heads per tile."""
    def plan(h):
        return launch.SparsePlan(*(torch.zeros(1, h, 2, dtype=torch.int32) for _ in range(2)),
                                 torch.zeros(1, h, 2, 1, dtype=torch.int32), None, None, 1)
    cfg = launch.DEFAULT_CONFIG
    H = launch._Heads
    assert launch._heads(plan(8), 8, 2, cfg) == H(8, 1, 1, 4, 8)                 # per query head
    assert launch._heads(plan(2), 8, 2, cfg) == H(2, 4, 4, 1, 2)                 # 256 rows: the 4 heads
    assert launch._heads(plan(2), 16, 2, cfg) == H(2, 8, 4, 2, 4)                # 8 heads: two tiles of 4
    assert launch._heads(plan(2), 16, 2, cfg, cfg.pack_gqa_dq_rows) == H(2, 8, 1, 8, 16)   # dQ: unpacked
    assert launch._heads(plan(3), 9, 3, cfg) == H(3, 3, 1, 3, 9)                 # 3 heads: no power-of-two tile
    assert launch._heads(plan(2), 4, 2, cfg) == H(2, 2, 1, 2, 4)                 # 2 heads < pack_gqa_min_heads
    part = dataclasses.replace(cfg, pack_gqa_partial=True)
    assert launch._heads(plan(2), 6, 2, part) == H(2, 3, 4, 1, 2)                # 3 heads in a 4-slot tile
    two = dataclasses.replace(part, pack_gqa_rows=128, pack_gqa_min_heads=2)
    assert launch._heads(plan(2), 6, 2, two) == H(2, 3, 2, 2, 4)                 # 2 + 1 (masked) heads
    assert launch._heads(plan(2), 6, 2, dataclasses.replace(cfg, pack_gqa=False)) == H(2, 3, 1, 3, 6)
    with pytest.raises(ValueError, match="serve neither"):
        launch._heads(plan(3), 8, 2, cfg)


def test_per_head_reading_differs():
    """Negative control: the same index tensors read per query head (rows 0..hkv-1 for heads
    0..hkv-1 and garbage-free but different rows elsewhere) must not match the per-group oracle."""
    b, s, hq, hkv, d = 1, 128, 4, 2, 16
    idx, (q, k, v, _), scale, ref, _ = _case(b, s, hq, hkv, d, True, seed=5)
    full = idx.per_query_head(hq)
    # the per-head reading of the group rows: query head h reads row h % hkv instead of h // 2
    wrong = dataclasses.replace(full, block_count=idx.block_count.repeat(1, hq // hkv, 1),
                                block_index=idx.block_index.repeat(1, hq // hkv, 1, 1),
                                column_count=idx.column_count.repeat(1, hq // hkv, 1),
                                column_index=idx.column_index.repeat(1, hq // hkv, 1, 1), known_max=None)
    assert not torch.equal(wrong.block_count, full.block_count)
    out, _ = sparse_attention_forward(q, k, v, wrong, scale)
    assert rel_err(out, ref[0]) > 1e-3
    plan = plan_for(idx)
    assert plan.block_index.shape[1] == hkv

"""FA4 step planning (pure, CPU): tile classes and block lists against a token-level mask."""
from __future__ import annotations

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.fa4 import (FA4_BLOCK, FULL, PARTIAL, block_sparsity_from_tiles, classify_tiles,
                                        plan_step)

B = FA4_BLOCK


def token_mask(q_pos, k_pos, causal=True):
    if not causal:
        return torch.ones(q_pos.numel(), k_pos.numel(), dtype=torch.bool)
    return k_pos[None, :] <= q_pos[:, None]


def mask_of_plan(plan, sq, sk):
    """The token mask a plan computes, rebuilt from its lists (forward) alone."""
    if plan.kind == "none":
        return torch.zeros(sq, sk, dtype=torch.bool)
    if plan.kind == "full":
        return torch.ones(sq, sk, dtype=torch.bool)
    if plan.kind == "causal":
        return torch.ones(sq, sk, dtype=torch.bool).tril()
    sp = plan.sparsity
    blocks = torch.zeros(sq // B, sk // B, dtype=torch.bool)
    for i in range(sq // B):
        for j in sp.fwd_idx[0, 0, i, : int(sp.fwd_cnt[0, 0, i])].tolist():
            blocks[i, j] = True
    return blocks.repeat_interleave(B, 0).repeat_interleave(B, 1)


def check_lists(sp):
    """Backward lists are the transpose of the forward lists, both ascending and packed left."""
    m, n = sp.fwd_cnt.shape[-1], sp.bwd_cnt.shape[-1]
    fwd = torch.zeros(m, n, dtype=torch.bool)
    bwd = torch.zeros(m, n, dtype=torch.bool)
    for i in range(m):
        row = sp.fwd_idx[0, 0, i, : int(sp.fwd_cnt[0, 0, i])].tolist()
        assert row == sorted(row)
        fwd[i, row] = True
    for j in range(n):
        col = sp.bwd_idx[0, 0, j, : int(sp.bwd_cnt[0, 0, j])].tolist()
        assert col == sorted(col)
        bwd[col, j] = True
    assert torch.equal(fwd, bwd)
    assert sp.tiles == int(fwd.sum())
    assert torch.equal(sp.empty_rows, ~fwd.any(1))
    assert sp.fwd_cnt.dtype == sp.fwd_idx.dtype == sp.bwd_cnt.dtype == sp.bwd_idx.dtype == torch.int32


@pytest.mark.parametrize("kind,cp,gran,seq", [("striped", 2, 128, 2048), ("striped", 4, 128, 4096),
                                               ("striped", 4, 256, 4096), ("zigzag", 2, 1, 2048),
                                               ("zigzag", 4, 1, 4096)])
def test_every_step_maps_exactly(kind, cp, gran, seq):
    lay = Layout(kind, cp_size=cp, granularity=gran)
    kinds = set()
    for rank in range(cp):
        q_pos = lay.positions(rank, seq)
        for owner in range(cp):
            k_pos = lay.positions(owner, seq)
            plan = plan_step(q_pos, k_pos, causal=True)
            assert plan.kind != "unsupported", (rank, owner, plan.reason)
            kinds.add(plan.kind)
            assert torch.equal(mask_of_plan(plan, q_pos.numel(), k_pos.numel()), token_mask(q_pos, k_pos)), (rank, owner)
            if plan.kind == "blocks":
                check_lists(plan.sparsity)
    assert "causal" in kinds and ("blocks" in kinds or "full" in kinds)


def test_striped_steps_are_inclusive_and_strict_block_causal():
    lay = Layout("striped", cp_size=2, granularity=128)
    q_pos = lay.positions(1, 2048)
    inclusive = plan_step(q_pos, lay.positions(0, 2048)).sparsity      # owner < rank
    strict = plan_step(lay.positions(0, 2048), lay.positions(1, 2048)).sparsity  # owner > rank
    m = 2048 // 2 // B
    assert inclusive.fwd_cnt[0, 0].tolist() == [i + 1 for i in range(m)]
    assert strict.fwd_cnt[0, 0].tolist() == list(range(m))
    assert strict.empty_rows.tolist() == [True] + [False] * (m - 1)


@pytest.mark.parametrize("gran", [64, 1])
def test_token_level_masks_are_unsupported(gran):
    lay = Layout("striped", cp_size=2, granularity=gran)
    plan = plan_step(lay.positions(1, 2048), lay.positions(0, 2048))
    assert plan.kind == "unsupported" and "granularity" in plan.reason


def test_lengths_not_multiple_of_tile_are_unsupported():
    pos = torch.arange(192)
    assert plan_step(pos, pos).kind == "unsupported"
    with pytest.raises(ValueError, match="multiples of 128"):
        classify_tiles(pos, pos)


def test_non_causal_step_is_full_and_partial_tiles_are_found():
    pos = torch.arange(256)
    assert plan_step(pos, pos + 10_000, causal=False).kind == "full"
    tiles = classify_tiles(pos, pos)
    assert tiles.tolist() == [[PARTIAL, 0], [FULL, PARTIAL]]


def test_negative_control_a_missing_tile_is_seen():
    """The comparison used above can fail: drop one full tile and the masks differ."""
    lay = Layout("striped", cp_size=2, granularity=128)
    q_pos, k_pos = lay.positions(1, 2048), lay.positions(0, 2048)
    full = classify_tiles(q_pos, k_pos) == FULL
    full[3, 1] = False
    plan = plan_step(q_pos, k_pos)
    broken = type(plan)("blocks", block_sparsity_from_tiles(full))
    assert not torch.equal(mask_of_plan(broken, 1024, 1024), token_mask(q_pos, k_pos))


def test_select_backend_fa4_rules():
    """``fa4``: chosen by ``auto`` where FA4 runs (simulated), refused where it cannot, never on the CPU."""
    from megatron_mtraining.ops.backends import select_backend
    from megatron_mtraining.ops.fa4 import fa4_causal

    kw = dict(device="cuda", dtype=torch.bfloat16, head_dim=128, seq_len_local=4096, cp_size=2, triton_available=True)
    auto = select_backend("auto", fa4_available=True, **kw)
    assert auto.name == "fa4" and auto.dense_cp1 is fa4_causal and auto.sparse_step is not None
    assert select_backend("auto", fa4_available=False, **kw).name == "triton"
    assert select_backend("fa4", fa4_available=True, **kw).name == "fa4"
    with pytest.raises(ValueError, match="kernel_backend='fa4' cannot run these inputs: FlashAttention-4 is not"):
        select_backend("fa4", fa4_available=False, **kw)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("fa4", device="cpu", dtype=torch.bfloat16, head_dim=128)
    with pytest.raises(ValueError, match="head_dim 80"):
        select_backend("fa4", fa4_available=True, **{**kw, "head_dim": 80})
    assert select_backend("auto", device="cpu", dtype=torch.bfloat16, head_dim=128).name == "torch"


def test_fa4_dense_step_falls_back_per_step_on_cpu_layouts():
    """``make_fa4_dense_step`` plans every step from the layout; token-level steps go to the fallback."""
    from megatron_mtraining.ops.fa4 import make_fa4_dense_step
    from megatron_mtraining.ops.reference import DenseStepKernel

    for gran, want in ((128, {"causal", "blocks"}), (64, {"causal", "unsupported"})):
        lay = Layout("striped", cp_size=2, granularity=gran)
        kern = make_fa4_dense_step(lay, 1, 2048, 0.1, True, device="cpu", fallback=DenseStepKernel)
        assert {kern.plan(o).kind for o in range(2)} == want
        assert isinstance(kern.fallback, DenseStepKernel)

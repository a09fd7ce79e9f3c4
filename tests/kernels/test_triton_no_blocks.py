"""Plans of columns-only steps (``SparsePlan.no_blocks``), run by the Triton CPU interpreter.

A step whose indices list no block (the FA4 sparse step's columns, ``ops.fa4._without_blocks``; any step with a
valid ``known_max.block == 0``) is planned without block structures: no block split, no diagonal rows, no
inverted block index; its backward writes zero dK/dV instead of running the dK/dV kernel and its dQ kernel
skips the block loops. Checked: out, LSE, dQ, dK, dV bitwise those of the plan without the flag (causal and
not, GQA, deterministic and the atomic fast mode, a step with nothing listed), and against fp64; which indices
get the flag (a valid ``known_max`` with ``block == 0`` only; ``_without_blocks`` always); the FA4 step's
columns-only step through its Triton fallback.

As in test_triton_kernels.py, the interpreter is chosen before triton is imported; in a session that imported
compiled Triton first, the tests re-run this file in a fresh subprocess.
"""

import dataclasses
import os
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:  # else compiled Triton is in use (GPU session): the tests run in a subprocess
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.triton_interp import rerun_in_fresh_interpreter, use_interpreted_kernels

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from megatron_mtraining.ops.triton import launch, make_sparse_step_kernel, plan_for  # noqa: E402
from megatron_mtraining.patterns.indices import KnownMax, StepIndices  # noqa: E402
from tests.workers.gpu_common import dense_mask_rows, oracle, random_step_indices, rel_err  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.ops.triton.kernels", "_sparse_fwd_kernel")
    yield


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


def columns_only(idx: StepIndices) -> StepIndices:
    """``idx`` without its blocks (zero counts, a width-1 block index of -1), as the FA4 step builds it."""
    b, h, nqb = idx.block_count.shape
    return StepIndices(torch.zeros_like(idx.block_count), torch.full((b, h, nqb, 1), -1, dtype=torch.int32),
                       idx.column_count, idx.column_index, idx.causal)


def run(plan, q, k, v, dout, lse_g, delta_g, scale, deterministic, config=None):
    out, lse = launch.sparse_forward(q, k, v, plan, scale, config=config)
    grads = launch.sparse_backward(dout, q, k, v, lse_g, delta_g, plan, scale, deterministic, config=config)
    return (out, lse, *grads)


FAST = launch.KernelConfig(col_atomic_fast=True, dq_atomic_fast=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_columns_only_step_is_bitwise_the_same_with_the_flag(causal, mode):
    gen = torch.Generator().manual_seed(5 + causal)
    b, s, hq, hkv, d, scale = 2, 192, 2, 1, 64, 0.125
    idx = columns_only(random_step_indices(b, hq, s // 64, s // 64, causal, gen, p_col=0.1))
    q, k, v, dout = (torch.randn(b, s, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
    mask_fn = lambda r0, r1: dense_mask_rows(idx, r0, r1, s)  # noqa: E731
    o_ref, l_ref = oracle(q, k, v, mask_fn, scale)
    lse_g = torch.where(torch.isinf(l_ref), l_ref, l_ref + 0.25 * torch.rand(l_ref.shape, generator=gen,
                                                                              dtype=torch.float64))
    delta_g = torch.randn(l_ref.shape, generator=gen, dtype=torch.float64)
    *_, dq_r, dk_r, dv_r, _, _ = oracle(q, k, v, mask_fn, scale, dout, lse_g, delta_g)
    args = (idx.block_count, idx.block_index, idx.column_count, idx.column_index, causal)
    flagged, plain = launch.plan_from_indices(*args, no_blocks=True), launch.plan_from_indices(*args)
    assert flagged.no_blocks and not plain.no_blocks and torch.equal(flagged.block_split, idx.block_count)
    det, cfg = (True, None) if mode == "deterministic" else (False, FAST)
    got = run(flagged, q, k, v, dout, lse_g.float(), delta_g.float(), scale, det, cfg)
    want = run(plain, q, k, v, dout, lse_g.float(), delta_g.float(), scale, det, cfg)
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, w), name
    assert not flagged._kv and plain._kv                 # no inverted block index was built
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), got, (o_ref, l_ref, dq_r, dk_r, dv_r)):
        assert rel_err(a, r) <= 2e-5, name
    if causal and det:   # negative control: the flag on a step that does list blocks drops their dK/dV
        full = random_step_indices(b, hq, s // 64, s // 64, causal, gen, p_col=0.0)
        fargs = (full.block_count, full.block_index, full.column_count, full.column_index, causal)
        wrong, right = (launch.sparse_backward(dout, q, k, v, lse_g.float(), delta_g.float(),
                                               launch.plan_from_indices(*fargs, no_blocks=flag), scale)
                        for flag in (True, False))
        assert torch.equal(wrong[1], torch.zeros_like(wrong[1])) and not torch.equal(wrong[1], right[1])


@pytest.mark.parametrize("mode", ["deterministic", "fast"])
def test_step_with_nothing_listed_gives_zeros_with_the_flag(mode):
    gen = torch.Generator().manual_seed(2)
    b, s, hq, d = 1, 128, 2, 64
    q, k, v, dout = (torch.randn(b, s, hq, d, generator=gen) for _ in range(4))
    z = torch.zeros(b, hq, s // 64, dtype=torch.int32)
    plan = launch.plan_from_indices(z, torch.full((b, hq, s // 64, 1), -1, dtype=torch.int32), z,
                                    torch.zeros(b, hq, s // 64, 0, dtype=torch.int32), True, no_blocks=True)
    assert not plan.has_columns
    lse = torch.full((b, hq, s), float("-inf"))
    det, cfg = (True, None) if mode == "deterministic" else (False, FAST)
    for t in run(plan, q, k, v, dout, lse, torch.zeros(b, hq, s), 0.125, det, cfg):
        assert torch.equal(t, torch.zeros_like(t)) if t.dim() == 4 else bool(torch.isneginf(t).all())


def test_which_indices_get_the_flag():
    gen = torch.Generator().manual_seed(3)
    idx = columns_only(random_step_indices(1, 2, 3, 3, True, gen, p_col=0.1))
    assert not plan_for(idx).no_blocks                                        # nothing known on the host
    known = dataclasses.replace(idx, known_max=KnownMax(idx.block_count, idx.column_count, 0, 30))
    assert plan_for(known).no_blocks
    assert not plan_for(dataclasses.replace(idx, known_max=KnownMax(idx.block_count, idx.column_count, 1, 30))
                        ).no_blocks
    known.block_count.add_(0)                                                # a write: the record is stale
    assert not plan_for(known).no_blocks


@pytest.mark.parametrize("known", [True, False])
def test_fa4_columns_only_step_plans_no_blocks(known):
    """The FA4 sparse step's columns (``_without_blocks`` of 128-token indices, refined to the Triton tiles) get
    the flag, with or without the step's ``known_max``, and their Triton step gives bitwise the outputs and
    gradients of the plan without it."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.ops.fa4 import make_fa4_sparse_step
    from megatron_mtraining.patterns.convert import convert_pattern, refine_indices
    from tests.helpers.ring_sim import random_pattern

    s, hq, hkv, d, scale = 256, 2, 1, 64, 0.125
    steps = convert_pattern(random_pattern(s, 128, 1, hq, seed=8, max_slash=0, max_vertical=12, shared_columns=(3,)),
                            Layout("striped", 1, 128), 0)                    # the diagonal blocks and columns
    assert int(steps[0].column_count.sum()) > 0
    if not known:
        steps = [dataclasses.replace(st, known_max=None) for st in steps]
    kern = make_fa4_sparse_step(steps, scale, fallback=make_sparse_step_kernel)
    _, cols = kern._parts(steps[0])
    assert cols is not None and cols.known_max.block == 0
    flagged = kern.fallback.plan(cols)
    assert flagged.no_blocks
    fine = refine_indices(cols, 64)
    plain = launch.plan_from_indices(fine.block_count, fine.block_index, fine.column_count, fine.column_index,
                                     bool(fine.causal))
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, s, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
    out, lse = kern.fallback.forward_fn(q, k, v, cols, scale)
    delta = (dout * out).sum(-1).transpose(1, 2).contiguous()
    got = (out, lse, *kern.fallback.backward_fn(dout, q, k, v, lse, delta, cols, scale))
    want = run(plain, q, k, v, dout, lse, delta, scale, True)
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, w), name
    assert float(got[3].abs().sum()) > 0

"""Dense ring steps through FlashAttention-4 against fp64 (GPU, marked ``gpu``), and the ring
simulation they use, checked on the CPU with the torch reference step kernel."""
from __future__ import annotations

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.fa4 import FA4DenseStepKernel, fa4_unavailable_reason
from megatron_mtraining.ring import DenseStepKernel
from tests.helpers.ring_sim import simulate_dense_ring
from tests.workers.gpu_common import bf16_reference, oracle, rel_err


def causal_mask(r0, r1, sk, device):
    rows = torch.arange(r0, r1, device=device)
    return (torch.arange(sk, device=device)[None, :] <= rows[:, None])[None, None]


def inputs(b, seq, hq, hkv, d, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    return mk(b, seq, hq, d), mk(b, seq, hkv, d), mk(b, seq, hkv, d), mk(b, seq, hq, d)


def test_ring_simulation_matches_fp64_with_reference_kernel():
    """The harness itself (CPU, fp64): the reference step kernel gives exact attention."""
    lay = Layout("striped", cp_size=4, granularity=128)
    q, k, v, do = inputs(2, 1024, 4, 2, 16, "cpu", torch.float64)
    scale = 0.25
    got = simulate_dense_ring(lay, q, k, v, do,
                              lambda r: DenseStepKernel(lay, r, 1024, scale, True, device="cpu"))
    ref = oracle(q, k, v, lambda r0, r1: causal_mask(r0, r1, 1024, "cpu"), scale, dout=do)
    for name, a, bref in zip(("out", "lse", "dq", "dk", "dv"), got, ref[:5]):
        assert rel_err(a, bref) < 1e-6, name
    # negative control: dropping one owner's backward is seen
    class Drop(DenseStepKernel):
        def backward(self, dout, q, k, v, lse, delta, owner):
            return None if owner == 1 else super().backward(dout, q, k, v, lse, delta, owner)
    bad = simulate_dense_ring(lay, q, k, v, do, lambda r: Drop(lay, r, 1024, scale, True, device="cpu"))
    assert rel_err(bad[3], ref[3]) > 1e-3


needs_fa4 = pytest.mark.skipif(
    not torch.cuda.is_available() or fa4_unavailable_reason("cuda") is not None,
    reason="needs a Hopper/Blackwell GPU with flash-attn-4")


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("kind,cp,gran", [("striped", 2, 128), ("striped", 4, 128), ("zigzag", 2, 1)])
@pytest.mark.parametrize("d,hq,hkv", [(128, 16, 2), (64, 9, 3), (128, 4, 4)])
def test_fa4_dense_ring_matches_fp64(kind, cp, gran, d, hq, hkv):
    dev, seq, scale = torch.device("cuda"), 2048, d ** -0.5
    lay = Layout(kind, cp_size=cp, granularity=gran)
    q, k, v, do = inputs(2, seq, hq, hkv, d, dev, torch.bfloat16, seed=cp * 100 + d + hq)

    def make(rank):
        ref = DenseStepKernel(lay, rank, seq, scale, True, device=dev)
        kern = FA4DenseStepKernel(ref.q_pos, ref.k_pos, scale, True, fallback=ref)
        make.kernels.append(kern)
        return kern
    make.kernels = []
    got = simulate_dense_ring(lay, q, k, v, do, make)
    assert all(kk.fallback_steps == 0 for kk in make.kernels)
    mask = lambda r0, r1: causal_mask(r0, r1, seq, dev)
    ref = oracle(q, k, v, mask, scale, dout=do)
    bar = bf16_reference(q, k, v, mask, scale, do)
    for name, a, r64, r16 in zip(("out", "lse", "dq", "dk", "dv"), got, ref[:5], bar):
        err, err16 = rel_err(a, r64), rel_err(r16, r64)
        assert err <= 2 * err16, f"{name}: FA4 ring {err:.2e} vs bf16 reference {err16:.2e}"


@pytest.mark.gpu
@needs_fa4
def test_fa4_backend_ring_is_deterministic_and_accurate():
    """The backend's FA4 dense steps (deterministic backward) through the real ring Function at CP=1
    and in the simulated CP=4 ring: bitwise repeatable, within 2x the bf16 reference."""
    from megatron_mtraining.ops.backends import select_backend
    dev, seq, d = torch.device("cuda"), 2048, 128
    lay = Layout("striped", cp_size=4, granularity=128)
    backend = select_backend("fa4", device=dev, dtype=torch.bfloat16, head_dim=d, seq_len_local=seq // 4, cp_size=4)
    assert backend.name == "fa4"
    q, k, v, do = inputs(2, seq, 16, 2, d, dev, torch.bfloat16, seed=7)
    runs = [simulate_dense_ring(lay, q, k, v, do,
                                lambda r: backend.dense_step(lay, r, seq, d ** -0.5, True, device=dev))
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    mask = lambda r0, r1: causal_mask(r0, r1, seq, dev)
    ref = oracle(q, k, v, mask, d ** -0.5, dout=do)
    bar = bf16_reference(q, k, v, mask, d ** -0.5, do)
    for name, a, r64, r16 in zip(("out", "lse", "dq", "dk", "dv"), runs[0], ref[:5], bar):
        assert rel_err(a, r64) <= 2 * rel_err(r16, r64), name


@pytest.mark.gpu
@needs_fa4
def test_fa4_cp1_dense_matches_fp64():
    from megatron_mtraining.ops.fa4 import fa4_causal
    dev, seq, d = torch.device("cuda"), 2048, 64
    q, k, v, do = inputs(2, seq, 9, 3, d, dev, torch.bfloat16, seed=11)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out = fa4_causal(qa, ka, va, d ** -0.5)
    out.backward(do)
    mask = lambda r0, r1: causal_mask(r0, r1, seq, dev)
    ref = oracle(q, k, v, mask, d ** -0.5, dout=do)
    bar = bf16_reference(q, k, v, mask, d ** -0.5, do)
    for name, a, r64, r16 in (("out", out, ref[0], bar[0]), ("dq", qa.grad, ref[2], bar[2]),
                              ("dk", ka.grad, ref[3], bar[3]), ("dv", va.grad, ref[4], bar[4])):
        assert rel_err(a, r64) <= 2 * rel_err(r16, r64), name


@pytest.mark.gpu
@needs_fa4
def test_fa4_step_kernel_falls_back_on_token_level_masks():
    dev, seq, scale = torch.device("cuda"), 1024, 128 ** -0.5
    lay = Layout("striped", cp_size=2, granularity=64)
    ref = DenseStepKernel(lay, 1, seq, scale, True, device=dev)
    kern = FA4DenseStepKernel(ref.q_pos, ref.k_pos, scale, True, fallback=ref)
    assert kern.plan(0).kind == "unsupported"
    q, k, v, _ = inputs(1, seq // 2, 4, 2, 128, dev, torch.bfloat16)
    out, lse = kern.forward(q, k, v, 0)
    want = ref.forward(q, k, v, 0)
    assert torch.equal(out, want[0]) and kern.fallback_steps == 1


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("kind,cp,gran", [("striped", 1, 128), ("striped", 2, 128), ("striped", 4, 128),
                                          ("zigzag", 2, 1)])
@pytest.mark.parametrize("d,hq,hkv", [(128, 16, 2), (64, 9, 3), (128, 8, 8)])
@pytest.mark.parametrize("case", ["random", "shared_columns", "negative_scores"])
def test_fa4_sparse_ring_matches_fp64(kind, cp, gran, d, hq, hkv, case):
    """Vertical-slash ring steps at 128-token slash blocks: slash blocks on FA4 (per-head block
    lists, causal own step), columns on Triton, merged by LSE; out, LSE, dQ, dK, dV within 2x the
    error of a bf16 torch reference. Steps with query blocks that list no block are common at cp 4."""
    from megatron_mtraining.ops.fa4 import make_fa4_sparse_step, FA4SparseStepKernel
    from megatron_mtraining.ops.triton import make_sparse_step_kernel
    from megatron_mtraining.patterns.convert import convert_pattern
    from tests.helpers.ring_sim import random_pattern

    dev, seq, scale = torch.device("cuda"), 4096, d ** -0.5
    lay = Layout(kind, cp_size=cp, granularity=gran)
    q, k, v, do = inputs(2, seq, hq, hkv, d, dev, torch.bfloat16, seed=cp * 100 + d + hq)
    if case == "negative_scores":        # every visible score strongly negative (logits around -30)
        k = (-q.view(2, seq, hkv, hq // hkv, d).mean(3) * 4).to(torch.bfloat16)
    pat = random_pattern(seq, 128, 2, hq, seed=cp + d, max_slash=6, max_vertical=40,
                         shared_columns=(0, 1, 2, 3, 777, 2049) if case == "shared_columns" else ())
    pat = pat.to(dev) if hasattr(pat, "to") else pat
    steps = {r: convert_pattern(pat, lay, r) for r in range(cp)}

    def make(rank):
        kern = make_fa4_sparse_step(steps[rank], scale, fallback=make_sparse_step_kernel, deterministic=False)
        assert isinstance(kern, FA4SparseStepKernel)
        return kern
    got = simulate_dense_ring(lay, q, k, v, do, make)
    dm = pat.dense_mask()
    mask = lambda r0, r1: dm[:, :, r0:r1]
    ref = oracle(q, k, v, mask, scale, dout=do)
    bar = bf16_reference(q, k, v, mask, scale, do)
    for name, a, r64, r16 in zip(("out", "lse", "dq", "dk", "dv"), got, ref[:5], bar):
        err, err16 = rel_err(a, r64), rel_err(r16, r64)
        assert err <= 2 * err16, f"{name}: FA4 sparse ring {err:.2e} vs bf16 reference {err16:.2e}"


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("d,hq,hkv", [(128, 16, 2), (64, 9, 3)])
def test_fa4_backend_sparse_ring_with_estimated_pattern(d, hq, hkv):
    """The whole sparse path at cp 1 with ``block_size 128``: estimator, conversion, FA4 slash
    blocks + Triton columns (kernel_backend 'fa4'), against fp64 attention under the estimated mask."""
    from megatron_mtraining.ops.backends import select_backend
    from megatron_mtraining.ops.fa4 import FA4SparseStepKernel
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    from megatron_mtraining.ring.sparse import sparse_ring_attention

    from tests.workers.vs_data import make_qkv

    dev, seq, scale = torch.device("cuda"), 4096, d ** -0.5
    # vertical-slash structured inputs (sinks, heavy hitters, local phasors): a sparse estimate
    q, k, v = (t.to(dev, torch.bfloat16) for t in make_qkv(2, seq, hq, hkv, d, seed=d))
    do = inputs(2, seq, hq, hkv, d, dev, torch.bfloat16, seed=d)[3]
    backend = select_backend("fa4", device=dev, dtype=torch.bfloat16, head_dim=d, seq_len_local=seq, sparse=True,
                             deterministic=False)
    assert backend.name == "fa4"
    assert isinstance(backend.sparse_step([], scale), FA4SparseStepKernel)
    qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, pat = sparse_ring_attention(qa, ka, va, layout=Layout("striped", 1, 128), group=None,
                                     config=VerticalSlashConfig(recall=0.9, block_size=128), softmax_scale=scale,
                                     return_pattern=True, backend=backend)
    out.backward(do)
    dm = pat.dense_mask()
    assert float(dm.float().mean()) < 0.45
    mask = lambda r0, r1: dm[:, :, r0:r1]
    ref = oracle(q, k, v, mask, scale, dout=do)
    bar = bf16_reference(q, k, v, mask, scale, do)
    for name, a, r64, r16 in zip(("out", "dq", "dk", "dv"), (out, qa.grad, ka.grad, va.grad),
                                 (ref[0],) + tuple(ref[2:5]), (bar[0],) + tuple(bar[2:5])):
        err, err16 = rel_err(a, r64), rel_err(r16, r64)
        assert err <= 2 * err16, f"{name}: {err:.2e} vs bf16 reference {err16:.2e}"

"""select_backend: the one place choosing attention kernels.

The CUDA capability check is simulated through ``triton_available`` (no GPU needed: selection
allocates nothing). Numerical checks run on the CPU against an fp64 torch reference.
"""

import functools

import pytest
import torch

from megatron_mtraining.common import triton_runs_on
from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.backends import KERNEL_BACKENDS, TRITON_HEAD_DIMS, KernelBackend, select_backend
from megatron_mtraining.ops.reference import DenseStepKernel, attention_delta_torch, attention_forward
from megatron_mtraining.ops.sparse_reference import SparseStepKernel
from megatron_mtraining.ring import ring_attention

CUDA = dict(device="cuda", triton_available=True)      # a CUDA device where Triton runs (simulated)


def _fn(f):
    return f.func if isinstance(f, functools.partial) else f


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("triton_available", [False, True])
def test_auto_on_cpu_is_the_torch_reference(dtype, triton_available):
    b = select_backend("auto", device="cpu", dtype=dtype, head_dim=64, seq_len_local=128, cp_size=2,
                       triton_available=triton_available)
    assert isinstance(b, KernelBackend)
    assert (b.name, b.dense_step, b.sparse_step, b.delta, b.dense_cp1) == (
        "torch", DenseStepKernel, SparseStepKernel, attention_delta_torch, None)
    assert (b.estimator_impl, b.convert_impl) == ("torch", "torch")
    with pytest.raises(Exception):
        b.name = "triton"                         # frozen


def test_explicit_torch_everywhere():
    for dev in ("cpu", "cuda"):
        b = select_backend("torch", device=dev, dtype=torch.bfloat16, head_dim=80, cp_size=4, triton_available=True)
        assert (b.name, b.dense_step, b.sparse_step, b.dense_cp1, b.estimator_impl, b.delta) == (
            "torch", DenseStepKernel, SparseStepKernel, None, "torch", attention_delta_torch)


def test_auto_on_cuda_picks_sdpa_at_cp1_and_triton_elsewhere():
    from megatron_mtraining.ops.dense_gpu import DenseGpuStepKernel
    from megatron_mtraining.ops.sdpa import sdpa_causal
    from megatron_mtraining.ops.triton import TritonSparseStepKernel

    b = select_backend("auto", dtype=torch.bfloat16, head_dim=128, seq_len_local=4096, cp_size=1, **CUDA)
    assert b.name == "triton" and b.dense_cp1 is sdpa_causal
    assert (b.estimator_impl, b.convert_impl) == ("triton", "triton")
    b = select_backend("auto", dtype=torch.bfloat16, head_dim=128, seq_len_local=4096, cp_size=4, sparse=True,
                       deterministic=False, **CUDA)
    assert _fn(b.dense_step) is DenseGpuStepKernel and b.dense_step.keywords["deterministic"] is False
    assert _fn(b.sparse_step).__name__ == "make_sparse_step_kernel"
    assert (b.estimator_impl, b.convert_impl) == ("triton", "torch")       # the conversion kernel: cp 1 only
    kern = b.sparse_step([], 0.1)
    assert isinstance(kern, TritonSparseStepKernel) and kern.deterministic is False and kern.prebuild
    b = select_backend("auto", dtype=torch.float32, head_dim=64, cp_size=1, **CUDA)
    assert b.name == "triton" and b.dense_cp1 is None                    # SDPA for bf16/fp16 only


@pytest.mark.parametrize("why,kw", [
    ("head_dim 80", dict(dtype=torch.bfloat16, head_dim=80, seq_len_local=4096)),
    ("dtype torch.float64", dict(dtype=torch.float64, head_dim=128, seq_len_local=4096)),
    ("local sequence length 100", dict(dtype=torch.bfloat16, head_dim=128, seq_len_local=100)),
])
def test_auto_falls_back_where_a_triton_limit_fails(why, kw):
    """e.g. head_dim 80 on CUDA at CP>1: the torch reference steps, no error; explicit 'triton' names the rule."""
    b = select_backend("auto", cp_size=2, sparse=True, **kw, **CUDA)
    assert (b.name, b.dense_step, b.sparse_step) == ("torch", DenseStepKernel, SparseStepKernel)
    with pytest.raises(ValueError, match="kernel_backend='triton' cannot run these inputs") as e:
        select_backend("triton", cp_size=2, **kw, **CUDA)
    assert why in str(e.value)
    assert "supported:" in str(e.value)


def test_auto_fallback_for_head_dim_80_is_exact():
    """The backend auto picks for CUDA, head_dim 80, runs the ring (here on CPU tensors) to fp64 accuracy:
    out and dQ, dK, dV checked separately."""
    backend = select_backend("auto", dtype=torch.float32, head_dim=80, seq_len_local=128, cp_size=1, **CUDA)
    assert backend.name == "torch"
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 128, h, 80, generator=gen) for h in (4, 2, 2, 4))
    qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = ring_attention(qa, ka, va, layout=Layout("striped", 1, 64), backend=backend)
    out.backward(dout)
    qr, kr, vr = (t.double().requires_grad_(True) for t in (q, k, v))
    pos = torch.arange(128)
    ref, _ = attention_forward(qr, kr, vr, pos, pos)
    ref.backward(dout.double())
    for name, got, want in (("out", out, ref), ("dq", qa.grad, qr.grad), ("dk", ka.grad, kr.grad),
                            ("dv", va.grad, vr.grad)):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, (name, err)


def test_explicit_requests_that_cannot_run_raise_naming_the_rule():
    with pytest.raises(ValueError, match="kernel_backend must be one of 'auto', 'torch', 'triton', 'sdpa'"):
        select_backend("flash", device="cpu", dtype=torch.float32, head_dim=64)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", device="cpu", dtype=torch.float32, head_dim=64, triton_available=False)
    with pytest.raises(ValueError, match=", ".join(map(str, TRITON_HEAD_DIMS))):
        select_backend("triton", dtype=torch.float16, head_dim=96, **CUDA)
    with pytest.raises(ValueError, match="kernel_backend='sdpa' runs dense attention at cp_size 1 only"):
        select_backend("sdpa", dtype=torch.bfloat16, head_dim=128, cp_size=2, **CUDA)
    with pytest.raises(ValueError, match="sparse=True"):
        select_backend("sdpa", dtype=torch.bfloat16, head_dim=128, sparse=True, **CUDA)
    with pytest.raises(ValueError, match="float64, got dtype torch.int32"):
        select_backend("auto", device="cpu", dtype=torch.int32, head_dim=64)
    assert set(KERNEL_BACKENDS) == {"auto", "torch", "triton", "sdpa", "fa4"}


def test_explicit_triton_on_the_interpreter_is_allowed():
    if not triton_runs_on("cpu"):
        pytest.skip("needs TRITON_INTERPRET=1 and triton")
    b = select_backend("triton", device="cpu", dtype=torch.float32, head_dim=64, seq_len_local=128)
    assert b.name == "triton" and b.estimator_impl == "triton"


def test_sdpa_backend_at_cp1_matches_the_reference_and_refuses_the_sparse_ring():
    from megatron_mtraining.ring.sparse import sparse_ring_attention

    b = select_backend("sdpa", device="cpu", dtype=torch.float64, head_dim=32)
    assert b.name == "sdpa" and b.sparse_step is None and b.dense_cp1 is not None
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 128, h, 32, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    out = ring_attention(q, k, v, layout=Layout("striped", 1, 64), backend=b)
    ref, _ = attention_forward(q, k, v, torch.arange(128), torch.arange(128))
    assert (out - ref).abs().max() < 1e-12
    with pytest.raises(ValueError, match="kernel_backend='sdpa' has no sparse kernels"):
        sparse_ring_attention(q, k, v, layout=Layout("striped", 1, 64), backend=b)


def test_explicit_triton_built_without_the_length_names_the_rule_at_the_ring():
    """A Triton backend selected without ``seq_len_local`` and given 200 local tokens: the ring entry
    points name the 64-token rule (before: ``RuntimeError: shape '[3, 64]' is invalid`` from the kernels)."""
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    from megatron_mtraining.ring import backend_input_error
    from megatron_mtraining.ring.sparse import sparse_ring_attention

    b = select_backend("triton", device="cpu", dtype=torch.float32, head_dim=16, triton_available=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 200, h, 16, generator=g) for h in (2, 1, 1))
    lay = Layout("striped", 1, 8)
    rule = "local sequence length 200 is not supported \\(supported: multiples of 64\\)"
    with pytest.raises(ValueError, match=rule):
        ring_attention(q, k, v, layout=lay, backend=b)
    with pytest.raises(ValueError, match=rule):
        sparse_ring_attention(q, k, v, layout=lay, backend=b,
                              config=VerticalSlashConfig(block_size=8, last_q=8, sink_tokens=8))
    # negative controls: a multiple of 64 passes the length rule; the torch backend takes any length
    assert "local sequence length" not in (backend_input_error(b, q[:, :128]) or "")
    assert backend_input_error(select_backend("torch", device="cpu", dtype=torch.float32, head_dim=16), q) is None

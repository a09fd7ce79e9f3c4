"""The fused LSE merge kernel (``ops.triton.launch.attention_merge``) on a GPU (marker ``gpu``; skipped without CUDA).

FA4 sparse step shapes (a bf16 FA4 output with the column kernel's fp32 output, and two bf16 partials), ``-inf``
rows on either side and on both, strided LSE views: out and LSE against an fp64 merge of the same inputs
(``tests/workers/gpu_common.merge_fp64``), each within 2x the error of the merge computed by bf16 torch ops and
within fp32 rounding (the kernel computes in fp32 from the inputs as they are); no NaN; exact ``-inf`` / zero
rows. ``merge_attention_fast`` runs the kernel on CUDA. The CPU interpreter runs the same checks at small sizes
in tests/kernels/test_triton_merge.py.
"""
import pytest
import torch

from tests.workers.gpu_common import merge_fp64, rel_err

NEG = float("-inf")
CASES = [  # b, s, h, d, dtype of partial 1, of partial 2
    (1, 16384, 9, 64, torch.bfloat16, torch.float32),
    (2, 4096, 16, 128, torch.bfloat16, torch.float32),
    (2, 4096, 9, 96, torch.bfloat16, torch.bfloat16),
    (1, 8192, 12, 128, torch.float16, torch.float32),
]


def _partials(b, s, h, d, dt1, dt2, seed):
    g = torch.Generator().manual_seed(seed)
    o1 = torch.randn(b, s, h, d, generator=g).to(dt1)
    o2 = torch.randn(b, s, h, d, generator=g).to(dt2)
    l1 = torch.randn(b, h, s, generator=g) * 4 + 2
    l2 = torch.randn(b, h, s, generator=g) * 4
    l1[:, :, 0::11] = NEG
    l2[:, :, 4::11] = NEG
    l1[:, :, 7::11] = NEG
    l2[:, :, 7::11] = NEG
    for o, l in ((o1, l1), (o2, l2)):
        o.masked_fill_(torch.isneginf(l).transpose(1, 2)[..., None], 0.0)
    return tuple(t.cuda() for t in (o1, l1, o2, l2))


def _bf16_torch_merge(o1, l1, o2, l2):
    """The max-subtracted merge in bf16 torch ops (the error bar)."""
    bf = torch.bfloat16
    o1, l1, o2, l2 = (t.to(bf) for t in (o1, l1, o2, l2))
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    tot = w1 + w2
    lse = m + torch.log(tot)
    tot = torch.where(tot == 0, torch.ones_like(tot), tot)
    out = o1 * (w1 / tot).transpose(1, 2)[..., None] + o2 * (w2 / tot).transpose(1, 2)[..., None]
    return out, lse


def _check(got, inputs):
    out, lse = got
    assert out.dtype == lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    ref = merge_fp64(*inputs)
    bar = _bf16_torch_merge(*inputs)
    for name, a, r, r16 in (("out", out, ref[0], bar[0]), ("lse", lse, ref[1], bar[1])):
        err, err16 = rel_err(a, r), rel_err(r16, r)
        assert err <= 2 * err16, f"{name}: kernel {err:.2e} vs bf16 torch merge {err16:.2e}"
        assert err <= 1e-5, f"{name}: kernel {err:.2e} (fp32 arithmetic on the inputs as they are)"
    both = torch.isneginf(inputs[1]) & torch.isneginf(inputs[3])
    assert torch.isneginf(lse[both]).all() and (out[both.transpose(1, 2)] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,h,d,dt1,dt2", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_merge_kernel_matches_fp64_on_gpu(b, s, h, d, dt1, dt2):
    from megatron_mtraining.ops.triton.launch import attention_merge

    inputs = _partials(b, s, h, d, dt1, dt2, seed=s + h + d)
    _check(attention_merge(*inputs), inputs)
    swapped = attention_merge(inputs[0], inputs[3], inputs[2], inputs[1])          # negative control
    assert rel_err(swapped[0], merge_fp64(*inputs)[0]) > 1e-2


@pytest.mark.gpu
def test_merge_kernel_reads_strided_inputs_on_gpu():
    """A ``[b, s, h, d]`` view of a ``[b, h, s, d]`` output and LSE views with a strided sequence dimension."""
    from megatron_mtraining.ops.triton.launch import attention_merge

    o1, l1, o2, l2 = _partials(2, 2048, 9, 64, torch.bfloat16, torch.float32, seed=3)
    t1 = o1.transpose(1, 2).contiguous().transpose(1, 2)
    v1 = l1.transpose(1, 2).contiguous().transpose(1, 2)
    v2 = torch.cat([l2, l2], -1)[..., l2.shape[-1]:]
    got = attention_merge(t1, v1, o2, v2)
    assert torch.equal(got[0], attention_merge(o1, l1, o2, l2)[0])
    _check(got, (o1, l1, o2, l2))


@pytest.mark.gpu
def test_merge_attention_fast_runs_the_kernel_on_gpu(monkeypatch):
    from megatron_mtraining.ops import merge
    from megatron_mtraining.ops.triton import launch

    calls = []
    real = launch.attention_merge
    monkeypatch.setattr(launch, "attention_merge", lambda *a: calls.append(1) or real(*a))
    inputs = _partials(1, 1024, 4, 128, torch.bfloat16, torch.float32, seed=1)
    got = merge.merge_attention_fast(*inputs)
    assert calls == [1]
    _check(got, inputs)
    torch_res = merge.merge_attention_fast(*(t.double() for t in inputs))          # fp64: the torch merge
    assert calls == [1] and torch_res[0].dtype == torch.float64

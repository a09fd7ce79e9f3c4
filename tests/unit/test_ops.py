"""Torch reference attention with LSE and the LSE merge, against independent fp64 math."""
import pytest
import torch

from megatron_mtraining.ops.merge import merge_attention
from megatron_mtraining.ops.reference import attention_backward, attention_forward

torch.manual_seed(0)


def naive(q, k, v, q_pos, k_pos, scale):
    """fp64 masked softmax attention with GQA by repeat_interleave; returns out, lse."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (6, 2)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_forward_backward_match_fp64_autograd(hq, hkv, dtype, tol):
    b, sq, sk, d = 2, 96, 80, 32
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    q_pos = torch.sort(torch.randperm(200, generator=g)[:sq]).values
    k_pos = torch.sort(torch.randperm(200, generator=g)[:sk]).values + 30   # queries < 30 see no key
    q64 = torch.randn(b, sq, hq, d, dtype=torch.float64, requires_grad=True)
    k64 = torch.randn(b, sk, hkv, d, dtype=torch.float64, requires_grad=True)
    v64 = torch.randn(b, sk, hkv, d, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, sq, hq, d, dtype=torch.float64)
    ref_out, ref_lse = naive(q64, k64, v64, q_pos, k_pos, 0.2)
    ref_out.backward(dout)
    q, k, v = (t.detach().to(dtype) for t in (q64, k64, v64))
    out, lse = attention_forward(q, k, v, q_pos, k_pos, 0.2)
    visible = torch.isfinite(ref_lse)
    assert (~visible).any(), "the case must contain rows with no visible key"
    assert rel(out.double(), ref_out.detach()) < tol
    assert torch.equal(torch.isneginf(lse), ~visible)
    assert rel(lse.double()[visible], ref_lse[visible].detach()) < tol
    assert torch.all(out[~visible.transpose(1, 2)] == 0)
    delta = (dout.to(out.dtype) * out).sum(-1).transpose(1, 2)
    dq, dk, dv = attention_backward(dout.to(dtype), q, k, v, lse, delta, q_pos, k_pos, 0.2)
    assert rel(dq.double(), q64.grad) < tol
    assert rel(dk.double(), k64.grad) < tol
    assert rel(dv.double(), v64.grad) < tol
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


def test_negative_control_wrong_positions_is_detected():
    b, s, h, d = 1, 64, 2, 16
    pos = torch.arange(s)
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for _ in range(3))
    ref, _ = naive(q, k, v, pos, pos, 0.25)
    out, _ = attention_forward(q, k, v, pos, pos + 1, 0.25)
    assert rel(out, ref) > 1e-3


def test_non_causal_and_all_masked_rows():
    b, s, h, d = 1, 8, 1, 4
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for _ in range(3))
    out, lse = attention_forward(q, k, v, torch.arange(s), torch.arange(s) + 100, 0.5)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    dq, dk, dv = attention_backward(torch.randn_like(q), q, k, v, lse, torch.zeros(b, h, s, dtype=torch.float64),
                                    torch.arange(s), torch.arange(s) + 100, 0.5)
    assert all(torch.all(t == 0) for t in (dq, dk, dv))
    out_nc, _ = attention_forward(q, k, v, torch.arange(s), torch.arange(s) + 100, 0.5, causal=False)
    ref, _ = naive(q, k, v, torch.full((s,), 10**6), torch.arange(s), 0.5)
    assert rel(out_nc, ref) < 1e-12


def _split_merge(q, k, v, q_pos, k_pos, cut):
    o1, l1 = attention_forward(q, k[:, :cut], v[:, :cut], q_pos, k_pos[:cut], 0.3)
    o2, l2 = attention_forward(q, k[:, cut:], v[:, cut:], q_pos, k_pos[cut:], 0.3)
    return merge_attention(o1, l1, o2, l2)


def test_merge_of_two_key_halves_equals_whole():
    b, s, h, d = 2, 64, 3, 8
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(s)
    whole = attention_forward(q, k, v, pos, pos, 0.3)
    for cut in (1, 17, 63):
        out, lse = _split_merge(q, k, v, pos, pos, cut)
        assert rel(out, whole[0]) < 1e-13 and rel(lse, whole[1]) < 1e-13


@pytest.mark.parametrize("gap", [0.0, 30.0, 700.0, 1e4, 1e30])
def test_merge_extreme_lse_gaps_no_overflow(gap):
    b, s, h, d = 1, 4, 2, 8
    o1, o2 = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    l1 = torch.full((b, h, s), 5.0)
    l2 = l1 + gap
    out, lse = merge_attention(o1, l1, o2, l2)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    w2 = torch.sigmoid(torch.tensor(gap, dtype=torch.float64)).item()
    exp = (o1.double() * (1 - w2) + o2.double() * w2).float()
    assert torch.allclose(out, exp, rtol=1e-6, atol=1e-6)
    exp_lse = (l2.double() + torch.log1p(torch.exp(torch.tensor(-gap, dtype=torch.float64)))).float()
    assert torch.allclose(lse, exp_lse, rtol=1e-6)
    out_r, lse_r = merge_attention(o2, l2, o1, l1)         # symmetric
    assert torch.allclose(out_r, out, rtol=1e-6, atol=1e-7) and torch.equal(lse_r, lse)


def test_merge_minus_inf_partials():
    b, s, h, d = 1, 3, 1, 4
    o = torch.randn(b, s, h, d)
    lse = torch.randn(b, h, s)
    ninf = torch.full((b, h, s), float("-inf"))
    out, new = merge_attention(o, lse, torch.zeros_like(o), ninf)      # -inf partial changes nothing
    assert torch.equal(out, o) and torch.equal(new, lse)
    out, new = merge_attention(torch.zeros_like(o), ninf, o, lse)
    assert torch.equal(out, o) and torch.equal(new, lse)
    out, new = merge_attention(torch.zeros_like(o), ninf, torch.zeros_like(o), ninf)
    assert torch.all(out == 0) and torch.all(torch.isneginf(new))

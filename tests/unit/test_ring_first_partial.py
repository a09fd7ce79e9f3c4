"""The ring's first computed partial is taken as it is (no merge into zeros): the same values as the
LSE merge of that partial into an empty result, for the output, the LSE and the gradients (the same bits
except that a zero keeps its sign: the merge turned -0.0 into +0.0); a ring whose steps see no key gives
zeros (CP=1, no process group)."""
import torch

from megatron_mtraining.ops.merge import merge_attention
from megatron_mtraining.ring import RingAttentionFunc


class _Fixed:
    """A step kernel that returns fixed tensors (``visible=False``: no step sees a key)."""

    def __init__(self, q, k, visible=True):
        g = torch.Generator().manual_seed(1)
        b, s, h, d = q.shape
        self.visible = visible
        self.out = torch.randn(b, s, h, d, generator=g, dtype=q.dtype)
        self.lse = torch.randn(b, h, s, generator=g, dtype=q.dtype)
        self.grads = tuple(torch.randn(t.shape, generator=g, dtype=q.dtype) for t in (q, k, k))

    def forward(self, q, k, v, owner):
        return (self.out.clone(), self.lse.clone()) if self.visible else None

    def backward(self, dout, q, k, v, lse, delta, owner):
        return tuple(t.clone() for t in self.grads) if self.visible else None


def _run(kernel, q, k, v):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = RingAttentionFunc.apply(q, k, v, kernel, None)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad


def test_first_partial_is_the_merge_into_an_empty_result():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 64, 4, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
    kern = _Fixed(q, k)
    out, dq, dk, dv = _run(kern, q, k, v)
    empty = torch.zeros_like(kern.out), torch.full_like(kern.lse, float("-inf"))
    ref_out, _ = merge_attention(*empty, kern.out, kern.lse)
    assert torch.equal(out, ref_out) and torch.equal(out, kern.out)
    for got, want in zip((dq, dk, dv), kern.grads):
        assert torch.equal(got, want)


def test_no_visible_key_gives_zeros():
    q, k, v = torch.randn(1, 64, 4, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
    out, dq, dk, dv = _run(_Fixed(q, k, visible=False), q, k, v)
    for t in (out, dq, dk, dv):
        assert torch.equal(t, torch.zeros_like(t))


def test_output_is_not_a_view_of_a_step_buffer():
    """At CP=1 the fp32 output is the torch kernel's own partial (a transposed buffer); the ring returns it
    detached, so an in-place edit with autograd on is allowed (as when the partial was merged into zeros),
    and a backward after it is refused by the usual saved-tensor check."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.ring import ring_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 16, requires_grad=True) for _ in range(3))
    out = ring_attention(q, k, v, layout=Layout("striped", 1, 16))
    assert not out._is_view()
    out.add_(1.0)
    try:
        out.sum().backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
    else:
        raise AssertionError("a backward through an output edited in place must be refused")


class _Recording(_Fixed):
    """:class:`_Fixed` that keeps the tensors it hands out (to see whether the ring copies them)."""

    def forward(self, q, k, v, owner):
        self.handed = super().forward(q, k, v, owner)
        return self.handed

    def backward(self, dout, q, k, v, lse, delta, owner):
        self.handed_grads = super().backward(dout, q, k, v, lse, delta, owner)
        return self.handed_grads


def test_one_step_ring_takes_a_half_precision_partial_as_it_is():
    """CP=1 (one ring step): a step kernel's bf16 output is the ring's output itself (no fp32 copy, none back to
    bf16), with the values of the merge into an empty result rounded to bf16, its LSE in fp32; its bf16 dQ / dK /
    dV are the backward's (no fp32 copies). A column phase's partial merged into such an output is in fp32."""
    from megatron_mtraining.distributed import RingComm
    from megatron_mtraining.ring import finish_forward, merge_partial, ring_pass_backward, ring_pass_forward

    torch.manual_seed(0)
    bf = torch.bfloat16
    q, k, v = torch.randn(1, 64, 4, 16).to(bf), torch.randn(1, 64, 2, 16).to(bf), torch.randn(1, 64, 2, 16).to(bf)
    kern = _Recording(q, k)
    comm = RingComm(None)
    out, lse = ring_pass_forward(kern, comm, q, (k, v), None, None, lambda step: 0)
    assert out is kern.handed[0] and lse.dtype == torch.float32
    final, lse = finish_forward(q, out, lse, None)
    assert final.dtype == bf and final.data_ptr() == kern.handed[0].data_ptr() and not final._is_view()
    empty = torch.zeros(kern.out.shape), torch.full(kern.lse.shape, float("-inf"))
    ref_out, ref_lse = merge_attention(*empty, kern.out.float(), kern.lse.float())
    assert torch.equal(final, ref_out.to(bf)) and torch.equal(lse, ref_lse)
    dq, (dk, dv) = ring_pass_backward(kern, comm, torch.ones_like(q), q, (k, v), lse, torch.zeros_like(lse), None,
                                      lambda step: 0)
    assert all(a is b for a, b in zip((dq, dk, dv), kern.handed_grads))
    # through the Function: the same values as the fp32 path gave (bf16 -> fp32 -> bf16 is exact)
    got = _run(_Fixed(q, k), q, k, v)
    assert all(g.dtype == bf and torch.equal(g, w) for g, w in zip(got, (kern.out, *kern.grads)))
    # a later merge (the column phase's fp32 partial) computes in fp32
    cols = (torch.randn(kern.out.shape), torch.randn(kern.lse.shape))
    merged = merge_partial(kern.out, kern.lse.float(), cols, torch.float32, keep=True)
    want = merge_attention(kern.out.float(), kern.lse.float(), *cols)
    assert merged[0].dtype == torch.float32 and all(torch.equal(a, b) for a, b in zip(merged, want))
    # negative control: without keep the partial is copied to fp32
    assert merge_partial(None, None, kern.handed, torch.float32)[0].dtype == torch.float32

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

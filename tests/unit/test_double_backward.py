"""Second-order gradients through the attention Functions are an error naming the rule, never a
silently wrong number.

The ring Functions (dense and sparse flat ring, hierarchical ring) and the sparse custom op compute
first-order gradients only. With ``create_graph=True`` the first-order gradients must still equal
fp64 math attention, and differentiating them again must raise ``RuntimeError`` naming the rule
(before, the second derivative came out with a relative error of 0.4-1.5 against fp64 math attention).
The multi-rank cases (CP=4: the flat ring and the hierarchical ring, whose Function needs two levels
of >= 2 ranks) are in the ``hier_ok`` scenario of ``tests/distributed/agreement_worker.py``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_mtraining.common import DOUBLE_BACKWARD_RULE
from megatron_mtraining.layout import Layout
from megatron_mtraining.ops.reference import DenseStepKernel
from megatron_mtraining.patterns.estimator import VerticalSlashConfig
from megatron_mtraining.ring import RingAttentionFunc, ring_attention
from megatron_mtraining.ring.sparse import sparse_ring_attention

S, HQ, HKV, D = 128, 2, 1, 8
CFG = VerticalSlashConfig(last_q=64, block_size=64, sink_tokens=64, local_blocks=2, max_vertical=128, max_slash=2,
                          recall=1.0)   # every line kept: the sparse ring equals dense attention


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(1, S, h, D, generator=g, dtype=torch.float64, requires_grad=True)
    return mk(HQ), mk(HKV), mk(HKV), torch.randn(1, S, HQ, D, generator=g, dtype=torch.float64)


def _math_sdpa(q, k, v):
    """fp64 causal softmax attention written out (differentiable to any order)."""
    rep = HQ // HKV
    k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    logits = logits.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), v)


def _dense(q, k, v):
    return ring_attention(q, k, v, layout=Layout("striped", 1, 64))


def _sparse(q, k, v):
    return sparse_ring_attention(q, k, v, layout=Layout("striped", 1, 64), config=CFG)


def _flat_function(q, k, v):
    layout = Layout("striped", 1, 64)
    kernel = DenseStepKernel(layout, 0, S, D ** -0.5, True, device=q.device)
    return RingAttentionFunc.apply(q, k, v, kernel, None, None)


def _sparse_custom_op(q, k, v):
    """The sparse custom op (``torch.ops.mtraining.sparse_attn_fwd``) with every causal block listed."""
    from megatron_mtraining.ops.triton import sparse_attention
    from megatron_mtraining.patterns.convert import convert_pattern
    from megatron_mtraining.patterns.estimator import estimate_vertical_slash

    layout = Layout("striped", 1, 64)
    pattern = estimate_vertical_slash(q.detach(), k.detach(), layout=layout, group=None, config=CFG)
    (steps,) = convert_pattern(pattern, layout, 0)
    return sparse_attention(q, k, v, steps.per_query_head(HQ))


ATTENTIONS = {"dense ring": _dense, "sparse ring": _sparse, "ring function": _flat_function,
              "sparse custom op": _sparse_custom_op}


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_double_backward_raises_naming_the_rule(name):
    q, k, v, dout = _qkv()
    out = ATTENTIONS[name](q, k, v)
    (dq,) = torch.autograd.grad(out, q, dout, create_graph=True)
    # the first-order gradient is unchanged by create_graph (fp64 math attention as the reference)
    (dq_ref,) = torch.autograd.grad(_math_sdpa(q, k, v), q, dout)
    assert (dq.detach() - dq_ref).abs().max() < 1e-10 * dq_ref.abs().max()
    with pytest.raises(RuntimeError, match="double backward") as e:
        torch.autograd.grad(dq, k, torch.ones_like(dq))
    assert DOUBLE_BACKWARD_RULE in str(e.value)


def test_math_sdpa_double_backward_runs():
    # negative control: the same second derivative exists for fp64 math attention (the harness is sound)
    q, k, v, dout = _qkv()
    (dq,) = torch.autograd.grad(_math_sdpa(q, k, v), q, dout, create_graph=True)
    (dk,) = torch.autograd.grad(dq, k, torch.ones_like(dq))
    assert torch.isfinite(dk).all() and dk.abs().max() > 0


def test_first_order_backward_without_create_graph_is_unchanged():
    q, k, v, dout = _qkv(1)
    grads = torch.autograd.grad(_sparse(q, k, v), (q, k, v), dout)
    refs = torch.autograd.grad(_math_sdpa(q, k, v), (q, k, v), dout)
    for g, r in zip(grads, refs):
        assert g.grad_fn is None and (g - r).abs().max() < 1e-10 * r.abs().max()

"""A NaN or infinite ``softmax_scale`` is a ``ValueError`` naming the rule at every public entry point
(before: NaN outputs and no error); a scale that is not a number is a ``TypeError``. The multi-rank
case (NaN on one rank of two) is in the ``plan_once`` scenario of ``tests/distributed/agreement_worker.py``;
``MTrainingAttention`` (refused when the layer is built) in ``tests/integration/test_megatron_adapter.py``."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash
from megatron_mtraining.plan import resolve
from megatron_mtraining.ring import ring_attention
from megatron_mtraining.ring.sparse import sparse_ring_attention

CFG = VerticalSlashConfig(last_q=16, block_size=16, sink_tokens=16, local_blocks=1, max_vertical=64, max_slash=4)
LAY = Layout("striped", 1, 16)
RULE = "softmax_scale must be a finite number"


def _qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 64, h, 8, generator=g, dtype=torch.float64) for h in (2, 1, 1))


ENTRIES = {
    "ring_attention": lambda q, k, v, s: ring_attention(q, k, v, layout=LAY, softmax_scale=s),
    "sparse_ring_attention": lambda q, k, v, s: sparse_ring_attention(q, k, v, layout=LAY, config=CFG, softmax_scale=s),
    "estimate_vertical_slash": lambda q, k, v, s: estimate_vertical_slash(q, k, layout=LAY, config=CFG, softmax_scale=s),
    "plan.check_inputs": lambda q, k, v, s: resolve({"granularity": 16}, cp_group=None, seq_len=64).check_inputs(q, k, v,
                                                                                                   softmax_scale=s),
}


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_non_finite_softmax_scale_is_refused(entry, scale):
    with pytest.raises(ValueError, match=RULE):
        ENTRIES[entry](*_qkv(), scale)


@pytest.mark.parametrize("entry", ["ring_attention", "sparse_ring_attention"])
def test_softmax_scale_that_is_not_a_number_is_refused(entry):
    with pytest.raises(TypeError, match="softmax_scale must be a number or None"):
        ENTRIES[entry](*_qkv(), "0.3")


def test_finite_scales_run():
    # negative control: a finite scale (and the default) give finite outputs equal to fp64 attention
    q, k, v = _qkv()
    for s in (None, 0.3):
        out = ring_attention(q, k, v, layout=LAY, softmax_scale=s)
        scale = 8 ** -0.5 if s is None else s
        kk, vv = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
        logits = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
        logits = logits.masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril(), float("-inf"))
        ref = torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), vv)
        assert (out - ref).abs().max() < 1e-12

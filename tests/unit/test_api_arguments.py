"""Arguments of the wrong kind at the public ring entry points are errors naming the argument (before:
AttributeError / ZeroDivisionError from deep inside); the sparse ring takes its budgets as a
VerticalSlashConfig, a mapping of its fields or None."""

from __future__ import annotations

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.ring import ring_attention
from megatron_mtraining.ring.hierarchical import hierarchical_ring_attention
from megatron_mtraining.ring.sparse import sparse_ring_attention
from megatron_mtraining.patterns.estimator import VerticalSlashConfig

LAY = Layout("striped", 1, 16)
SMALL = dict(last_q=16, block_size=16, sink_tokens=16, local_blocks=1, max_vertical=64, max_slash=4)


def _qkv(d=8):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 64, h, d, generator=g, dtype=torch.float64) for h in (2, 1, 1))


ENTRIES = {
    "ring_attention": lambda q, k, v, **kw: ring_attention(q, k, v, **kw),
    "sparse_ring_attention": lambda q, k, v, **kw: sparse_ring_attention(q, k, v, config=SMALL, **kw),
    "hierarchical_ring_attention": lambda q, k, v, **kw: hierarchical_ring_attention(
        q, k, v, inner_group=None, outer_group=None, **kw),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("kw, needle", [
    ({"layout": "striped"}, "layout must be a megatron_mtraining.layout.Layout"),
    ({"layout": LAY, "backend": "torch"}, "backend must be a KernelBackend or None, got 'torch'; for a backend by name"),
    ({"layout": LAY, "backend": 3}, "backend must be a KernelBackend or None, got int"),
])
def test_wrong_argument_types_name_the_argument(entry, kw, needle):
    with pytest.raises(TypeError, match=entry) as e:
        ENTRIES[entry](*_qkv(), **kw)
    assert needle in str(e.value)


def test_tensors_and_head_dim_are_checked():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="ring_attention: k must be a torch.Tensor"):
        ring_attention(q, k.numpy(), v, layout=LAY)
    z = torch.zeros(1, 64, 2, 0, dtype=torch.float64)
    for fn in (ring_attention, lambda *a, **kw: sparse_ring_attention(*a, config=SMALL, **kw)):
        with pytest.raises(ValueError, match=r"head_dim must be >= 1"):
            fn(z, z[:, :, :1], z[:, :, :1], layout=LAY)


def test_sparse_config_as_mapping_or_none():
    q, k, v = _qkv()
    ref = sparse_ring_attention(q, k, v, layout=LAY, config=VerticalSlashConfig(**SMALL))
    assert torch.equal(sparse_ring_attention(q, k, v, layout=LAY, config=dict(SMALL)), ref)
    q64 = torch.randn(1, 128, 2, 8, dtype=torch.float64)
    out = sparse_ring_attention(q64, q64[:, :, :1], q64[:, :, :1], layout=Layout("striped", 1, 64), config=None)
    assert out.shape == q64.shape and torch.isfinite(out).all()
    np = pytest.importorskip("numpy")
    numpy_cfg = {**SMALL, "max_slash": np.int64(4), "recall": np.float64(0.95)}
    assert torch.equal(sparse_ring_attention(q, k, v, layout=LAY, config=numpy_cfg), ref)
    with pytest.raises(TypeError, match=r"config has unknown key\(s\) bogus"):
        sparse_ring_attention(q, k, v, layout=LAY, config={**SMALL, "bogus": 1})
    with pytest.raises(TypeError, match="config must be a VerticalSlashConfig, a mapping of its fields or None, got list"):
        sparse_ring_attention(q, k, v, layout=LAY, config=[0.9])
    with pytest.raises(ValueError, match="recall"):
        sparse_ring_attention(q, k, v, layout=LAY, config={**SMALL, "recall": 1.5})

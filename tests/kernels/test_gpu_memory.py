"""Steady-state GPU memory of the sparse ring (marker ``gpu``; skipped without CUDA).

Repeated forward + backward passes of the sparse ring at CP=1 (Triton kernels, bf16, S=16384,
9/3 heads of 64 as SmolLM2-135M, recall 0.98, columns in the ring and out of it) with Python's
cycle collector disabled: the memory allocated after each pass equals that after the first, so
nothing of a pass (step plans, index tensors, column gathers) outlives its autograd graph. The
CPU check of the same property, object by object, is tests/kernels/test_reference_cycles.py.
"""
import gc

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.patterns.estimator import VerticalSlashConfig
from megatron_mtraining.ring.sparse import sparse_ring_attention


@pytest.mark.gpu
@pytest.mark.parametrize("columns", ["in_ring", "out_of_ring"])
def test_sparse_ring_memory_is_flat_across_passes(columns):
    s, hq, hkv, d = 16384, 9, 3, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for h in (hq, hkv, hkv))
    cfg = VerticalSlashConfig(recall=0.98, last_q=64, block_size=64, sink_tokens=64, local_blocks=2,
                              max_vertical=2048, max_slash=256)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        after = []
        for _ in range(6):
            out = sparse_ring_attention(q, k, v, layout=Layout("striped", 1, 64), config=cfg, columns=columns)
            out.float().square().mean().backward()
            del out
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            after.append(torch.cuda.memory_allocated())
    finally:
        if was_enabled:
            gc.enable()
    print(columns, "allocated after each pass (MiB):", [round(a / 2 ** 20, 1) for a in after])
    assert after[-1] == after[1], after      # the first pass may create lasting caches (autotuning, tables)

"""The estimator's torch selection of one line kind, as a reference for the Triton selection kernel
(tests/kernels/test_select_triton.py in the CPU interpreter, tests/kernels/test_gpu_select.py on a GPU)."""
from __future__ import annotations

import torch

from megatron_mtraining.patterns import estimator as E

F64 = torch.float64


def torch_select(score, n_floor, cap, target, take_all, width, L):
    """``(selected [b, h, width] int64, count [b, h] int64, covered / L [b, h] fp64)`` by the torch path
    (positions = indices), padded with -1 to ``width``."""
    n = score.shape[-1]
    s, o = E.floor_first_sort(score, n_floor)
    cnt, cov = E._budget(s.to(F64), min(n_floor, n), cap, target, take_all)
    sel = E._take_sorted(o, cnt, min(width, max(1, n)), sentinel=n)
    pad = torch.full((*sel.shape[:-1], width - sel.shape[-1]), -1, dtype=sel.dtype, device=sel.device)
    return torch.cat([sel, pad], -1), cnt, cov / L


def same(a, b):
    """Bitwise equal tensors of the same dtype and shape."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_mass_close(a, b, n, ctx):
    """fp64 sums of the same ``n`` non-negative terms in two orders: ``|a - b| <= n * 2**-53 * a``."""
    assert a.dtype == b.dtype == F64 and a.shape == b.shape, ctx
    tol = max(n, 1) * 2.0 ** -53
    assert torch.all((a - b).abs() <= tol * a.abs()), (ctx, a, b)


def assert_same_selection(new, ref, n, ctx):
    """Kept lines and counts bitwise equal, covered fractions within the summation-order rounding."""
    for name, x, y in (("selected", new[0], ref[0]), ("count", new[1], ref[1])):
        assert same(x, y), (name, ctx, x, y)
    assert_mass_close(new[2], ref[2], n, ctx)

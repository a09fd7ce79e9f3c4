"""Hierarchical (inner x outer) ring: exactness vs fp64 and vs the flat ring, overlap of the outer link.

The exactness checks run as cases of tests/workers/ring_check.py (``--cases``), one torchrun launch
per world size (4 and 8 ranks) for all of them; each case builds its own Megatron hierarchical CP
groups. A 4-rank case on 8 ranks runs on two CP groups at once, each with its own data.
"""
import json

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.ring.hierarchical import hierarchical_ring_attention
from tests.helpers.dist import result_rows, run_torchrun, shared_torchrun

RING = "tests/workers/ring_check.py"
_DENSE = {"granularity": 16, "kv_heads": 2, "seq": 512}
_SPARSE = {"sparse": True, "granularity": 64, "kv_heads": 2, "seq": 1024}
CASES = {
    4: [{"name": "dense_2x2", "hier": [2, 2], **_DENSE},
        {"name": "dense_2x2_triton", "hier": [2, 2], "kernel_backend": "triton", **_DENSE},
        {"name": "sparse_2x2_in_ring", "hier": [2, 2], "columns": "in_ring", **_SPARSE},
        {"name": "sparse_2x2_out_of_ring", "hier": [2, 2], "columns": "out_of_ring", **_SPARSE}],
    8: [{"name": "dense_2x4", "hier": [2, 4], **_DENSE},
        {"name": "dense_4x2", "hier": [4, 2], **_DENSE},
        {"name": "dense_2x2_tp2", "hier": [2, 2], "tp": 2, **_DENSE},
        {"name": "sparse_2x4_in_ring", "hier": [2, 4], "columns": "in_ring", **_SPARSE}],
}


def _case(name):
    nproc = next(n for n, cases in CASES.items() if any(c["name"] == name for c in cases))
    res = shared_torchrun(RING, ["--cases", json.dumps(CASES[nproc])], nproc=nproc, timeout=900)
    assert res.returncode == 0, res.tail()
    rows = result_rows(res, name)
    assert len(rows) == 1, res.tail()
    return rows[0]


def _result(script, args, nproc, timeout=300):
    res = run_torchrun(script, args, nproc=nproc, timeout=timeout)
    assert res.returncode == 0, res.tail()
    rows = result_rows(res)
    assert len(rows) == 1, res.tail()
    return rows[0]


@pytest.mark.parametrize("inner,outer,tp", [(2, 2, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2)])
def test_hierarchical_matches_fp64_and_flat_ring(inner, outer, tp):
    """Megatron's hierarchical CP groups (TP=2: strided CP groups); fwd and dQ/dK/dV."""
    r = _case(f"dense_{inner}x{outer}" + ("_tp2" if tp == 2 else ""))
    assert r["finite"], r
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)
    assert r["vs_flat"] <= 1e-5, r


def test_dense_hierarchical_ring_runs_the_backend_step_kernels():
    """The dense hierarchical ring uses the backend's step kernels like the flat ring: with the Triton
    backend (here in the Triton CPU interpreter) both run the Triton dense step, fwd and dQ/dK/dV vs fp64."""
    pytest.importorskip("triton")
    r = _case("dense_2x2_triton")
    assert r["step_kernel"] == "DenseGpuStepKernel", r
    assert r["finite"], r
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 2e-5, (key, r)
    assert r["vs_flat"] <= 1e-5, r


@pytest.mark.parametrize("inner,outer,columns", [(2, 2, "in_ring"), (2, 4, "in_ring"), (2, 2, "out_of_ring")])
def test_hierarchical_sparse_matches_flat_sparse_and_fp64_masked(inner, outer, columns):
    """Vertical-slash pattern (recall 0.9) through the hierarchical ring: equals the flat sparse ring
    and fp64 attention masked with the same estimated pattern; the pattern is a strict subset.
    ``out_of_ring``: the columns are computed outside both rings (one gather over the CP group)."""
    r = _case(f"sparse_{inner}x{outer}_{columns}")
    assert r["finite"], r
    assert r["density"] < 0.99, r
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)
    assert r["vs_flat"] <= 1e-5, r


@pytest.mark.serial          # measures time spent blocked: `make test` runs it alone, not beside other tests
def test_outer_transfer_is_hidden_behind_inner_ring():
    """With a slow outer link (every transfer takes D seconds) the overlapped schedule posts the
    transfer before the inner ring, which hides the link time; the serial schedule (negative
    control) waits for the transfer first and is blocked for at least D per forward."""
    r = _result("tests/workers/hier_overlap.py", ["--seq-local", 512, "--reps", 5], nproc=4, timeout=400)
    d = r["delay_s"]
    print("overlap measurement:", r)
    assert d > 0.0, r
    assert r["overlap_exposed"] < 0.5 * d, r
    assert r["serial_blocked"] > 0.9 * d, r


def test_degenerate_levels_are_errors():
    q = torch.zeros(1, 64, 2, 8)
    with pytest.raises(ValueError, match="inner and outer rings of >= 2 ranks"):
        hierarchical_ring_attention(q, q, q, layout=Layout("striped", 1, 64), inner_group=None, outer_group=None)

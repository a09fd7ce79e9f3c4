"""Sparse ring with ``share_pattern="kv_group"`` over gloo, cp 1 and 2 (worker:
tests/workers/kv_group_ring_check.py, see its docstring): out / dQ / dK / dV vs the fp64 attention
masked with the per-group pattern repeated per query head, on the torch reference kernels and on the
Triton kernels in the CPU interpreter (per-group indices); columns in and out of the ring."""
import pytest

from tests.helpers.dist import result_rows, shared_torchrun

WORKER = "tests/workers/kv_group_ring_check.py"
TOL = 1e-5

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("cp", [1, 2])
def test_kv_group_sparse_ring(cp, kernels):
    if kernels == "triton":
        pytest.importorskip("triton")
    res = shared_torchrun(WORKER, ["--kernels", "torch", "triton"], nproc=cp, timeout=600)   # one launch per cp
    rows = [r for r in result_rows(res) if r["config"]["kernels"] == kernels]
    assert res.returncode == 0 and rows, res.tail()
    assert {(r["config"]["hq"], r["config"]["columns"]) for r in rows} == {
        (hq, c) for hq in (4, 6) for c in ("in_ring", "out_of_ring")}
    for r in rows:
        assert r["finite"] and r["same_pattern"], r
        assert r["pattern_heads"] == 2.0, r                 # one pattern per KV head
        assert r["headwise_differs"], r                     # negative control: the option changes the mask
        assert 0.2 < r["density"] < 0.9, r                  # a strict subset of the causal mask
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= TOL, (key, r)

"""Dense ring attention vs an independent fp64 attention, over gloo (torchrun subprocesses).

The worker (tests/workers/ring_check.py) compares out, dQ, dK and dV separately on every rank.
Matrix: cp in {1, 2, 4} x {striped g=1, 16, 64, zigzag} x GQA group 1 and 4 x
batch 1 and 2 x head_dim 64 and 128 x {fp64 (<=1e-10), fp32 (<=1e-5)}, all relative to the
largest reference magnitude. One torchrun launch per world size (1, 2, 4 and 8 ranks) runs all of
that size's cases in turn (``ring_check.py --cases``).
"""
import json

import pytest

from tests.helpers.dist import result_rows, shared_torchrun

WORKER = "tests/workers/ring_check.py"
TOL = {"float64": 1e-10, "float32": 1e-5}
# one torchrun launch per world size runs all of its cases in turn (ring_check.py --cases)
CASES = {
    1: [{"name": "matrix", "matrix": True, "seq": 256}],
    2: [{"name": "matrix", "matrix": True, "seq": 256},
        {"name": "wrong_zigzag", "layout": "striped", "granularity": 16, "wrong_layout": "zigzag"},
        {"name": "wrong_contiguous", "layout": "striped", "granularity": 16, "wrong_layout": "contiguous"},
        {"name": "mismatch", "layout": "striped", "granularity": 16, "mismatch_rank": 1}],
    4: [{"name": "matrix", "matrix": True, "seq": 256},
        {"name": "long_striped64_gqa", "seq": 1024, "layout": "striped", "granularity": 64, "heads": 8,
         "kv_heads": 2, "batch": 2},
        {"name": "megatron_tp2", "tp": 2, "dp": 1, "layout": "striped", "granularity": 16, "kv_heads": 2}],
    8: [{"name": "megatron_tp2_dp2", "tp": 2, "dp": 2, "layout": "zigzag", "granularity": 16, "kv_heads": 2}],
}


def _results(name, nproc):
    res = shared_torchrun(WORKER, ["--cases", json.dumps(CASES[nproc])], nproc=nproc, timeout=600)
    assert res.returncode == 0, res.tail()
    rows = result_rows(res, name)
    assert rows, res.tail()
    return rows


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_matrix_matches_fp64_reference(cp):
    rows = _results("matrix", nproc=cp)
    assert len(rows) == 64
    for r in rows:
        tol = TOL[r["config"]["dtype"]]
        assert r["finite"], r
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= tol, (key, r)


def test_ring_longer_sequence_striped64_gqa():
    (r,) = _results("long_striped64_gqa", nproc=4)
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)


@pytest.mark.parametrize("told", ["zigzag", "contiguous"])
def test_negative_control_wrong_layout_fails(told):
    (r,) = _results(f"wrong_{told}", nproc=2)
    assert r["out"] > 1e-2 and r["dq"] > 1e-2, r


def test_shape_mismatch_across_ranks_raises_instead_of_hanging():
    (r,) = _results("mismatch", nproc=2)
    assert len(r["error"]) == 2
    assert all("ranks of the CP group disagree" in e for e in r["error"]), r


@pytest.mark.parametrize("world,tp,dp,layout", [(4, 2, 1, "striped"), (8, 2, 2, "zigzag")])
def test_ring_on_megatron_cp_subgroups(world, tp, dp, layout):
    """CP groups of a TPxCP(xDP) world (strided global ranks, several CP groups at once, each with
    its own data) must each compute their own exact attention."""
    (r,) = _results(f"megatron_tp{tp}" + (f"_dp{dp}" if dp > 1 else ""), nproc=world)
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)

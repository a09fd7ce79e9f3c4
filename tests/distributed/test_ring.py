"""Dense ring attention vs an independent fp64 attention, over gloo (torchrun subprocesses).

The worker (tests/workers/ring_check.py) compares out, dQ, dK and dV separately on every rank.
Matrix: cp in {1, 2, 4} x {striped g=1, 16, 64, zigzag} x GQA group 1 and 4 x
batch 1 and 2 x head_dim 64 and 128 x {fp64 (<=1e-10), fp32 (<=1e-5)}, all relative to the
largest reference magnitude.
"""
import json

import pytest

from tests.helpers.dist import run_torchrun

WORKER = "tests/workers/ring_check.py"
TOL = {"float64": 1e-10, "float32": 1e-5}


def _results(args, nproc, timeout=240):
    res = run_torchrun(WORKER, args, nproc=nproc, timeout=timeout)
    assert res.returncode == 0, res.tail()
    rows = [json.loads(line[len("RESULT "):]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert rows, res.tail()
    return rows


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_matrix_matches_fp64_reference(cp):
    rows = _results(["--matrix", "--seq", "256"], nproc=cp)
    assert len(rows) == 64
    for r in rows:
        tol = TOL[r["config"]["dtype"]]
        assert r["finite"], r
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= tol, (key, r)


def test_ring_longer_sequence_striped64_gqa():
    (r,) = _results(["--seq", "1024", "--layout", "striped", "--granularity", "64", "--heads", "8",
                     "--kv-heads", "2", "--batch", "2"], nproc=4)
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)


@pytest.mark.parametrize("told", ["zigzag", "contiguous"])
def test_negative_control_wrong_layout_fails(told):
    (r,) = _results(["--layout", "striped", "--granularity", "16", "--wrong-layout", told], nproc=2)
    assert r["out"] > 1e-2 and r["dq"] > 1e-2, r


def test_shape_mismatch_across_ranks_raises_instead_of_hanging():
    (r,) = _results(["--layout", "striped", "--granularity", "16", "--mismatch-rank", "1"], nproc=2, timeout=60)
    assert len(r["error"]) == 2
    assert all("ranks of the CP group disagree" in e for e in r["error"]), r


@pytest.mark.parametrize("world,tp,dp,layout", [(4, 2, 1, "striped"), (8, 2, 2, "zigzag")])
def test_ring_on_megatron_cp_subgroups(world, tp, dp, layout):
    """CP groups of a TPxCP(xDP) world (strided global ranks, several CP groups at once, each with
    its own data) must each compute their own exact attention."""
    (r,) = _results(["--tp", str(tp), "--dp", str(dp), "--layout", layout, "--granularity", "16",
                     "--kv-heads", "2"], nproc=world, timeout=300)
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)

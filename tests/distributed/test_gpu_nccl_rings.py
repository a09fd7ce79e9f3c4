"""Dense, sparse and hierarchical rings over NCCL on several GPUs (marker ``gpu(count=N)``; skipped
without N CUDA devices).

The workers of the gloo tests with ``--backend nccl``: each rank runs its ring on
``cuda:LOCAL_RANK`` (Triton step kernels, GPU estimator), while the problems, patterns and fp64
references stay on the CPU. Same criteria as test_ring.py, test_sparse_ring.py and
test_hierarchical.py: out, dQ, dK, dV separately, relative to the largest reference magnitude.

* Dense ring matrix (tests/workers/ring_check.py ``--matrix``, S=1024) on 2 and 4 GPUs: one
  launch per world size, one test per configuration (layouts striped g=1/16/64 and zigzag x GQA
  group 1 and 4 x batch 1 and 2 x head_dim 64 and 128 x fp64 <= 1e-10 / fp32 <= 1e-5); a longer
  striped GQA sequence; the wrong-layout negative control; a shape mismatch across ranks must
  raise on every rank, not hang; Megatron TPxCP(xDP) sub-groups.
* Sparse ring (tests/workers/sparse_ring_check.py, S=2048, head_dim 64) on 2 and 4 GPUs: masked
  vs fp64 (fp32 <= 1e-5, columns in and out of the ring), the pattern identical to the
  single-process one, recall 1 == the dense ring, negative controls fail, strided CP sub-groups.
* Hierarchical ring (ring_check.py ``--hier``) on 4 GPUs: dense and sparse, vs fp64 and vs the flat ring.
"""
import itertools

import pytest

from tests.helpers.dist import result_rows, shared_torchrun

RING = "tests/workers/ring_check.py"
SPARSE = "tests/workers/sparse_ring_check.py"
TOL = {"float64": 1e-10, "float32": 1e-5}
LAUNCH_TIMEOUT = 3000           # each new shape compiles its Triton kernels (seconds per configuration)

# the --matrix of ring_check.py, in its order
MATRIX = [dict(layout=lay, granularity=gran, heads=h, kv_heads=hkv, batch=bsz, head_dim=hd, dtype=dt)
          for (lay, gran), (h, hkv), bsz, hd, dt in itertools.product(
              [("striped", 1), ("striped", 16), ("striped", 64), ("zigzag", 64)], [(4, 4), (4, 1)], [1, 2],
              [64, 128], ["float64", "float32"])]

def _rows(script, args, nproc, timeout=LAUNCH_TIMEOUT):
    """One torchrun launch per (script, args, nproc), shared by the tests that read it
    (``shared_torchrun``: a failed launch is reported by every test that needs it, never re-run)."""
    res = shared_torchrun(script, ["--backend", "nccl", *args], nproc=nproc, timeout=timeout)
    rows = result_rows(res)
    assert res.returncode == 0 and rows, res.tail()
    return rows


def _gpus(n):
    return [pytest.mark.gpu(count=n), pytest.mark.slow, pytest.mark.timeout(LAUNCH_TIMEOUT + 300)]


def _matrix_id(cp, c):
    return (f"cp{cp}-{c['layout']}{c['granularity']}-h{c['heads']}kv{c['kv_heads']}-b{c['batch']}-d{c['head_dim']}"
            f"-{c['dtype']}")


def _matrix_params():
    for cp in (2, 4):
        for c in MATRIX:
            yield pytest.param(cp, c, id=_matrix_id(cp, c), marks=_gpus(cp))


@pytest.mark.parametrize("cp,config", list(_matrix_params()))
def test_nccl_ring_matrix_matches_fp64_reference(cp, config):
    rows = _rows(RING, ["--matrix", "--seq", "1024"], cp)
    assert len(rows) == len(MATRIX), rows
    (r,) = [r for r in rows if all(r["config"][k] == v for k, v in config.items())]
    assert r["finite"], r
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= TOL[config["dtype"]], (key, r)


@pytest.mark.parametrize("cp", [pytest.param(4, id="cp4", marks=_gpus(4))])
def test_nccl_ring_longer_sequence_striped64_gqa(cp):
    (r,) = _rows(RING, ["--seq", "1024", "--layout", "striped", "--granularity", "64", "--heads", "8",
                        "--kv-heads", "2", "--batch", "2"], cp)
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)


@pytest.mark.parametrize("told", [pytest.param(t, marks=_gpus(2)) for t in ("zigzag", "contiguous")])
def test_nccl_negative_control_wrong_layout_fails(told):
    (r,) = _rows(RING, ["--layout", "striped", "--granularity", "16", "--wrong-layout", told], 2)
    assert r["out"] > 1e-2 and r["dq"] > 1e-2, r


@pytest.mark.parametrize("cp", [pytest.param(2, id="cp2", marks=_gpus(2))])
def test_nccl_shape_mismatch_across_ranks_raises_instead_of_hanging(cp):
    (r,) = _rows(RING, ["--layout", "striped", "--granularity", "16", "--mismatch-rank", "1"], cp, timeout=300)
    assert len(r["error"]) == cp
    assert all("ranks of the CP group disagree" in e for e in r["error"]), r


@pytest.mark.parametrize("world,tp,dp,layout", [pytest.param(4, 2, 1, "striped", marks=_gpus(4)),
                                                pytest.param(8, 2, 2, "zigzag", marks=_gpus(8))])
def test_nccl_ring_on_megatron_cp_subgroups(world, tp, dp, layout):
    (r,) = _rows(RING, ["--tp", str(tp), "--dp", str(dp), "--layout", layout, "--granularity", "16",
                        "--kv-heads", "2"], world)
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)


# ---- sparse ring ---------------------------------------------------------------------------------

def _sparse_rows(cp):
    return _rows(SPARSE, ["--seq", "2048", "--head-dim", "64"] + (["--subgroups"] if cp == 4 else []), cp)


def _kind(rows, kind):
    return [r for r in rows if r["kind"] == kind]


SPARSE_CP = [pytest.param(cp, id=f"cp{cp}", marks=_gpus(cp)) for cp in (2, 4)]


@pytest.mark.parametrize("cp", SPARSE_CP)
def test_nccl_sparse_ring_matches_fp64_masked_attention(cp):
    masked = _kind(_sparse_rows(cp), "masked")
    expected = {(lay, hkv, cols) for lay in ("striped", "zigzag") for hkv in (4, 1)
                for cols in ("in_ring", "out_of_ring")}
    assert {(r["config"]["layout"], r["config"]["hkv"], r["config"].get("columns", "in_ring"))
            for r in masked if "groups" not in r["config"]} == expected
    for r in masked:
        assert r["finite"], r
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= TOL["float32"], (key, r)


@pytest.mark.parametrize("cp", SPARSE_CP)
def test_nccl_estimated_pattern_identical_to_single_process(cp):
    for r in _kind(_sparse_rows(cp), "masked"):
        assert r["same_pattern"], r
        assert 0.2 < r["density"] < 0.9, r            # a strict subset: the pattern matters
        assert r["distinct_samples"], r


@pytest.mark.parametrize("cp", SPARSE_CP)
def test_nccl_oracle_full_budget_equals_dense_ring(cp):
    oracle = _kind(_sparse_rows(cp), "oracle")
    assert {r["config"]["layout"] for r in oracle} == {"striped", "zigzag"}
    for r in oracle:
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= TOL["float32"], (key, r)


@pytest.mark.parametrize("cp", SPARSE_CP)
def test_nccl_sparse_negative_controls_fail(cp):
    neg = _kind(_sparse_rows(cp), "negative")
    assert {r["config"]["mode"] for r in neg} == {"no_causal_on_own_step", "shifted_block_index", "columns_dropped"}
    for r in neg:
        assert r["out"] > 1e-2 and r["dq"] > 1e-2, r


@pytest.mark.parametrize("cp", SPARSE_CP)
def test_nccl_out_of_ring_columns_carry_real_work(cp):
    out = [r for r in _kind(_sparse_rows(cp), "masked") if r["config"].get("columns") == "out_of_ring"]
    assert out
    for r in out:
        assert r["columns_in_steps"] > 0, r


@pytest.mark.parametrize("cp", [pytest.param(4, id="cp4", marks=_gpus(4))])
def test_nccl_sparse_cp_subgroups(cp):
    sub = [r for r in _kind(_sparse_rows(cp), "masked") if "groups" in r["config"]]
    assert {r["config"].get("columns", "in_ring") for r in sub} == {"in_ring", "out_of_ring"}
    for r in sub:
        assert r["same_pattern"] and r["finite"], r
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= TOL["float32"], (key, r)


# ---- hierarchical ring ---------------------------------------------------------------------------

@pytest.mark.parametrize("inner,outer,tp", [pytest.param(2, 2, 1, marks=_gpus(4)), pytest.param(2, 4, 1, marks=_gpus(8)),
                                            pytest.param(4, 2, 1, marks=_gpus(8)), pytest.param(2, 2, 2, marks=_gpus(8))])
def test_nccl_hierarchical_matches_fp64_and_flat_ring(inner, outer, tp):
    (r,) = _rows(RING, ["--hier", inner, outer, "--tp", tp, "--granularity", 16, "--kv-heads", 2, "--seq", 512],
                 inner * outer * tp)
    assert r["finite"], r
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)
    assert r["vs_flat"] <= 1e-5, r


@pytest.mark.parametrize("inner,outer,columns", [pytest.param(2, 2, "in_ring", marks=_gpus(4)),
                                                 pytest.param(2, 4, "in_ring", marks=_gpus(8)),
                                                 pytest.param(2, 2, "out_of_ring", marks=_gpus(4))])
def test_nccl_hierarchical_sparse_matches_flat_sparse_and_fp64_masked(inner, outer, columns):
    (r,) = _rows(RING, ["--hier", inner, outer, "--sparse", "--granularity", 64, "--kv-heads", 2, "--seq", 1024,
                        "--columns", columns], inner * outer)
    assert r["finite"], r
    assert r["density"] < 0.99, r
    for key in ("out", "dq", "dk", "dv"):
        assert r[key] <= 1e-5, (key, r)
    assert r["vs_flat"] <= 1e-5, r


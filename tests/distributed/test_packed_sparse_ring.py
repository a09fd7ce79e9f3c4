"""The vertical-slash sparse ring over packed documents over gloo (torchrun subprocesses).

The worker (tests/workers/packed_sparse_ring_check.py) runs ``sparse_ring_attention`` with
documents (the estimator's collectives included) at cp 2 and 4, striped and zigzag, GQA 1 and 4,
fp64 (<= 1e-10) and fp32 (<= 1e-5), documents of lengths 1 ... 2*cp*block straddling stripes and
padded documents, and per-document probes (``probes="document"``, gathered across the ranks); at
cp 4 also the 2 x 2 hierarchical ring. At cp 2 the same check runs the Triton
sparse step kernels (document mask) in the Triton CPU interpreter. out, dQ, dK, dV are compared separately
with an fp64 reference built from the same pattern; the pattern must equal the cp-1 estimate,
padding gets exact zeros and a single document equals the unpacked sparse ring bitwise.
"""
import json

import pytest

from tests.helpers.dist import run_torchrun

pytestmark = pytest.mark.slow
TOL = {"float64": 1e-10, "float32": 1e-5}


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_sparse_ring_matches_pattern_reference(cp):
    res = run_torchrun("tests/workers/packed_sparse_ring_check.py", [], nproc=cp, timeout=300)
    assert res.returncode == 0, res.tail()
    rows = [json.loads(line[len("RESULT "):]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    cases = [r for r in rows if "ring" in r["case"]]
    assert len(cases) == 24 + 2 + (6 if cp == 4 else 0), res.tail()
    for r in cases:
        assert r["finite"] and r["padding_zero"] and r["same_pattern"], r
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= TOL[r["case"]["dtype"]], (key, r)
    (single,) = [r for r in rows if r["case"].get("check") == "single_document"]
    assert single["bitwise"], single


def test_packed_sparse_ring_on_triton_kernels_matches_pattern_reference():
    """cp 2, ``kernel_backend`` triton in the Triton CPU interpreter (fp32, striped and zigzag)."""
    pytest.importorskip("triton")
    res = run_torchrun("tests/workers/packed_sparse_ring_check.py", ["--backend", "triton"], nproc=2, timeout=600,
                       env={"TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.tail()
    rows = [json.loads(line[len("RESULT "):]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(rows) == 8, res.tail()
    for r in rows:
        assert r["triton_steps"] and r["finite"] and r["padding_zero"] and r["same_pattern"], r
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= TOL["float32"], (key, r)

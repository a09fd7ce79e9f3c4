"""Packed sequences on the dense flat and hierarchical rings over gloo (torchrun subprocesses).

The worker (tests/workers/packed_ring_check.py) compares out, dQ, dK and dV separately on every
rank with an fp64 per-document reference (each document attended alone): cp 2 and 4 x striped
granularity 16 and 1 and zigzag x GQA 1 and 4 x fp64 (<= 1e-10) and fp32 (<= 1e-5), documents of
lengths 1 ... 2*cp*block that straddle stripes, padded documents and a rank whose stripes are all
padding (exact zeros); at cp 4 also the 2 x 2 hierarchical ring. A single document must equal the
unpacked ring bitwise, and documents that differ across ranks (or offsets malformed on one rank) must
be an error on every rank.
"""
import json

import pytest

from tests.helpers.dist import run_torchrun

pytestmark = pytest.mark.slow
TOL = {"float64": 1e-10, "float32": 1e-5}


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_rings_match_per_document_reference(cp):
    res = run_torchrun("tests/workers/packed_ring_check.py", [], nproc=cp, timeout=300)
    assert res.returncode == 0, res.tail()
    rows = [json.loads(line[len("RESULT "):]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    cases = [r for r in rows if "ring" in r["case"]]
    assert len(cases) == 24 + (4 if cp == 4 else 0), res.tail()
    for r in cases:
        assert r["finite"] and r["padding_zero"], r
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= TOL[r["case"]["dtype"]], (key, r)
    (single,) = [r for r in rows if r["case"].get("check") == "single_document"]
    assert single["bitwise"], single
    (dis,) = [r for r in rows if r["case"].get("check") == "disagreement"]
    assert all("ranks of the CP group disagree" in e and "documents=" in e for e in dis["errors"]), dis
    (bad,) = [r for r in rows if r["case"].get("check") == "plan_disagreement"]
    assert all("invalid input on group rank 0" in e and "the batch holds" in e for e in bad["errors"]), bad

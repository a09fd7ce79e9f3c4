"""Invalid or inconsistent CP inputs are one error on every rank, never a hang or a wrong answer.

Runs tests/distributed/agreement_worker.py under torchrun (gloo, CPU) with a timeout, one launch for
the 2-rank and one for the 4-rank scenarios (each in turn in one process group): an input that
is invalid on one rank only (heads, length, layout cp), a ``softmax_scale`` that differs between
ranks, and hierarchical inner/outer groups given the wrong way round must make every rank raise
the same ``ValueError``; the CP plan checks once per shape signature.
"""

from __future__ import annotations

import pytest

from tests.helpers.dist import result_rows, shared_torchrun

WORKER = "tests/distributed/agreement_worker.py"
SCENARIOS = {
    2: ["gqa_one_rank", "length_one_rank", "layout_cp_one_rank", "scale_one_rank", "sparse_scale_one_rank",
        "plan_once", "plan_gqa_one_rank", "layer_policy_one_rank", "auto_policy_timings_differ"],
    4: ["hier_swapped", "hier_swapped_sparse", "hier_gqa_one_rank", "hier_ok"],
}


def _run(scenario: str, nproc: int, timeout: float = 300) -> list[dict]:
    res = shared_torchrun(WORKER, SCENARIOS[nproc], nproc=nproc, timeout=timeout)
    assert not res.timed_out, "ranks hung instead of raising:\n" + res.tail()
    assert res.returncode == 0, res.tail()
    lines = result_rows(res, scenario)
    assert len(lines) == 1, res.tail()
    rows = sorted(lines[0], key=lambda r: r["rank"])
    assert len(rows) == nproc, res.tail()
    return rows


def _same_error_everywhere(rows: list[dict], needle: str) -> None:
    errors = [r["error"] for r in rows]
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, errors
    assert needle in errors[0], errors[0]


@pytest.mark.parametrize("scenario, needle", [
    ("gqa_one_rank", "invalid input on group rank 1: GQA needs num query heads (4) divisible by num kv heads (3)"),
    ("length_one_rank", "invalid input on group rank 1"),
    ("layout_cp_one_rank", "invalid input on group rank 1: layout.cp_size=4 but the process group has 2 ranks"),
])
def test_input_invalid_on_one_rank_fails_on_every_rank(scenario, needle):
    _same_error_everywhere(_run(scenario, 2), needle)


@pytest.mark.parametrize("scenario", ["scale_one_rank", "sparse_scale_one_rank"])
def test_softmax_scale_mismatch_is_an_error(scenario):
    rows = _run(scenario, 2)
    _same_error_everywhere(rows, "ranks of the CP group disagree")
    assert "softmax_scale=0.3" in rows[0]["error"] and "softmax_scale=0.25" in rows[0]["error"]


def test_hierarchical_groups_swapped_is_an_error():
    """Dense hierarchical ring, 2 x 2, inner and outer groups swapped: before, relative error ~1."""
    _same_error_everywhere(_run("hier_swapped", 4), "are the inner and outer groups swapped?")


def test_hierarchical_groups_swapped_is_an_error_sparse():
    _same_error_everywhere(_run("hier_swapped_sparse", 4), "are the inner and outer groups swapped?")


def test_hierarchical_invalid_on_one_rank_fails_on_every_rank():
    rows = _run("hier_gqa_one_rank", 4)
    errors = [r["error"] for r in rows]
    assert all(e is not None and "GQA needs" in e for e in errors), errors


def test_hierarchical_correct_groups_match_flat_ring():
    """Positive control of the numbering check: Megatron's numbering runs and equals the flat ring."""
    rows = _run("hier_ok", 4)
    assert all(r["error"] is None for r in rows), rows
    assert max(r["vs_flat"] for r in rows) < 1e-12, rows
    # second-order gradients are an error on every rank (flat and hierarchical ring, CP=4), not a wrong number
    for r in rows:
        assert len(r["double_backward"]) == 2 and all(e and "double backward" in e for e in r["double_backward"]), r


def test_plan_checks_once_per_shape_signature():
    rows = _run("plan_once", 2)
    assert all(r["error"] is None for r in rows), rows
    assert [r["collectives"] for r in rows] == [2, 2], rows     # two signatures, five calls
    # documents whose offsets differ between ranks (a collision of the former weighted checksum) are an
    # error on every rank, at both front doors (ring_attention, the plan's document check)
    for i in range(2):
        errors = [r["documents_differ"][i] for r in rows]
        assert all(e and "ranks of the CP group disagree" in e and "documents=" in e for e in errors), errors
        assert len(set(errors)) == 1, errors
    # a NaN softmax_scale on one rank: the same error naming the rule on every rank
    errors = [r["nan_scale"] for r in rows]
    assert len(set(errors)) == 1 and "invalid input on group rank 1: softmax_scale must be a finite number" in errors[0]


def test_plan_check_input_invalid_on_one_rank_fails_on_every_rank():
    _same_error_everywhere(_run("plan_gqa_one_rank", 2), "invalid input on group rank 1: GQA needs")


def test_layer_policy_mismatch_is_an_error():
    """Ranks whose per-layer policies differ disagree even in a layer that both run sparse."""
    rows = _run("layer_policy_one_rank", 2)
    _same_error_everywhere(rows, "ranks of the CP group disagree")
    assert "layer_policy" in rows[0]["error"], rows[0]["error"]


def test_auto_layer_policy_is_one_decision_on_every_rank():
    """dense_layers: auto sums the ranks' times: rank 0 alone would run sparse, rank 1 alone dense; both run
    the dense ring (6 ms sparse against 5 dense summed), measured once."""
    rows = _run("auto_policy_timings_differ", 2)
    assert all(r["error"] is None for r in rows), rows
    for r in rows:
        assert r["timed"] == 2 and r["groups"] == 1 and r["is_dense_ring"], r
        assert r["decisions"] == [{"layer_number": 1, "seq_len": 256, "cp_size": 2, "dense": True, "sparse_ms": 6.0,
                                   "dense_ms": 5.0, "ranks": 2, "tokens": 256}], r

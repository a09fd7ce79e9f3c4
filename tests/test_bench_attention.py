"""tools/bench_attention.py --pattern-file on CPU (Triton interpreter, --cpu-dry-run): a saved pattern's
rows regrouped to another model's head count (--regroup-heads), and the errors for rows that do not fit."""
import json

import numpy as np
import pytest

from tests.helpers.dist import run_python

pytest.importorskip("triton", reason="triton is not installed")


def _pattern(path, rows: int, seq: int = 128):
    from tools.imbalance import pattern_from_arrays, save_pattern

    rng = np.random.default_rng(0)
    slash = [np.array([0] + ([1] if r % 2 else [])) for r in range(rows)]          # diagonal (+ one far diagonal)
    vertical = [rng.choice(seq, size=3, replace=False) for _ in range(rows)]
    save_pattern(str(path), pattern_from_arrays(seq, slash, vertical), {"test": True})


def _bench(tmp_path, pat, *extra):
    out = tmp_path / "bench.json"
    res = run_python("tools/bench_attention.py", [
        "--cpu-dry-run", "--dtype", "float32", "--json", str(out), "--pattern-file", str(pat), "--head-dims", "16",
        "--impls", "ours", "--budget", "0.001", *extra], timeout=300, env={"TRITON_INTERPRET": "1"})
    return res, out


def test_regroup_heads_runs_the_rows_as_layers_of_another_shape(tmp_path):
    pat = tmp_path / "p.npz"
    _pattern(pat, rows=6)
    res, out = _bench(tmp_path, pat, "--heads", "4", "--kv-heads", "2", "--regroup-heads")
    assert res.returncode == 0, res.tail()
    rows = json.loads(out.read_text())["rows"]
    det = [r for r in rows if r["impl"] == "ours_det"]
    assert [r["layer"] for r in det] == [0]                 # 6 rows, 4 per layer: one layer, 2 rows dropped
    # rows 0-3: two with the diagonal only, two with one more diagonal; 2 query blocks of 64
    (total,) = [r for r in rows if r["impl"] == "ours_det_all_layers"]
    assert total["layers"] == 1 and "2 rows dropped" in total["note"]
    assert det[0]["block_tiles"] == 4 * 2 + 2 * 1           # 2 diagonal tiles per head + 1 far tile for 2 heads


def test_rows_that_do_not_fit_are_clear_errors(tmp_path):
    pat = tmp_path / "p.npz"
    _pattern(pat, rows=6)
    res, _ = _bench(tmp_path, pat, "--heads", "4", "--kv-heads", "2")        # 6 rows: not layers x 4
    assert res.returncode != 0 and "--regroup-heads" in res.stderr, res.tail()
    res, _ = _bench(tmp_path, pat, "--heads", "8", "--kv-heads", "2", "--regroup-heads")
    assert res.returncode != 0 and "fewer than --heads 8" in res.stderr, res.tail()
    res, _ = _bench(tmp_path, pat, "--heads", "4", "--kv-heads", "3", "--regroup-heads")
    assert res.returncode != 0 and "not a multiple of --kv-heads 3" in res.stderr, res.tail()

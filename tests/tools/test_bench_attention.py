"""tools/bench_attention.py --pattern-file on CPU (Triton interpreter, --cpu-dry-run): a saved pattern's
rows regrouped to another model's head count (--regroup-heads), and the errors for rows that do not fit."""
import json

import numpy as np
import pytest

from tests.helpers.dist import run_python

pytest.importorskip("triton", reason="triton is not installed")


def _pattern(path, rows: int, seq: int = 512):
    """Row r: the diagonal plus r far diagonals (offsets 1..r, at most the last block's), no columns: row r
    has nb + (nb-1) + ... + (nb-r) block tiles at nb = seq / 64 query blocks."""
    from megatron_mtraining.patterns.io import pattern_from_arrays, save_pattern

    slash = [np.arange(min(r, seq // 64 - 1) + 1) for r in range(rows)]
    vertical = [np.zeros(0, dtype=np.int64) for _ in range(rows)]
    save_pattern(str(path), pattern_from_arrays(seq, slash, vertical), {"test": True})


def _bench(tmp_path, pat, *extra):
    out = tmp_path / "bench.json"
    res = run_python("tools/bench_attention.py", [
        "--cpu-dry-run", "--dtype", "float32", "--json", str(out), "--pattern-file", str(pat), "--head-dims", "16",
        "--impls", "ours", "--budget", "0.001", *extra], timeout=300, env={"TRITON_INTERPRET": "1"})
    return res, out


def test_regroup_heads_runs_the_rows_as_layers_of_another_shape(tmp_path):
    pat = tmp_path / "p.npz"
    _pattern(pat, rows=6, seq=256)
    res, out = _bench(tmp_path, pat, "--heads", "4", "--kv-heads", "2", "--regroup-heads")
    assert res.returncode == 0, res.tail()
    rows = json.loads(out.read_text())["rows"]
    det = [r for r in rows if r["impl"] == "ours_det"]
    assert [r["layer"] for r in det] == [0]                 # 6 rows, 4 per layer: one layer, 2 rows left over
    (total,) = [r for r in rows if r["impl"] == "ours_det_all_layers"]
    assert total["layers"] == 1 and "2 rows left over" in total["note"]
    tiles = [sum(4 - o for o in range(min(r, 3) + 1)) for r in range(6)]     # 4, 7, 9, 10, 10, 10
    assert det[0]["block_tiles"] == sum(tiles[:4]) == 30      # rows 0-3: any other four sum to more
    assert det[0]["column_tiles"] == 0


def _refusal(tmp_path, pat, capsys, *extra) -> str:
    """The tool's error for ``extra`` (in this process: these are checked before any kernel runs)."""
    from tools.bench_attention import main

    with pytest.raises(SystemExit) as exc:
        main(["--cpu-dry-run", "--dtype", "float32", "--json", str(tmp_path / "e.json"), "--pattern-file", str(pat),
              "--head-dims", "16", "--impls", "ours", "--budget", "0.001", *extra])
    assert exc.value.code not in (0, None)
    assert not (tmp_path / "e.json").exists()
    return f"{exc.value.code} {capsys.readouterr().err}"


def test_rows_that_do_not_fit_are_clear_errors(tmp_path, capsys):
    pat = tmp_path / "p.npz"
    _pattern(pat, rows=6)
    assert "--regroup-heads" in _refusal(tmp_path, pat, capsys, "--heads", "4", "--kv-heads", "2")   # not layers x 4
    assert "fewer than --heads 8" in _refusal(tmp_path, pat, capsys, "--heads", "8", "--kv-heads", "2",
                                              "--regroup-heads")
    assert "not a multiple of --kv-heads 3" in _refusal(tmp_path, pat, capsys, "--heads", "4", "--kv-heads", "3",
                                                        "--regroup-heads")


@pytest.mark.slow
def test_share_pattern_kv_group_rows(tmp_path, capsys):
    """--share-pattern kv_group: --kv-heads rows of the file per layer, timed per head (repeated rows)
    and per group (unpacked, packed into 128- and 256-row tiles), every variant with the same work."""
    pat = tmp_path / "p.npz"
    _pattern(pat, rows=2, seq=128)
    res, out = _bench(tmp_path, pat, "--heads", "4", "--kv-heads", "2", "--share-pattern", "kv_group")
    assert res.returncode == 0, res.tail()
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if "error" in r], rows
    names = {r["impl"] for r in rows}
    for det in ("det", "fast"):
        for var in ("head", "nopack", "default", "pack128", "pack256", "pack256_dq128", "pack256_dq256"):
            assert f"ours_{det}_kvg_{var}" in names and f"ours_{det}_kvg_{var}_all_layers" in names
    per_layer = [r for r in rows if r["impl"] == "ours_det_kvg_pack128"]
    assert [r["layer"] for r in per_layer] == [0]             # 2 rows, 2 KV heads per layer: one layer
    assert "multiple of --kv-heads" in _refusal(tmp_path, pat, capsys, "--heads", "4", "--kv-heads", "3",
                                                "--share-pattern", "kv_group")


@pytest.mark.parametrize("extra, message", [
    (["--impls", "bogus"], "--impls 'bogus': unknown ['bogus']"),
    (["--seqs", "100"], "--seqs: 100 must be a positive multiple of 64"),
    (["--seqs", "128,,256"], "--seqs '128,,256': a comma-separated list of integers expected"),
    (["--sparsity", "1.5"], "--sparsity: 1.5 must lie in [0, 1)"),
    (["--sparsity", "nan"], "--sparsity: nan must lie in [0, 1)"),
    (["--head-dims", "48"], "--head-dims: 48 is not a head_dim the sparse kernels support"),
    (["--heads", "3", "--kv-heads", "2"], "--heads 3 is not a multiple of --kv-heads 2"),
    (["--kv-heads", "0"], "--kv-heads must be >= 1, got 0"),
    (["--dtype", "foo"], "--dtype 'foo': choose from bfloat16, float16, float32"),
])
def test_bench_attention_refuses_bad_arguments_by_name(tmp_path, capsys, extra, message):
    from tools.bench_attention import main
    with pytest.raises(SystemExit) as exc:
        main(["--json", str(tmp_path / "out.json"), "--cpu-dry-run", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()

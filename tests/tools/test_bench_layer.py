"""tools/bench_layer.py on the CPU: one tiny layer, sparse and dense rows in a result record (the GPU timings
are benchmarks, not tests; the graphs mode needs CUDA and is skipped here with a note)."""
import json

from tools import bench_layer


def test_rows_and_record(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert bench_layer.main(["--seq-lengths", "256", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                             "--mtraining-config", "configs/demo_sparse.yaml", "--warmup", "1", "--repeats", "1",
                             "--device", "cpu", "--json", str(out)]) == 0
    assert "graphs: needs CUDA, skipped" in capsys.readouterr().err
    rec = json.loads(out.read_text())
    assert rec["meta"]["tool"] and rec["config"]["pattern"] == "vertical_slash"
    rows = {r["mode"]: r for r in rec["rows"]}
    assert set(rows) == {"sparse", "dense"}
    assert rows["sparse"]["kernels"] == "sparse: torch" and rows["dense"]["kernels"] == "dense: torch"
    for r in rows.values():
        assert r["seq"] == 256 and r["median_ms"] > 0 and r["host_ms"] > 0 and r["ops"] > 0


def test_inputs_are_deterministic_and_shaped():
    import torch

    a = bench_layer.layer_inputs(128, 4, 2, 16, "structured", "cpu", torch.float32, seed=3)
    b = bench_layer.layer_inputs(128, 4, 2, 16, "structured", "cpu", torch.float32, seed=3)
    assert [t.shape for t in a] == [(1, 128, 4, 16), (1, 128, 2, 16), (1, 128, 2, 16)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))

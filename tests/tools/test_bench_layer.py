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


def test_bad_arguments_are_argparse_errors(capsys):
    """Sizes, counts, devices and configs that cannot run are errors naming the flag (shared argument types of
    megatron_mtraining.bench.cli), before any tensor is built; so is profile_step.py's --vocab-size."""
    import pytest
    import torch

    from tools import profile_step

    base = ["--mtraining-config", "configs/demo_sparse.yaml"]
    cases = [(["--heads", "0"], "argument --heads: must be an integer >= 1, got '0'"),
             (["--seq-lengths", "0"], "argument --seq-lengths: must be comma-separated positive integers, got '0'"),
             (["--seq-lengths", "abc"], "argument --seq-lengths"), (["--repeats", "0"], "argument --repeats"),
             (["--heads", "3", "--kv-heads", "2"], "--heads 3 must be a multiple of --kv-heads 2"),
             (["--device", "tpu0"], "--device tpu0: "),
             (["--mtraining-config", "/nonexistent.yaml"], "--mtraining-config: mtraining config: file not found"),
             (["--seq-lengths", "1000"], "--seq-lengths: cannot split a sequence of 1000 tokens"),
             (["--seq-lengths", "64"], "--seq-lengths: 64 must be > 64 with --inputs structured"),
             (["--head-dim", "6"], "--head-dim must be a multiple of 4 with --inputs structured, got 6"),
             (["--device", "meta"], "--device meta: cpu or cuda"),
             (["--modes", ""], "--modes '': no mode left to run")]
    if not torch.cuda.is_available():
        cases += [(["--device", "cuda"], "--device cuda: no CUDA device here"),
                  (["--device", "cuda:1"], "--device cuda:1: no CUDA device here")]
    for extra, needle in cases:
        with pytest.raises(SystemExit):
            bench_layer.main(base + extra)
        assert needle in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):
        profile_step.build_parser().parse_args(["--vocab-size", "0"])
    assert "argument --vocab-size: must be an integer >= 1, got '0'" in capsys.readouterr().err

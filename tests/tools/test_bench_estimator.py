"""tools/bench_estimator.py runs end to end on CPU (small shape) and writes consistent JSON."""
import json

from tests.helpers.dist import REPO_ROOT, run_python


def test_bench_estimator_cpu_smoke(tmp_path):
    out = tmp_path / "est.json"
    res = run_python("tools/bench_estimator.py", ["--device", "cpu", "--seqs", "512", "--heads", "2", "--kv-heads", "1",
                                                  "--head-dim", "64", "--warmup", "0", "--repeats", "1",
                                                  "--json", str(out)], timeout=240)
    assert res.returncode == 0, res.tail()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["seq"] == 512 and row["estimate_s"] > 0 and row["kernels_s"] > 0
    assert row["estimate_share"] == row["estimate_s"] / row["kernels_s"]
    assert 0 < row["kept_fraction"] <= 1
    assert row["impl"] == "torch" and row["scores_s"] > 0 and row["convert_s"] > 0   # auto on the CPU: torch
    assert "est/kernels" in res.stdout and "scores ms" in res.stdout and "convert ms" in res.stdout


def test_bench_estimator_triton_impl_in_the_interpreter(tmp_path):
    """--impl triton runs the fused estimator kernels (Triton CPU interpreter) and finds the same pattern."""
    import pytest

    pytest.importorskip("triton", reason="triton is not installed")
    rows = {}
    for impl in ("torch", "triton"):
        out = tmp_path / f"{impl}.json"
        res = run_python("tools/bench_estimator.py", ["--device", "cpu", "--seqs", "512", "--heads", "2",
                                                      "--kv-heads", "1", "--head-dim", "64", "--warmup", "0",
                                                      "--repeats", "1", "--impl", impl, "--json", str(out)],
                         timeout=240, env={"TRITON_INTERPRET": "1"})
        assert res.returncode == 0, res.tail()
        (rows[impl],) = json.loads(out.read_text())["rows"]
        assert rows[impl]["impl"] == impl and rows[impl]["scores_s"] > 0
    for key in ("kept_fraction", "mean_slash_blocks", "mean_vertical"):
        assert rows["triton"][key] == rows["torch"][key], key


def test_bench_estimator_bad_inputs_are_clear_errors(tmp_path, capsys, monkeypatch):
    """User mistakes end with 'error: ...' naming the flag (exit 2), not a traceback."""
    import pytest

    from tools.bench_estimator import main

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    import torch

    devices = [] if torch.cuda.is_available() else [(["--device", "cuda"], "--device cuda: no CUDA device here")]
    for extra, needle in (*devices, (["--device", "meta"], "--device meta: cpu or cuda"),
                          (["--seqs", "abc"], "--seqs"), (["--seqs", "100"], "--seqs"),
                          (["--impl", "triton"], "--impl"),
                          (["--seqs", "32"], "--seqs"), (["--config", str(tmp_path / "none.yaml")], "--config"),
                          (["--config", str(REPO_ROOT / "configs" / "demo.yaml")], "--config"),
                          (["--heads", "3", "--kv-heads", "2"], "--kv-heads"), (["--repeats", "0"], "--repeats"),
                          (["--json", str(tmp_path / "no" / "x.json")], "--json")):
        with pytest.raises(SystemExit) as exc:
            main(["--device", "cpu", "--seqs", "512", "--warmup", "0", *extra])    # a later --device wins
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "error: " + needle in err, (extra, err)

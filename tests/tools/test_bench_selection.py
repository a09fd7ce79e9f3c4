"""tools/bench_selection.py runs on CPU (small shape), checks the new code against the frozen oracle
and reports fewer sorts and host syncs."""
import json

import pytest

from tests.helpers.dist import run_python


def test_bench_selection_cpu_smoke(tmp_path):
    out = tmp_path / "sel.json"
    res = run_python("tools/bench_selection.py", ["--seqs", "512,1024", "--heads", "3", "--kv-heads", "3",
                                                  "--repeats", "1", "--estimate-seq", "256", "--json", str(out)],
                     timeout=240)
    assert res.returncode == 0, res.tail()
    data = json.loads(out.read_text())
    assert [r["seq"] for r in data["rows"]] == [512, 1024]
    for r in data["rows"]:
        assert r["select_new"]["sorts"] < r["select_old"]["sorts"]
        assert r["select_new"]["syncs"] == 1 and r["convert_new"]["syncs"] == 1
        assert r["select_new_s"] > 0 and r["convert_new_s"] > 0
    est = data["estimate"]
    assert (est["heads"], est["kv_heads"]) == (3, 3)
    assert est["estimate_new"]["syncs"] == 1 and est["estimate_new"]["h2d"] == 0
    assert "convert old ms" in res.stdout


@pytest.mark.parametrize("argv, message", [
    (["--heads", "9"], "--heads (9) must be a positive multiple of --kv-heads (2)"),   # the default 2 KV heads
    (["--seqs", "1000"], "--seqs: cannot split a sequence of 1000 tokens"),
    (["--seqs", "128,,256"], "--seqs '128,,256': a comma-separated list of integers expected"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--estimate-seq", "1000"], "--estimate-seq: cannot split a sequence of 1000 tokens"),
    (["--config", "configs/demo.yaml"], "the selection needs a sparse config"),
])
def test_bench_selection_refuses_bad_arguments_by_name(capsys, argv, message):
    from tools.bench_selection import main
    with pytest.raises(SystemExit) as exc:
        main(["--seqs", "512", "--repeats", "1", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

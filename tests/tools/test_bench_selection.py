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


def test_bench_selection_refuses_heads_not_a_multiple_of_kv_heads(capsys):
    from tools.bench_selection import main
    with pytest.raises(SystemExit) as exc:
        main(["--heads", "9", "--seqs", "512"])           # 9 query heads over the default 2 KV heads
    assert exc.value.code == 2
    assert "--heads (9) must be a positive multiple of --kv-heads (2)" in capsys.readouterr().err

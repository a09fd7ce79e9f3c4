"""tools/compare_long_context.py: the report's numbers against values computed here by hand,
repeated metric rows (last wins), plots, and errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import compare_long_context as clc


def _metrics(path: Path, losses, times=None, repeat_last_with=None):
    rows = [{"iteration": i + 1, "lm_loss": x, "tokens": 100, "time_s": (times or [1.0] * len(losses))[i]}
            for i, x in enumerate(losses)]
    if repeat_last_with is not None:  # a killed call logged an iteration that the next call repeated
        rows.insert(len(rows) - 1, {"iteration": len(losses), "lm_loss": repeat_last_with, "tokens": 100, "time_s": 9.0})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _eval(path: Path, ppls, cells):
    buckets = [{"bucket": b, "tokens": 10, "loss": 0.0, "ppl": p} for b, p in zip(("0-2K", "2K-8K"), ppls)]
    path.write_text(json.dumps({"ppl": {"buckets": buckets, "overall": {"tokens": 20, "loss": 0.0, "ppl": sum(ppls) / 2}},
                                "niah": {"cells": [{"length": L, "depth": d, "greedy_score": g, "ll_score": ll}
                                                   for L, d, g, ll in cells],
                                         "control_no_needle": [{"length": 4096, "ll_score": 3.0}]}}))
    return path


def test_report_numbers_and_plots(tmp_path, capsys):
    d = _metrics(tmp_path / "d.jsonl", [3.0, 2.0, 1.0, 1.0], times=[9.0, 2.0, 2.0, 4.0])
    m = _metrics(tmp_path / "m.jsonl", [3.3, 2.0, 1.1, 1.2, 5.0], repeat_last_with=7.0)  # iteration 5 not shared
    e_d = _eval(tmp_path / "ed.json", [10.0, 20.0], [(4096, 0, 100.0, 80.0)])
    e_m = _eval(tmp_path / "em.json", [11.0, 19.0], [(4096, 0, 0.0, 40.0), (8192, 50, 100.0, 90.0)])
    out = tmp_path / "plots"
    assert clc.main(["--eval", f"dense={e_d}", f"mtraining={e_m}", "--loss-curves", f"dense={d}", f"mtraining={m}",
                     "--baseline", "dense", "--last", "2", "--out", str(out), "--json", str(tmp_path / "c.json")]) == 0
    text = capsys.readouterr().out
    res = json.loads((tmp_path / "c.json").read_text())["losses"]
    assert res["shared_iterations"] == [1, 4] and res["last"] == 2
    r_d, r_m = res["runs"]["dense"], res["runs"]["mtraining"]
    assert r_d["last_mean"] == pytest.approx(1.0) and r_m["last_mean"] == pytest.approx(1.15)
    assert r_m["all_mean"] == pytest.approx((3.3 + 2.0 + 1.1 + 1.2) / 4)
    assert r_d["median_s_per_iter"] == pytest.approx(2.0)  # iteration 1 (compilation) excluded
    assert r_d["tokens"] == 400
    assert "1.1500 (+15.00 %)" in text and "3.3000 (+10.00 %)" in text
    assert "| 0-2K | 10.00 | 11.00 | mtraining +10.00 % |" in text
    assert "| 4096 | 0 % | 100 / 80.0 | 0 / 40.0 |" in text
    assert "| 8192 | 50 % | — | 100 / 90.0 |" in text  # not run is a dash, never a zero
    assert sorted(p.name for p in out.iterdir()) == ["loss_curves.png", "niah.png", "ppl_by_position.png"]


def test_repeated_iteration_last_row_wins(tmp_path):
    rows = clc.read_metrics(_metrics(tmp_path / "m.jsonl", [3.0, 2.0], repeat_last_with=9.0))
    assert rows[2]["lm_loss"] == 2.0


@pytest.mark.parametrize("argv, msg", [
    (["--eval", "a=/nonexistent.json"], "file not found"),
    (["--eval", "nolabel"], "expected LABEL=FILE"),
    ([], "give --eval and/or --loss-curves"),
])
def test_errors(argv, msg, capsys):
    with pytest.raises(SystemExit):
        clc.main(argv)
    assert msg in capsys.readouterr().err


def test_files_without_results_are_errors(tmp_path, capsys):
    """An empty or non-JSON eval file, a JSON file with no eval results (e.g. a bench_e2e record) and an
    empty metrics file are errors naming the flag and label, not an empty report."""
    empty, other, bad = tmp_path / "e.json", tmp_path / "o.json", tmp_path / "b.json"
    empty.write_text("")
    other.write_text('{"runs": [], "meta": {}}')
    bad.write_text("[1, 2]")
    for path, msg in ((empty, "not a JSON file"), (other, "no 'ppl' or 'niah' results"), (bad, "no 'ppl' or 'niah'")):
        with pytest.raises(SystemExit):
            clc.main(["--eval", f"a={path}"])
        assert f"--eval a={path}: {msg}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        clc.main(["--loss-curves", f"a={empty}"])
    assert f"--loss-curves a={empty}: no iterations in the file" in capsys.readouterr().err
    empty.write_text("not json\n")
    with pytest.raises(SystemExit):
        clc.main(["--loss-curves", f"a={empty}"])
    assert "not a pretrain_gpt.py metrics line" in capsys.readouterr().err


def test_unknown_baseline(tmp_path, capsys):
    m = _metrics(tmp_path / "m.jsonl", [1.0])
    with pytest.raises(SystemExit):
        clc.main(["--loss-curves", f"a={m}", "--baseline", "dense"])
    assert "--baseline 'dense' is not one of the labels" in capsys.readouterr().err


def test_inputs_the_report_cannot_read_are_errors(tmp_path, capsys):
    """Eval files whose 'ppl' / 'niah' lack what the report reads, a string loss, and curves with no
    shared iteration are errors naming the flag, not a traceback from the report."""
    cases = [({"ppl": {"x": 1}}, "'ppl' needs a 'buckets' list and an 'overall' object"),
             ({"ppl": 1}, "'ppl' needs a 'buckets' list"),
             ({"niah": {"cells": [{"length": 4096}]}}, "'niah.cells' rows need numeric length, depth"),
             ({"ppl": {"buckets": [{"bucket": "0-2K", "tokens": 5, "ppl": "x"}],
                       "overall": {"tokens": 5, "ppl": 2.0}}}, "a 'ppl' row without numeric 'tokens' / 'ppl'")]
    for i, (data, msg) in enumerate(cases):
        path = tmp_path / f"e{i}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(SystemExit):
            clc.main(["--eval", f"a={path}"])
        assert f"--eval a={path}: {msg}" in capsys.readouterr().err, data
    s = tmp_path / "s.jsonl"
    s.write_text(json.dumps({"iteration": 1, "lm_loss": "3.0"}) + "\n")
    with pytest.raises(SystemExit):
        clc.main(["--loss-curves", f"a={s}"])
    assert "lm_loss '3.0' is not a number" in capsys.readouterr().err
    a = _metrics(tmp_path / "a.jsonl", [3.0, 2.9])
    b = tmp_path / "b.jsonl"
    b.write_text("\n".join(json.dumps({"iteration": i, "lm_loss": 2.5}) for i in (3, 4)) + "\n")
    with pytest.raises(SystemExit):
        clc.main(["--loss-curves", f"a={a}", f"b={b}"])
    assert "--loss-curves: the runs share no iteration (a: 1-2, b: 3-4)" in capsys.readouterr().err

"""tools/simulate_hierarchy.py: the default rows of the recorded model, --imbalance-json, and bad inputs
refused with one error line naming the flag (exit 2), not a traceback or a NaN/negative table."""
from __future__ import annotations

import json

import pytest

from tools import simulate_hierarchy as sh


def test_default_rows_match_the_record(tmp_path, capsys):
    """The defaults reproduce docs/results/70_hierarchy_model.json (FlexAttention anchor rows)."""
    out = tmp_path / "h.json"
    sh.main(["--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["nodes"], r["gpus_per_node"]) for r in rows] == [(4, 8), (8, 8)]
    assert [round(r["flat_ms"], 2) for r in rows] == [85.09, 85.36]
    assert [round(r["hier_ms"], 2) for r in rows] == [19.15, 11.47]
    assert "4 x 8" in capsys.readouterr().out


def test_imbalance_json_step_times(tmp_path):
    path = tmp_path / "imb.json"
    path.write_text(json.dumps({"step_ms_fwd_max": [1.0, 3.0], "step_ms_bwd_max": [2.0, 4.0]}))
    out = tmp_path / "h.json"
    sh.main(["--nodes", "1", "--gpus-per-node", "2", "--imbalance-json", str(path), "--json", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert (row["t_step_fwd_ms"], row["t_step_bwd_ms"]) == (2.0, 3.0)


BAD = [(["--nodes", "0"], "--nodes must be >= 1"),
       (["--nodes", "4", "-1"], "--nodes must be >= 1"),
       (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1"),
       (["--seq-len", "-5"], "--seq-len must be >= 1"),
       (["--seq-len", "1000"], "--seq-len 1000 must be divisible by --nodes x --gpus-per-node = 4 x 8 = 32"),
       (["--kv-heads", "0"], "--kv-heads must be >= 1"),
       (["--bytes-per-element", "0"], "--bytes-per-element must be >= 1"),
       (["--intra-gbs", "0"], "--intra-gbs must be a finite number > 0"),
       (["--inter-gbs", "-1"], "--inter-gbs must be a finite number > 0"),
       (["--fwd-ms", "nan"], "--fwd-ms must be a finite number > 0"),
       (["--fwdbwd-ms", "inf"], "--fwdbwd-ms must be a finite number > 0"),
       (["--fwd-ms", "600"], "--fwdbwd-ms (548.4) must be >= --fwd-ms (600.0)"),
       (["--imbalance-json", "{tmp}/none.json"], "--imbalance-json: file not found"),
       (["--imbalance-json", "{tmp}/notjson.json"], "not a tools/imbalance.py --model gpu JSON"),
       (["--imbalance-json", "{tmp}/nokeys.json"], "not a tools/imbalance.py --model gpu JSON"),
       (["--imbalance-json", "{tmp}/nan.json", "--nodes", "1", "--gpus-per-node", "2"], "lists of finite times >= 0"),
       (["--imbalance-json", "{tmp}/cp2.json", "--nodes", "1", "--gpus-per-node", "4"],
        "was measured with cp=2, but --nodes x --gpus-per-node = 4")]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_inputs_are_one_line_errors(argv, needle, tmp_path, capsys):
    (tmp_path / "notjson.json").write_text("nope")
    (tmp_path / "nokeys.json").write_text('{"x": 1}')
    (tmp_path / "nan.json").write_text('{"step_ms_fwd_max": [NaN, 1], "step_ms_bwd_max": [1, 1]}')
    (tmp_path / "cp2.json").write_text('{"step_ms_fwd_max": [1, 1], "step_ms_bwd_max": [1, 1]}')
    with pytest.raises(SystemExit) as exc:
        sh.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]       # argparse: the usage, then one error line
    assert exc.value.code == 2 and ": error: " in last and needle in last, captured.err
    assert captured.out == ""                          # no table


def test_help_cites_only_repository_files(capsys):
    with pytest.raises(SystemExit):
        sh.main(["--help"])
    text = capsys.readouterr().out
    assert "../" not in text and "docs/results/70_hierarchy_model.json" in text

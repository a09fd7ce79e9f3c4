"""tools/time_tests.py --from-junit (the record behind docs/results/tests.json): a junit file becomes one run
with outcome, folder and marker counts; inputs that would write a wrong record are argparse errors."""
from __future__ import annotations

import json

import pytest

from tools import time_tests

JUNIT = """<testsuites><testsuite>
<testcase classname="tests.unit.test_a" name="test_one" time="1.5"/>
<testcase classname="tests.unit.test_a" name="test_two" time="0.5"><skipped/></testcase>
<testcase classname="tests.tools.test_b" name="test_three" time="3.0"><failure/></testcase>
</testsuite></testsuites>"""


def test_from_junit_record_and_bad_inputs(tmp_path, capsys):
    junit, out = tmp_path / "j.xml", tmp_path / "tests.json"
    junit.write_text(JUNIT)
    base = ["--label", "x", "--out", str(out), "--from-junit", str(junit)]
    assert time_tests.main(base + ["--wall-s", "60", "--marker-counts", "unit=2,tools=1"]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["wall_s"] == 60 and run["outcomes"] == {"failed": 1, "passed": 1, "skipped": 1}
    assert run["markers"] == {"unit": 2, "tools": 1}
    assert [(f["folder"], f["tests"]) for f in run["folders"]] == [("tests/tools", 1), ("tests/unit", 2)]
    empty, bad_out = tmp_path / "e.xml", tmp_path / "bad.json"
    empty.write_text("")
    bad_out.write_text('{"runs": 5}')
    labelless = tmp_path / "labelless.json"
    labelless.write_text('{"runs": [{}]}')
    for argv, needle in ((base + ["--wall-s", "-5"], "argument --wall-s: must be a finite number > 0"),
                         (base + ["--wall-s", "nan"], "argument --wall-s"),
                         (base + ["--wall-s", "5", "--marker-counts", "foo"], "--marker-counts 'foo'"),
                         (["--label", "x", "--out", str(out), "--from-junit", str(empty), "--wall-s", "5"],
                          "not a junit XML file"),
                         (["--label", "x", "--out", str(bad_out), "--from-junit", str(junit), "--wall-s", "5"],
                          "not a tests record"),
                         (base + ["--wall-s", "5", "--marker-counts", "=3,a=-1"], "--marker-counts '=3,a=-1'"),
                         (["--label", "x", "--out", str(tmp_path), "--from-junit", str(junit), "--wall-s", "5"],
                          "is a directory"),
                         (["--label", "x", "--out", str(labelless), "--from-junit", str(junit), "--wall-s", "5"],
                          "every run needs a 'label'"),
                         (["--label", "x", "--out", str(out), "--command", "true", "--commit", "deadbeef",
                           "--wall-s", "5"], "--wall-s, --commit: only with --from-junit")):
        with pytest.raises(SystemExit):
            time_tests.main(argv)
        assert needle in capsys.readouterr().err, argv
    assert len(json.loads(out.read_text())["runs"]) == 1          # nothing written by the refused calls

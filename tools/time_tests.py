"""Time the test suite and record it in ``docs/results/tests.json``.

Runs a test command (default ``make test``) with ``MTRAINING_TEST_REPORT`` set, so that
``tests/conftest.py`` writes each test's outcome, duration (setup + call + teardown, seconds) and
markers; measures the command's wall time; and adds one run to the record::

    python tools/time_tests.py --label "fresh clone 1"                  # runs `make test` here
    python tools/time_tests.py --label gpu --command "make test-gpu"    # on a GPU machine
    python tools/time_tests.py --label before --from-junit junit.xml --wall-s 2700   # an earlier run

A run is ``{"label", "command", "wall_s", "returncode", "meta" (date, commit, versions, host),
"outcomes" (passed / failed / skipped / error counts), "folders" ([{"folder", "tests", "passed",
"skipped", "failed", "duration_s"}]), "markers" ({marker: tests}; absent for a JUnit import),
"slowest" (the 20 slowest tests: [{"nodeid", "duration_s"}])}``. A run with the same label is
replaced; the others are kept. The command's exit status is this tool's exit status.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from megatron_mtraining.bench.cli import positive_float
from megatron_mtraining.bench.record import environment, write_json

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "results" / "tests.json"
N_SLOWEST = 20


def rows_from_junit(path: Path) -> list[dict]:
    """Test rows (``nodeid``, ``outcome``, ``duration_s``) from a pytest ``--junitxml`` file."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        mod = case.get("classname", "").replace(".", "/")
        nodeid = f"{mod}.py::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag == "skipped":
                outcome = "skipped"
            elif child.tag in ("failure", "error"):
                outcome = "failed"
        rows.append({"nodeid": nodeid, "outcome": outcome, "duration_s": float(case.get("time", 0.0))})
    return rows


def summarize(rows: list[dict]) -> dict:
    """Outcome counts, per-folder counts and summed durations, per-marker counts, the slowest tests."""
    outcomes = collections.Counter(r["outcome"] for r in rows)
    folders: dict[str, dict] = {}
    for r in rows:
        parts = r["nodeid"].split("::")[0].split("/")
        folder = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
        f = folders.setdefault(folder, {"folder": folder, "tests": 0, "passed": 0, "skipped": 0, "failed": 0,
                                        "duration_s": 0.0})
        f["tests"] += 1
        f[r["outcome"] if r["outcome"] in ("passed", "skipped") else "failed"] += 1
        f["duration_s"] += r["duration_s"]
    for f in folders.values():
        f["duration_s"] = round(f["duration_s"], 1)
    out = {"outcomes": dict(sorted(outcomes.items())),
           "folders": sorted(folders.values(), key=lambda f: -f["duration_s"]),
           "slowest": [{"nodeid": r["nodeid"], "duration_s": round(r["duration_s"], 1)}
                       for r in sorted(rows, key=lambda r: -r["duration_s"])[:N_SLOWEST]]}
    if rows and "markers" in rows[0]:
        markers = collections.Counter(m for r in rows for m in r["markers"])
        out["markers"] = dict(sorted(markers.items()))
    return out


def load_record(out: Path) -> dict:
    """The tests record at ``out`` (``{"runs": []}`` when there is none).

    Raises:
        ValueError: the file is not a JSON object with a ``runs`` list.
    """
    if out.is_dir():
        raise ValueError("is a directory (a record file is expected)")
    if not out.exists():
        if not out.parent.is_dir():
            raise ValueError(f"directory {out.parent} not found")
        return {"runs": []}
    try:
        rec = json.loads(out.read_text())
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or not isinstance(rec.get("runs"), list):
        raise ValueError("not a tests record (a JSON object with a 'runs' list)")
    if any(not isinstance(r, dict) or not isinstance(r.get("label"), str) for r in rec["runs"]):
        raise ValueError("not a tests record (every run needs a 'label')")
    return rec


def add_run(out: Path, run: dict) -> None:
    """Add ``run`` to the record at ``out`` (replacing a run with the same label)."""
    rec = load_record(out)
    rec["runs"] = [r for r in rec["runs"] if r["label"] != run["label"]] + [run]
    write_json(out, rec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="name of this run in the record")
    ap.add_argument("--command", default="make test", help="test command to time (default: make test)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="record file (default docs/results/tests.json)")
    ap.add_argument("--from-junit", type=Path, default=None,
                    help="record an earlier run from its pytest --junitxml file instead of running")
    ap.add_argument("--wall-s", type=positive_float, default=None,
                    help="with --from-junit: that run's wall time in seconds")
    ap.add_argument("--note", default=None, help="free text stored with the run (machine load, ...)")
    ap.add_argument("--commit", default=None, help="with --from-junit: the commit that run tested")
    ap.add_argument("--marker-counts", default=None,
                    help="with --from-junit: 'marker=N,...' from `pytest --collect-only -m MARKER` of that commit")
    args = ap.parse_args(argv)
    if args.from_junit is None:
        given = [flag for flag, val in (("--wall-s", args.wall_s), ("--commit", args.commit),
                                        ("--marker-counts", args.marker_counts)) if val is not None]
        if given:
            ap.error(f"{', '.join(given)}: only with --from-junit (a timed run records its own commit, wall "
                     "time and markers)")
    markers = None
    if args.marker_counts:
        try:
            markers = {k.strip(): int(v) for k, v in (kv.split("=") for kv in args.marker_counts.split(","))}
        except ValueError:
            markers = {}
        if not markers or any(not k or n < 0 for k, n in markers.items()):
            ap.error(f"--marker-counts {args.marker_counts!r}: expected 'marker=N,...' with names and counts >= 0")
    try:
        load_record(args.out)                      # before the tests run, not after
    except ValueError as e:
        ap.error(f"--out {args.out}: {e}")

    if args.from_junit is not None:
        if args.wall_s is None:
            ap.error("--from-junit needs --wall-s")
        try:
            rows = rows_from_junit(args.from_junit)
        except ET.ParseError as e:
            ap.error(f"--from-junit {args.from_junit}: not a junit XML file ({e})")
        except (OSError, ValueError) as e:
            ap.error(f"--from-junit {args.from_junit}: {e}")
        if not rows:
            ap.error(f"--from-junit {args.from_junit}: no test cases in the file")
        rc, wall, command = None, args.wall_s, None
    else:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            env = dict(os.environ, MTRAINING_TEST_REPORT=str(report))
            t0 = time.monotonic()
            rc = subprocess.call(args.command, shell=True, cwd=ROOT, env=env)
            wall = time.monotonic() - t0
            if not report.exists():
                print(f"time_tests: {args.command!r} wrote no test report (exit {rc})", file=sys.stderr)
                return rc or 1
            rows = json.loads(report.read_text())["tests"]
        command = args.command
    run = {"label": args.label, "command": command, "wall_s": round(wall, 1), "returncode": rc,
           "meta": environment(argv=sys.argv[1:], tool="time_tests"), **summarize(rows)}
    if args.commit:
        run["meta"]["git_commit"], run["meta"]["git_dirty"] = args.commit, None
    if markers:
        run["markers"] = markers
    if args.note:
        run["note"] = args.note
    add_run(args.out, run)
    print(f"{args.label}: {wall / 60:.1f} min, {run['outcomes']} -> {args.out}")
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())

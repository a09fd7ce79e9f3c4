"""Test-session set-up shared by every test module.

Triton mode. Without a GPU, Triton kernels can only run in Triton's CPU interpreter, and the
interpreter must be switched on before anything imports ``triton`` (its ``@triton.jit`` decorators
are resolved at import time). Several modules import it indirectly (the sparse ring's GPU factory,
the imbalance tool's GPU mode), so the switch lives here, before any test module is collected.
With a GPU, ``triton`` is imported here in compiled mode first: the GPU tests then run compiled
kernels, and the interpreter test modules (tests/kernels/) re-run themselves in a fresh
interpreter subprocess.

Markers (registered in pyproject.toml, ``--strict-markers``):

* ``gpu`` / ``gpu(count=N)``: needs CUDA (N devices, default 1); skipped otherwise with the reason.
  ``pytest -m gpu`` runs exactly these.
* ``slow``, ``network``: set by the test modules; ``make test-fast`` leaves out ``slow``.
* ``unit``, ``distributed``, ``kernels``, ``integration``, ``tools``: set here from the folder a
  test lives in, so a layer can be selected with ``-m``.
"""
import os
from pathlib import Path

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
    _N_CUDA = torch.cuda.device_count() if _HAS_CUDA else 0
except Exception:  # torch is a hard dependency; this only guards odd environments
    _HAS_CUDA, _N_CUDA = False, 0

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif os.environ.get("TRITON_INTERPRET") != "1":
    try:
        import triton  # noqa: F401  (compiled mode, before any test module can switch the interpreter on)
    except ImportError:
        pass

LAYERS = ("unit", "distributed", "kernels", "integration", "tools")
_TESTS_DIR = Path(__file__).resolve().parent


def gpu_skip_reason(count: int, available: int, has_cuda: bool) -> str | None:
    """Why a test marked ``gpu(count=count)`` cannot run here (``None``: it can)."""
    if not has_cuda:
        return "needs CUDA (marker gpu); run on a GPU machine with `pytest -m gpu`"
    if available < count:
        return f"needs {count} CUDA devices (marker gpu(count={count})), {available} visible"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            layer = Path(item.path).resolve().relative_to(_TESTS_DIR).parts[0]
        except ValueError:
            layer = None
        if layer in LAYERS:
            item.add_marker(getattr(pytest.mark, layer))
        mark = item.get_closest_marker("gpu")
        if mark is not None:
            count = int(mark.kwargs.get("count", mark.args[0] if mark.args else 1))
            reason = gpu_skip_reason(count, _N_CUDA, _HAS_CUDA)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


# ------------------------------------------------------------------ per-test timing report
# With MTRAINING_TEST_REPORT=FILE, the session adds its tests to FILE at its end (one JSON object):
# {"tests": [{"nodeid", "outcome", "duration_s" (setup + call + teardown), "markers"}]}.
# tools/time_tests.py turns it into the record docs/results/tests.json. Under pytest-xdist the
# workers' reports reach the controller, which alone writes the file.
_REPORT: dict = {}


def pytest_runtest_logreport(report):
    if not os.environ.get("MTRAINING_TEST_REPORT"):
        return
    row = _REPORT.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "duration_s": 0.0,
                                              "markers": sorted(k for k in report.keywords
                                                                if k in LAYERS or k in ("slow", "serial", "gpu", "network"))})
    row["duration_s"] += report.duration
    if report.outcome == "failed" or (report.outcome == "skipped" and row["outcome"] == "passed"):
        row["outcome"] = report.outcome


def pytest_sessionfinish(session):
    path = os.environ.get("MTRAINING_TEST_REPORT")
    if not path or hasattr(session.config, "workerinput"):
        return
    import json

    rows = {r["nodeid"]: r for r in (json.loads(Path(path).read_text())["tests"] if Path(path).is_file() else [])}
    rows.update(_REPORT)                          # one file for the sessions of one command (make test runs two)
    Path(path).write_text(json.dumps({"tests": list(rows.values())}, indent=0))

"""Shared by the Triton interpreter test modules (tests/kernels/: test_triton_kernels.py, test_estimator_triton.py,
test_convert_triton.py)."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest


def use_interpreted_kernels(request, preimported: bool, module: str, kernel: str, also=()) -> None:
    """Autouse-fixture body: skip when triton was imported compiled before this module set
    ``TRITON_INTERPRET=1`` (``preimported``; the module's ``test_all_in_fresh_interpreter`` runs it in
    a subprocess instead); else reload ``module`` (and first the modules ``also``) if its ``kernel``
    was decorated in compiled mode."""
    if preimported and request.node.name != "test_all_in_fresh_interpreter":
        pytest.skip("triton was imported before the interpreter was enabled: run in a subprocess")
    mod = sys.modules.get(module)
    if mod is not None and not type(getattr(mod, kernel)).__name__.startswith("Interpreted"):
        for name in also:
            importlib.reload(sys.modules[name])
        importlib.reload(mod)


def rerun_in_fresh_interpreter(test_file: str, timeout: float = 900) -> None:
    """Run ``test_file`` in a new pytest process with ``TRITON_INTERPRET=1`` set before triton is
    imported (triton decides interpreted vs compiled at import time); assert it passes."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# The CPU-side runs of the GPU checks: they launch Triton kernels on CPU tensors, so they need the
# interpreter; in a CUDA session (Triton compiled) they skip, and the GPU tests cover the same code.
requires_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 (the default without CUDA)")


def run_aot_worker(worker: str, timeout: float = 600) -> str:
    """Run ``tests/workers/<worker>`` (an ahead-of-time sm_90 compile of Triton kernels) in a subprocess without
    ``TRITON_INTERPRET``; skip when Triton has no NVIDIA backend; assert it prints ``RESULT PASS``; return its
    stdout (one line per compiled variant, with the cubin's register / stack use)."""
    import importlib.util

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton has no NVIDIA backend here")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, os.path.join(root, "tests", "workers", worker)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "RESULT PASS" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
    return r.stdout

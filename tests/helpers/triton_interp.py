"""Shared by the Triton interpreter test modules (test_triton_kernels.py, test_estimator_triton.py)."""
from __future__ import annotations

import os
import subprocess
import sys


def rerun_in_fresh_interpreter(test_file: str, timeout: float = 900) -> None:
    """Run ``test_file`` in a new pytest process with ``TRITON_INTERPRET=1`` set before triton is
    imported (triton decides interpreted vs compiled at import time); assert it passes."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]

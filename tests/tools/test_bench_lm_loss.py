"""tools/bench_lm_loss.py on CPU (fp32, Liger-Kernel's kernels in the Triton interpreter): every row
runs, the fused loss agrees with megatron-core's (relative error <= 1e-5 for the loss and both
gradients), the record is written, and bad arguments (a device the fused loss cannot run on too) name the
flag."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(*argv, env=None):
    return subprocess.run([sys.executable, str(REPO / "tools" / "bench_lm_loss.py"), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})


def test_rows_agree_and_record(tmp_path):
    out = tmp_path / "r.json"
    # 96 tokens x 256 vocab: the auto rule does not chunk, so the rows are megatron-core's unchunked loss
    # and the fused one
    r = _run("--tokens", "96", "--hidden", "16", "--vocab", "256", "--dtype", "fp32", "--device", "cpu",
             "--budget", "0.05", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    rows = {row["impl"]: row for row in rec["rows"]}
    assert set(rows) == {"megatron_unchunked", "liger"}
    liger = rows["liger"]
    assert liger["rel_err_vs"] == "megatron_unchunked"
    for k in ("rel_err_loss", "rel_err_d_hidden", "rel_err_d_weight"):
        assert liger[k] <= 1e-5, (k, liger[k])
    assert rec["meta"]["tool"] == "bench_lm_loss"


def test_bad_arguments_name_the_flag(tmp_path):
    r = _run("--tokens", "0")
    assert r.returncode == 2 and "--tokens" in r.stderr
    r = _run("--device", "cpu", "--json", str(tmp_path / "missing" / "r.json"))
    assert r.returncode == 2 and "--json" in r.stderr
    r = _run("--device", "cpu", env={"TRITON_INTERPRET": "0"})        # Liger's kernels cannot run here
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--device cpu: the liger row (the fused loss) runs Triton kernels" in r.stderr, r.stderr[-2000:]

"""megatron_mtraining.training as a library, at CP=2 on 2 gloo ranks (tiny model, tiny data).

* A stop hook that fires on one rank only ends the run on every rank after that iteration (no rank
  waits alone), logs the reason, saves the normal checkpoint and returns it in ``TrainResult``.
* The CP plan is resolved once per run (not per layer nor per micro-batch): over 2 iterations x 2
  micro-batches of a 2-layer model each rank resolves one plan, in the trainer, and no ``Layout``
  is built during the iterations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.dist import run_torchrun
from tests.helpers.tiny_data import make_tiny_dataset

WORKER = r'''
import json, os, sys
import megatron_mtraining.layout as layout_mod
import megatron_mtraining.plan as plan_mod

built, plans = [], []
class CountingLayout(layout_mod.Layout):
    def __init__(self, *a, **k):
        built.append(sys._getframe(1).f_code.co_filename)   # who builds it
        super().__init__(*a, **k)
layout_mod.Layout = CountingLayout                 # before anything imports it

_resolve = plan_mod.resolve
def counting_resolve(*a, **k):
    plans.append(sys._getframe(1).f_code.co_filename)       # who resolves it
    return _resolve(*a, **k)
plan_mod.resolve = counting_resolve                # before the attention module imports it

from megatron_mtraining.training import TrainHooks, run

def should_stop(info):
    seen.append((info.iteration, len(built)))
    return "hook on rank 1" if (rank == 1 and info.iteration == 2) else None

if __name__ == "__main__":                         # the checkpoint writer starts a multiprocessing Manager
    rank = int(os.environ["RANK"])
    seen = []
    res = run(sys.argv[2:], TrainHooks(should_stop=should_stop))
    with open(f"{sys.argv[1]}.{rank}", "w") as f:
        json.dump({"start": res.start_iteration, "end": res.end_iteration, "reason": res.stop_reason,
                   "seen": seen, "plans": plans}, f)
'''


@pytest.mark.slow
def test_stop_hook_on_one_rank_stops_all_and_plan_is_resolved_once(tmp_path):
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out, ckpt = tmp_path / "res", tmp_path / "ckpt"
    argv = [str(out), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "256", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
            "--context-parallel-size", "2", "--cp-granularity", "32", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--data-path", prefix,
            "--split", "100,0,0", "--tokenizer-model", tok, "--eval-iters", "0", "--log-interval", "1",
            "--save", str(ckpt), "--data-cache-path", str(tmp_path / "cache")]
    r = run_torchrun(str(script), argv, nproc=2, timeout=240)
    assert r.returncode == 0, r.tail()
    res = [json.loads((tmp_path / f"res.{k}").read_text()) for k in (0, 1)]
    assert res[1]["reason"] == "hook on rank 1" and res[0]["reason"] == "stop hook of another rank"
    for x in res:
        assert (x["start"], x["end"], [it for it, _ in x["seen"]]) == (0, 2, [1, 2])
        assert len(x["plans"]) == 1 and "megatron_mtraining/training/" in x["plans"][0], x  # once, by the trainer
        assert x["seen"][0][1] == x["seen"][1][1], x  # and nothing builds one per micro-batch
    assert " > exiting after iteration 2 (" in r.stdout
    assert "iteration        3/" not in r.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_cli_and_tools_import_the_package():
    """examples/pretrain_gpt.py is a thin command line over the package, and nothing loads it as a
    module or puts examples/ on sys.path."""
    from tests.helpers.dist import REPO_ROOT

    cli = (REPO_ROOT / "examples" / "pretrain_gpt.py").read_text()
    assert len(cli.splitlines()) <= 80 and "from megatron_mtraining.training import main" in cli
    assert "sys.path" not in cli
    for path in [*(REPO_ROOT / "tools").glob("*.py"), *(REPO_ROOT / "tests").rglob("*.py")]:
        if path.resolve() == Path(__file__).resolve():
            continue
        lines = path.read_text().splitlines()
        assert not [ln for ln in lines if "sys.path" in ln and "examples" in ln], path
        assert not [ln for ln in lines if "spec_from_file_location" in ln and "pretrain" in ln.lower()], path

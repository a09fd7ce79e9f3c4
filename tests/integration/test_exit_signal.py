"""``--exit-signal-handler`` / ``--exit-signal`` of examples/pretrain_gpt.py, without Slurm.

The trainer runs as plain subprocesses (one per rank, torch.distributed env:// variables set as
srun's tasks set them), a real signal is sent with ``os.kill`` once iterations are running, and:

* with the handler the process finishes the iteration in progress, saves a checkpoint at that
  iteration and exits 0 (the negative control: without the flag the same signal kills it, status
  -SIGTERM, nothing saved);
* a signal to ONE of two ranks stops both after the same iteration (the flag is all-reduced), and
  the rank that got no signal says so;
* a bad combination of flags is an argument error naming the flag.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args
from tests.helpers.dist import REPO_ROOT, free_port, worker_env
from tests.helpers.tiny_data import make_tiny_dataset

SCRIPT = str(REPO_ROOT / "examples" / "pretrain_gpt.py")
TRAIN_ITERS = 500          # never reached: the signal ends every run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("tiny_data"))


def _argv(prefix: str, tok: str, *extra: str) -> list[str]:
    return ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "128",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--micro-batch-size", "1",
            "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3", "--data-path", prefix, "--split", "90,10,0",
            "--tokenizer-model", tok, "--cp-granularity", "32", "--log-interval", "1", "--eval-iters", "0",
            *extra]


def _start(argv: list[str], world: int, out: Path) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = worker_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                          "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=log, stderr=subprocess.STDOUT,
                                      env=env, cwd=REPO_ROOT, start_new_session=True))
        log.close()
    return procs


def _wait_for(out: Path, needle: str, procs, timeout: float = 180) -> None:
    t0 = time.monotonic()
    while needle not in (out / "rank0.log").read_text(errors="replace"):
        if any(p.poll() is not None for p in procs) or time.monotonic() - t0 > timeout:
            _kill(procs)
            pytest.fail(f"{needle!r} never appeared:\n{(out / 'rank0.log').read_text()[-3000:]}")
        time.sleep(0.2)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _finish(procs, timeout: float = 120) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        _kill(procs)
        pytest.fail("a rank did not exit after the signal")


def _iterations(metrics: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()]


def _validate(tiny, *extra):
    return validate_args(build_parser().parse_args(_argv(*tiny, *extra)), world_size=1, te_importable=False)


def test_exit_signal_flags(tiny):
    assert _validate(tiny, "--exit-signal-handler").exit_signal == "SIGTERM"     # Megatron-LM's default
    assert _validate(tiny, "--exit-signal-handler", "--exit-signal", "SIGUSR1").exit_signal == "SIGUSR1"
    assert _validate(tiny).exit_signal is None
    with pytest.raises(ArgumentValidationError, match="--exit-signal SIGUSR1 has no effect without "
                                                      "--exit-signal-handler"):
        _validate(tiny, "--exit-signal", "SIGUSR1")
    with pytest.raises(SystemExit):                                           # argparse: invalid choice
        build_parser().parse_args(_argv(*tiny, "--exit-signal-handler", "--exit-signal", "SIGKILL"))


@pytest.mark.parametrize("handler", [True, False], ids=["handler", "no-handler-control"])
def test_sigterm_finishes_the_iteration_saves_and_exits_0(tiny, tmp_path, handler):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    argv = _argv(*tiny, "--save", str(ckpt), "--metrics-file", str(metrics),
                 *(["--exit-signal-handler"] if handler else []))
    procs = _start(argv, 1, tmp_path)
    _wait_for(tmp_path, " iteration        2/", procs)
    procs[0].send_signal(signal.SIGTERM)
    rc = _finish(procs)
    log = (tmp_path / "rank0.log").read_text()
    if not handler:                                    # negative control: the default action kills it
        assert rc == [-signal.SIGTERM], log[-3000:]
        assert not (ckpt / "latest_checkpointed_iteration.txt").exists()
        return
    assert rc == [0], log[-3000:]
    done = _iterations(metrics)
    k = done[-1]
    assert done == list(range(1, k + 1)) and 2 <= k < TRAIN_ITERS, done
    assert f"exiting after iteration {k} (SIGTERM received, --exit-signal-handler)" in log, log[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(k)
    assert (ckpt / f"iter_{k:07d}" / "metadata.json").is_file()


@pytest.mark.slow
def test_signal_to_one_rank_stops_every_rank_after_the_same_iteration(tiny, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    argv = _argv(*tiny, "--context-parallel-size", "2", "--save", str(ckpt), "--metrics-file", str(metrics),
                 "--exit-signal-handler", "--exit-signal", "SIGUSR1")
    procs = _start(argv, 2, tmp_path)
    _wait_for(tmp_path, " iteration        2/", procs)
    procs[1].send_signal(signal.SIGUSR1)               # rank 1 only
    rc = _finish(procs)
    log = (tmp_path / "rank0.log").read_text()
    assert rc == [0, 0], log[-3000:] + (tmp_path / "rank1.log").read_text()[-3000:]
    k = _iterations(metrics)[-1]
    # rank 0 (which logs) got no signal: it stopped because rank 1's flag was all-reduced
    assert f"exiting after iteration {k} (SIGUSR1 received by another rank, --exit-signal-handler)" in log, log
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(k)
    assert k < TRAIN_ITERS

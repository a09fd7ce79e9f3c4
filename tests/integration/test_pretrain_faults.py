"""The example trainer when a CP rank raises mid-ring: every process exits non-zero on its own.

``examples/pretrain_gpt.py``'s ``main`` runs on 2 gloo ranks with CP=2 (``tests/workers/pretrain_fault.py``,
one process per rank via ``run_ranks``: torchrun would stop the survivor itself, and the test is that
it stops without help). Rank 1's step kernel raises a Python exception in the first iteration's
forward; rank 1 exits with status 1 and its traceback, rank 0 ends with a ``CommError`` naming the
flat ring, the pass, the step and rank 1. Its message states the CP group's timeout, 0:01:00 from
``--distributed-timeout-minutes 1``: the flag reaches Megatron's groups, not only the default group.
"""
from __future__ import annotations

import re
import time

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_data import make_tiny_dataset
from tests.integration.test_pretrain_cli import _argv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("tiny_data"))


def test_rank_raising_mid_ring_ends_every_trainer_process(tiny):
    argv = _argv(*tiny, **{"--context-parallel-size": 2, "--distributed-timeout-minutes": 1, "--train-iters": 2})
    t0 = time.time()
    # forward:2 = the second layer's ring step 0 (2 layers x 2 steps per forward)
    survivor, victim = run_ranks("tests/workers/pretrain_fault.py",
                                 ["--victim", 1, "--kernel", "forward:2", "--how", "raise", "--", *argv],
                                 nproc=2, timeout=240)
    assert victim.returncode == 1, victim.tail()
    assert "RuntimeError: injected fault at step kernel forward:2" in victim.stderr, victim.tail()
    assert survivor.returncode not in (0, None), survivor.tail()
    m = re.search(r"CommError: flat ring (forward|backward) step \d \([^)]*\) failed on group rank 0 \(global rank 0\), "
                  r"sending to global rank 1 and receiving from global rank 1", survivor.stderr)
    assert m, survivor.tail()
    assert "process-group timeout (0:01:00)" in survivor.stderr, survivor.tail()
    assert survivor.end_time - t0 < 60 + 60, survivor.end_time - t0   # start-up + at most the timeout
    assert not re.search(r"iteration +\d+/", survivor.stdout), survivor.tail()     # no iteration finished
    assert "training done" not in survivor.stdout, survivor.tail()

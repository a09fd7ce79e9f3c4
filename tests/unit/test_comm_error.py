"""``comm_context`` / ``wait_all`` (single process, no process group): what becomes a ``CommError``
and what its message holds. The multi-rank behaviour is in ``tests/distributed/test_ring_faults.py``."""
import pickle

import pytest

from megatron_mtraining.distributed import CommError, comm_context, wait_all


class _Work:
    def __init__(self, error=None):
        self.error, self.waited = error, False

    def wait(self):
        self.waited = True
        if self.error is not None:
            raise self.error


def test_backend_error_becomes_comm_error_naming_the_operation_and_peers():
    cause = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234\nsecond line")
    with pytest.raises(CommError) as e:
        with comm_context("flat ring forward step 3 (K/V exchange for step 4)", None, peers=(1, 2),
                          peer_text="sending to global rank 1 and receiving from global rank 2"):
            raise cause
    msg = str(e.value)
    assert msg.startswith("flat ring forward step 3 (K/V exchange for step 4) failed on group rank 0 (global rank 0), "
                          "sending to global rank 1 and receiving from global rank 2: [pair.cc:553] Connection closed")
    assert "second line" not in msg and "--distributed-timeout-minutes" in msg
    assert e.value.__cause__ is cause
    assert (e.value.where, e.value.peers) == ("flat ring forward step 3 (K/V exchange for step 4)", (1, 2))
    again = pickle.loads(pickle.dumps(e.value))
    assert str(again) == msg and again.peers == (1, 2)


def test_other_errors_and_inner_comm_errors_pass_unchanged():
    with pytest.raises(ValueError, match="not a transfer"):       # negative control: only RuntimeErrors are wrapped
        with comm_context("x", None):
            raise ValueError("not a transfer")
    inner = CommError("inner", where="inner ring backward step 0 of outer step 1 (dK/dV exchange)")
    with pytest.raises(CommError) as e:
        with comm_context("outer", None):
            raise inner
    assert e.value is inner


def test_wait_all_waits_every_handle_and_names_the_failure():
    ok, bad = _Work(), _Work(RuntimeError("Timed out waiting 30000ms for recv operation to complete"))
    wait_all([ok, None], "sparse ring forward: all_reduce", None)
    assert ok.waited
    with pytest.raises(CommError, match=r"^sparse ring forward: all_reduce failed .*: Timed out waiting 30000ms"):
        wait_all([_Work(), bad], "sparse ring forward: all_reduce", None)
    assert bad.waited

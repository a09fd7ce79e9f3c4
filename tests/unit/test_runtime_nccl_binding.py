"""``init_distributed`` binds NCCL to the rank's GPU (eager communicators) only with more than one rank."""

import argparse

import pytest
import torch
import torch.distributed as dist

from megatron_mtraining.training import runtime


@pytest.mark.parametrize("world, bound", [("1", False), ("4", True)])
def test_nccl_device_binding_by_world_size(monkeypatch, world, bound):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    for k, v in (("WORLD_SIZE", world), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "1")):
        monkeypatch.setenv(k, v)
    args = argparse.Namespace(distributed_backend=None, distributed_timeout_minutes=1)
    assert runtime.init_distributed(args) == torch.device("cuda", 0)
    (kw,) = calls
    assert kw["backend"] == "nccl"
    assert ("device_id" in kw) is bound
    if bound:
        assert kw["device_id"] == torch.device("cuda", 0)

"""``init_distributed`` leaves the NCCL group unbound (no ``device_id``), as Megatron-LM does: each communicator is
made at its group's first collective, so the groups a run never uses hold no GPU memory."""

import argparse

import pytest
import torch
import torch.distributed as dist

from megatron_mtraining.training import runtime

ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("world", ["1", "4", None])          # None: a plain `python` start (no torchrun env)
def test_nccl_group_is_not_bound_to_the_gpu(monkeypatch, world):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    for k in ENV:                           # recorded first, so the values init_distributed sets are undone
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    if world is not None:
        for k, v in zip(ENV, (world, "0", "0", "127.0.0.1", "1")):
            monkeypatch.setenv(k, v)
    args = argparse.Namespace(distributed_backend=None, distributed_timeout_minutes=1)
    assert runtime.init_distributed(args) == torch.device("cuda", 0)
    (kw,) = calls
    assert kw["backend"] == "nccl"
    assert "device_id" not in kw

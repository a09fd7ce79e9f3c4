"""Process set-up of a training run: ``torch.distributed`` from the torchrun environment, rank-0 logging."""

from __future__ import annotations

import datetime
import os
from typing import Any

__all__ = ["log0", "init_distributed"]


def log0(*msg: Any) -> None:
    """Print on global rank 0 only (every rank before ``torch.distributed`` is initialised)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*msg, flush=True)


def init_distributed(args) -> "torch.device":
    """Initialise the default process group for ``args`` and return this rank's device.

    Uses the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``);
    without ``WORLD_SIZE`` (a plain ``python`` start) it sets up a 1-rank world on a free local port.
    The backend is ``--distributed-backend`` or nccl on CUDA / gloo on CPU; the process-group
    timeout is ``--distributed-timeout-minutes`` (the trainer passes the same value to Megatron's
    ``initialize_model_parallel`` for the TP/CP/DP groups). On CPU without ``OMP_NUM_THREADS`` the cores are
    shared between the local ranks. The group is not bound to the GPU (no ``device_id``, as in Megatron-LM):
    each NCCL communicator is made at its group's first collective, on this rank's current device. In a
    one-rank run on an H100 that leaves 6.8 GiB more GPU memory than a bound group
    (``docs/results.md#nccl-one-gpu``).

    Returns:
        ``torch.device("cuda", LOCAL_RANK)`` on a CUDA machine, else ``torch.device("cpu")``.
    """
    import torch
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:  # plain `python pretrain_gpt.py`: a 1-rank world on a free port
        from megatron_mtraining.common import free_local_port

        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_local_port())), ("RANK", "0"),
                     ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
    use_cuda = torch.cuda.is_available()
    backend = args.distributed_backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        # share the cores between the local ranks (2 ranks on 2 cores: 1 thread each)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    # No device_id (as in Megatron-LM): a bound group would set up a communicator for every group
    # initialize_model_parallel makes, at once (8.2 GiB of GPU memory on one H100 in a one-rank world);
    # unbound, each group's communicator is made at its first collective and unused groups cost nothing.
    dist.init_process_group(backend=backend,
                            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    return device

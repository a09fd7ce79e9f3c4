"""The example trainer (megatron_mtraining.training.run) under torchrun, recording what a parity test
compares: every rank writes ``OUT.rank<R>.pt`` with its local gradients after each iteration's
gradient reduction and its local parameters at the end of the run.

    torchrun --nproc-per-node 4 tests/workers/trainer_parity_worker.py OUT <pretrain_gpt.py flags>

The trainer runs unchanged; two megatron-core functions that it calls are wrapped in this process
only: ``megatron.core.distributed.finalize_model_grads`` (after it returns, each parameter's
``main_grad`` is copied) and ``parallel_state.destroy_model_parallel`` (before it runs, each
parameter is copied). Loss and grad norm come from the trainer's own ``--metrics-file``.

The file holds ``{"tp_rank", "tp_size", "cp_rank", "dp_rank", "pp_rank", "grads": [{name: tensor}],
"params": {name: tensor}, "params_start": {name: tensor}, "meta": {name: (tensor_model_parallel, partition_dim, partition_stride)},
"attention_calls": int}`` (``MTrainingAttention.forward`` calls of this rank, recomputations included); names are the
GPTModel's parameter names (the DDP / Float16Module wrappers stripped). With
``--use-distributed-optimizer`` ``main_grad`` holds the reduced gradient only in this rank's shard
of the buffer, so parity tests compare the parameters after the steps instead.
"""

from __future__ import annotations

import sys
import warnings

warnings.filterwarnings("ignore")


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def main() -> int:
    import torch
    import megatron.core.distributed as mcd
    from megatron.core import parallel_state as ps

    out, argv = sys.argv[1], sys.argv[2:]
    rec: dict = {"grads": [], "params": {}, "meta": {}}
    orig_finalize, orig_destroy = mcd.finalize_model_grads, ps.destroy_model_parallel
    models: list = []

    def finalize(model, *a, **k):
        res = orig_finalize(model, *a, **k)
        models[:] = list(model)
        if "params_start" not in rec:                    # before the first optimizer step
            rec["params_start"] = {n: p.detach().float().clone() for c in model
                                   for n, p in _unwrap(c).named_parameters()}
        grads = {}
        for chunk in model:
            for name, p in _unwrap(chunk).named_parameters():
                grads[name] = p.main_grad.detach().float().clone()
                rec["meta"][name] = (bool(getattr(p, "tensor_model_parallel", False)),
                                     int(getattr(p, "partition_dim", -1)), int(getattr(p, "partition_stride", 1)))
        rec["grads"].append(grads)
        return res

    def destroy(*a, **k):
        for chunk in models:
            for name, p in _unwrap(chunk).named_parameters():
                rec["params"][name] = p.detach().float().clone()
        rec.update(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                   cp_rank=ps.get_context_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
                   pp_rank=ps.get_pipeline_model_parallel_rank())
        import torch.distributed as dist

        torch.save(rec, f"{out}.rank{dist.get_rank()}.pt")
        return orig_destroy(*a, **k)

    from megatron_mtraining.megatron.attention import MTrainingAttention

    attn_forward = MTrainingAttention.forward

    def counted_forward(self, *a, **k):                  # recomputation runs the core attention again
        rec["attention_calls"] = rec.get("attention_calls", 0) + 1
        return attn_forward(self, *a, **k)

    MTrainingAttention.forward = counted_forward
    mcd.finalize_model_grads = finalize
    ps.destroy_model_parallel = destroy
    from megatron_mtraining.training import run

    run(argv)
    return 0


if __name__ == "__main__":          # the checkpoint writer may start a multiprocessing Manager
    sys.exit(main())

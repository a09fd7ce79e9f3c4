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
GPTModel's parameter names (the DDP / Float16Module wrappers stripped), a transformer layer's by its
global layer number (``decoder.layers.<L>`` on every pipeline stage, as in the one-stage model). With
``--use-distributed-optimizer`` ``main_grad`` holds the reduced gradient only in this rank's shard
of the buffer, so parity tests compare the parameters after the steps instead.

With ``MTRAINING_PARITY_INIT=REF.rank0.pt`` (a one-rank, TP=1 run's file) the model's initial
weights are set from that run's ``params_start`` by global name right after the trainer builds the
model (before the DDP wrapper and the optimizer copy them), so a pipeline-parallel run starts from
the one-stage run's weights although each stage initialises its own layers.
"""

from __future__ import annotations

import sys
import warnings

warnings.filterwarnings("ignore")


def main() -> int:
    import os

    import torch
    import megatron.core.distributed as mcd
    from megatron.core import parallel_state as ps

    from megatron_mtraining.training import loop
    from megatron_mtraining.training.faults import global_param_names

    out, argv = sys.argv[1], sys.argv[2:]
    rec: dict = {"grads": [], "params": {}, "meta": {}}
    orig_finalize, orig_destroy = mcd.finalize_model_grads, ps.destroy_model_parallel
    models: list = []

    def finalize(model, *a, **k):
        res = orig_finalize(model, *a, **k)
        models[:] = list(model)
        if "params_start" not in rec:                    # before the first optimizer step
            rec["params_start"] = {n: p.detach().float().clone() for c in model
                                   for n, p in global_param_names(c)}
        grads = {}
        for chunk in model:
            for name, p in global_param_names(chunk):
                grads[name] = p.main_grad.detach().float().clone()
                rec["meta"][name] = (bool(getattr(p, "tensor_model_parallel", False)),
                                     int(getattr(p, "partition_dim", -1)), int(getattr(p, "partition_stride", 1)))
        rec["grads"].append(grads)
        return res

    def destroy(*a, **k):
        for chunk in models:
            for name, p in global_param_names(chunk):
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
    init = os.environ.get("MTRAINING_PARITY_INIT")
    if init:
        start = torch.load(init)["params_start"]
        build = loop.build_model

        def build_from_reference(*a, **k):
            model = build(*a, **k)
            with torch.no_grad():
                for name, p in global_param_names(model):
                    if name == "output_layer.weight" and name not in start:     # tied: the last stage's copy
                        name = "embedding.word_embeddings.weight"
                    assert start[name].shape == p.shape, (name, start[name].shape, p.shape)
                    p.copy_(start[name])
            return model

        loop.build_model = build_from_reference
    mcd.finalize_model_grads = finalize
    ps.destroy_model_parallel = destroy
    loop.run(argv)
    return 0


if __name__ == "__main__":          # the checkpoint writer may start a multiprocessing Manager
    sys.exit(main())

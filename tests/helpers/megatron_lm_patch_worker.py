"""Run the *patched* Megatron-LM ``gpt_builder`` and ``get_batch`` on CPU (gloo) and print the loss.

Usage (from tests/integration/test_patch.py)::

    PYTHONPATH=<patched Megatron-LM checkout>:<repo> torchrun --nproc-per-node CP \\
        tests/helpers/megatron_lm_patch_worker.py --context-parallel-size CP

The Megatron-LM command line is parsed by Megatron-LM's own ``parse_args`` + ``validate_args``
with the patched ``pretrain_gpt.add_cp_attention_args`` as ``extra_args_provider`` (so
``--cp-attention``/``--mtraining-config`` go through the real parser). Then: gloo world,
``initialize_model_parallel``, the model as the patched Megatron-LM line builds it (0.16 to 0.18:
``gpt_builders.gpt_builder``; 0.19: ``gpt_config_from_args`` + the patch's
``mtraining_model_config`` + ``GPTModelBuilder.build_model`` and the config's pre-wrap hooks);
it must have ``MTrainingAttention`` in every layer and a ``LayoutRotaryEmbedding``. Then the
patched ``pretrain_gpt.get_batch`` (Megatron's ``get_batch_on_this_tp_rank`` + our split; must
equal ``Layout.shard`` of the sample), forward with labels, backward. Rank 0 prints ``RESULT {"loss": ..., "grad_sq": ...}`` and, with
``MTRAINING_RESULT_FILE`` set, saves the per-token losses (global order) and the CP-summed
gradient vector there. Megatron-LM's training loop itself is
CUDA-only, so ``pretrain()`` is not called.

With ``--check-te-path`` (one rank, no ``--cp-attention`` flag: the default ``te``) it parses the
command line, builds the model and calls ``get_batch`` the same way, then checks that nothing of
``megatron_mtraining`` was imported (the patch imports it only on the mtraining path) and that the
layers keep Megatron's core attention; it prints ``TE_PATH_OK``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

if sys.version_info < (3, 12):
    import typing

    # Megatron-LM 0.19's megatron.training decorates methods with typing.override (Python 3.12),
    # a marker without run-time effect; on 3.11 the same no-op lets its code run here.
    typing.override = getattr(typing, "override", lambda f: f)


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    te_path = "--check-te-path" in argv
    argv = [a for a in argv if a != "--check-te-path"]
    S = 512
    sys.argv = [
        "pretrain_gpt.py",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128",
        "--seq-length", str(S), "--max-position-embeddings", str(S),
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--micro-batch-size", "1", "--init-method-std", "0.2", "--train-iters", "1", "--lr", "1e-3",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--mock-data",
        "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
        "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion",
        "--no-persist-layer-norm", "--no-rope-fusion", "--no-create-attention-mask-in-dataloader",
        *([] if te_path else ["--cp-attention", "mtraining"]), "--distributed-backend", "gloo",
        *argv,
    ]
    from megatron.core import parallel_state as ps
    from megatron.training import arguments as mlm_arguments
    from megatron.training.arguments import parse_args, validate_args

    # CPU: validate_args asks the GPU architecture when TP or CP > 1 (then requires
    # CUDA_DEVICE_MAX_CONNECTIONS=1, which the test sets); answer "Hopper" (9).
    mlm_arguments.get_device_arch_version = lambda: 9
    from megatron.training.global_vars import set_args

    import gpt_builders  # patched Megatron-LM files, from PYTHONPATH
    import pretrain_gpt

    args = parse_args(pretrain_gpt.add_cp_attention_args)  # the patch's flags
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    args.padded_vocab_size = 128
    set_args(args)

    dist.init_process_group("gloo")
    if te_path:
        return _check_te_path(args, gpt_builders, pretrain_gpt, S)

    from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_seed, cuda_requests_on_cpu
    from megatron_mtraining.megatron.megatron_lm import mtraining_layout

    apply_cpu_patches()
    cp = args.context_parallel_size
    ps.initialize_model_parallel(1, 1, context_parallel_size=cp,
                                 hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes)
    cpu_seed(1234)
    torch.manual_seed(1234)
    model, _ = _build(args, gpt_builders, pretrain_gpt)
    kinds = sorted({type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers})
    assert kinds == ["MTrainingAttention"], kinds
    assert type(model.rotary_pos_emb).__name__ == "LayoutRotaryEmbedding", type(model.rotary_pos_emb)

    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, 127, (1, S + 1), generator=g)
    sample = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(1, S),
              "position_ids": torch.arange(S).unsqueeze(0)}
    with cuda_requests_on_cpu():  # Megatron-LM's get_batch_on_this_tp_rank calls .cuda()
        got_batch = pretrain_gpt.get_batch(iter([sample]))
    if len(got_batch) == len(BATCH_KEYS):  # 0.18, 0.19: the values of BATCH_KEYS, in its order
        named = dict(zip(BATCH_KEYS, got_batch))
        tokens, labels, loss_mask, position_ids = (named[k] for k in ("tokens", "labels", "loss_mask", "position_ids"))
        attention_mask, psp = named["attention_mask"], named["cu_seqlens"]
    else:
        tokens, labels, loss_mask, attention_mask, position_ids, psp = got_batch
    layout = mtraining_layout(args)
    rank = ps.get_context_parallel_rank()
    assert attention_mask is None and psp is None
    for name, got in (("tokens", tokens), ("labels", labels), ("position_ids", position_ids)):
        want = layout.shard(sample[name], rank, dim=1) if cp > 1 else sample[name]
        assert torch.equal(got, want), name

    losses = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)  # [1, S/cp]
    loss = (losses.float() * loss_mask).sum()
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    per_token = losses.detach().float()
    if cp > 1:
        group = ps.get_context_parallel_group()
        dist.all_reduce(grads, group=group)
        shards = [torch.empty_like(per_token) for _ in range(cp)]
        dist.all_gather(shards, per_token, group=group)
        per_token = layout.unshard(shards, dim=1)  # global token order
    if dist.get_rank() == 0:
        out = os.environ.get("MTRAINING_RESULT_FILE")
        if out:
            torch.save({"per_token_loss": per_token, "grads": grads.detach()}, out)
        print("RESULT " + json.dumps({"cp": cp, "layout": layout.kind, "loss": per_token.mean().item(),
                                      "grad_sq": float(grads.double().pow(2).sum())}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


#: Megatron-LM 0.18 and 0.19's get_batch return these fields, in this (alphabetical) order.
BATCH_KEYS = ["attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens"]


def _build(args, gpt_builders, pretrain_gpt):
    """The model as the patched line builds it (0.19: through its GPTModelConfig)."""
    if not hasattr(pretrain_gpt, "gpt_config_from_args"):  # 0.16 to 0.18: gpt_builders.gpt_builder
        return gpt_builders.gpt_builder(args, True, True), None
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    model_cfg = gpt_config_from_args(args)
    if args.cp_attention == "mtraining":  # as the patched __main__
        from megatron_mtraining.megatron.megatron_lm import mtraining_model_config

        model_cfg = mtraining_model_config(model_cfg, args)
    model = GPTModelBuilder(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups(),
                                                   pre_process=True, post_process=True)
    for hook in model_cfg.pre_wrap_hooks:  # as build_distributed_models does before wrapping
        hook([model])
    return model, model_cfg


def _check_te_path(args, gpt_builders, pretrain_gpt, S: int) -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    assert args.cp_attention == "te" and args.mtraining_config is None, (args.cp_attention, args.mtraining_config)
    ps.initialize_model_parallel(1, 1, context_parallel_size=1)
    model, _ = _build(args, gpt_builders, pretrain_gpt)
    kinds = sorted({type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers})
    assert "MTrainingAttention" not in kinds, kinds
    def ours() -> set:
        return {m for m in sys.modules if m.split(".")[0] == "megatron_mtraining"}

    assert not ours(), f"parsing and building the model on the te path imported {sorted(ours())}"
    # get_batch_on_this_tp_rank needs the CUDA shims; they are ours, so compare against what they load
    from megatron_mtraining.megatron.cpu_compat import cuda_requests_on_cpu

    before = ours()
    seq = torch.arange(S + 1).unsqueeze(0) % 127
    sample = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": torch.ones(1, S),
              "position_ids": torch.arange(S).unsqueeze(0)}
    with cuda_requests_on_cpu():
        got = pretrain_gpt.get_batch(iter([sample]))
    assert not ours() - before, f"get_batch on the te path imported {sorted(ours() - before)}"
    assert any(t is not None and torch.equal(t, sample["tokens"]) for t in got)  # CP=1: the batch as is
    print(f"TE_PATH_OK core_attention={kinds}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

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


S = 512
EOD = 127  # Megatron-LM's NullTokenizer with --vocab-size 127: the EOD id is the vocabulary size
#: document lengths of the packed cases (the last one padded to the sequence); every boundary lands
#: inside a 64-token block or on its edge, some documents span both CP ranks' blocks
DOC_LENGTHS = (100, 37, 1, 170, 64, 90)


def _argv(case_flags: list[str], te_path: bool) -> list[str]:
    return [
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
        *case_flags,
    ]


def _parse(case_flags: list[str], te_path: bool = False):
    """Megatron-LM's own parse_args + validate_args with the patch's extra_args_provider."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args

    import pretrain_gpt

    sys.argv = _argv(case_flags, te_path)
    args = parse_args(pretrain_gpt.add_cp_attention_args)  # the patch's flags
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    args.padded_vocab_size = 128
    set_args(args)
    return args


def _sample(kind: str, args, batch_size: int, seed: int = 7) -> dict:
    """A micro-batch as Megatron-LM's GPTDataset gives it.

    plain: random tokens without EOD. docs: documents of DOC_LENGTHS, each ending with the EOD token;
    loss mask and position ids from Megatron-Core's own ``_get_ltor_masks_and_position_ids`` with the
    run's --reset-position-ids / --reset-attention-mask / --eod-mask-loss (as GPTDataset). thd: the
    same documents, no EOD resets, plus the ``cu_seqlens`` / ``max_seqlen`` that GPTDataset adds with
    --dataloader-inter-document-masking (offsets padded to S + 1 entries, position ids restarted at
    every document). sft: as thd, with the exact offsets (one more entry than documents) that
    SFTDataset gives (``--sft``)."""
    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in range(batch_size):
        seq = torch.randint(0, EOD, (S + 1,), generator=g)
        if kind != "plain":
            lengths = DOC_LENGTHS if r % 2 == 0 else DOC_LENGTHS[::-1]
            ends = torch.tensor(lengths).cumsum(0) - 1
            seq[ends[ends < S + 1]] = EOD
        rows.append(seq)
    seq = torch.stack(rows)
    tokens, labels = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    loss_masks, positions = [], []
    for r in range(batch_size):
        _, lm, pos = _get_ltor_masks_and_position_ids(tokens[r], EOD, args.reset_position_ids,
                                                      args.reset_attention_mask, args.eod_mask_loss, False)
        loss_masks.append(lm)
        positions.append(pos)
    sample = {"tokens": tokens, "labels": labels, "loss_mask": torch.stack(loss_masks),
              "position_ids": torch.stack(positions)}
    if kind in ("thd", "sft"):
        cus, maxes = [], []
        for r in range(batch_size):
            lengths = list(DOC_LENGTHS if r % 2 == 0 else DOC_LENGTHS[::-1])
            lengths[-1] = S - sum(lengths[:-1])
            cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
            padded = torch.full((S + 1,), S, dtype=torch.int32)
            padded[: cu.numel()] = cu
            cus.append(cu if kind == "sft" else padded)
            maxes.append(max(lengths))
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                sample["position_ids"][r, a:b] = torch.arange(b - a)
        sample["cu_seqlens"] = torch.stack(cus)
        sample["max_seqlen"] = torch.tensor(maxes, dtype=torch.int32)
    return sample


def _run_case(case: dict, ps, gpt_builders, pretrain_gpt) -> None:
    """One case: parse its command line, build the model as the patch does, run the patched
    forward_step (get_batch, the documents, the model) and backward; rank 0 saves the result."""
    import torch
    import torch.distributed as dist

    from megatron_mtraining.megatron.cpu_compat import cpu_seed, cuda_requests_on_cpu
    from megatron_mtraining.megatron.megatron_lm import mtraining_layout

    args = _parse(["--context-parallel-size", os.environ.get("WORLD_SIZE", "1"), "--mtraining-config", case["config"],
                   *case.get("flags", [])])
    cp = args.context_parallel_size
    assert cp == ps.get_context_parallel_world_size(), (cp, ps.get_context_parallel_world_size())
    cpu_seed(1234)
    torch.manual_seed(1234)
    model, _ = _build(args, gpt_builders, pretrain_gpt)
    kinds = sorted({type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers})
    assert kinds == ["MTrainingAttention"], kinds
    # a hierarchical case runs the two-level ring on Megatron's inner/outer CP groups
    hier = {layer.self_attention.core_attention.hierarchical_groups is not None for layer in model.decoder.layers}
    assert hier == {bool(getattr(args, "hierarchical_context_parallel_sizes", None))}, hier
    assert type(model.rotary_pos_emb).__name__ == "LayoutRotaryEmbedding", type(model.rotary_pos_emb)

    kind = case.get("data", "plain")
    sample = _sample(kind, args, args.micro_batch_size)
    layout = mtraining_layout(args)
    rank = ps.get_context_parallel_rank()
    with cuda_requests_on_cpu():  # Megatron-LM's get_batch_on_this_tp_rank calls .cuda()
        got_batch = pretrain_gpt.get_batch(iter([dict(sample)]))
    if len(got_batch) == len(BATCH_KEYS):  # 0.18 on: the values of BATCH_KEYS, in its order
        named = dict(zip(BATCH_KEYS, got_batch))
        attention_mask, has_docs = named["attention_mask"], named["cu_seqlens"] is not None
    else:
        named = dict(zip(["tokens", "labels", "loss_mask", "attention_mask", "position_ids", "psp"], got_batch))
        attention_mask, has_docs = named["attention_mask"], named["psp"] is not None
    assert attention_mask is None
    documents = (args.reset_attention_mask or getattr(args, "dataloader_inter_document_masking", False)
                 or getattr(args, "sft", False))
    assert has_docs == bool(documents), (has_docs, documents)
    for name in ("tokens", "labels", "position_ids", "loss_mask"):
        want = layout.shard(sample[name], rank, dim=1) if cp > 1 else sample[name]
        assert torch.equal(named[name], want.to(named[name].dtype)), name

    # the patched forward_step: get_batch again (a fresh iterator), the documents, the model
    with cuda_requests_on_cpu():
        losses, _ = pretrain_gpt.forward_step(iter([dict(sample)]), model)  # [b, S/cp]
    loss_mask = named["loss_mask"]
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
        out = os.path.join(os.environ["MTRAINING_RESULT_DIR"], case["name"] + ".pt")
        torch.save({"per_token_loss": per_token, "grads": grads.detach(),
                    "loss_mask": sample["loss_mask"].float()}, out)
        print("RESULT " + json.dumps({"case": case["name"], "cp": cp, "layout": layout.kind,
                                      "loss": per_token.mean().item(),
                                      "grad_sq": float(grads.double().pow(2).sum())}), flush=True)
    dist.barrier()


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    te_path = "--check-te-path" in argv
    from megatron.core import parallel_state as ps
    from megatron.training import arguments as mlm_arguments
    from megatron.training import global_vars

    # CPU: validate_args asks the GPU architecture when TP or CP > 1 (then requires
    # CUDA_DEVICE_MAX_CONNECTIONS=1, which the test sets); answer "Hopper" (9).
    mlm_arguments.get_device_arch_version = lambda: 9

    import gpt_builders  # patched Megatron-LM files, from PYTHONPATH
    import pretrain_gpt

    if te_path:
        args = _parse([], te_path=True)
        dist.init_process_group("gloo")
        return _check_te_path(args, gpt_builders, pretrain_gpt, S)

    cases = json.loads(argv[argv.index("--cases") + 1])
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    args = _parse(["--context-parallel-size", str(cp)])
    global_vars._build_tokenizer(args)  # as initialize_megatron: the EOD token of --reset-attention-mask
    global_vars._set_timers(args)       # forward_step's timers
    dist.init_process_group("gloo")

    from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches

    apply_cpu_patches()
    # --hierarchical I,O: Megatron's hierarchical CP groups (--hierarchical-context-parallel-sizes I O)
    hier = [int(x) for x in argv[argv.index("--hierarchical") + 1].split(",")] if "--hierarchical" in argv else None
    ps.initialize_model_parallel(1, 1, context_parallel_size=cp, hierarchical_context_parallel_sizes=hier)
    for case in cases:
        _run_case(case, ps, gpt_builders, pretrain_gpt)
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

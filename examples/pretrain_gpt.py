#!/usr/bin/env python
"""GPT pretraining on megatron-core with the MTraining context-parallel attention.

Megatron-LM's ``pretrain_gpt.py`` is not on PyPI (the megatron-core wheel has no
``megatron.training``), so this is a compact trainer built on megatron.core only, with Megatron-LM
flag names (see :mod:`megatron_mtraining.megatron.args`)::

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention \\
        --num-query-groups 2 --seq-length 4096 --position-embedding-type rope --normalization RMSNorm \\
        --swiglu --context-parallel-size 2 --micro-batch-size 1 --global-batch-size 2 \\
        --train-iters 40 --lr 1e-3 --data-path DATA_PREFIX --tokenizer-model tok.model --save ckpt

Flow: arguments (validated before anything starts) -> ``torch.distributed`` (gloo on CPU, nccl on
GPU; torchrun env) -> ``parallel_state.initialize_model_parallel(tp, context_parallel_size=cp)``
-> sentencepiece tokenizer (``megatron.core.tokenizers.MegatronTokenizer``) -> GPTDataset
(BlendedMegatronDatasetBuilder, no dense attention mask) -> GPTModel with the MTraining spec
(``--cp-attention mtraining``) or the Transformer Engine spec (``te``) -> megatron-core
DistributedDataParallel + ``get_megatron_optimizer`` (Adam) + ``OptimizerParamScheduler`` ->
training loop -> ``dist_checkpointing`` checkpoint.

Context parallelism (``--cp-attention mtraining``): every CP rank holds the tokens
``Layout(striped).positions(cp_rank, S)`` of each sample; the batch is split with
``get_batch_on_this_cp_rank_striped``, RoPE uses the same positions (``install_layout_rope``)
and attention is computed by ring attention over the CP group.

Loss (exact global per-token mean): the objective of one iteration is
``sum over all tokens of the global batch (loss * loss_mask) / N`` where ``N`` is the number of
loss tokens of the whole global batch. Each rank first counts the loss tokens of its micro-batches
and ``N`` is all-reduced over the DP x CP group; every micro-batch then back-propagates
``sum(loss * mask) / N`` and DDP *sums* the gradients over DP x CP (``calculate_per_token_loss``,
gradient scaling 1). This is exact even when the loss mask is uneven across CP ranks (EOD masking,
padding). Megatron-LM without ``--calculate-per-token-loss`` divides by each rank's *local* token
count and averages over DP x CP, i.e. optimizes the mean of per-rank means, which is wrong for
uneven masks (Megatron-LM PR #7513).

Checkpoints: ``--ckpt-format torch_dist`` (default) saves model, optimizer, LR scheduler and the
iteration with ``megatron.core.dist_checkpointing`` into ``SAVE/iter_XXXXXXX`` and writes
``SAVE/latest_checkpointed_iteration.txt``; it works on CPU/gloo. ``--ckpt-format torch`` is a
plain fallback: one ``torch.save`` file per rank (``mp_rank_TT_cp_CC_dp_DDD.pt``) that can only be
loaded with the same parallel layout.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from megatron_mtraining.megatron.args import parse_args  # noqa: E402  (light: no megatron import)


def log0(*msg: Any) -> None:
    """Print on global rank 0 only."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*msg, flush=True)


# ------------------------------------------------------------------------------------- setup
def init_distributed(args) -> "torch.device":
    import torch
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:  # plain `python pretrain_gpt.py`: a 1-rank world on a free port
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"),
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
    kw = {"device_id": device} if (use_cuda and backend == "nccl") else {}  # binds NCCL to this rank's GPU
    dist.init_process_group(backend=backend,
                            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes), **kw)
    return device


def build_tokenizer(args):
    """``--tokenizer-type HuggingFaceTokenizer``: a ``tokenizer.json`` through the ``tokenizers`` library
    (:class:`~megatron_mtraining.megatron.hf_tokenizer.TokenizersTokenizer`); every other type: the
    sentencepiece model through ``megatron.core.tokenizers`` (GPT model type)."""
    if args.tokenizer_type == "HuggingFaceTokenizer":
        from megatron_mtraining.megatron.hf_tokenizer import TokenizersTokenizer

        return TokenizersTokenizer(args.tokenizer_model)
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=args.tokenizer_model,
        metadata_path={"library": "sentencepiece", "model_type": "gpt"},
    )


def padded_vocab_size(vocab: int, args) -> int:
    mult = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab / mult) * mult)


def effective_split(args, prefixes: list[str]) -> str:
    """``--split`` with zero weight for splits that would get no document of some prefix.

    megatron-core 0.16.1 splits by *documents* and loops forever in ``GPTDataset._get_num_epochs``
    when a requested split is empty (0 tokens per epoch), e.g. a 2% validation split of a 5-book
    corpus. Such a split is disabled here (with a message); an empty training split is an error.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    fr = list(args.split_fractions)
    bounds = np.concatenate([[0.0], np.cumsum(fr)])
    for prefix in prefixes:
        n_docs = len(IndexedDataset(prefix, mmap=True).document_indices) - 1
        for i, name in enumerate(("train", "valid", "test")):
            if fr[i] > 0 and int(round(bounds[i + 1] * n_docs)) <= int(round(bounds[i] * n_docs)):
                if i == 0:
                    raise SystemExit(f"pretrain_gpt.py: error: --split {args.split!r} leaves no training "
                                     f"document in {prefix} ({n_docs} documents)")
                log0(f" > --split {args.split!r}: the {name} split of {prefix} ({n_docs} documents) would be "
                     f"empty; {name} split disabled")
                fr[i] = 0.0
    return ",".join(f"{f:.6f}" for f in fr)


def build_datasets(args, tokenizer):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if len(args.data_path) == 1:
        blend = ([args.data_path[0]], None)
    else:
        blend = (list(args.data_path[1::2]), [float(w) for w in args.data_path[0::2]])
    split = effective_split(args, blend[0])
    gbs = args.global_batch_size
    n_evals = args.train_iters // args.eval_interval + 1 if args.eval_iters > 0 else 0
    sizes = [args.train_iters * gbs, max(n_evals * args.eval_iters * gbs, 1), max(args.eval_iters * gbs, 1)]
    cfg = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, split=split,
        path_to_cache=args.data_cache_path, tokenizer=tokenizer, mmap_bin_files=True,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # causality comes from the layout positions, never a dense mask
    )
    train, valid, _test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    if train is None:
        raise RuntimeError(f"--split {args.split!r} leaves no training data")
    return train, valid


def transformer_config(args):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.megatron.cpu_compat import cpu_transformer_config_kwargs

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    kw = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=not args.disable_bias_linear, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size, cp_comm_type="p2p",
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        calculate_per_token_loss=True,  # DDP sums grads; we divide by the global token count
        **cpu_transformer_config_kwargs(),
    )
    if args.swiglu:
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    if args.recompute_granularity:
        kw.update(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                  recompute_num_layers=args.recompute_num_layers)
    return TransformerConfig(**kw)


def build_model(args, config, vocab_size: int, device, layer_spec=None):
    """GPTModel for ``args`` (Float16Module-wrapped with --bf16/--fp16).

    ``layer_spec`` replaces the transformer-layer spec that ``--cp-attention`` selects (and then
    megatron-core's own RoPE is kept); tools/eval_long_context.py passes megatron-core's local spec
    (stock ``DotProductAttention``) for its dense reference.
    """
    from megatron.core.models.gpt import GPTModel

    from megatron_mtraining.layout import Layout

    if layer_spec is not None:
        spec = layer_spec
    elif args.cp_attention == "mtraining":
        from megatron_mtraining.megatron.attention import MTrainingAttentionConfig
        from megatron_mtraining.megatron.spec import get_gpt_layer_spec_with_mtraining

        cfg = args.mtraining                     # validated MTrainingConfig (args.validate_args)
        kwargs = cfg.attention_kwargs()
        kwargs["hierarchical"] = cfg.hierarchical_sizes(args.context_parallel_size,
                                                        args.hierarchical_context_parallel_sizes)
        spec = get_gpt_layer_spec_with_mtraining(
            mtraining_config=MTrainingAttentionConfig(**kwargs),
            normalization=args.normalization,
        )
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )
    if layer_spec is None and args.cp_attention == "mtraining":
        from megatron.core import parallel_state as ps

        from megatron_mtraining.megatron.rope import install_layout_rope

        layout = Layout(args.cp_layout, args.context_parallel_size, args.cp_granularity)
        install_layout_rope(model, layout, ps.get_context_parallel_group())
    if device.type == "cuda":
        model.cuda(device)
    if args.bf16 or args.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_iteration(args, vocab_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward), the standard 6N + attention rule.

    ``6 * N * T`` for the matmul weights (N counts the QKV/out projections, MLP and the output
    (logit) layer, not the embedding lookup; 2 FLOPs per multiply-add, x3 for forward + backward)
    plus the causal attention matmuls ``6 * L * S * (heads * head_dim)`` per token
    (QK^T and PV: 4 * context * d_attn FLOPs forward, average causal context S/2, x3).
    T = global batch x sequence length.
    """
    h, L, S = args.hidden_size, args.num_layers, args.seq_length
    d_q = args.num_attention_heads * args.kv_channels
    d_kv = args.num_query_groups * args.kv_channels
    mlp = h * args.ffn_hidden_size * (3 if args.swiglu else 2)
    n_matmul = L * (h * d_q + 2 * h * d_kv + d_q * h + mlp) + h * vocab_size
    tokens = args.global_batch_size * S
    return tokens * (6.0 * n_matmul + 6.0 * L * S * d_q)


# -------------------------------------------------------------------------------------- data
class MicroBatches:
    """Megatron's pretraining sampler: iteration ``i`` consumes global samples
    ``[consumed, consumed + global_batch)``; micro-batch ``m`` of DP rank ``d`` takes
    ``consumed + m * mbs * dp + d * mbs + [0, mbs)``. All TP and CP ranks of a DP rank read the
    same samples (each from the memory-mapped dataset; Megatron-LM broadcasts from TP rank 0)."""

    def __init__(self, dataset, mbs: int, dp: int, dp_rank: int, consumed: int = 0):
        self.ds, self.mbs, self.dp, self.dp_rank, self.consumed = dataset, mbs, dp, dp_rank, consumed

    def next_global_batch(self, num_micro: int) -> list[dict]:
        import numpy as np
        import torch

        out = []
        for m in range(num_micro):
            base = self.consumed + m * self.mbs * self.dp + self.dp_rank * self.mbs
            samples = [self.ds[(base + j) % len(self.ds)] for j in range(self.mbs)]
            out.append({k: torch.stack([torch.as_tensor(np.asarray(s[k])) if not torch.is_tensor(s[k])
                                        else s[k] for s in samples])
                        for k in samples[0]})
        self.consumed += num_micro * self.mbs * self.dp
        return out


def split_for_cp(args, batch: dict, device) -> dict:
    """This CP rank's part of a micro-batch, moved to ``device``."""
    from megatron.core import parallel_state as ps

    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "attention_mask"}
    if args.cp_attention == "te":
        from megatron.core.utils import get_batch_on_this_cp_rank  # Megatron's zigzag split

        return get_batch_on_this_cp_rank(batch)
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.megatron.batch import get_batch_on_this_cp_rank_striped

    layout = Layout(args.cp_layout, args.context_parallel_size, args.cp_granularity)
    return get_batch_on_this_cp_rank_striped(batch, layout, ps.get_context_parallel_rank())


# ------------------------------------------------------------------------------ train / eval
def forward_backward(args, model, optimizer, micro_batches: list[dict], device, train: bool):
    """Run all micro-batches of one global batch; returns (loss sum, token count) over DP x CP.

    With ``train=True`` each micro-batch back-propagates ``sum(loss*mask) / N_global`` (see the
    module docstring); gradients accumulate in DDP's buffers and are reduced afterwards.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    local = [split_for_cp(args, b, device) for b in micro_batches]
    count = torch.stack([b["loss_mask"].float().sum() for b in local]).sum().to(torch.float64)
    count_global = count.clone()
    dist.all_reduce(count_global, group=dp_cp)  # exact token count of the whole global batch
    denom = count_global.clamp(min=1.0).float()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, b in enumerate(local):
        last = i == len(local) - 1
        sync = model.no_sync() if (train and not last and hasattr(model, "no_sync")) else contextlib.nullcontext()
        with sync:
            per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # [b, s_local]
            # torch.where, not multiply: a non-finite loss at a masked position must not leak (NaN*0)
            masked = torch.where(b["loss_mask"] > 0, per_token.float() * b["loss_mask"].float(),
                                 torch.zeros((), device=per_token.device))
            s = masked.sum()
            if train:
                optimizer.scale_loss(s / denom).backward()
        loss_sum += s.detach().to(torch.float64)
    dist.all_reduce(loss_sum, group=dp_cp)
    return loss_sum, count_global


def evaluate(args, model, optimizer, valid_iter: MicroBatches, device) -> Optional[float]:
    import torch

    if valid_iter is None or args.eval_iters == 0:
        return None
    model.eval()
    tot, cnt = 0.0, 0.0
    with torch.no_grad():
        for _ in range(args.eval_iters):
            s, n = forward_backward(args, model, optimizer, valid_iter.next_global_batch(args.num_microbatches),
                                    device, train=False)
            tot, cnt = tot + s.item(), cnt + n.item()
    model.train()
    return tot / max(cnt, 1.0)


# ------------------------------------------------------------------------------- checkpoints
def _rank_file(args) -> str:
    from megatron.core import parallel_state as ps

    return (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_cp_{ps.get_context_parallel_rank():02d}"
            f"_dp_{ps.get_data_parallel_rank():03d}.pt")


def save_checkpoint(args, iteration: int, model, optimizer, scheduler) -> str:
    import torch
    import torch.distributed as dist

    ckpt_dir = os.path.join(args.save, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    meta = {"iteration": iteration, "checkpoint_version": 3.0, "ckpt_format": args.ckpt_format,
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}}
    if args.ckpt_format == "torch_dist":
        from megatron.core import dist_checkpointing

        from megatron_mtraining.megatron.cpu_compat import patch_missing_psutil

        patch_missing_psutil()  # else the checkpoint writer dies without psutil and the save hangs
        model_sd = model.module.sharded_state_dict()
        state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd),
                 "opt_param_scheduler": scheduler.state_dict(), **meta}
        dist_checkpointing.save(state, ckpt_dir)
    else:  # fallback: one plain torch.save file per rank (same parallel layout required to load)
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "opt_param_scheduler": scheduler.state_dict(), **meta},
                   os.path.join(ckpt_dir, _rank_file(args)))
    dist.barrier()
    if dist.get_rank() == 0:
        Path(args.save, "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return ckpt_dir


# --load of a converted checkpoint must describe the same network as the command line
ARCH_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
             "kv_channels", "normalization", "swiglu", "disable_bias_linear", "position_embedding_type",
             "untie_embeddings_and_output_weights", "padded_vocab_size")


def check_release_args(args, saved: dict, vocab: int, ckpt_dir: str) -> None:
    """Exit with a message naming the flag when a release checkpoint's network differs from ``args``."""
    mine = {**{k: getattr(args, k, None) for k in ARCH_KEYS}, "padded_vocab_size": vocab}
    bad = [f"--{k.replace('_', '-')} {mine[k]!r} (checkpoint: {saved[k]!r})"
           for k in ARCH_KEYS if k in saved and saved[k] != mine[k]]
    if bad:
        raise SystemExit(f"pretrain_gpt.py: error: --load {args.load}: {ckpt_dir} holds a different network: "
                         + "; ".join(bad) + " (see the flags file next to the checkpoint)")


# scheduler state (megatron-core OptimizerParamScheduler.state_dict) -> the flags that set it
SCHEDULE_FLAGS = {"wd_incr_steps": "--train-iters", "lr_decay_steps": "--lr-decay-iters (default --train-iters)",
                  "lr_warmup_steps": "--lr-warmup-iters", "max_lr": "--lr", "min_lr": "--min-lr",
                  "lr_decay_style": "--lr-decay-style", "start_wd": "--weight-decay", "end_wd": "--weight-decay"}


def check_resume_schedule(args, scheduler, saved: dict, ckpt_dir: str) -> None:
    """Exit with a message naming the flag when resuming ``ckpt_dir`` with another LR / weight-decay
    schedule (megatron-core would silently take the checkpoint's; steps count samples, so
    ``--global-batch-size`` enters them too)."""
    mine = scheduler.state_dict()
    bad = [f"{flag} (run: {mine[k]!r}, checkpoint: {saved[k]!r})" for k, flag in SCHEDULE_FLAGS.items()
           if k in saved and k in mine and saved[k] != mine[k]]
    if bad:
        raise SystemExit(f"pretrain_gpt.py: error: --load {args.load}: {ckpt_dir} was saved with another schedule: "
                         + "; ".join(bad) + " (steps are samples: iterations x --global-batch-size); resume with "
                         "the flags of the run that saved it")


def load_checkpoint(args, model, optimizer, scheduler, vocab: Optional[int] = None) -> int:
    """Restore from ``--load`` (latest iteration); returns the iteration (0 if nothing to load).

    Megatron-LM's *release* convention is honoured: when ``latest_checkpointed_iteration.txt``
    reads ``release`` (converted weights, e.g. ``tools/convert_smollm2.py``), only the model is
    loaded from ``LOAD/release`` (its architecture must match the flags, see
    :func:`check_release_args`); the optimizer, LR schedule and iteration start fresh at 0.
    """
    import torch

    tracker = Path(args.load, "latest_checkpointed_iteration.txt")
    if not tracker.is_file():
        log0(f" > no checkpoint found under --load {args.load} ({tracker.name} missing); starting from scratch")
        return 0
    if tracker.read_text().strip() == "release":
        ckpt_dir = os.path.join(args.load, "release")
        if args.ckpt_format == "torch_dist":
            from megatron.core import dist_checkpointing

            check_release_args(args, dist_checkpointing.load_common_state_dict(ckpt_dir).get("args", {}),
                               vocab, ckpt_dir)
            state = dist_checkpointing.load({"model": model.module.sharded_state_dict()}, ckpt_dir)
        else:
            state = torch.load(os.path.join(ckpt_dir, _rank_file(args)), map_location="cpu", weights_only=False)
            check_release_args(args, state.get("args", {}), vocab, ckpt_dir)
        model.module.load_state_dict(state["model"])
        # The optimizer was built before the load: with --bf16/--fp16 it holds fp32 main copies of
        # the *initial* weights, and its first step would write them back over the loaded model.
        # Refresh them from the loaded parameters (Megatron-LM does the same when it loads a model
        # without its optimizer).
        if optimizer is not None:
            optimizer.reload_model_params()
        log0(f" > loaded release checkpoint {ckpt_dir} (model weights only; optimizer, LR schedule and "
             "iteration start fresh)")
        return 0
    iteration = int(tracker.read_text().strip())
    ckpt_dir = os.path.join(args.load, f"iter_{iteration:07d}")
    if args.ckpt_format == "torch_dist":
        from megatron.core import dist_checkpointing

        model_sd = model.module.sharded_state_dict()
        template = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}
        state = dist_checkpointing.load(template, ckpt_dir)
        common = dist_checkpointing.load_common_state_dict(ckpt_dir)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        check_resume_schedule(args, scheduler, common["opt_param_scheduler"], ckpt_dir)
        scheduler.load_state_dict(common["opt_param_scheduler"])
    else:
        state = torch.load(os.path.join(ckpt_dir, _rank_file(args)), map_location="cpu", weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        check_resume_schedule(args, scheduler, state["opt_param_scheduler"], ckpt_dir)
        scheduler.load_state_dict(state["opt_param_scheduler"])
    log0(f" > loaded checkpoint {ckpt_dir} (iteration {iteration})")
    return iteration


def checkpoint_dir(load_dir: str, iteration: Optional[int] = None) -> tuple[str, Any]:
    """``(directory, iteration)`` of a checkpoint under ``load_dir``: ``iter_XXXXXXX`` of ``iteration``
    (default: ``latest_checkpointed_iteration.txt``; ``release`` there means ``load_dir/release``).

    Raises:
        FileNotFoundError: no tracker file / no such directory.
    """
    if iteration is None:
        tracker = Path(load_dir, "latest_checkpointed_iteration.txt")
        if not tracker.is_file():
            raise FileNotFoundError(f"{load_dir}: not a checkpoint directory ({tracker.name} missing)")
        text = tracker.read_text().strip()
        iteration = "release" if text == "release" else int(text)
    d = os.path.join(load_dir, "release" if iteration == "release" else f"iter_{iteration:07d}")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{d}: checkpoint of iteration {iteration} not found")
    return d, iteration


def load_model_weights(load_dir: str, model, ckpt_format: str = "torch_dist",
                       iteration: Optional[int] = None) -> tuple[str, Any]:
    """Load only the model weights of a checkpoint (evaluation; see :func:`checkpoint_dir`).

    Args:
        load_dir: the ``--save`` directory (holds ``latest_checkpointed_iteration.txt``).
        model: the unwrapped model of :func:`build_model` (GPTModel or Float16Module, no DDP).
        ckpt_format: ``torch_dist`` or ``torch`` (as saved; any CP/DP size at TP=1).
        iteration: which ``iter_XXXXXXX`` to load (default: the latest).

    Returns:
        ``(checkpoint directory, iteration)``.
    """
    import torch

    ckpt_dir, iteration = checkpoint_dir(load_dir, iteration)
    if ckpt_format == "torch_dist":
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)
    else:  # every CP/DP rank holds the full model at TP=1: take TP 0 / CP 0 / DP 0's file
        state = torch.load(os.path.join(ckpt_dir, "mp_rank_00_cp_00_dp_000.pt"), map_location="cpu",
                           weights_only=False)
    model.load_state_dict(state["model"])
    return ckpt_dir, iteration


# ---------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    t_start = time.time()     # --exit-duration-in-mins counts from here (Megatron-LM: start of pretrain)
    args = parse_args(argv)  # exits with status 2 and "error: --flag ..." on a bad command line
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)

    import torch
    import torch.distributed as dist

    device = init_distributed(args)

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_seed

    patches = apply_cpu_patches()  # [] on CUDA
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 context_parallel_size=args.context_parallel_size,
                                 hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes)
    cpu_seed(args.seed)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    tokenizer = build_tokenizer(args)
    vocab = padded_vocab_size(tokenizer.vocab_size, args)
    train_ds, valid_ds = build_datasets(args, tokenizer)

    config = transformer_config(args)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = build_model(args, config, vocab, device)
    n_params = count_params(model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=args.bf16 or args.fp16,
                                               overlap_grad_reduce=False, use_distributed_optimizer=False)
    model = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
        loss_scale=args.loss_scale, use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
    )
    start_iter = load_checkpoint(args, model, optimizer, scheduler, vocab) if args.load else 0

    log0(f" > world {args.world_size} = TP {args.tensor_model_parallel_size} x CP {args.context_parallel_size}"
         f" x DP {dp} | device {device.type} ({args.distributed_backend or dist.get_backend()})"
         f" | cp-attention {args.cp_attention} (layout {args.cp_layout}"
         f"{', granularity ' + str(args.cp_granularity) if args.cp_layout == 'striped' else ''}"
         + (f", implementation {args.mtraining.implementation}, pattern {args.mtraining.pattern}"
            + (f", columns {args.mtraining.columns}" if args.mtraining.sparse else "")
            + (f", hierarchical {args.hierarchical_context_parallel_sizes}"
               if args.hierarchical_context_parallel_sizes else "") if args.mtraining else "") + ")")
    log0(f" > model: {n_params / 1e6:.2f}M parameters (vocab {tokenizer.vocab_size} padded to {vocab}), "
         f"dtype {config.params_dtype}, micro-batches per iteration {args.num_microbatches}, "
         f"train samples {len(train_ds)}, valid samples {len(valid_ds) if valid_ds is not None else 0}")
    if patches:
        log0(f" > CPU shims for megatron-core: {', '.join(patches)}")

    train_iter = MicroBatches(train_ds, args.micro_batch_size, dp, dp_rank, consumed=start_iter * gbs)
    valid_consumed = (start_iter // args.eval_interval) * args.eval_iters * gbs  # evaluations already run
    valid_iter = (MicroBatches(valid_ds, args.micro_batch_size, dp, dp_rank, consumed=valid_consumed)
                  if valid_ds is not None else None)
    flops_iter = flops_per_iteration(args, vocab)
    metrics_f = open(args.metrics_file, "a") if (args.metrics_file and dist.get_rank() == 0) else None
    tb = None
    if args.tensorboard_dir and dist.get_rank() == 0:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(log_dir=args.tensorboard_dir)

    model.train()
    acc_loss, acc_n, acc_time, acc_iters = 0.0, 0, 0.0, 0
    t_train = time.perf_counter()
    iteration = start_iter
    saved_iter = start_iter                        # last iteration already on disk (no second save of it)
    while iteration < args.train_iters:
        t0 = time.perf_counter()
        micro = train_iter.next_global_batch(args.num_microbatches)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss_sum, n_tok = forward_backward(args, model, optimizer, micro, device, train=True)
        finalize_model_grads([model])
        lr = optimizer.param_groups[0]["lr"]
        update_ok, grad_norm, _ = optimizer.step()
        if update_ok:
            scheduler.step(increment=gbs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        iteration += 1
        loss = (loss_sum / n_tok.clamp(min=1)).item()
        acc_loss, acc_n, acc_time, acc_iters = acc_loss + loss, acc_n + 1, acc_time + dt, acc_iters + 1
        if metrics_f:
            metrics_f.write(json.dumps({"iteration": iteration, "lm_loss": loss, "grad_norm": grad_norm,
                                        "lr": lr, "tokens": int(n_tok.item()), "time_s": dt,
                                        "model_flops": flops_iter,
                                        "max_memory_allocated": (torch.cuda.max_memory_allocated(device)
                                                                 if device.type == "cuda" else None)}) + "\n")
            metrics_f.flush()
        if tb is not None:                        # Megatron-LM's scalar names
            tb.add_scalar("lm loss", loss, iteration)
            tb.add_scalar("learning-rate", lr, iteration)
            if grad_norm is not None:
                tb.add_scalar("grad-norm", grad_norm, iteration)
            tb.add_scalar("throughput/tokens-per-sec-per-gpu", gbs * args.seq_length / dt / args.world_size, iteration)
            tb.add_scalar("throughput/tflops-per-gpu", flops_iter / dt / args.world_size / 1e12, iteration)
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            t_it = acc_time / acc_iters
            tok_s = gbs * args.seq_length / t_it / args.world_size
            tflops = flops_iter / t_it / args.world_size / 1e12
            gn = f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else ""
            scale = f" loss scale: {optimizer.get_loss_scale().item():.1f} |" if args.fp16 else ""
            log0(f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
                 f" consumed samples: {iteration * gbs:12d} | elapsed time per iteration (ms): {t_it * 1000:.1f} |"
                 f" learning rate: {lr:.6E} | global batch size: {gbs:5d} | lm loss: {acc_loss / acc_n:.6E} |"
                 f"{scale}{gn} tokens/s/GPU: {tok_s:.1f} | TFLOP/s/GPU: {tflops:.2f} |")
            acc_loss, acc_n, acc_time, acc_iters = 0.0, 0, 0.0, 0
        if args.eval_iters > 0 and valid_iter is not None and iteration % args.eval_interval == 0:
            vl = evaluate(args, model, optimizer, valid_iter, device)
            if tb is not None:
                tb.add_scalar("lm loss validation", vl, iteration)
            log0(f" validation loss at iteration {iteration} | lm loss value: {vl:.6E} |"
                 f" lm loss PPL: {math.exp(min(vl, 20)):.6E} |")
        if args.save and args.save_interval and iteration % args.save_interval == 0 and iteration < args.train_iters:
            log0(f" > saved checkpoint {save_checkpoint(args, iteration, model, optimizer, scheduler)}")
            saved_iter = iteration
        if iteration < args.train_iters and (args.exit_interval or args.exit_duration_in_mins):
            reason = None
            if args.exit_interval and iteration % args.exit_interval == 0:
                reason = f"--exit-interval {args.exit_interval}"
            elif args.exit_duration_in_mins:
                # every rank must take the same decision: the slowest clock decides (all-reduce MAX)
                mins = torch.tensor([(time.time() - t_start) / 60.0], dtype=torch.float64, device=device)
                dist.all_reduce(mins, op=dist.ReduceOp.MAX)
                if mins.item() > args.exit_duration_in_mins:
                    reason = f"--exit-duration-in-mins {args.exit_duration_in_mins:g} ({mins.item():.2f} min elapsed)"
            if reason:
                log0(f" > exiting after iteration {iteration} ({reason})")
                break

    log0(f" > training done: {iteration - start_iter} iterations in {time.perf_counter() - t_train:.1f} s")
    if args.save and iteration > saved_iter:
        log0(f" > saved checkpoint {save_checkpoint(args, iteration, model, optimizer, scheduler)}")
    if metrics_f:
        metrics_f.close()
    if tb is not None:
        tb.close()
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

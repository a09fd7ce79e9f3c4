"""Command line of ``examples/pretrain_gpt.py``: Megatron-LM flag names plus the CP-attention flags.

Only the flags listed here exist; anything else is rejected by argparse ("unrecognized
arguments: --flag"). :func:`validate_args` checks everything that can be checked without
starting distributed training (files, divisibility rules, Transformer Engine availability) and
:func:`parse_args` turns a failure into ``parser.error`` (exit status 2, message naming the flag).

Differences from Megatron-LM defaults (documented in ``--help``): ``--attention-dropout`` and
``--hidden-dropout`` default to 0.0 (the ring kernels have no attention dropout), the data loader
never builds a dense attention mask (``--no-create-attention-mask-in-dataloader`` is accepted and
is always in effect), and the loss is always the exact per-token mean over the global batch
(Megatron's ``--calculate-per-token-loss`` semantics; accepted as a no-op).

This module does not import megatron.core (fast ``--help`` and argument errors).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["build_parser", "parse_args", "validate_args", "apply_mtraining_config", "ArgumentValidationError",
           "world_size_from_env"]

CP_ATTENTION_CHOICES = ("mtraining", "te")
CP_LAYOUT_CHOICES = ("striped", "zigzag")
DEFAULT_CP_GRANULARITY = 64     # --cp-granularity when neither the flag nor a config gives one
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")   # Megatron-LM's --exit-signal choices
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer")
# HuggingFaceTokenizer: --tokenizer-model is a tokenizer.json (or a directory holding one), loaded with the
# `tokenizers` library (megatron_mtraining.megatron.hf_tokenizer); the others: a sentencepiece .model file.


class ArgumentValidationError(ValueError):
    """An inconsistent or invalid command line; the message names the offending flag(s)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (Megatron-LM names, ``--foo-bar`` -> ``args.foo_bar``)."""
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT pretraining on megatron-core with the MTraining context-parallel attention.",
        allow_abbrev=False,
    )
    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default 4*hidden (with --swiglu: 8/3*hidden rounded down to a multiple of 64)")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden/heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1, help="used with --group-query-attention")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.0,
                   help="must be 0 with --cp-attention mtraining (Megatron-LM default: 0.1)")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="(Megatron-LM default: 0.1)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages: megatron-core's 1F1B schedule over the micro-batches of each "
                        "global batch; --num-layers is split evenly (must be divisible); checkpoints need "
                        "--ckpt-format torch_dist")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism: the layer norms, dropout and residuals of each rank's "
                        "CP chunk are split along the sequence over the TP group (needs "
                        "--tensor-model-parallel-size > 1)")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-attention", choices=CP_ATTENTION_CHOICES, default="mtraining",
                   help="core attention under CP: mtraining (ring attention, striped layout; runs on CPU "
                        "and GPU) or te (Transformer Engine's TEDotProductAttention, zigzag layout; needs TE)")
    g.add_argument("--cp-layout", choices=CP_LAYOUT_CHOICES, default=None,
                   help="sequence layout across CP ranks (default: striped for mtraining; te needs zigzag; a "
                        "--mtraining-config sets it, and a different explicit value is an error)")
    g.add_argument("--cp-granularity", type=int, default=None,
                   help="striped chunk size in tokens (default 64; a --mtraining-config sets it, and a different "
                        "explicit value is an error; an error with the zigzag layout, which has none)")
    g.add_argument("--mtraining-config", default=None, metavar="YAML",
                   help="MTraining config (configs/*.yaml): implementation striped|zigzag|hierarchical, "
                        "pattern dense|vertical_slash and its budgets, granularity; sets the CP layout")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None,
                   metavar="SIZE", help="INNER OUTER: two-level ring (inner = intra-node CP ranks, outer = "
                                        "nodes); Megatron's hierarchical CP groups")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="activation recomputation (megatron-core's): selective recomputes the core attention "
                        "in the backward pass, full recomputes whole layers (--recompute-method, "
                        "--recompute-num-layers); CPU and GPU")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state and fp32 main parameters over the data-parallel group "
                        "(with CP: the DP x CP group), megatron-core's DistributedOptimizer (ZeRO-1)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="timeout of every process group (default, TP, CP, DP, hierarchical CP), in whole minutes "
                        "(Megatron-LM's unit): a rank that died, raised or is stuck ends the others' waits "
                        "within it, with an error naming the operation and the peer ranks")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro*dp")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default: dynamic for fp16)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="--fp16 dynamic loss scaling: the first scale (default 2^32)")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="--fp16 dynamic loss scaling: the scale never goes below this (default 1)")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="--fp16 dynamic loss scaling: double the scale after this many updates without "
                        "overflow (default 1000)")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="--fp16 dynamic loss scaling: halve the scale after this many overflows (default 2)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="accepted for compatibility: the loss is always the exact global per-token mean")
    g.add_argument("--cross-entropy-chunk-tokens", type=_chunk_tokens, default="auto", metavar="auto|0|N",
                   help="LM-head loss in chunks of N sequence positions, recomputed in the backward, so that at most one "
                        "chunk's logits are alive (megatron_mtraining.megatron.lm_loss); auto (default): chunk "
                        "when a micro-batch's fp32 logits exceed 1 GiB (never with --sequence-parallel); 0: never")
    from megatron_mtraining.megatron.lm_loss_check import LM_LOSS_IMPLS

    g.add_argument("--lm-loss", choices=LM_LOSS_IMPLS, default="megatron",
                   help="(not a Megatron-LM flag) the LM-head loss: megatron (default): megatron-core's "
                        "vocabulary-parallel cross entropy, chunked per --cross-entropy-chunk-tokens; liger: "
                        "Liger-Kernel's fused linear cross entropy (the [liger] extra; no fp32 logits; "
                        "tensor-parallel size 1, CUDA)")
    g.add_argument("--no-rope-fusion", dest="rope_fusion", action="store_false",
                   help="unfused RoPE (megatron-core's element-wise ops). Default with CUDA: fused, by Transformer "
                        "Engine's kernel or, without it, megatron_mtraining.megatron.fusions (torch.compile); the "
                        "CPU always runs unfused")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="unfused SwiGLU. Default with CUDA and --swiglu: megatron-core's fused bias_swiglu_impl "
                        "(torch.compile); the CPU always runs unfused")
    g.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="stop the run (before the optimizer step, on every rank, exit status 1) when the loss or a "
                        "gradient is NaN/Inf, naming the iteration and the first offending parameter; "
                        "--no-check-for-nan-in-loss-and-grad turns it off (default: on)")

    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed-dataset prefix(es) (PREFIX or W1 PREFIX1 W2 PREFIX2 ...)")
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=0, help="(unused: samples are read in-process)")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_true",
                   help="accepted for compatibility: a dense mask is never built")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="attention stays inside each document (documents end at EOD tokens; "
                        "--cp-attention mtraining, dense pattern)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions (RoPE angles) restart at every document (--cp-attention mtraining)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="SentencePieceTokenizer",
                   help="HuggingFaceTokenizer: a tokenizer.json (tokenizers library, e.g. from "
                        "tools/convert_smollm2.py); the others: a sentencepiece model")
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model file, or for HuggingFaceTokenizer a tokenizer.json file or a "
                        "directory holding one")

    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (saving a checkpoint when --save is given) after the iteration that is a multiple "
                        "of this (Megatron-LM)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (saving a checkpoint when --save is given) after the first iteration that ends "
                        "more than this many minutes after the script started; ranks agree (Megatron-LM)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on the --exit-signal (default SIGTERM), finish the current iteration, save a checkpoint "
                        "when --save is given and exit with status 0; the signal reaching any rank stops every "
                        "rank after the same iteration (Megatron-LM)")
    g.add_argument("--exit-signal", choices=EXIT_SIGNALS, default=None,
                   help="the signal of --exit-signal-handler (default SIGTERM; Slurm's --signal=USR1@SECONDS "
                        "sends SIGUSR1 before the time limit) (Megatron-LM)")
    g.add_argument("--load", default=None)
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="with --load: take the LR / weight-decay schedule of this command line (--lr, --min-lr, "
                        "--lr-decay-style, --lr-decay-iters, --lr-warmup-iters, --weight-decay, --train-iters), not "
                        "the checkpoint's; the step count is the checkpoint's. E.g. to extend a run with a larger "
                        "--train-iters (Megatron-LM)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="with --load: keep the checkpoint's LR / weight-decay schedule whatever the schedule flags "
                        "of this command line say (Megatron-LM). Without either flag, a schedule that differs from "
                        "the checkpoint's is an error naming the flag")
    g.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="torch_dist: megatron.core dist_checkpointing; torch: one torch.save file per rank")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None,
                   help="write tensorboard scalars (lm loss, learning rate, grad norm, throughput, "
                        "validation loss) here (rank 0)")
    g.add_argument("--metrics-file", default=None,
                   help="(not a Megatron-LM flag) rank 0 writes one JSON line per iteration (iteration, lm_loss, "
                        "grad_norm, lr, tokens, time_s, model_flops, max_memory_allocated; with sparse layers "
                        "also attention_kept, attention_kept_min, attention_kept_max, attention_kept_layers; "
                        "full precision). An "
                        "existing file is appended to, never truncated, and the run logs that it appends "
                        "('> --metrics-file FILE: appending to an existing file ...'): a run resumed with --load "
                        "adds its rows after the earlier run's, and iterations repeated after a resume appear "
                        "twice (the last row of an iteration is the current one). Use a new file for a new run.")
    return p


def _cp_granularity(args: argparse.Namespace) -> int:
    """``--cp-granularity``, or its default when not given."""
    return DEFAULT_CP_GRANULARITY if args.cp_granularity is None else args.cp_granularity


def world_size_from_env() -> int:
    """``WORLD_SIZE`` as set by torchrun (1 when absent)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _data_prefixes(data_path: Sequence[str]) -> list[str]:
    if len(data_path) == 1:
        return list(data_path)
    if len(data_path) % 2:
        raise ArgumentValidationError(
            "--data-path: expected PREFIX or weight/prefix pairs (W1 PREFIX1 W2 PREFIX2 ...), "
            f"got {len(data_path)} values")
    for w in data_path[0::2]:
        try:
            float(w)
        except ValueError:
            raise ArgumentValidationError(f"--data-path: weight {w!r} is not a number") from None
    return list(data_path[1::2])


def parse_split(split: str) -> list[float]:
    """``"969, 30, 1"`` -> normalized ``[train, valid, test]`` fractions."""
    parts = [s.strip() for s in split.replace("/", ",").split(",") if s.strip()]
    try:
        vals = [float(s) for s in parts]
    except ValueError:
        raise ArgumentValidationError(f"--split {split!r}: expected comma-separated numbers") from None
    if not 1 <= len(vals) <= 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise ArgumentValidationError(f"--split {split!r}: expected 1 to 3 non-negative numbers with a positive sum")
    vals += [0.0] * (3 - len(vals))
    return [v / sum(vals) for v in vals]


def _chunk_tokens(text: str):
    """``--cross-entropy-chunk-tokens``: ``"auto"`` or an int >= 0."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected auto, 0 or a positive number of tokens, got {text!r}")
    return n


def validate_args(args: argparse.Namespace, world_size: Optional[int] = None,
                  te_importable: Optional[bool] = None, check_files: bool = True,
                  cuda: Optional[bool] = None) -> argparse.Namespace:
    """Check and complete ``args`` in place (derived defaults, ``args.data_parallel_size`` ...).

    Args:
        args: parsed arguments.
        world_size: number of ranks (default: ``WORLD_SIZE`` from the environment).
        te_importable: override Transformer Engine detection (tests).
        check_files: check the tokenizer, data and ``--load`` paths (``False``: tools that feed the
            model synthetic tokens, e.g. ``tools/profile_step.py``).
        cuda: whether the ranks run on CUDA (``None``: ``torch.cuda.is_available()`` here), for the
            config's ``kernel_backend`` rules; ``True`` on a machine without a GPU checks a GPU launch
            (the Slurm scripts' dry run on a login node).

    Returns:
        ``args`` with ``ffn_hidden_size``, ``kv_channels``, ``max_position_embeddings``,
        ``global_batch_size``, ``lr_decay_iters``, ``cp_layout``, ``data_parallel_size``,
        ``num_microbatches``, ``world_size`` filled in.

    Raises:
        ArgumentValidationError: the message names the flag(s) and the violated rule.
    """
    from megatron_mtraining.layout import Layout

    E = ArgumentValidationError
    ws = world_size_from_env() if world_size is None else world_size
    args.world_size = ws
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    for flag, val in (("--num-layers", args.num_layers), ("--hidden-size", args.hidden_size),
                      ("--num-attention-heads", args.num_attention_heads), ("--seq-length", args.seq_length),
                      ("--micro-batch-size", args.micro_batch_size), ("--train-iters", args.train_iters),
                      ("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp),
                      ("--cp-granularity", _cp_granularity(args)),
                      ("--log-interval", args.log_interval),
                      ("--distributed-timeout-minutes", args.distributed_timeout_minutes)):
        if val is None or val < 1:
            raise E(f"{flag} must be >= 1, got {val}")
    pp = args.pipeline_model_parallel_size
    if pp < 1:
        raise E(f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    if pp > 1:
        if args.num_layers % pp != 0:
            raise E(f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})")
        if (args.save or args.load) and args.ckpt_format != "torch_dist":
            raise E(f"{'--save' if args.save else '--load'} with --pipeline-model-parallel-size {pp} needs "
                    f"--ckpt-format torch_dist (got {args.ckpt_format}: its per-rank files do not name the "
                    "pipeline stage)")
    if ws % (tp * cp * pp) != 0:
        raise E(f"world size {ws} is not divisible by --tensor-model-parallel-size ({tp}) x "
                f"--context-parallel-size ({cp})" + (f" x --pipeline-model-parallel-size ({pp})" if pp > 1 else ""))
    dp = ws // (tp * cp * pp)
    args.data_parallel_size = dp

    # --- model shape
    if args.hidden_size % args.num_attention_heads != 0 and args.kv_channels is None:
        raise E(f"--hidden-size ({args.hidden_size}) must be divisible by --num-attention-heads "
                f"({args.num_attention_heads}) (or set --kv-channels)")
    if args.num_attention_heads % tp != 0:
        raise E(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_query_groups < 1 or args.num_attention_heads % args.num_query_groups != 0:
        raise E(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({args.num_query_groups})")
    if args.num_query_groups % tp != 0 and tp % args.num_query_groups != 0:
        raise E(f"--num-query-groups ({args.num_query_groups}) and --tensor-model-parallel-size ({tp}) "
                "must divide one another")
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu
                                else 4 * args.hidden_size)
        args.ffn_hidden_size = max(args.ffn_hidden_size, 64 if args.swiglu else 1)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.position_embedding_type == "learned_absolute" and args.max_position_embeddings < args.seq_length:
        raise E(f"--max-position-embeddings ({args.max_position_embeddings}) must be >= --seq-length "
                f"({args.seq_length}) with learned_absolute position embeddings")
    if args.sequence_parallel and tp == 1:
        raise E("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence over the "
                "tensor-parallel group)")
    if args.sequence_parallel and (args.seq_length // cp) % tp != 0:
        raise E(f"--sequence-parallel: the {args.seq_length // cp} tokens of each CP rank (--seq-length "
                f"{args.seq_length} / --context-parallel-size {cp}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})")
    if args.sequence_parallel and args.cross_entropy_chunk_tokens not in ("auto", 0):
        raise E(f"--cross-entropy-chunk-tokens {args.cross_entropy_chunk_tokens} with --sequence-parallel: the "
                "chunked LM-head loss does not support sequence parallelism (use auto, which does not chunk "
                "with it, or 0)")
    if getattr(args, "lm_loss", "megatron") == "liger":
        if tp > 1:
            raise E(f"--lm-loss liger with --tensor-model-parallel-size {tp}: the fused loss needs the whole "
                    "vocabulary on each rank (use --lm-loss megatron with tensor parallelism)")
        if args.cross_entropy_chunk_tokens not in ("auto", 0):
            raise E(f"--cross-entropy-chunk-tokens {args.cross_entropy_chunk_tokens} with --lm-loss liger: the "
                    "chunk size applies to --lm-loss megatron (the fused loss sizes its own chunks)")
        from megatron_mtraining.megatron.lm_loss_check import liger_problem

        problem = liger_problem()          # the device is checked where the run starts (training.loop)
        if problem:
            raise E(problem)
    if args.ffn_hidden_size % tp != 0:
        raise E(f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by --tensor-model-parallel-size ({tp})")
    if args.bf16 and args.fp16:
        raise E("--bf16 and --fp16 are mutually exclusive")
    if args.loss_scale is not None and not (math.isfinite(args.loss_scale) and args.loss_scale > 0):
        raise E(f"--loss-scale must be a positive finite number, got {args.loss_scale}")
    if args.fp16 and args.loss_scale is None:       # dynamic loss scaling: the flags that drive it (else unused)
        for flag, value in (("--initial-loss-scale", args.initial_loss_scale),
                            ("--min-loss-scale", args.min_loss_scale)):
            if not (math.isfinite(value) and value > 0):
                raise E(f"{flag} must be a positive finite number, got {value}")
        if args.min_loss_scale > args.initial_loss_scale:
            raise E(f"--min-loss-scale ({args.min_loss_scale}) must not exceed --initial-loss-scale "
                    f"({args.initial_loss_scale})")
        for flag, value in (("--loss-scale-window", args.loss_scale_window), ("--hysteresis", args.hysteresis)):
            if not (value >= 1 and float(value).is_integer()):      # counts of updates / overflows
                raise E(f"{flag} must be a whole number >= 1, got {value}")

    # --- CP attention backend and layout
    if args.cp_attention == "te":
        if args.cp_layout not in (None, "zigzag"):
            raise E(f"--cp-attention te uses Transformer Engine's zigzag (DualChunkSwap) layout; "
                    f"--cp-layout {args.cp_layout} is not supported with it")
        if args.cp_granularity is not None:
            raise E(f"--cp-granularity {args.cp_granularity} applies to --cp-attention mtraining's striped layout "
                    "only; --cp-attention te uses the zigzag layout (no granularity): drop the flag")
        args.cp_layout = "zigzag"
        te_ok = _te_importable() if te_importable is None else te_importable
        if not te_ok:
            raise E("--cp-attention te requires Transformer Engine (transformer_engine.pytorch), which is "
                    f"not importable here{' (context-parallel size ' + str(cp) + ')' if cp > 1 else ''}; "
                    "use --cp-attention mtraining")
    if args.recompute_granularity == "full" and (args.recompute_method is None or args.recompute_num_layers is None):
        raise E("--recompute-granularity full needs --recompute-method {uniform,block} and --recompute-num-layers N")
    apply_mtraining_config(args, cp, cuda=cuda)   # mtraining: the layout rules are checked there
    if args.mtraining is None:                 # te: apply_mtraining_config gave the granularity its default
        try:
            Layout(args.cp_layout, cp_size=cp, granularity=args.cp_granularity).check_seq_len(args.seq_length)
        except ValueError as e:
            raise E(f"--seq-length {args.seq_length} with --context-parallel-size {cp}, --cp-layout "
                    f"{args.cp_layout}, --cp-granularity {args.cp_granularity}: {e}") from None

    # --- batch sizes and schedule
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        raise E(f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size "
                f"({args.micro_batch_size}) x data-parallel size ({dp} = world {ws} / (TP {tp} x CP {cp}" + (f" x PP {pp}" if pp > 1 else "") + "))")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise E(f"--lr ({args.lr}) and --min-lr ({args.min_lr}) must satisfy 0 <= min-lr <= lr")
    if args.lr_warmup_iters < 0:
        raise E(f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    if args.lr_decay_iters < 1:
        raise E(f"--lr-decay-iters must be >= 1, got {args.lr_decay_iters}")
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise E(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be < --lr-decay-iters ({args.lr_decay_iters}"
                f"{', the default: --train-iters' if args.lr_decay_iters == args.train_iters else ''}): the "
                "schedule warms up, then decays")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise E(f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    if args.exit_signal is not None and not args.exit_signal_handler:
        raise E(f"--exit-signal {args.exit_signal} has no effect without --exit-signal-handler")
    if args.exit_signal_handler and args.exit_signal is None:
        args.exit_signal = "SIGTERM"
    for flag, val in (("--save-interval", args.save_interval), ("--eval-interval", args.eval_interval),
                      ("--exit-interval", args.exit_interval)):
        if val is not None and val < 1:
            raise E(f"{flag} must be >= 1, got {val}")
    if args.eval_iters < 0:
        raise E(f"--eval-iters must be >= 0, got {args.eval_iters}")

    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise E("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other: the "
                "first takes this command line's LR schedule, the second the checkpoint's")

    if args.use_distributed_optimizer and (args.save or args.load):
        raise E(f"{'--save' if args.save else '--load'} with --use-distributed-optimizer: the example trainer does "
                "not checkpoint the distributed optimizer (megatron-core's sharded optimizer state cannot be "
                "reloaded here); train without --save/--load, or without --use-distributed-optimizer")

    # --- files
    if not check_files:
        args.split_fractions = parse_split(args.split)
        return args
    if args.tokenizer_model is None:
        raise E(f"--tokenizer-model is required with --tokenizer-type {args.tokenizer_type}")
    if args.tokenizer_type == "HuggingFaceTokenizer":
        tok = Path(args.tokenizer_model)
        if not (tok.is_file() or (tok / "tokenizer.json").is_file()):
            raise E(f"--tokenizer-model: no tokenizer.json at {args.tokenizer_model} (--tokenizer-type "
                    "HuggingFaceTokenizer takes a tokenizer.json file or a directory holding one)")
    elif not Path(args.tokenizer_model).is_file():
        raise E(f"--tokenizer-model: file not found: {args.tokenizer_model}")
    if not args.data_path:
        raise E("--data-path is required (indexed-dataset prefix, without .bin/.idx)")
    for prefix in _data_prefixes(args.data_path):
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                raise E(f"--data-path: {prefix + ext} not found (give the prefix without .bin/.idx)")
    args.split_fractions = parse_split(args.split)
    if args.load is not None and not Path(args.load).exists():
        raise E(f"--load: checkpoint directory not found: {args.load}")
    return args


def apply_mtraining_config(args: argparse.Namespace, cp: Optional[int] = None, cuda: Optional[bool] = None) -> None:
    """Resolve ``--mtraining-config`` / ``--hierarchical-context-parallel-sizes`` into ``args.mtraining``
    (a validated :class:`~megatron_mtraining.config.MTrainingConfig`, hierarchical sizes filled in;
    ``None`` with ``--cp-attention te``) and the layout flags (``cp_layout``, ``cp_granularity``).

    Part of :func:`validate_args`; tools that build a namespace from :func:`build_parser` without
    the data and tokenizer files call it directly. ``cp`` is the context-parallel size (default:
    ``args.context_parallel_size``); ``cuda`` as for :func:`validate_args`.

    The rules are :func:`megatron_mtraining.plan.config_from_args`, shared with the Megatron-LM patch:
    without a config the run is the dense ring on ``--cp-layout``, and hierarchical sizes alone
    select the dense hierarchical ring; a config fixes the layout (an explicit, different
    ``--cp-layout`` is an error) and must agree with the hierarchical sizes; hierarchical sizes with
    a flat config are an error (the run would silently use a flat ring).

    Raises:
        ArgumentValidationError: naming the flag or config key and the violated rule.
    """
    from megatron_mtraining.plan import config_from_args

    E = ArgumentValidationError
    cp = int(args.context_parallel_size) if cp is None else int(cp)
    hcp = args.hierarchical_context_parallel_sizes
    if hcp is not None and (len(hcp) != 2 or hcp[0] * hcp[1] != cp):
        raise E(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hcp))}: need INNER OUTER with "
                f"INNER*OUTER = --context-parallel-size {cp}")
    if args.cp_attention != "mtraining":
        if args.mtraining_config:
            raise E("--mtraining-config needs --cp-attention mtraining")
        for flag in ("reset_attention_mask", "reset_position_ids"):
            if getattr(args, flag, False):
                raise E(f"--{flag.replace('_', '-')}: packed documents need --cp-attention mtraining (the te "
                        "path of this trainer has no document masks)")
        args.mtraining = None
        args.cp_granularity = _cp_granularity(args)
        return
    if args.mtraining_config is not None:
        try:
            from megatron_mtraining.config import load_mtraining_config

            load_mtraining_config(args.mtraining_config)
        except (ValueError, OSError) as e:
            raise E(f"--mtraining-config: {e}") from None
    try:
        cfg = config_from_args(args, cuda)
    except OSError as e:
        raise E(f"--mtraining-config: {e}") from None
    except ValueError as e:
        msg = str(e)
        if msg.startswith("--"):
            raise E(msg) from None
        src = args.mtraining_config or (f"--cp-layout {args.cp_layout or 'striped'} --cp-granularity "
                                        f"{_cp_granularity(args)}")
        raise E(f"--seq-length {args.seq_length} with --context-parallel-size {cp} and {src}: {msg}") from None
    args.cp_layout, args.cp_granularity = cfg.layout_kind, cfg.granularity
    sizes = cfg.hierarchical.sizes if cfg.implementation == "hierarchical" else None
    if sizes is not None:
        args.hierarchical_context_parallel_sizes = list(sizes)
    args.mtraining = cfg


def parse_args(argv: Optional[Sequence[str]] = None,
               world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate; on a bad command line print ``pretrain_gpt.py: error: ...`` and exit(2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args, world_size=world_size)
    except ArgumentValidationError as e:
        parser.error(str(e))
    return args

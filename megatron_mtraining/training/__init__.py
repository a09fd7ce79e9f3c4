"""GPT pretraining on megatron-core with the MTraining context-parallel attention, as a library.

Megatron-LM's ``pretrain_gpt.py`` is not on PyPI (the megatron-core wheel has no
``megatron.training``), so this is a compact trainer built on megatron.core only, with Megatron-LM
flag names (:mod:`megatron_mtraining.megatron.args`). ``examples/pretrain_gpt.py`` is its command
line; tools build on the same pieces::

    from megatron_mtraining.training import main, TrainHooks
    main(argv, hooks=TrainHooks(should_stop=lambda info: "budget" if info.time_s > 60 else None))

Modules (each imports megatron.core lazily, so ``--help`` and argument errors stay fast):

* ``parse_args`` / ``build_parser``: the flags (:mod:`megatron_mtraining.megatron.args`), validated before anything starts.
* :mod:`.runtime`: ``init_distributed`` (torchrun env; gloo on CPU, nccl on GPU), ``log0``.
* :mod:`.build`: tokenizer, padded vocabulary, ``TransformerConfig``, the CP plan (resolved once per
  run), GPTModel with the MTraining spec (``--cp-attention mtraining``: every CP rank holds the
  tokens ``Layout.positions(cp_rank, S)``; RoPE on the same positions) or the Transformer Engine
  spec (``te``), DDP + optimizer + LR scheduler, model FLOPs.
* :mod:`.data`: the ``.bin/.idx`` and token-id checks before training, GPTDataset splits, Megatron's pretraining sampler, the per-CP-rank batch split.
* :mod:`.step`: ``forward_backward`` / ``evaluate`` with the exact global per-token loss.
* :mod:`.checkpoint`: save/load with ``megatron.core.dist_checkpointing`` (or per-rank
  ``torch.save``), atomic saves (``iter_XXXXXXX.tmp`` renamed when complete, then the tracker),
  ``--load`` of the last complete checkpoint, release checkpoints (weights only), checks that name
  the mismatching flag.
* :mod:`.faults`: ``--check-for-nan-in-loss-and-grad`` (NaN/Inf loss or gradient) and the
  throughput-above-peak check, with the same verdict on every rank.
* :mod:`.stop`: ``--exit-interval``, ``--exit-duration-in-mins``, ``--exit-signal-handler`` and a caller's
  stop hook.
* :mod:`.metrics`: the Megatron-LM log line, ``--metrics-file`` JSON lines, TensorBoard scalars.
* :mod:`.loop`: ``train(args, hooks) -> TrainResult``, ``run(argv, hooks) -> TrainResult`` (parse +
  train) and ``main(argv, hooks) -> int``.
"""

from __future__ import annotations

from .build import (build_model, build_optimizer, build_plan, build_tokenizer, count_params,
                    flops_per_iteration, padded_vocab_size, transformer_config)
from .checkpoint import (checkpoint_dir, check_checkpoint_args, check_release_args, check_resume_position,
                         check_resume_schedule, is_complete_checkpoint, load_checkpoint, load_model_weights,
                         resolve_checkpoint, save_checkpoint)
from megatron_mtraining.megatron.args import build_parser, parse_args
from .data import CPBatchSplit, MicroBatches, build_datasets, check_data, check_indexed_dataset, effective_split
from .faults import NanGuard, ThroughputGuard, peak_tflops
from .loop import IterationInfo, TrainHooks, TrainResult, main, run, train
from .metrics import RunMetrics, open_metrics_file
from .runtime import init_distributed, log0
from .step import evaluate, forward_backward
from .stop import ExitSignalHandler, StopPolicy

__all__ = [
    "build_model", "build_optimizer", "build_plan", "build_tokenizer", "count_params", "flops_per_iteration",
    "padded_vocab_size", "transformer_config", "checkpoint_dir", "check_release_args", "check_resume_schedule",
    "check_resume_position", "check_checkpoint_args", "is_complete_checkpoint", "resolve_checkpoint",
    "load_checkpoint", "load_model_weights", "save_checkpoint", "build_parser", "parse_args", "CPBatchSplit",
    "MicroBatches", "build_datasets", "check_data", "check_indexed_dataset", "effective_split",
    "NanGuard", "ThroughputGuard", "peak_tflops", "IterationInfo", "TrainHooks", "TrainResult", "main",
    "run", "train", "RunMetrics", "open_metrics_file", "init_distributed", "log0", "evaluate",
    "forward_backward", "StopPolicy", "ExitSignalHandler",
]

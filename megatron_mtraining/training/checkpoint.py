"""Checkpoints of a training run.

``--ckpt-format torch_dist`` (default) saves model, optimizer, LR scheduler and the iteration with
``megatron.core.dist_checkpointing`` into ``SAVE/iter_XXXXXXX`` and writes
``SAVE/latest_checkpointed_iteration.txt``; it works on CPU/gloo. ``--ckpt-format torch`` is a
plain fallback: one ``torch.save`` file per rank (``mp_rank_TT_cp_CC_dp_DDD.pt``) that can only be
loaded with the same parallel layout. A ``release`` tracker (converted weights) loads the model only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from .runtime import log0

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_dir", "load_model_weights", "check_release_args",
           "check_resume_schedule", "ARCH_KEYS", "SCHEDULE_FLAGS"]


def _rank_file(args) -> str:
    from megatron.core import parallel_state as ps

    return (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_cp_{ps.get_context_parallel_rank():02d}"
            f"_dp_{ps.get_data_parallel_rank():03d}.pt")


def save_checkpoint(args, iteration: int, model, optimizer, scheduler) -> str:
    """Save model, optimizer, scheduler and ``iteration`` into ``--save``/``iter_XXXXXXX`` (every rank
    takes part) and then point ``latest_checkpointed_iteration.txt`` at it; returns the directory."""
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



"""Checkpoints of a training run.

``--ckpt-format torch_dist`` (default) saves model, optimizer, LR scheduler and the iteration with
``megatron.core.dist_checkpointing`` into ``SAVE/iter_XXXXXXX`` and writes
``SAVE/latest_checkpointed_iteration.txt``; it works on CPU/gloo. ``--ckpt-format torch`` is a
plain fallback: one ``torch.save`` file per rank (``mp_rank_TT_cp_CC_dp_DDD.pt``) that can only be
loaded with the same parallel layout. A ``release`` tracker (converted weights) loads the model only.

A save is atomic: everything is written into ``SAVE/iter_XXXXXXX.tmp``, flushed to disk
(``fsync`` of its files and directories), renamed to ``iter_XXXXXXX`` in one ``os.rename``, and only
then is the tracker replaced (written to a temporary file, ``fsync``, ``os.replace``). A process
killed at any point of a save therefore leaves either the previous checkpoint and tracker, or the
new ones; a directory named ``iter_XXXXXXX`` is always complete. :func:`resolve_checkpoint` picks
what ``--load`` resumes: the tracker's iteration when that checkpoint is complete, else the newest
complete ``iter_XXXXXXX``; ``*.tmp`` leftovers are ignored (and removed by the next save), and each
such decision is logged.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Union

from .runtime import log0

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_dir", "resolve_checkpoint", "is_complete_checkpoint",
           "load_model_weights", "check_release_args", "check_checkpoint_args", "check_resume_schedule",
           "check_resume_position", "check_resume_optimizer", "optimizer_state_saved", "ARCH_KEYS", "SCHEDULE_FLAGS",
           "TRACKER", "TMP_SUFFIX", "LAYER_DECISIONS_KEY"]

TRACKER = "latest_checkpointed_iteration.txt"
TMP_SUFFIX = ".tmp"                       # iter_XXXXXXX.tmp: a save in progress (or killed)
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def _rank_file(args) -> str:
    from megatron.core import parallel_state as ps

    return (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_cp_{ps.get_context_parallel_rank():02d}"
            f"_dp_{ps.get_data_parallel_rank():03d}.pt")


def _fsync_path(path: Union[str, Path]) -> None:
    """``fsync`` one file or directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """``fsync`` every file and directory under ``root`` (``root`` last)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def _commit_checkpoint(tmp_dir: str, final_dir: str) -> None:
    """Make the fully written ``tmp_dir`` the checkpoint ``final_dir`` (rank 0 only): flush it to
    disk, then one ``os.rename``. An existing ``final_dir`` (the same iteration saved again) is moved
    aside first and removed afterwards."""
    _fsync_tree(tmp_dir)
    old = None
    if os.path.exists(final_dir):
        old = final_dir + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    _fsync_path(os.path.dirname(final_dir) or ".")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_tracker(save_dir: str, iteration: Union[int, str]) -> None:
    """Point ``save_dir/latest_checkpointed_iteration.txt`` at ``iteration`` atomically (rank 0 only):
    write a temporary file, ``fsync`` it, ``os.replace`` it over the tracker, ``fsync`` the directory."""
    path = os.path.join(save_dir, TRACKER)
    tmp = path + TMP_SUFFIX
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(save_dir)


def _remove_incomplete(save_dir: str) -> None:
    """Remove ``iter_*.tmp`` (and ``iter_*.old``) directories that an interrupted save left in
    ``save_dir`` (rank 0 only), saying so in the log."""
    if not os.path.isdir(save_dir):
        return
    for name in sorted(os.listdir(save_dir)):
        if name.startswith("iter_") and name.endswith((TMP_SUFFIX, ".old")) and os.path.isdir(
                os.path.join(save_dir, name)):
            log0(f" > removing incomplete checkpoint {os.path.join(save_dir, name)} (left by a save that did "
                 "not finish)")
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


#: the checkpoint entry that holds the measured layer decisions of ``dense_layers: auto``
LAYER_DECISIONS_KEY = "mtraining_layer_decisions"


def save_checkpoint(args, iteration: int, model, optimizer, scheduler, plan=None) -> str:
    """Save model, optimizer, scheduler and ``iteration`` into ``--save``/``iter_XXXXXXX`` (every rank
    takes part) and then point ``latest_checkpointed_iteration.txt`` at it; returns the directory.

    ``plan``: the run's :class:`~megatron_mtraining.plan.CPPlan`; with ``dense_layers: auto`` its measured
    layer decisions, gathered from every rank (each pipeline stage holds its own layers), are saved too
    (``LAYER_DECISIONS_KEY``), so that :func:`load_checkpoint` resumes with the same attention per layer.

    Atomic (see the module docstring): the data goes to ``iter_XXXXXXX.tmp``, which is flushed and
    renamed once complete; the tracker is replaced after the rename. Leftover ``*.tmp`` directories
    of an earlier, interrupted save are removed first.
    """
    import torch
    import torch.distributed as dist

    ckpt_dir = os.path.join(args.save, f"iter_{iteration:07d}")
    tmp_dir = ckpt_dir + TMP_SUFFIX
    if dist.get_rank() == 0:
        os.makedirs(args.save, exist_ok=True)
        _remove_incomplete(args.save)
        os.makedirs(tmp_dir)
    dist.barrier()
    meta = {"iteration": iteration, "checkpoint_version": 3.0, "ckpt_format": args.ckpt_format,
            "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}}
    if plan is not None and plan.config.auto_dense_layers:
        meta[LAYER_DECISIONS_KEY] = [d.to_dict() for d in plan.layer_decisions(dist.group.WORLD)]
    if args.ckpt_format == "torch_dist":
        from megatron.core import dist_checkpointing

        from megatron_mtraining.megatron.cpu_compat import patch_missing_psutil

        patch_missing_psutil()  # else the checkpoint writer dies without psutil and the save hangs
        model_sd = model.module.sharded_state_dict()
        state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd),
                 "opt_param_scheduler": scheduler.state_dict(), **meta}
        dist_checkpointing.save(state, tmp_dir)   # shard files are fsynced by megatron-core's writer
    else:  # fallback: one plain torch.save file per rank (same parallel layout required to load)
        path = os.path.join(tmp_dir, _rank_file(args))
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "opt_param_scheduler": scheduler.state_dict(), **meta}, path)
        _fsync_path(path)
    dist.barrier()                                 # every rank's part is written
    if dist.get_rank() == 0:
        _commit_checkpoint(tmp_dir, ckpt_dir)
        _write_tracker(args.save, iteration)
    dist.barrier()
    return ckpt_dir


def is_complete_checkpoint(ckpt_dir: Union[str, Path]) -> bool:
    """Whether ``ckpt_dir`` holds a whole checkpoint: megatron-core's ``metadata.json`` (written
    last by ``dist_checkpointing.save``) for ``torch_dist``, or a ``mp_rank_*.pt`` file for
    ``torch``. Directories written by :func:`save_checkpoint` are complete by construction (atomic
    rename); this also rejects the half-written directories of a non-atomic writer."""
    d = Path(ckpt_dir)
    return d.is_dir() and ((d / "metadata.json").is_file() or any(d.glob("mp_rank_*.pt")))


def resolve_checkpoint(load_dir: Union[str, Path]) -> tuple[Union[int, str, None], list[str]]:
    """Which checkpoint of ``load_dir`` to resume: ``(iteration, notes)``.

    ``iteration`` is the tracker's (``latest_checkpointed_iteration.txt``) when that checkpoint is
    complete (``"release"`` for a release tracker), else the newest complete ``iter_XXXXXXX``, else
    ``None`` (nothing to load). ``notes`` are the log lines explaining what was skipped: ``*.tmp``
    directories of interrupted saves, incomplete directories, a missing or unreadable tracker, a
    tracker naming a missing checkpoint, complete checkpoints newer than the tracker (the tracker
    wins, so a tracker edited to go back is honoured).

    Raises:
        SystemExit: the tracker names a checkpoint that is missing or incomplete and no complete
            checkpoint is left to fall back on.
    """
    load_dir = str(load_dir)
    notes: list[str] = []
    complete: list[int] = []
    names = sorted(os.listdir(load_dir)) if os.path.isdir(load_dir) else []
    for name in names:
        path = os.path.join(load_dir, name)
        if name.startswith("iter_") and name.endswith((TMP_SUFFIX, ".old")) and os.path.isdir(path):
            notes.append(f" > ignoring incomplete checkpoint {path} (a save that did not finish)")
            continue
        m = _ITER_RE.match(name)
        if m and os.path.isdir(path):
            if is_complete_checkpoint(path):
                complete.append(int(m.group(1)))
            else:
                notes.append(f" > ignoring incomplete checkpoint {path} (no metadata.json / mp_rank_*.pt)")
    complete.sort()
    tracker = Path(load_dir, TRACKER)
    wanted: Union[int, str, None] = None
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            return "release", notes
        try:
            wanted = int(text)
        except ValueError:
            notes.append(f" > {tracker}: unreadable ({text[:40]!r})")
        if wanted is not None:
            if wanted in complete:
                newer = [i for i in complete if i > wanted]
                if newer:
                    notes.append(f" > {load_dir}: iter_{newer[-1]:07d} is newer than the tracker's iteration "
                                 f"{wanted}; the tracker wins")
                return wanted, notes
            notes.append(f" > {tracker} names iteration {wanted}, but {load_dir}/iter_{wanted:07d} is missing or "
                         "incomplete")
        if not complete:
            raise SystemExit(f"pretrain_gpt.py: error: --load {load_dir}: {tracker.name} reads {text[:40]!r} and no "
                             "complete checkpoint (iter_XXXXXXX with metadata.json or mp_rank_*.pt) is there")
    elif complete:
        notes.append(f" > {load_dir}: no {TRACKER}")
    if complete:
        notes.append(f" > resuming from the newest complete checkpoint {load_dir}/iter_{complete[-1]:07d}")
        return complete[-1], notes
    return None, notes


def _agreed_resolution(load_dir: str) -> tuple[Union[int, str, None], list[str]]:
    """:func:`resolve_checkpoint` on rank 0, broadcast so that every rank loads the same one; an
    error is raised on every rank."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return resolve_checkpoint(load_dir)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", resolve_checkpoint(load_dir))
        except SystemExit as e:
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise SystemExit(value)
    return value


# --load must describe the same network as the command line
ARCH_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
             "kv_channels", "normalization", "swiglu", "disable_bias_linear", "position_embedding_type",
             "untie_embeddings_and_output_weights", "padded_vocab_size")


def check_checkpoint_args(args, saved: dict, vocab: Optional[int], ckpt_dir: str) -> None:
    """Exit with a message naming every flag whose value differs between ``args`` and the network a
    checkpoint was saved with (``saved``: the arguments stored in it; absent keys are not compared).
    ``vocab`` is the run's padded vocabulary; ``--max-position-embeddings`` is compared with learned
    absolute position embeddings (it sizes their table).

    Raises:
        SystemExit: ``pretrain_gpt.py: error: --load DIR: CKPT holds a different network: --flag ...``.
    """
    keys = ARCH_KEYS + (("max_position_embeddings",) if args.position_embedding_type == "learned_absolute" else ())
    mine = {**{k: getattr(args, k, None) for k in keys}, "padded_vocab_size": vocab}
    bad = [f"--{k.replace('_', '-')} {mine[k]!r} (checkpoint: {saved[k]!r})"
           for k in keys if k in saved and mine[k] is not None and saved[k] != mine[k]]
    if bad:
        raise SystemExit(f"pretrain_gpt.py: error: --load {args.load}: {ckpt_dir} holds a different network: "
                         + "; ".join(bad) + " (see the flags file next to the checkpoint)")


check_release_args = check_checkpoint_args     # the release checkpoint's check is the same


# scheduler state (megatron-core OptimizerParamScheduler.state_dict) -> the flags that set it
SCHEDULE_FLAGS = {"wd_incr_steps": "--train-iters", "lr_decay_steps": "--lr-decay-iters (default --train-iters)",
                  "lr_warmup_steps": "--lr-warmup-iters", "max_lr": "--lr", "min_lr": "--min-lr",
                  "lr_decay_style": "--lr-decay-style", "start_wd": "--weight-decay", "end_wd": "--weight-decay"}


def check_resume_schedule(args, scheduler, saved: dict, ckpt_dir: str) -> None:
    """Exit with a message naming the flag when resuming ``ckpt_dir`` with another LR / weight-decay
    schedule (megatron-core would silently take the checkpoint's; steps count samples, so
    ``--global-batch-size`` enters them too). Megatron-LM's ``--override-opt_param-scheduler`` (take
    the command line's schedule) and ``--use-checkpoint-opt_param-scheduler`` (take the checkpoint's)
    choose one side instead: no check."""
    if getattr(args, "override_opt_param_scheduler", False) or getattr(args, "use_checkpoint_opt_param_scheduler",
                                                                       False):
        return
    mine = scheduler.state_dict()
    bad = [f"{flag} (run: {mine[k]!r}, checkpoint: {saved[k]!r})" for k, flag in SCHEDULE_FLAGS.items()
           if k in saved and k in mine and saved[k] != mine[k]]
    if bad:
        raise SystemExit(f"pretrain_gpt.py: error: --load {args.load}: {ckpt_dir} was saved with another schedule: "
                         + "; ".join(bad) + " (steps are samples: iterations x --global-batch-size); resume with "
                         "the flags of the run that saved it, or choose a side: --override-opt_param-scheduler "
                         "(this command line's schedule, e.g. to extend a run with a larger --train-iters) or "
                         "--use-checkpoint-opt_param-scheduler (the checkpoint's)")


def check_resume_position(args, saved_args: dict, iteration: int, ckpt_dir: str) -> None:
    """Exit when the run would read its data from another sample than the run that saved ``ckpt_dir``
    would have: the data position is ``iteration x --global-batch-size``, so resuming with another
    ``--global-batch-size`` than the saving run's (``saved_args``: the arguments stored in the
    checkpoint; absent: no check) would skip or repeat samples. Holds with
    ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler`` too."""
    saved = saved_args.get("global_batch_size")
    gbs = args.global_batch_size
    if saved is not None and saved != gbs:
        raise SystemExit(f"pretrain_gpt.py: error: --load {args.load}: {ckpt_dir} was saved by a run with "
                         f"--global-batch-size {saved}; the data position is iterations x --global-batch-size, so "
                         f"{gbs} would read from sample {iteration * gbs} instead of {iteration * saved} (skipping or "
                         f"repeating samples): resume with --global-batch-size {saved}")


def check_resume_optimizer(args, saved_args: dict, ckpt_dir: str) -> None:
    """Exit when ``--optimizer`` differs from the run that saved ``ckpt_dir`` (``saved_args``: the
    arguments stored in it; absent: no check): its state (Adam's moments, SGD's momentum buffers and
    hyper-parameters) belongs to that optimizer."""
    saved = saved_args.get("optimizer")
    if saved is not None and saved != args.optimizer:
        raise SystemExit(f"pretrain_gpt.py: error: --load {args.load}: {ckpt_dir} was saved by a run with --optimizer "
                         f"{saved}, whose state cannot continue as --optimizer {args.optimizer}: resume with "
                         f"--optimizer {saved}")


def _load_errors() -> tuple:
    """What a load that does not fit raises: torch.distributed.checkpoint's ``CheckpointException`` (a
    ``BaseException``, e.g. for a key the checkpoint lacks) included."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _does_not_fit(args, ckpt_dir: str, e: BaseException) -> SystemExit:
    return SystemExit(f"pretrain_gpt.py: error: --load {args.load}: {ckpt_dir} cannot be loaded into the model of "
                      f"the command line ({type(e).__name__}: {str(e)[:500]})")


def optimizer_state_saved(ckpt_dir: Union[str, Path]) -> bool:
    """Whether the ``torch_dist`` checkpoint ``ckpt_dir`` holds optimizer state besides the fp32 main
    weights (Adam's ``exp_avg`` / ``exp_avg_sq``): ``False`` for a run saved before its first optimizer
    step, e.g. an fp16 run whose first updates were skipped for gradient overflow. Reads the metadata
    file only."""
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))      # chained optimizers: "chained_N." first
    return any(re.match(r"(chained_\d+\.)?optimizer\.state\.(?!fp32_param\.)", k) for k in keys)


def load_checkpoint(args, model, optimizer, scheduler, vocab: Optional[int] = None, plan=None) -> int:
    """Restore from ``--load``; returns the iteration (0 if nothing to load).

    ``plan``: the run's :class:`~megatron_mtraining.plan.CPPlan`; with ``dense_layers: auto`` the
    checkpoint's measured layer decisions are restored into it (the layers do not measure again at the
    sequence length and CP size they were measured at). A ``release`` checkpoint starts a new run: its
    decisions, if any, are not used.

    The checkpoint is chosen by :func:`resolve_checkpoint` (on rank 0, the same on every rank) and
    its notes are logged. Its network must match the flags (:func:`check_checkpoint_args`, before
    any tensor is read), its LR schedule too (:func:`check_resume_schedule`; Megatron-LM's
    ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler`` choose a side
    instead) and its data position in every case (:func:`check_resume_position`).

    Megatron-LM's *release* convention is honoured: when ``latest_checkpointed_iteration.txt``
    reads ``release`` (converted weights, e.g. ``tools/convert_smollm2.py``), only the model is
    loaded from ``LOAD/release``; the optimizer, LR schedule and iteration start fresh at 0.

    Raises:
        SystemExit: on every rank, with a message naming the flag or the file.
    """
    import torch

    found, notes = _agreed_resolution(args.load)
    for note in notes:
        log0(note)
    if found is None:
        log0(f" > no checkpoint found under --load {args.load} ({TRACKER} missing); starting from scratch")
        return 0
    if found == "release":
        ckpt_dir = os.path.join(args.load, "release")
        if not is_complete_checkpoint(ckpt_dir):
            raise SystemExit(f"pretrain_gpt.py: error: --load {args.load}: the tracker reads 'release' but "
                             f"{ckpt_dir} is missing or incomplete")
        try:
            if args.ckpt_format == "torch_dist":
                from megatron.core import dist_checkpointing

                check_checkpoint_args(args, dist_checkpointing.load_common_state_dict(ckpt_dir).get("args", {}),
                                      vocab, ckpt_dir)
                state = dist_checkpointing.load({"model": model.module.sharded_state_dict()}, ckpt_dir)
            else:
                state = torch.load(os.path.join(ckpt_dir, _rank_file(args)), map_location="cpu", weights_only=False)
                check_checkpoint_args(args, state.get("args", {}), vocab, ckpt_dir)
            model.module.load_state_dict(state["model"])
        except SystemExit:
            raise
        except _load_errors() as e:
            raise _does_not_fit(args, ckpt_dir, e) from e
        # The optimizer was built before the load: with --bf16/--fp16 it holds fp32 main copies of
        # the *initial* weights, and its first step would write them back over the loaded model.
        # Refresh them from the loaded parameters (Megatron-LM does the same when it loads a model
        # without its optimizer).
        if optimizer is not None:
            optimizer.reload_model_params()
        log0(f" > loaded release checkpoint {ckpt_dir} (model weights only; optimizer, LR schedule and "
             "iteration start fresh)")
        return 0
    iteration = int(found)
    ckpt_dir = os.path.join(args.load, f"iter_{iteration:07d}")

    def check_saved_args(saved: dict) -> None:       # the network, the data position and the optimizer
        check_checkpoint_args(args, saved, vocab, ckpt_dir)
        check_resume_position(args, saved, iteration, ckpt_dir)
        check_resume_optimizer(args, saved, ckpt_dir)

    try:
        if args.ckpt_format == "torch_dist":
            from megatron.core import dist_checkpointing

            common = dist_checkpointing.load_common_state_dict(ckpt_dir)
            check_saved_args(common.get("args", {}))                                   # before any tensor is read
            model_sd = model.module.sharded_state_dict()
            # is_loading=True creates the optimizer's moments (zeros) for the checkpoint's to fill; a run saved
            # before its first optimizer step (fp16: the first updates are skipped while the loss scale comes
            # down) holds none, and resumes with none, as the uninterrupted run has
            stepped = optimizer_state_saved(ckpt_dir)
            template = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=stepped)}
            state = dist_checkpointing.load(template, ckpt_dir)
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            saved_schedule = common["opt_param_scheduler"]
            saved_decisions = common.get(LAYER_DECISIONS_KEY)
        else:
            state = torch.load(os.path.join(ckpt_dir, _rank_file(args)), map_location="cpu", weights_only=False)
            check_saved_args(state.get("args", {}))
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            saved_schedule = state["opt_param_scheduler"]
            saved_decisions = state.get(LAYER_DECISIONS_KEY)
    except SystemExit:
        raise
    except _load_errors() as e:
        raise _does_not_fit(args, ckpt_dir, e) from e
    check_resume_schedule(args, scheduler, saved_schedule, ckpt_dir)
    scheduler.load_state_dict(saved_schedule)
    # megatron-core's load_state_dict sets the optimizer's LR / weight decay before it restores the
    # checkpoint's weight-decay values: apply them again, so that the first update after the resume
    # uses the schedule chosen (--use-checkpoint-opt_param-scheduler: the checkpoint's)
    scheduler.step(increment=0)
    log0(f" > loaded checkpoint {ckpt_dir} (iteration {iteration})")
    if plan is not None and plan.config.auto_dense_layers:
        from megatron_mtraining.layer_policy import layer_decision_lines

        try:
            taken = plan.restore_layer_decisions(saved_decisions)
        except ValueError as e:
            raise SystemExit(f"pretrain_gpt.py: error: --load {args.load}: {ckpt_dir}: {e}") from None
        log0(f" > dense_layers: auto: {len(taken)} measured layer decisions restored from the checkpoint"
             + (" (none for this --seq-length and CP size: the layers measure at their first call)" if not taken
                else ""))
        for line in layer_decision_lines(taken):
            log0(f" > {line} (restored)")
    return iteration


def checkpoint_dir(load_dir: str, iteration: Optional[int] = None) -> tuple[str, Any]:
    """``(directory, iteration)`` of a checkpoint under ``load_dir``: ``iter_XXXXXXX`` of ``iteration``
    (default: :func:`resolve_checkpoint`, i.e. the tracker's when complete, else the newest
    complete one; ``release`` means ``load_dir/release``).

    Raises:
        FileNotFoundError: no checkpoint / no such directory.
    """
    if iteration is None:
        try:
            iteration, _notes = resolve_checkpoint(load_dir)
        except SystemExit as e:
            raise FileNotFoundError(str(e)) from None
        if iteration is None:
            raise FileNotFoundError(f"{load_dir}: not a checkpoint directory ({TRACKER} missing)")
    d = os.path.join(load_dir, "release" if iteration == "release" else f"iter_{iteration:07d}")
    if not os.path.isdir(d):
        raise FileNotFoundError(f"{d}: checkpoint of iteration {iteration} not found")
    return d, iteration


def load_model_weights(load_dir: str, model, ckpt_format: str = "torch_dist",
                       iteration: Optional[int] = None, plan=None) -> tuple[str, Any]:
    """Load only the model weights of a checkpoint (evaluation; see :func:`checkpoint_dir`).

    Args:
        load_dir: the ``--save`` directory (holds ``latest_checkpointed_iteration.txt``).
        model: the unwrapped model of :func:`build_model` (GPTModel or Float16Module, no DDP).
        ckpt_format: ``torch_dist`` or ``torch`` (as saved; any CP/DP size at TP=1).
        iteration: which ``iter_XXXXXXX`` to load (default: the latest).
        plan: the model's :class:`~megatron_mtraining.plan.CPPlan`; with ``dense_layers: auto`` the
            checkpoint's measured layer decisions are restored into it (the layers run as in training).

    Returns:
        ``(checkpoint directory, iteration)``.
    """
    import torch

    ckpt_dir, iteration = checkpoint_dir(load_dir, iteration)
    if ckpt_format == "torch_dist":
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)
        decisions = (dist_checkpointing.load_common_state_dict(ckpt_dir).get(LAYER_DECISIONS_KEY)
                     if plan is not None and plan.config.auto_dense_layers else None)
    else:  # every CP/DP rank holds the full model at TP=1: take TP 0 / CP 0 / DP 0's file
        state = torch.load(os.path.join(ckpt_dir, "mp_rank_00_cp_00_dp_000.pt"), map_location="cpu",
                           weights_only=False)
        decisions = state.get(LAYER_DECISIONS_KEY)
    model.load_state_dict(state["model"])
    if plan is not None and plan.config.auto_dense_layers:
        plan.restore_layer_decisions(decisions)
    return ckpt_dir, iteration



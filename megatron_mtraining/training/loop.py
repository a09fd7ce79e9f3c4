"""The training run: set-up from the validated arguments, the iteration loop, the final save."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .build import (build_model, build_optimizer, build_plan, build_tokenizer, count_params,
                    flops_per_iteration, padded_vocab_size, transformer_config)
from .checkpoint import load_checkpoint, save_checkpoint
from .data import CPBatchSplit, MicroBatches, build_datasets
from .faults import NanGuard, ThroughputGuard
from .metrics import RunMetrics
from .runtime import init_distributed, log0
from .step import evaluate, forward_backward
from .stop import ExitSignalHandler, StopPolicy

__all__ = ["IterationInfo", "TrainHooks", "TrainResult", "train", "run", "main"]


@dataclass(frozen=True)
class IterationInfo:
    """What a stop hook sees after each training iteration.

    Attributes:
        iteration: the iteration just finished (1-based, counting from the start of the whole run).
        start_iteration: the iteration this process resumed from (0 without a checkpoint).
        train_iters: ``--train-iters``.
        lm_loss: the iteration's per-token training loss.
        time_s: wall time of the iteration (data, forward, backward, optimizer step), seconds.
    """

    iteration: int
    start_iteration: int
    train_iters: int
    lm_loss: float
    time_s: float


@dataclass(frozen=True)
class TrainHooks:
    """Caller hooks of :func:`train`.

    Attributes:
        should_stop: ``should_stop(info: IterationInfo) -> Optional[str]``, called after every
            iteration before ``--train-iters`` on every rank; a non-empty reason ends the run after
            that iteration like ``--exit-interval`` does (logged, then the final checkpoint is saved
            with ``--save``). The schedules (data order, LR, weight decay) stay those of
            ``--train-iters``, so a later ``--load`` continues as one uninterrupted run.
    """

    should_stop: Optional[Callable[[IterationInfo], Optional[str]]] = None


@dataclass(frozen=True)
class TrainResult:
    """Outcome of :func:`train`: ``start_iteration`` (resumed from), ``end_iteration`` (last one run)
    and ``stop_reason`` (``None`` when the run reached ``--train-iters``)."""

    start_iteration: int
    end_iteration: int
    stop_reason: Optional[str]


def train(args, hooks: Optional[TrainHooks] = None, t_start: Optional[float] = None) -> TrainResult:
    """Run the training described by validated ``args`` (:func:`~megatron_mtraining.megatron.args.parse_args`).

    Flow: ``torch.distributed`` (gloo on CPU, nccl on GPU; torchrun env) ->
    ``parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp)`` (every group with the
    ``--distributed-timeout-minutes`` timeout) -> tokenizer ->
    GPTDataset -> GPTModel with the MTraining spec (``--cp-attention mtraining``: RoPE and the batch
    split on the CP layout's positions) or the Transformer Engine spec (``te``) -> megatron-core DDP +
    optimizer + ``OptimizerParamScheduler`` -> ``--load`` -> iterations -> ``--save``. The CP plan
    is resolved once per run (:func:`~megatron_mtraining.training.build.build_plan`).

    Args:
        args: validated arguments.
        hooks: optional :class:`TrainHooks`.
        t_start: start time for ``--exit-duration-in-mins`` (default: now).

    Returns:
        :class:`TrainResult`. The process group is destroyed on return.

    With ``--exit-signal-handler`` the handler of ``--exit-signal`` is installed for the whole call
    (first thing, so a signal during set-up is not lost) and the previous one restored on return: the
    run stops after the iteration in progress, saves with ``--save`` and returns normally.

    Raises:
        SystemExit: a checkpoint that does not fit the command line (message names the flag).
    """
    t_start = time.time() if t_start is None else t_start
    if not getattr(args, "exit_signal_handler", False):
        return _train(args, hooks, t_start, None)
    with ExitSignalHandler(args.exit_signal) as handler:
        return _train(args, hooks, t_start, handler)


def _train(args, hooks: Optional[TrainHooks], t_start: float, handler: Optional[ExitSignalHandler]) -> TrainResult:
    import torch
    import torch.distributed as dist

    device = init_distributed(args)
    # checked where the run starts, not in the argument check: a Slurm dry run checks those on a login node
    cfg = getattr(args, "mtraining", None)
    if cfg is not None and cfg.cuda_graphs and device.type != "cuda":
        raise SystemExit(f"pretrain_gpt.py: error: --mtraining-config {args.mtraining_config}: 'cuda_graphs: "
                         f"true' captures CUDA graphs, and this run is on the {device.type}; set cuda_graphs: false")
    if getattr(args, "lm_loss", "megatron") == "liger":
        from megatron_mtraining.megatron.lm_loss import liger_problem

        problem = liger_problem(device)
        if problem:
            raise SystemExit(f"pretrain_gpt.py: error: {problem}")

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_seed

    patches = apply_cpu_patches()  # [] on CUDA
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                 context_parallel_size=args.context_parallel_size,
                                 hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
                                 distributed_timeout_minutes=args.distributed_timeout_minutes)
    cpu_seed(args.seed)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    try:
        tokenizer = build_tokenizer(args)
    except ValueError as e:
        raise SystemExit(f"pretrain_gpt.py: error: {e}") from None
    vocab = padded_vocab_size(tokenizer.vocab_size, args)
    args.padded_vocab_size = vocab                 # saved with the checkpoint's arguments (Megatron-LM's name)
    train_ds, valid_ds = build_datasets(args, tokenizer)

    plan = build_plan(args, tokenizer.eod)   # the run's CP plan: attention, RoPE and batch split share it
    if plan is not None:
        plan.track_kept_fraction()           # the sparse layers' kept work, in the metrics and the log
    config = transformer_config(args)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = build_model(args, config, vocab, device, plan=plan)
    n_params = count_params(model)
    model, optimizer, scheduler = build_optimizer(args, config, model)
    gbs = args.global_batch_size
    start_iter = load_checkpoint(args, model, optimizer, scheduler, vocab, plan=plan) if args.load else 0

    pp = args.pipeline_model_parallel_size
    log0(f" > world {args.world_size} = TP {args.tensor_model_parallel_size} x CP {args.context_parallel_size}"
         f" x DP {dp}{f' x PP {pp}' if pp > 1 else ''} | device {device.type}"
         f" ({args.distributed_backend or dist.get_backend()})"
         f" | cp-attention {args.cp_attention} (layout {args.cp_layout}"
         f"{', granularity ' + str(args.cp_granularity) if args.cp_layout == 'striped' else ''}"
         + (f", implementation {args.mtraining.implementation}, pattern {args.mtraining.pattern}"
            + (f", columns {args.mtraining.columns}" if args.mtraining.sparse else "")
            + (f", {args.mtraining.layer_policy_text()}" if args.mtraining.has_layer_policy else "")
            + (f", hierarchical {args.hierarchical_context_parallel_sizes}"
               if args.hierarchical_context_parallel_sizes else "") if args.mtraining else "") + ")")
    log0(f" > model: {n_params / 1e6:.2f}M parameters{' on the first pipeline stage' if pp > 1 else ''} "
         f"(vocab {tokenizer.vocab_size} padded to {vocab}), "
         f"dtype {config.params_dtype}, micro-batches per iteration {args.num_microbatches}, "
         f"train samples {len(train_ds)}, valid samples {len(valid_ds) if valid_ds is not None else 0}")
    if patches:
        log0(f" > CPU shims for megatron-core: {', '.join(patches)}")

    split = CPBatchSplit(args, plan, device)
    train_iter = MicroBatches(train_ds, args.micro_batch_size, dp, dp_rank, consumed=start_iter * gbs)
    valid_consumed = (start_iter // args.eval_interval) * args.eval_iters * gbs  # evaluations already run
    valid_iter = (MicroBatches(valid_ds, args.micro_batch_size, dp, dp_rank, consumed=valid_consumed)
                  if valid_ds is not None else None)
    metrics = RunMetrics(args, flops_per_iteration(args, vocab), device, optimizer, rank0=dist.get_rank() == 0)
    stop = StopPolicy(args, t_start, device, hook=hooks.should_stop if hooks else None, signal_handler=handler)
    if handler is not None:
        log0(f" > --exit-signal-handler: on {handler.name} the run saves after the current iteration and exits")
    nan_guard = NanGuard(args, model, device)
    sparse = args.mtraining is not None and args.mtraining.sparse   # sparse attention does less than the dense count
    throughput = ThroughputGuard(args, flops_per_iteration(args, vocab, attention=not sparse), device,
                                 config.params_dtype)

    pp_group = ps.get_pipeline_model_parallel_group() if args.pipeline_model_parallel_size > 1 else None
    model.train()
    t_train = time.perf_counter()
    iteration = start_iter
    saved_iter = start_iter                        # last iteration already on disk (no second save of it)
    stop_reason = None
    while iteration < args.train_iters:
        t0 = time.perf_counter()
        micro = train_iter.next_global_batch(args.num_microbatches)
        if plan is not None:
            plan.take_kept_fraction()              # drop what an evaluation recorded: this iteration's work only
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss_sum, n_tok = forward_backward(model, optimizer, micro, split, device, train=True)
        nan_guard.after_backward(iteration + 1, loss_sum, n_tok)
        finalize_model_grads([model])
        nan_guard.after_grad_reduce(iteration + 1)
        lr = optimizer.param_groups[0]["lr"]
        update_ok, grad_norm, _ = optimizer.step()
        if update_ok:
            scheduler.step(increment=gbs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        iteration += 1
        throughput.check(iteration, dt)
        loss = (loss_sum / n_tok.clamp(min=1)).item()
        metrics.iteration(iteration, loss, grad_norm, lr, int(n_tok.item()), dt,
                          kept=plan.take_kept_fraction(pp_group) if plan is not None else None, skipped=not update_ok)
        kernels = plan.kernel_summary() if iteration == start_iter + 1 and plan is not None else ""
        if kernels:
            log0(f" > attention kernels: {kernels}")
        if plan is not None and plan.config.auto_dense_layers and iteration == start_iter + 1:   # decided by now
            from megatron_mtraining.layer_policy import layer_decision_lines   # torch: not at import (fast --help)

            for line in layer_decision_lines(plan.take_new_layer_decisions(pp_group)):
                log0(f" > {line}")
        if args.eval_iters > 0 and valid_iter is not None and iteration % args.eval_interval == 0:
            metrics.validation(iteration, evaluate(args, model, optimizer, valid_iter, split, device))
        if args.save and args.save_interval and iteration % args.save_interval == 0 and iteration < args.train_iters:
            log0(f" > saved checkpoint {save_checkpoint(args, iteration, model, optimizer, scheduler, plan)}")
            saved_iter = iteration
        stop_reason = stop.reason(IterationInfo(iteration, start_iter, args.train_iters, loss, dt))
        if stop_reason:
            log0(f" > exiting after iteration {iteration} ({stop_reason})")
            break

    log0(f" > training done: {iteration - start_iter} iterations in {time.perf_counter() - t_train:.1f} s")
    if args.save and iteration > saved_iter:
        log0(f" > saved checkpoint {save_checkpoint(args, iteration, model, optimizer, scheduler, plan)}")
    metrics.close()
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return TrainResult(start_iter, iteration, stop_reason)


def run(argv: Optional[Sequence[str]] = None, hooks: Optional[TrainHooks] = None) -> TrainResult:
    """Parse and validate ``argv`` (exit status 2 and ``error: --flag ...`` on a bad command line),
    then :func:`train` with ``hooks``; returns its :class:`TrainResult`."""
    from megatron_mtraining.megatron.args import parse_args

    t_start = time.time()     # --exit-duration-in-mins counts from here (Megatron-LM: start of pretrain)
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    return train(args, hooks, t_start=t_start)


def main(argv: Optional[Sequence[str]] = None, hooks: Optional[TrainHooks] = None) -> int:
    """Command-line entry point (``examples/pretrain_gpt.py``): :func:`run`; returns the exit status 0."""
    run(argv, hooks)
    return 0

"""What a run reports per iteration: the Megatron-LM log line (rank 0), one JSON line per iteration
(``--metrics-file``) and TensorBoard scalars (``--tensorboard-dir``) under Megatron-LM's names."""

from __future__ import annotations

import datetime
import json
import math
import os
from typing import Optional, TextIO

from .runtime import log0

__all__ = ["open_metrics_file", "RunMetrics"]

def open_metrics_file(path: str) -> tuple[TextIO, Optional[str]]:
    """Open ``--metrics-file`` for appending (created with its directory when missing).

    Returns:
        ``(file, note)``: ``note`` is ``None`` for a new or empty file, else the log line saying the
        run appends to an existing file (rows already there and their last iteration). An existing
        file whose last line was cut off (no final newline) gets a newline first, so every row of
        this run is a whole JSON line.
    """
    note = None
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
            f.seek(-1, os.SEEK_END)
            ends_with_newline = f.read(1) == b"\n"
        rows = [ln for ln in lines if ln.strip()]
        last = None
        for ln in reversed(rows):
            try:
                last = json.loads(ln).get("iteration")
                break
            except (ValueError, AttributeError):
                continue
        note = (f" > --metrics-file {path}: appending to an existing file ({len(rows)} rows"
                + (f", last iteration {last}" if last is not None else "") + ")"
                + ("" if ends_with_newline else "; its last line was incomplete, a newline ends it"))
    else:
        ends_with_newline = True
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
    f = open(path, "a")
    if not ends_with_newline:
        f.write("\n")
    return f, note


class RunMetrics:
    """Per-iteration reporting of a run (rank 0 writes; every rank may call).

    Args:
        args: validated arguments (``--log-interval``, ``--metrics-file``, ``--tensorboard-dir``,
            ``--train-iters``, ``--global-batch-size``, ``--seq-length``, ``--fp16``; ``--bf16`` and
            ``--loss-scale`` when present).
        flops_iter: model FLOPs of one iteration (:func:`~megatron_mtraining.training.build.flops_per_iteration`).
        device: this rank's device (peak memory on CUDA).
        optimizer: read for the loss scale (``--fp16``; ``--bf16`` with ``--loss-scale``).
        rank0: whether this process writes the files.
    """

    def __init__(self, args, flops_iter: float, device, optimizer, rank0: bool):
        self.args, self.flops_iter, self.device, self.optimizer = args, flops_iter, device, optimizer
        self.metrics_f = None
        if args.metrics_file and rank0:
            self.metrics_f, note = open_metrics_file(args.metrics_file)
            if note:
                log0(note)
        self.tb = None
        if args.tensorboard_dir and rank0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=args.tensorboard_dir)
        self._reset()

    def _reset(self) -> None:
        self.acc_loss, self.acc_n, self.acc_time, self.acc_iters = 0.0, 0, 0.0, 0
        self.acc_kept = []
        self.acc_skipped = 0

    def iteration(self, iteration: int, loss: float, grad_norm, lr: float, tokens: int, dt: float,
                  kept: Optional[dict] = None, skipped: bool = False) -> None:
        """Record one training iteration (``dt`` seconds); prints the log line every ``--log-interval``
        iterations and at the last one (averages since the previous line). ``kept``: the sparse layers'
        share of causal attention work in this iteration's first micro-batch
        (:meth:`~megatron_mtraining.plan.CPPlan.take_kept_fraction`; ``None``: no sparse layer ran).
        ``skipped``: the optimizer skipped this update (a loss-scaled run: gradient overflow). With a loss
        scale (``--fp16``, or ``--bf16`` with ``--loss-scale``) the row has ``loss_scale`` (after this
        iteration's update) and ``skipped``, and the log line the number of skipped iterations since the
        previous line, as Megatron-LM's. The line's ``lm loss`` averages the iterations whose update was
        applied, as Megatron-LM's does (where none was, the line has no ``lm loss`` field); the metrics
        file and TensorBoard have every iteration's loss."""
        import torch

        args, gbs = self.args, self.args.global_batch_size
        if not skipped:                                # the average leaves skipped updates out
            self.acc_loss, self.acc_n = self.acc_loss + loss, self.acc_n + 1
        self.acc_skipped += bool(skipped)
        scaled = args.fp16 or (getattr(args, "bf16", False) and getattr(args, "loss_scale", None) is not None)
        loss_scale = float(self.optimizer.get_loss_scale()) if scaled else None
        self.acc_time, self.acc_iters = self.acc_time + dt, self.acc_iters + 1
        if kept is not None:
            self.acc_kept.append(kept["mean"])
        if self.metrics_f:
            row = {"iteration": iteration, "lm_loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
                   "time_s": dt, "model_flops": self.flops_iter,
                   "max_memory_allocated": (torch.cuda.max_memory_allocated(self.device)
                                            if self.device.type == "cuda" else None)}
            if loss_scale is not None:
                row.update(loss_scale=loss_scale, skipped=bool(skipped))
            if kept is not None:
                row.update(attention_kept=kept["mean"], attention_kept_min=kept["min"],
                           attention_kept_max=kept["max"], attention_kept_layers=kept["layers"])
            self.metrics_f.write(json.dumps(row) + "\n")
            self.metrics_f.flush()
        if self.tb is not None:                        # Megatron-LM's scalar names
            self.tb.add_scalar("lm loss", loss, iteration)
            self.tb.add_scalar("learning-rate", lr, iteration)
            if grad_norm is not None:
                self.tb.add_scalar("grad-norm", grad_norm, iteration)
            if loss_scale is not None:
                self.tb.add_scalar("loss-scale", loss_scale, iteration)
            self.tb.add_scalar("throughput/tokens-per-sec-per-gpu", gbs * args.seq_length / dt / args.world_size,
                               iteration)
            self.tb.add_scalar("throughput/tflops-per-gpu", self.flops_iter / dt / args.world_size / 1e12, iteration)
            if kept is not None:
                self.tb.add_scalar("mtraining/attention-kept", kept["mean"], iteration)
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            t_it = self.acc_time / self.acc_iters
            tok_s = gbs * args.seq_length / t_it / args.world_size
            tflops = self.flops_iter / t_it / args.world_size / 1e12
            gn = f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else ""
            lm = f" lm loss: {self.acc_loss / self.acc_n:.6E} |" if self.acc_n else ""
            scale = (f" loss scale: {loss_scale:.1f} | number of skipped iterations: {self.acc_skipped:3d} |"
                     if loss_scale is not None else "")
            log0(f" [{datetime.datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
                 f" consumed samples: {iteration * gbs:12d} | elapsed time per iteration (ms): {t_it * 1000:.1f} |"
                 f" learning rate: {lr:.6E} | global batch size: {gbs:5d} |{lm}"
                 f"{scale}{gn} tokens/s/GPU: {tok_s:.1f} | TFLOP/s/GPU: {tflops:.2f} |"
                 + (f" attention kept: {sum(self.acc_kept) / len(self.acc_kept):.3f} |" if self.acc_kept else ""))
            self._reset()

    def validation(self, iteration: int, loss: float) -> None:
        """Record a validation loss (per-token mean) after ``iteration``."""
        if self.tb is not None:
            self.tb.add_scalar("lm loss validation", loss, iteration)
        log0(f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} |"
             f" lm loss PPL: {math.exp(min(loss, 20)):.6E} |")

    def close(self) -> None:
        if self.metrics_f:
            self.metrics_f.close()
        if self.tb is not None:
            self.tb.close()

"""When a run ends before ``--train-iters``: Megatron-LM's ``--exit-interval`` and
``--exit-duration-in-mins``, plus an optional caller-supplied stop hook. Every rank takes the same
decision (the duration by the slowest clock; a hook's stop by any rank)."""

from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["StopPolicy"]


class StopPolicy:
    """Decides after each iteration whether the run ends early (and then saves as at the end).

    Args:
        args: validated arguments (``--train-iters``, ``--exit-interval``, ``--exit-duration-in-mins``).
        t_start: ``time.time()`` of the process start (the duration counts from there).
        device: this rank's device (the all-reduce tensors).
        hook: ``hook(info) -> reason or None``, called with the iteration's
            :class:`~megatron_mtraining.training.loop.IterationInfo` on every rank when neither flag
            stops the run; a reason on any rank stops all ranks.
    """

    def __init__(self, args, t_start: float, device, hook: Optional[Callable] = None):
        self.args, self.t_start, self.device, self.hook = args, t_start, device, hook

    def reason(self, info) -> Optional[str]:
        """Why the run stops after ``info.iteration`` (``None``: it goes on). Collective when
        ``--exit-duration-in-mins`` or a hook is set: every rank must call it."""
        import torch
        import torch.distributed as dist

        args, iteration = self.args, info.iteration
        if iteration >= args.train_iters:
            return None
        reason = None
        if args.exit_interval and iteration % args.exit_interval == 0:
            reason = f"--exit-interval {args.exit_interval}"
        elif args.exit_duration_in_mins:
            # every rank must take the same decision: the slowest clock decides (all-reduce MAX)
            mins = torch.tensor([(time.time() - self.t_start) / 60.0], dtype=torch.float64, device=self.device)
            dist.all_reduce(mins, op=dist.ReduceOp.MAX)
            if mins.item() > args.exit_duration_in_mins:
                reason = f"--exit-duration-in-mins {args.exit_duration_in_mins:g} ({mins.item():.2f} min elapsed)"
        if reason is None and self.hook is not None:
            reason = self.hook(info)
            if dist.get_world_size() > 1:       # one rank's stop stops every rank (no rank waits alone)
                flag = torch.tensor([1.0 if reason else 0.0], dtype=torch.float64, device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() > 0 and not reason:
                    reason = "stop hook of another rank"
        return reason

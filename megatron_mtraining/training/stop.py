"""When a run ends before ``--train-iters``: Megatron-LM's ``--exit-interval``,
``--exit-duration-in-mins`` and ``--exit-signal-handler``, plus an optional caller-supplied stop
hook. Every rank takes the same decision (the duration by the slowest clock; a signal or a hook's
stop by any rank)."""

from __future__ import annotations

import signal
import time
from typing import Callable, Optional

__all__ = ["StopPolicy", "ExitSignalHandler"]


class ExitSignalHandler:
    """``--exit-signal-handler``: records that this process received ``--exit-signal``.

    The handler only sets a flag (the iteration in progress finishes; no collective is interrupted);
    :class:`StopPolicy` all-reduces the flag after every iteration, so a signal delivered to one rank
    only (or to the ranks at different moments) stops every rank after the same iteration.

    Args:
        name: ``"SIGTERM"``, ``"SIGINT"``, ``"SIGUSR1"`` or ``"SIGUSR2"``.

    Use as a context manager (or :meth:`install` / :meth:`release`); leaving it restores the
    previous handler. Must be installed from the main thread (Python's rule for ``signal.signal``).
    """

    def __init__(self, name: str):
        self.name = name
        self.signum = signal.Signals[name]
        self.received = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        self.received = True

    def install(self) -> "ExitSignalHandler":
        self._previous = signal.signal(self.signum, self._handler)
        return self

    def release(self) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

    def __enter__(self) -> "ExitSignalHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.release()


class StopPolicy:
    """Decides after each iteration whether the run ends early (and then saves as at the end).

    Args:
        args: validated arguments (``--train-iters``, ``--exit-interval``, ``--exit-duration-in-mins``).
        t_start: ``time.time()`` of the process start (the duration counts from there).
        device: this rank's device (the all-reduce tensors).
        hook: ``hook(info) -> reason or None``, called with the iteration's
            :class:`~megatron_mtraining.training.loop.IterationInfo` on every rank when neither flag
            stops the run; a reason on any rank stops all ranks.
        signal_handler: the run's :class:`ExitSignalHandler` (``--exit-signal-handler``), or ``None``.
    """

    def __init__(self, args, t_start: float, device, hook: Optional[Callable] = None,
                 signal_handler: Optional[ExitSignalHandler] = None):
        self.args, self.t_start, self.device, self.hook = args, t_start, device, hook
        self.signal_handler = signal_handler

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` OR-ed over all ranks (a collective: every rank calls it)."""
        import torch
        import torch.distributed as dist

        if dist.get_world_size() == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item() > 0

    def reason(self, info) -> Optional[str]:
        """Why the run stops after ``info.iteration`` (``None``: it goes on). Collective when
        ``--exit-duration-in-mins``, ``--exit-signal-handler`` or a hook is set: every rank must call it."""
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
        if reason is None and self.signal_handler is not None:
            mine = self.signal_handler.received
            if self._any_rank(mine):
                reason = (f"{self.signal_handler.name} received{'' if mine else ' by another rank'}, "
                          "--exit-signal-handler")
        if reason is None and self.hook is not None:
            reason = self.hook(info)
            if self._any_rank(bool(reason)) and not reason:   # one rank's stop stops every rank
                reason = "stop hook of another rank"
        return reason

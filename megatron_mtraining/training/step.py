"""One training step and evaluation with the exact global per-token loss.

The objective of one iteration is ``sum over all tokens of the global batch (loss * loss_mask) / N``
where ``N`` is the number of loss tokens of the whole global batch. Each rank first counts the loss
tokens of its micro-batches and ``N`` is all-reduced over the DP x CP group; every micro-batch then
back-propagates ``sum(loss * mask) / N`` and DDP *sums* the gradients over DP x CP
(``calculate_per_token_loss``, gradient scaling 1). This is exact even when the loss mask is uneven
across CP ranks (EOD masking, padding). Megatron-LM without ``--calculate-per-token-loss`` divides
by each rank's *local* token count and averages over DP x CP, i.e. optimizes the mean of per-rank
means, which is wrong for uneven masks.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

__all__ = ["forward_backward", "evaluate"]


def forward_backward(model, optimizer, micro_batches: list[dict], split: Callable[[dict], dict], device,
                     train: bool):
    """Run all micro-batches of one global batch.

    Args:
        model: the DDP-wrapped GPTModel.
        optimizer: the megatron-core optimizer (``scale_loss``).
        micro_batches: this DP rank's micro-batches (:meth:`MicroBatches.next_global_batch`).
        split: the run's :class:`~megatron_mtraining.training.data.CPBatchSplit`.
        device: this rank's device.
        train: back-propagate ``sum(loss*mask) / N_global`` per micro-batch (gradients accumulate in
            DDP's buffers and are reduced afterwards); ``False``: forward only.

    Returns:
        ``(loss_sum, token_count)``: float64 scalar tensors summed over DP x CP (identical on every rank).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    local = [split(b) for b in micro_batches]
    count = torch.stack([b["loss_mask"].float().sum() for b in local]).sum().to(torch.float64)
    count_global = count.clone()
    dist.all_reduce(count_global, group=dp_cp)  # exact token count of the whole global batch
    denom = count_global.clamp(min=1.0).float()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, b in enumerate(local):
        last = i == len(local) - 1
        sync = model.no_sync() if (train and not last and hasattr(model, "no_sync")) else contextlib.nullcontext()
        with sync:
            per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                              packed_seq_params=b.get("packed_seq_params"))  # [b, s_local]
            # torch.where, not multiply: a non-finite loss at a masked position must not leak (NaN*0)
            masked = torch.where(b["loss_mask"] > 0, per_token.float() * b["loss_mask"].float(),
                                 torch.zeros((), device=per_token.device))
            s = masked.sum()
            if train:
                optimizer.scale_loss(s / denom).backward()
        loss_sum += s.detach().to(torch.float64)
    dist.all_reduce(loss_sum, group=dp_cp)
    return loss_sum, count_global


def evaluate(args, model, optimizer, valid_iter, split: Callable[[dict], dict], device) -> Optional[float]:
    """Mean per-token validation loss over ``--eval-iters`` global batches (``None`` without data)."""
    import torch

    if valid_iter is None or args.eval_iters == 0:
        return None
    model.eval()
    tot, cnt = 0.0, 0.0
    with torch.no_grad():
        for _ in range(args.eval_iters):
            s, n = forward_backward(model, optimizer, valid_iter.next_global_batch(args.num_microbatches),
                                    split, device, train=False)
            tot, cnt = tot + s.item(), cnt + n.item()
    model.train()
    return tot / max(cnt, 1.0)

"""One training step and evaluation with the exact global per-token loss.

The objective of one iteration is ``sum over all tokens of the global batch (loss * loss_mask) / N``
where ``N`` is the number of loss tokens of the whole global batch. Each rank first counts the loss
tokens of its micro-batches and ``N`` is all-reduced over the DP x CP group; every micro-batch then
back-propagates ``sum(loss * mask) / N`` and DDP *sums* the gradients over DP x CP
(``calculate_per_token_loss``, gradient scaling 1). This is exact even when the loss mask is uneven
across CP ranks (EOD masking, padding). Megatron-LM without ``--calculate-per-token-loss`` divides
by each rank's *local* token count and averages over DP x CP, i.e. optimizes the mean of per-rank
means, which is wrong for uneven masks.

With ``--pipeline-model-parallel-size`` > 1 megatron-core's 1F1B schedule
(``get_forward_backward_func``) runs the micro-batches over the stages with the same objective.
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
    if ps.get_pipeline_model_parallel_world_size() > 1:
        return _pipelined(model, optimizer, local, denom, loss_sum, count_global, dp_cp, train)
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


def _masked_sum(per_token, loss_mask):
    import torch

    # torch.where, not multiply: a non-finite loss at a masked position must not leak (NaN*0)
    return torch.where(loss_mask > 0, per_token.float() * loss_mask.float(),
                       torch.zeros((), device=per_token.device)).sum()


def _pipelined(model, optimizer, local: list[dict], denom, loss_sum, count_global, dp_cp, train: bool):
    """:func:`forward_backward` over pipeline stages: megatron-core's schedule
    (``get_forward_backward_func``: 1F1B, activations sent between stages) runs the micro-batches;
    the last stage's loss function returns ``sum(loss * mask) / N_global`` per micro-batch, which
    the schedule back-propagates as it is (``calculate_per_token_loss`` set for the call: without it
    the schedule would divide by the micro-batch's local token count and the number of
    micro-batches), and the loss sum is then broadcast from the last stage to the others."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = model.config
    config.grad_scale_func = optimizer.scale_loss if train else None
    config.no_sync_func = getattr(model, "no_sync", None)
    config.finalize_model_grads_func = None            # the caller reduces the gradients
    saved_per_token, config.calculate_per_token_loss = config.calculate_per_token_loss, True
    sums: list = []

    def loss_func(loss_mask, per_token):
        s = _masked_sum(per_token, loss_mask)
        sums.append(s.detach())
        return s / denom, (loss_mask > 0).sum().to(torch.int), {"loss_sum": s.detach()}

    def forward_step(data_iterator, model_chunk):
        import functools

        b = next(data_iterator)
        out = model_chunk(b["tokens"], b["position_ids"], None, labels=b["labels"],
                          packed_seq_params=b.get("packed_seq_params"))
        return out, functools.partial(loss_func, b["loss_mask"])

    b0 = local[0]
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(local), model=[model], num_microbatches=len(local),
            seq_length=b0["tokens"].shape[1] * ps.get_context_parallel_world_size(),
            micro_batch_size=b0["tokens"].shape[0], forward_only=not train)
    finally:
        config.calculate_per_token_loss = saved_per_token
    if ps.is_pipeline_last_stage():
        for s in sums:
            loss_sum += s.to(torch.float64)
        dist.all_reduce(loss_sum, group=dp_cp)
    dist.broadcast(loss_sum, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
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

"""Training data: GPTDataset splits, Megatron's pretraining sampler and the per-CP-rank batch split."""

from __future__ import annotations

from .runtime import log0

__all__ = ["effective_split", "build_datasets", "MicroBatches", "CPBatchSplit"]


def effective_split(args, prefixes: list[str]) -> str:
    """``--split`` with zero weight for splits that would get no document of some prefix.

    megatron-core 0.16.1 splits by *documents* and loops forever in ``GPTDataset._get_num_epochs``
    when a requested split is empty (0 tokens per epoch), e.g. a 2% validation split of a 5-book
    corpus. Such a split is disabled here (with a message); an empty training split is an error.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    fr = list(args.split_fractions)
    bounds = np.concatenate([[0.0], np.cumsum(fr)])
    for prefix in prefixes:
        n_docs = len(IndexedDataset(prefix, mmap=True).document_indices) - 1
        for i, name in enumerate(("train", "valid", "test")):
            if fr[i] > 0 and int(round(bounds[i + 1] * n_docs)) <= int(round(bounds[i] * n_docs)):
                if i == 0:
                    raise SystemExit(f"pretrain_gpt.py: error: --split {args.split!r} leaves no training "
                                     f"document in {prefix} ({n_docs} documents)")
                log0(f" > --split {args.split!r}: the {name} split of {prefix} ({n_docs} documents) would be "
                     f"empty; {name} split disabled")
                fr[i] = 0.0
    return ",".join(f"{f:.6f}" for f in fr)


def build_datasets(args, tokenizer):
    """``(train, valid)`` GPTDatasets of ``--data-path`` / ``--split`` sized for the whole run
    (``--train-iters`` x global batch; every evaluation's ``--eval-iters``). No dense attention
    mask is built: causality comes from the layout positions, document masks from the EOD tokens
    (the batch split); ``--reset-position-ids`` resets the samples' ``position_ids``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if len(args.data_path) == 1:
        blend = ([args.data_path[0]], None)
    else:
        blend = (list(args.data_path[1::2]), [float(w) for w in args.data_path[0::2]])
    split = effective_split(args, blend[0])
    gbs = args.global_batch_size
    n_evals = args.train_iters // args.eval_interval + 1 if args.eval_iters > 0 else 0
    sizes = [args.train_iters * gbs, max(n_evals * args.eval_iters * gbs, 1), max(args.eval_iters * gbs, 1)]
    cfg = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, split=split,
        path_to_cache=args.data_cache_path, tokenizer=tokenizer, mmap_bin_files=True,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # causality comes from the layout positions, never a dense mask
    )
    train, valid, _test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    if train is None:
        raise RuntimeError(f"--split {args.split!r} leaves no training data")
    return train, valid


class MicroBatches:
    """Megatron's pretraining sampler: iteration ``i`` consumes global samples
    ``[consumed, consumed + global_batch)``; micro-batch ``m`` of DP rank ``d`` takes
    ``consumed + m * mbs * dp + d * mbs + [0, mbs)``. All TP and CP ranks of a DP rank read the
    same samples (each from the memory-mapped dataset; Megatron-LM broadcasts from TP rank 0)."""

    def __init__(self, dataset, mbs: int, dp: int, dp_rank: int, consumed: int = 0):
        self.ds, self.mbs, self.dp, self.dp_rank, self.consumed = dataset, mbs, dp, dp_rank, consumed

    def next_global_batch(self, num_micro: int) -> list[dict]:
        """This DP rank's ``num_micro`` micro-batches of the next global batch (``[mbs, s]`` tensors)."""
        import numpy as np
        import torch

        out = []
        for m in range(num_micro):
            base = self.consumed + m * self.mbs * self.dp + self.dp_rank * self.mbs
            samples = [self.ds[(base + j) % len(self.ds)] for j in range(self.mbs)]
            out.append({k: torch.stack([torch.as_tensor(np.asarray(s[k])) if not torch.is_tensor(s[k])
                                        else s[k] for s in samples])
                        for k in samples[0]})
        self.consumed += num_micro * self.mbs * self.dp
        return out


class CPBatchSplit:
    """This CP rank's part of a micro-batch, moved to ``device``.

    ``--cp-attention mtraining``: :func:`~megatron_mtraining.megatron.batch.get_batch_on_this_cp_rank_striped`
    with the run's plan (the tokens ``plan.layout.positions(plan.cp_rank, S)``); ``te``: megatron-core's
    zigzag ``get_batch_on_this_cp_rank``. Built once per run.

    Args:
        args: validated arguments (``--cp-attention``).
        plan: the run's :class:`~megatron_mtraining.plan.CPPlan`
            (:func:`~megatron_mtraining.training.build.build_plan`; ``None`` with ``te``).
        device: where the local tensors go.
    """

    def __init__(self, args, plan, device):
        if args.cp_attention == "mtraining" and plan is None:
            raise ValueError("CPBatchSplit: --cp-attention mtraining needs the run's CP plan (build_plan(args))")
        self.plan = plan if args.cp_attention == "mtraining" else None
        self.device = device

    def __call__(self, batch: dict) -> dict:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items() if k != "attention_mask"}
        if self.plan is None:
            from megatron.core.utils import get_batch_on_this_cp_rank  # Megatron's zigzag split

            return get_batch_on_this_cp_rank(batch)
        from megatron_mtraining.megatron.batch import get_batch_on_this_cp_rank_striped

        return get_batch_on_this_cp_rank_striped(batch, self.plan)

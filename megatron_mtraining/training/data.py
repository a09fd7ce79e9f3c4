"""Training data: GPTDataset splits, Megatron's pretraining sampler and the per-CP-rank batch split."""

from __future__ import annotations

import os
import struct
from typing import Optional

from .runtime import log0

__all__ = ["document_lengths", "check_indexed_dataset", "check_data", "effective_split", "build_datasets", "MicroBatches", "CPBatchSplit"]

_SCAN_CHUNK = 1 << 26                      # tokens per np.max over the memory-mapped .bin


def check_indexed_dataset(prefix: str, vocab_size: Optional[int] = None) -> Optional[str]:
    """What is wrong with the megatron indexed dataset ``prefix`` (``.bin`` + ``.idx``), or ``None``.

    Checks that the ``.idx`` parses (megatron-core's ``IndexedDataset``: header, version, dtype) and
    has exactly the size its header announces, that the sequence pointers are the running sum of
    the sequence lengths and the ``.bin`` holds exactly that many tokens (a truncated or padded file
    fails), that the document indices are ordered and end at the sequence count, and, with
    ``vocab_size``, that every token id of the ``.bin`` is in ``[0, vocab_size)`` (a full read of the
    ``.bin``, memory-mapped, in chunks of 64M tokens).

    Returns:
        a message naming the file and the violated rule, or ``None`` when the dataset is sound.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    idx, bin_ = prefix + ".idx", prefix + ".bin"
    try:
        ds = IndexedDataset(prefix, multimodal=False, mmap=True)
    except (AssertionError, ValueError, KeyError, struct.error, OSError) as e:
        return f"{idx}: not a readable megatron indexed-dataset index (truncated or corrupt: {str(e) or type(e).__name__})"
    index = ds.index
    lengths = np.asarray(index.sequence_lengths, dtype=np.int64)
    pointers = np.asarray(index.sequence_pointers, dtype=np.int64)
    docs = np.asarray(ds.document_indices, dtype=np.int64)
    n, itemsize = len(lengths), np.dtype(index.dtype).itemsize
    expected_idx = 34 + 4 * n + 8 * n + 8 * len(docs)
    if os.path.getsize(idx) != expected_idx:
        return (f"{idx}: {os.path.getsize(idx)} bytes, but its header ({n} sequences, {len(docs)} document "
                f"indices) needs {expected_idx} (truncated or corrupt)")
    if n and (lengths.min() < 0 or not np.array_equal(pointers, np.concatenate([[0], np.cumsum(lengths)[:-1]])
                                                      * itemsize)):
        return f"{idx}: sequence lengths and pointers disagree (corrupt index)"
    if len(docs) == 0 or docs[0] != 0 or docs[-1] != n or np.any(np.diff(docs) < 0):
        return f"{idx}: document indices are not an ordered list from 0 to the {n} sequences (corrupt index)"
    total = int(lengths.sum())
    if os.path.getsize(bin_) != total * itemsize:
        return (f"{bin_}: {os.path.getsize(bin_)} bytes, but {idx} describes {total} tokens of {itemsize} bytes "
                f"= {total * itemsize} bytes (truncated, or not the .bin of this .idx)")
    if vocab_size is None or total == 0:
        return None
    tokens = np.memmap(bin_, dtype=index.dtype, mode="r", shape=(total,))
    for start in range(0, total, _SCAN_CHUNK):
        chunk = tokens[start:start + _SCAN_CHUNK]
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0 or hi >= vocab_size:
            bad = int(np.argmax((chunk < 0) | (chunk >= vocab_size)))
            return (f"{bin_}: token id {int(chunk[bad])} (token {start + bad}) is outside the vocabulary "
                    f"[0, {vocab_size}) of the tokenizer: the data was made with another tokenizer than "
                    "--tokenizer-model (tokenize it again with tools/preprocess_data.py, or pass the tokenizer that "
                    "made it)")
    return None


def check_data(args, tokenizer) -> None:
    """Check every ``--data-path`` prefix before training (:func:`check_indexed_dataset`): every
    rank checks the file structure, rank 0 also reads every token id; the verdicts are gathered
    so that every rank stops with the same message.

    Raises:
        SystemExit: ``pretrain_gpt.py: error: --data-path ...: <rule>`` on every rank.
    """
    import time

    import torch.distributed as dist

    prefixes = list(args.data_path) if len(args.data_path) == 1 else list(args.data_path[1::2])
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    t0 = time.perf_counter()
    msg = None
    for prefix in prefixes:
        msg = check_indexed_dataset(prefix, tokenizer.vocab_size if rank0 else None)
        if msg:
            msg = f"pretrain_gpt.py: error: --data-path {prefix}: {msg}"
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts: list = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, msg)
        msg = next((v for v in verdicts if v), None)
    if msg:
        raise SystemExit(msg)
    log0(f" > checked --data-path ({len(prefixes)} dataset(s)): whole .bin/.idx files, token ids below the "
         f"vocabulary size {tokenizer.vocab_size} ({time.perf_counter() - t0:.1f} s)")


def document_lengths(prefix: str):
    """Token count of every document of a tokenized ``PREFIX.bin/.idx`` pair (megatron-core's
    ``IndexedDataset``): int64 numpy ``[num_documents]``.

    Raises:
        FileNotFoundError: ``PREFIX.idx`` or ``PREFIX.bin`` does not exist.
    """
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for ext in (".idx", ".bin"):
        if not os.path.isfile(prefix + ext):
            raise FileNotFoundError(f"{prefix}{ext} not found (a tokenized corpus prefix, e.g. "
                                    "data/megatron/books_text_document)")
    ds = IndexedDataset(prefix, mmap=True)
    seq = np.asarray(ds.sequence_lengths, dtype=np.int64)
    idx = np.asarray(ds.document_indices, dtype=np.int64)
    return np.add.reduceat(seq, idx[:-1]) if idx.size > 1 else np.zeros(0, dtype=np.int64)


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
    (the batch split); ``--reset-position-ids`` resets the samples' ``position_ids``. The files are
    checked first (:func:`check_data`)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    check_data(args, tokenizer)
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

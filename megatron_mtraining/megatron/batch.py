"""Split a GPT micro-batch across context-parallel ranks with a :class:`Layout`.

Replacement for ``megatron.core.utils.get_batch_on_this_cp_rank`` (which hard-codes the zigzag
"DualChunkSwap" split) for the layouts of :mod:`megatron_mtraining.layout`.
"""

from __future__ import annotations

from typing import Mapping, Optional, Union

import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.plan import CPPlan

__all__ = ["SEQ_KEYS", "get_batch_on_this_cp_rank_striped"]

#: Keys of a GPTDataset sample that carry a sequence dimension (dim 1 of a batch).
SEQ_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def get_batch_on_this_cp_rank_striped(
    batch: Mapping[str, Optional[torch.Tensor]], layout: Union[Layout, CPPlan], cp_rank: Optional[int] = None
) -> dict[str, Optional[torch.Tensor]]:
    """This CP rank's part of a GPT micro-batch.

    ``tokens``, ``labels``, ``loss_mask`` and ``position_ids`` (each ``[b, s]``) are sharded along
    dim 1 with ``layout.shard`` -> ``[b, s // cp_size]`` holding global positions
    ``layout.positions(cp_rank, s)`` in ascending order. ``labels`` must already be the shifted
    next tokens (GPTDataset does this on the whole sequence), so label ``i`` stays paired with
    token ``i`` after sharding. Other keys are passed through unchanged; ``None`` values stay
    ``None``. With ``layout.cp_size == 1`` the batch's tensors are returned as they are.

    Packed documents: when the plan masks attention by documents (``--reset-attention-mask``,
    :attr:`~megatron_mtraining.plan.CPPlan.document_mask`) and the batch has no ``packed_seq_params``,
    the documents are read from the *whole* ``tokens`` before the split (a new document starts after
    every EOD token, Megatron-LM's rule) and the result gets ``packed_seq_params``
    (:func:`~megatron_mtraining.megatron.packed.packed_seq_params_from_eod`, the same offsets on every
    CP rank) for the model's forward. ``position_ids`` are sharded as they come (GPTDataset resets
    them with ``--reset-position-ids``).

    Args:
        batch: mapping of name to tensor (or ``None``).
        layout: the run's :class:`~megatron_mtraining.plan.CPPlan` (its layout and CP rank), or the
            CP layout (its ``cp_size`` is the CP group size).
        cp_rank: this rank's index in the CP group (default: the plan's; required with a layout).

    Returns:
        A new dict with the sharded tensors.

    Raises:
        ValueError: ``attention_mask`` is not ``None`` (a dense mask is built for the zigzag query
            rows; use ``create_attention_mask=False``), sequence lengths differ between keys, the
            sequence length cannot be split by ``layout`` (message names the layout rule), or a
            document mask without ``tokens``.
    """
    packing = None
    if isinstance(layout, CPPlan):
        if cp_rank is not None and cp_rank != layout.cp_rank:
            raise ValueError(f"get_batch_on_this_cp_rank_striped: cp_rank={cp_rank} but the plan's CP rank is "
                             f"{layout.cp_rank}")
        packing = layout.packing if layout.document_mask else None
        layout, cp_rank = layout.layout, layout.cp_rank
    elif cp_rank is None:
        raise ValueError("get_batch_on_this_cp_rank_striped: cp_rank is required with a Layout (or pass the CPPlan)")
    if batch.get("attention_mask") is not None:
        raise ValueError(
            "get_batch_on_this_cp_rank_striped: attention_mask must be None "
            "(build the dataset with create_attention_mask=False / "
            "--no-create-attention-mask-in-dataloader; causality comes from the layout's positions)"
        )
    out: dict[str, Optional[torch.Tensor]] = dict(batch)
    seq_len = None
    for key in SEQ_KEYS:
        t = batch.get(key)
        if t is None:
            continue
        if t.dim() < 2:
            raise ValueError(f"batch[{key!r}] must be [b, s, ...], got shape {tuple(t.shape)}")
        if seq_len is None:
            seq_len = t.size(1)
        elif t.size(1) != seq_len:
            raise ValueError(f"batch[{key!r}] has sequence length {t.size(1)}, expected {seq_len}")
    if seq_len is None:
        return out
    layout.check_seq_len(seq_len)
    if packing is not None and batch.get("packed_seq_params") is None:
        tokens = batch.get("tokens")
        if tokens is None:
            raise ValueError("get_batch_on_this_cp_rank_striped: --reset-attention-mask needs batch['tokens'] "
                             "(documents end at EOD tokens)")
        from megatron_mtraining.megatron.packed import packed_seq_params_from_eod

        out["packed_seq_params"] = packed_seq_params_from_eod(tokens, packing.eod_token)
    if layout.cp_size == 1:
        return out
    for key in SEQ_KEYS:
        t = batch.get(key)
        if t is not None:
            out[key] = layout.shard(t, cp_rank, dim=1)
    return out

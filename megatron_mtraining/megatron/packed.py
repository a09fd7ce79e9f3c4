"""Megatron-Core's ``PackedSeqParams`` <-> :class:`~megatron_mtraining.layout.PackedDocuments`.

A packed micro-batch reaches :class:`~megatron_mtraining.megatron.attention.MTrainingAttention` as
megatron-core's ``PackedSeqParams`` (``cu_seqlens_q``/``cu_seqlens_kv`` and, where documents are
padded, ``cu_seqlens_q_padded``/``cu_seqlens_kv_padded``; self-attention: q and kv offsets equal).
Two ``qkv_format`` values are accepted:

* ``"sbhd"``: what :func:`packed_seq_params_from_eod` builds for the batch split
  (:func:`~megatron_mtraining.megatron.batch.get_batch_on_this_cp_rank_striped`). The tensors keep
  Megatron's ``[s_local, b, h, d]`` shape, ``b`` streams of ``S`` tokens each; the offsets run over
  the ``b`` streams concatenated and ``max_seqlen_q = max_seqlen_kv = S`` (Megatron's RoPE then asks
  for the ``S``-row table). Megatron-Core applies RoPE as for unpacked batches, on the rows
  :func:`~megatron_mtraining.megatron.rope.install_layout_rope` gives (positions inside documents
  with ``--reset-position-ids``).
* ``"thd"``: Megatron's packed format, ``[t_local, h, d]`` (one stream, ``b = 1``), split by the
  run's layout as a whole stream. Megatron-Core's THD RoPE assumes a per-document zigzag split, so
  with RoPE under CP > 1 this format is refused by the RoPE module; use ``"sbhd"``.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_mtraining.layout import PackedDocuments, cu_seqlens_from_eod

__all__ = ["PACKED_FORMATS", "documents_from_packed_seq_params", "packed_seq_params_from_cu_seqlens",
           "packed_seq_params_from_eod"]

PACKED_FORMATS = ("sbhd", "thd")

_CACHE_ATTR = "_mtraining_documents"


def _same(a, b) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    return a.shape == b.shape and bool(torch.equal(a.to(b.device), b))


def documents_from_packed_seq_params(params: PackedSeqParams, seq_len: int, batch_size: int) -> PackedDocuments:
    """The documents of ``params`` for ``batch_size`` streams of ``seq_len`` tokens (cached on ``params``,
    so every layer of a micro-batch shares one).

    Raises:
        ValueError: a ``qkv_format`` other than ``"sbhd"``/``"thd"``, missing ``cu_seqlens_q``, q and kv
            offsets that differ (cross attention), or offsets that do not describe the batch (see
            :meth:`~megatron_mtraining.layout.PackedDocuments.from_cu_seqlens`).
    """
    fmt = getattr(params, "qkv_format", None)
    if fmt not in PACKED_FORMATS:
        raise ValueError(f"packed_seq_params.qkv_format must be one of {PACKED_FORMATS}, got {fmt!r}")
    cached = getattr(params, _CACHE_ATTR, None)
    if cached is not None and cached.seq_len == seq_len and cached.batch_size == batch_size:
        return cached
    cu, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
    if cu is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required")
    if cu_kv is not None and not _same(cu, cu_kv):
        raise ValueError("packed_seq_params: cu_seqlens_q and cu_seqlens_kv differ; MTrainingAttention is "
                         "self-attention (the same documents for queries and keys)")
    pad, pad_kv = params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded
    if pad_kv is not None and not _same(pad if pad is not None else cu, pad_kv):
        raise ValueError("packed_seq_params: cu_seqlens_q_padded and cu_seqlens_kv_padded differ")
    docs = PackedDocuments.from_cu_seqlens(cu, seq_len, batch_size=batch_size,
                                           cu_seqlens_padded=pad if pad is not None else pad_kv)
    setattr(params, _CACHE_ATTR, docs)
    return docs


def packed_seq_params_from_eod(tokens: torch.Tensor, eod_token: int) -> PackedSeqParams:
    """``PackedSeqParams`` (``qkv_format="sbhd"``) of ``tokens [b, S]`` split after every EOD token
    (Megatron-LM's ``--reset-attention-mask`` rule), with its documents attached.

    Call it on the whole micro-batch, before the CP split: every CP rank gets the same offsets.
    """
    b, s = tokens.shape
    cu = cu_seqlens_from_eod(tokens, eod_token)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
    setattr(params, _CACHE_ATTR, PackedDocuments.from_cu_seqlens(cu, s, batch_size=b))
    return params


def packed_seq_params_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int, batch_size: int,
                                      cu_seqlens_padded: Optional[torch.Tensor] = None) -> PackedSeqParams:
    """``PackedSeqParams`` (``qkv_format="sbhd"``) of whole-batch document offsets: ``cu_seqlens``
    (and ``cu_seqlens_padded``) 1-D over ``batch_size`` streams of ``seq_len`` tokens concatenated,
    e.g. the THD offsets of Megatron-LM's data loader, with its documents attached.

    Raises:
        ValueError: as :meth:`~megatron_mtraining.layout.PackedDocuments.from_cu_seqlens` (offsets
            that do not describe the batch, a document crossing a stream boundary).
    """
    cu = cu_seqlens.reshape(-1).to(torch.int32)
    pad = None if cu_seqlens_padded is None else cu_seqlens_padded.reshape(-1).to(torch.int32)
    docs = PackedDocuments.from_cu_seqlens(cu, seq_len, batch_size=batch_size, cu_seqlens_padded=pad)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=pad,
                             cu_seqlens_kv_padded=pad, max_seqlen_q=int(seq_len), max_seqlen_kv=int(seq_len))
    setattr(params, _CACHE_ATTR, docs)
    return params


def documents_of(params: Optional[PackedSeqParams]) -> Optional[PackedDocuments]:
    """The documents attached to ``params`` by this module, or ``None``."""
    return None if params is None else getattr(params, _CACHE_ATTR, None)

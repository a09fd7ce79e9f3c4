"""Packed sequences: the document structure of a packed stream, as pure index maps.

Long-context training packs several documents into one stream of ``seq_len`` tokens. Attention
must not cross a document boundary, positions restart per document and padding contributes
nothing. The stream is described the way Megatron's THD format describes it:

* ``cu_seqlens`` (int, ``[n + 1]``, ascending, ``cu_seqlens[0] == 0``): document ``i`` has
  ``cu_seqlens[i+1] - cu_seqlens[i]`` real tokens.
* ``cu_seqlens_padded`` (optional, same shape): document ``i`` occupies
  ``[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`` of the stream; its real tokens come first, the
  rest of its slot is padding. Without it the documents are contiguous
  (``cu_seqlens_padded == cu_seqlens``).
* Tokens past the last document (``cu_seqlens_padded[-1] ... batch_size * seq_len - 1``) are padding.

With ``batch_size > 1`` the offsets run over the ``batch_size`` rows concatenated (row ``r`` is
the flat range ``[r * seq_len, (r + 1) * seq_len)``, THD's ``t = b * s``), and a document may not
cross a row boundary.

The CP layout splits the *stream as a whole* (striped: ``granularity``-token stripes dealt round
robin; zigzag: ``2 * cp_size`` chunks), not each document. A document is then an arbitrary run of
global positions, and the attention rule of every (query, key) pair, on every rank and ring step,
is one interval test on global positions::

    key t visible to query p  iff  lo[p] <= t <= hi[p]
    real query:    lo[p] = first position of p's document,  hi[p] = p
    padding query: lo[p] = seq_len,  hi[p] = -1   (sees nothing, is seen by nothing)

(plain causal attention is ``lo = 0, hi = p``). Real keys of a document lie between its start and
its real end, so padding keys fall outside every real query's interval.

Example::

    docs = PackedDocuments.from_cu_seqlens(torch.tensor([0, 5, 12]), seq_len=16)
    lo, hi = docs.key_bounds(layout, rank)     # [1, s_local] each, int64
    pos = docs.positions(layout, rank)         # [1, s_local]: position inside the document
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["PackedDocuments", "cu_seqlens_from_eod", "NO_DOCUMENTS_KEY", "documents_agreement_key"]

NO_DOCUMENTS_KEY = (0,) * 7   # PackedDocuments.agreement_key() of "no documents" (no real stream has batch 0)


def _offsets_digest(offsets: tuple) -> tuple[int, int]:
    """BLAKE2b-128 of the offsets as little-endian int64, as two signed int64."""
    digest = hashlib.blake2b(struct.pack(f"<{len(offsets)}q", *offsets), digest_size=16).digest()
    return struct.unpack("<qq", digest)


def documents_agreement_key(documents) -> tuple:
    """``documents.agreement_key()``, or :data:`NO_DOCUMENTS_KEY` for ``None``."""
    return NO_DOCUMENTS_KEY if documents is None else documents.agreement_key()


def _as_offsets(name: str, t, device) -> torch.Tensor:
    t = torch.as_tensor(t, device=device)
    if t.dim() != 1 or t.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor [num_documents + 1], got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    return t.to(torch.int64)


def cu_seqlens_from_eod(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """Document offsets of ``tokens [b, s]`` split after every EOD token (Megatron-LM's
    ``--reset-attention-mask`` / ``--reset-position-ids`` rule: the EOD token ends its document, the
    next token starts a new one; each row starts a new document).

    Returns:
        ``cu_seqlens`` int32 ``[n + 1]`` over the ``b`` rows concatenated (THD), on ``tokens.device``.

    Raises:
        ValueError: ``tokens`` is not ``[b, s]``.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, s], got shape {tuple(tokens.shape)}")
    b, s = tokens.shape
    start = torch.zeros(b, s, dtype=torch.bool, device=tokens.device)
    start[:, 0] = True
    start[:, 1:] = tokens[:, :-1] == eod_token
    starts = start.reshape(-1).nonzero().squeeze(1)
    end = torch.tensor([b * s], device=tokens.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


@dataclass(frozen=True, eq=False)
class PackedDocuments:
    """The document structure of ``batch_size`` packed streams of ``seq_len`` tokens each.

    Build it with :meth:`from_cu_seqlens` (or :meth:`from_eod`). All tensors live on one device.

    Attributes:
        seq_len: tokens per stream (the global sequence length ``S`` the layout splits).
        batch_size: number of streams ``b``.
        lo, hi: ``[b, S]`` int64, the interval of visible key positions of every query (module
            docstring); a padding token has ``lo = S``, ``hi = -1``.
        doc_start: ``[b, S]`` int64, global position of the first token of each token's document
            (``positions = arange(S) - doc_start``); 0 for padding.
        num_documents: number of documents with at least one real token.
        single_document: one document per stream covering all of it, no padding: attention is
            plain causal attention and every consumer runs its unpacked path.
        cu_seqlens, cu_seqlens_padded: the offsets (int64, host copies as tuples in ``key``).
    """

    seq_len: int
    batch_size: int
    lo: torch.Tensor
    hi: torch.Tensor
    doc_start: torch.Tensor
    num_documents: int
    single_document: bool
    cu_seqlens: tuple
    cu_seqlens_padded: tuple
    _agreed: set = field(default_factory=set, repr=False, compare=False)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, seq_len: int, batch_size: int = 1, cu_seqlens_padded=None,
                        device=None) -> "PackedDocuments":
        """Documents from THD offsets (module docstring).

        Args:
            cu_seqlens: ``[n + 1]`` integer offsets of the real tokens.
            seq_len: tokens per stream ``S``.
            batch_size: number of streams ``b`` (the offsets run over ``b * S`` tokens).
            cu_seqlens_padded: ``[n + 1]`` offsets of the documents' slots, or ``None``.
            device: where the maps go (default: that of ``cu_seqlens``).

        Raises:
            ValueError: offsets not 1-D integer, not starting at 0, decreasing, past ``b * S``,
                a document longer than its padded slot, padded offsets of another length, or a
                document that crosses a row boundary (naming the document).
        """
        seq_len, batch_size = int(seq_len), int(batch_size)
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        device = torch.device(device) if device is not None else torch.as_tensor(cu_seqlens).device
        cu = _as_offsets("cu_seqlens", cu_seqlens, device)
        pad = cu if cu_seqlens_padded is None else _as_offsets("cu_seqlens_padded", cu_seqlens_padded, device)
        if pad.numel() != cu.numel():
            raise ValueError(f"cu_seqlens_padded has {pad.numel()} entries but cu_seqlens has {cu.numel()}")
        cu_h, pad_h = tuple(cu.tolist()), tuple(pad.tolist())        # small; one host copy per micro-batch
        total = batch_size * seq_len
        for name, off in (("cu_seqlens", cu_h), ("cu_seqlens_padded", pad_h)):
            if off[0] != 0:
                raise ValueError(f"{name} must start at 0, got {off[0]}")
            if any(b < a for a, b in zip(off, off[1:])):
                raise ValueError(f"{name} must be non-decreasing, got {list(off)}")
        if pad_h[-1] > total:
            raise ValueError(f"the documents end at token {pad_h[-1]} but the batch holds "
                             f"batch_size*seq_len = {batch_size}*{seq_len} = {total} tokens")
        lengths = [b - a for a, b in zip(cu_h, cu_h[1:])]
        for i, n in enumerate(lengths):
            if n > pad_h[i + 1] - pad_h[i]:
                raise ValueError(f"document {i} has {n} tokens but its padded slot "
                                 f"[{pad_h[i]}, {pad_h[i + 1]}) holds {pad_h[i + 1] - pad_h[i]}")
            if n > 0 and pad_h[i] // seq_len != (pad_h[i] + n - 1) // seq_len:
                raise ValueError(f"document {i} (tokens {pad_h[i]} ... {pad_h[i] + n - 1}) crosses the boundary of "
                                 f"a {seq_len}-token row; packed documents must lie inside one row")
        x = torch.arange(total, device=device)
        starts = pad[:-1]
        ends = starts + (cu[1:] - cu[:-1])                          # end of each document's real tokens
        if starts.numel() == 0:
            real = torch.zeros(total, dtype=torch.bool, device=device)
            first = torch.zeros(total, dtype=torch.int64, device=device)
        else:
            doc = (torch.searchsorted(starts, x, right=True) - 1).clamp_(min=0)
            first = starts[doc]
            real = (x >= first) & (x < ends[doc])
        row_base = (x // seq_len) * seq_len
        p = x - row_base
        doc_start = torch.where(real, first - row_base, torch.zeros_like(x))
        lo = torch.where(real, doc_start, torch.full_like(x, seq_len))
        hi = torch.where(real, p, torch.full_like(x, -1))
        n_docs = sum(1 for n in lengths if n > 0)
        single = n_docs == batch_size and all(n == seq_len for n in lengths if n > 0) and \
            all(n == 0 or pad_h[i] % seq_len == 0 for i, n in enumerate(lengths))
        shape = (batch_size, seq_len)
        return cls(seq_len=seq_len, batch_size=batch_size, lo=lo.view(shape), hi=hi.view(shape),
                   doc_start=doc_start.view(shape), num_documents=n_docs, single_document=bool(single),
                   cu_seqlens=cu_h, cu_seqlens_padded=pad_h)

    @classmethod
    def from_eod(cls, tokens: torch.Tensor, eod_token: int) -> "PackedDocuments":
        """Documents of ``tokens [b, S]`` split after every EOD token (:func:`cu_seqlens_from_eod`)."""
        return cls.from_cu_seqlens(cu_seqlens_from_eod(tokens, eod_token), tokens.shape[1], tokens.shape[0])

    # ------------------------------------------------------------------ per-rank maps
    def _local(self, t: torch.Tensor, layout, rank: int) -> torch.Tensor:
        idx = layout.positions(rank, self.seq_len, device=t.device)
        return t.index_select(1, idx)

    def key_bounds(self, layout, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` of ``rank``'s local queries under ``layout``: ``[b, S // cp_size]`` int64 each
        (key ``t`` visible to local query ``i`` iff ``lo[:, i] <= t <= hi[:, i]``)."""
        return self._local(self.lo, layout, rank), self._local(self.hi, layout, rank)

    def positions(self, layout, rank: int) -> torch.Tensor:
        """Position inside its document of every local token of ``rank``: ``[b, S // cp_size]`` int64
        (0 for padding). These are the RoPE positions of a packed batch."""
        pos = torch.arange(self.seq_len, device=self.doc_start.device)[None, :] - self.doc_start
        return self._local(torch.where(self.hi >= 0, pos, torch.zeros_like(pos)), layout, rank)

    def real(self, layout=None, rank: int = 0) -> torch.Tensor:
        """``[b, S]`` (or ``rank``'s ``[b, S // cp_size]``) bool: True for tokens of a document."""
        r = self.hi >= 0
        return r if layout is None else self._local(r, layout, rank)

    def agreement_key(self) -> tuple:
        """Seven integers every CP rank must agree on: batch size, stream length, number of offsets,
        and a 128-bit BLAKE2b digest (two int64 each) of ``cu_seqlens`` and of ``cu_seqlens_padded``
        (their int64 bytes), so ranks with different offsets disagree (a weighted checksum let
        different offsets pass as equal). ``NO_DOCUMENTS_KEY`` stands for no documents."""
        return (self.batch_size, self.seq_len, len(self.cu_seqlens),
                *_offsets_digest(self.cu_seqlens), *_offsets_digest(self.cu_seqlens_padded))

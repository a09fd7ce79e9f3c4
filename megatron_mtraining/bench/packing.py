"""Packed-sequence workloads for the benchmarks: document lengths packed into streams, and the
work a document-masked ring computes per (worker, ring step).

* :func:`pack_lengths` fills a stream of ``seq_len`` tokens with documents of given lengths (a
  corpus's, read by the tool from a ``.idx`` file, or fixed ones), long documents split into pieces
  of at most ``max_doc_len`` tokens, the last document cut at the end of the stream (as a packing
  data loader does); :func:`parse_length_spec` reads ``--doc-lengths`` specs.
* :func:`packed_pair_work` / :func:`packed_tile_work`: the FLOP model of causal attention *within*
  documents over a CP layout, ``[cp, cp]`` by (query rank, key owner). Pairs count (query, key)
  pairs with ``key <= query`` in the same document (useful work); tiles count 64x64 score tiles of
  64 local query rows x 64 local keys holding at least one such pair (what the document-masked
  tile kernels compute, in full), for layouts that keep 64-token blocks whole on one rank.
  :func:`per_document_tiles` is the tile count of every document attended alone.

Pure numpy / torch; no kernels.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

__all__ = ["BLOCK", "parse_length_spec", "pack_lengths", "packed_pair_work", "packed_tile_work",
           "per_document_tiles", "causal_tiles"]

BLOCK = 64


def parse_length_spec(spec: str) -> tuple[str, Optional[list[int]]]:
    """``"corpus"`` -> ``("corpus", None)``; ``"fixed:N"`` -> ``("fixed", [N])``;
    ``"list:A,B,..."`` -> ``("list", [A, B, ...])`` (repeated cyclically).

    Raises:
        ValueError: another form, or a length < 1 (naming ``--doc-lengths``).
    """
    kind, _, rest = spec.partition(":")
    if kind == "corpus" and not rest:
        return "corpus", None
    if kind in ("fixed", "list") and rest:
        try:
            vals = [int(x) for x in rest.split(",")]
        except ValueError:
            vals = []
        if vals and all(v >= 1 for v in vals) and (kind == "list" or len(vals) == 1):
            return kind, vals
    raise ValueError(f"--doc-lengths {spec!r}: expected 'corpus', 'fixed:N' or 'list:A,B,...' with lengths >= 1")


def pack_lengths(lengths: Sequence[int], seq_len: int, max_doc_len: Optional[int] = None,
                 cycle: bool = True) -> list[int]:
    """Document lengths of one stream of ``seq_len`` tokens.

    Args:
        lengths: source document lengths (tokens), taken in order.
        seq_len: tokens in the stream.
        max_doc_len: split longer documents into pieces of this many tokens (the remainder is the
            last piece); ``None``: no split.
        cycle: start over at the first document when the source runs out (a small corpus).

    Returns:
        Lengths summing to exactly ``seq_len`` (the last one cut to fit).

    Raises:
        ValueError: no positive length, ``seq_len < 1`` or ``max_doc_len < 1``; the source runs
            out without ``cycle``.
    """
    src = [int(n) for n in lengths if int(n) > 0]
    if not src or seq_len < 1:
        raise ValueError(f"pack_lengths needs positive document lengths and seq_len >= 1 (got {len(src)} lengths, "
                         f"seq_len {seq_len})")
    if max_doc_len is not None and max_doc_len < 1:
        raise ValueError(f"--max-doc-len must be >= 1, got {max_doc_len}")
    out, left, i = [], int(seq_len), 0
    while left > 0:
        if i == len(src):
            if not cycle:
                raise ValueError(f"the documents hold {sum(src)} tokens, fewer than the stream's {seq_len}")
            i = 0
        n = src[i]
        i += 1
        pieces = [n] if max_doc_len is None else [max_doc_len] * (n // max_doc_len) + (
            [n % max_doc_len] if n % max_doc_len else [])
        for p in pieces:
            take = min(p, left)
            out.append(take)
            left -= take
            if left == 0:
                break
    return out


def _doc_id(doc_lengths: Sequence[int], seq_len: int) -> np.ndarray:
    """``[S]`` document index of every token (``-1`` past the documents: padding)."""
    ids = np.full(seq_len, -1, dtype=np.int64)
    ends = np.cumsum(doc_lengths)
    if len(doc_lengths) and ends[-1] > seq_len:
        raise ValueError(f"the documents hold {int(ends[-1])} tokens, more than the stream's {seq_len}")
    ids[:int(ends[-1]) if len(doc_lengths) else 0] = np.repeat(np.arange(len(doc_lengths)), doc_lengths)
    return ids


def _token_owners(layout, seq_len: int) -> np.ndarray:
    import torch

    layout.check_seq_len(seq_len)
    rank, _ = layout.global_to_local(torch.arange(seq_len), seq_len)
    return rank.numpy().astype(np.int64)


def packed_pair_work(doc_lengths: Sequence[int], seq_len: int, layout) -> np.ndarray:
    """``[cp, cp]`` (query rank, key owner): pairs ``(p, t)``, ``t <= p``, in the same document.

    ``doc_lengths`` are contiguous documents from token 0; tokens past their sum are padding
    (no pairs). Exact (int64 counts, returned as float64).
    """
    cp = layout.cp_size
    owner = _token_owners(layout, seq_len)
    doc = _doc_id(doc_lengths, seq_len)
    onehot = np.zeros((seq_len, cp), dtype=np.int64)
    real = doc >= 0
    onehot[np.arange(seq_len)[real], owner[real]] = 1
    csum = np.cumsum(onehot, axis=0)                       # keys of each owner at positions <= p
    starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.int64) if len(doc_lengths) else np.zeros(0)
    base = np.zeros((seq_len, cp), dtype=np.int64)          # ... before p's document starts
    s = starts[doc[real]]
    base[real] = np.where((s > 0)[:, None], csum[np.maximum(s - 1, 0)], 0)
    seen = (csum - base)[real]                              # [n_real, cp]: same-document keys <= p by owner
    out = np.zeros((cp, cp), dtype=np.int64)
    np.add.at(out, owner[real], seen)
    return out.astype(np.float64)


def _block_bounds(doc_lengths: Sequence[int], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Per 64-token block: ``lo[b]`` the first key block of its tiles, ``real[b]`` whether it has real tokens.

    A query block computes key blocks ``lo[b] .. b``: ``lo[b]`` is the block where the document of
    its first real token starts (every block in between lies inside that document)."""
    if seq_len % BLOCK:
        raise ValueError(f"the tile model needs a sequence length that is a multiple of {BLOCK}, got {seq_len}")
    nb = seq_len // BLOCK
    doc = _doc_id(doc_lengths, seq_len).reshape(nb, BLOCK)
    real = (doc >= 0).any(1)
    first = np.where(real, np.where(doc >= 0, doc, np.iinfo(np.int64).max).min(1), 0)
    starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.int64) if len(doc_lengths) else np.zeros(1)
    lo = np.where(real, starts[first] // BLOCK, np.arange(nb))
    return lo, real


def packed_tile_work(doc_lengths: Sequence[int], seq_len: int, layout) -> np.ndarray:
    """``[cp, cp]`` (query rank, key owner): score entries of the 64x64 tiles a document-masked
    tile kernel computes (``64 * 64`` per tile holding a same-document causal pair).

    Raises:
        ValueError: a layout that splits 64-token blocks across ranks (striped granularity not a
            multiple of 64, or chunks not 64-aligned), or a length that is not a multiple of 64.
    """
    cp = layout.cp_size
    owner = _token_owners(layout, seq_len).reshape(-1, BLOCK) if seq_len % BLOCK == 0 else None
    if owner is None or not (owner == owner[:, :1]).all():
        raise ValueError(f"unit 'tiles' needs 64-token blocks whole on one rank; {layout} at {seq_len} splits them "
                         "(use --unit pairs)")
    blk_owner = owner[:, 0]
    lo, real = _block_bounds(doc_lengths, seq_len)
    nb = lo.size
    onehot = np.zeros((nb + 1, cp), dtype=np.int64)
    onehot[np.arange(1, nb + 1), blk_owner] = 1
    csum = np.cumsum(onehot, axis=0)                        # csum[x, o]: blocks < x owned by o
    cnt = csum[np.arange(1, nb + 1)] - csum[lo]             # key blocks lo..b by owner, [nb, cp]
    cnt[~real] = 0
    out = np.zeros((cp, cp), dtype=np.int64)
    np.add.at(out, blk_owner, cnt)
    return out.astype(np.float64) * BLOCK * BLOCK


def causal_tiles(n: int) -> int:
    """64x64 tiles of one causal sequence of ``n`` tokens (``ceil(n/64)`` query tiles, lower triangle)."""
    t = -(-int(n) // BLOCK)
    return t * (t + 1) // 2


def per_document_tiles(doc_lengths: Sequence[int]) -> int:
    """Tiles of every document attended alone (each its own causal sequence)."""
    return int(sum(causal_tiles(n) for n in doc_lengths))

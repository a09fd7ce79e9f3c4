"""Index format shared by the sparse pattern converter, the torch reference and the Triton kernels.

Global pattern (MTraining §3.2, per sample ``b`` and query head ``h``):
    * ``slash`` diagonals at **block level**: a set ``D`` of block offsets ``d >= 0``; key block
      ``kb`` is active for query block ``qb`` iff ``qb - kb in D`` (blocks of ``block_size`` = 64
      tokens, global coordinates);
    * ``vertical`` columns at **token level**: a set ``V`` of global key positions.
    The attention mask is ``M(p, t) = (t <= p) and ((p // 64 - t // 64) in D or t in V)``.

Per ring step (query rank ``r``, K/V owner ``o``), in **local** coordinates of the two shards
(local 64-row query block ``i`` of rank ``r``, local key block / key token of owner ``o``):

    block_count  [b, hq, nqb]          int32   number of active key blocks of query block i
    block_index  [b, hq, nqb, max_nb]  int32   their local key-block indices, ascending; entries
                                               at positions >= block_count are padding (ignored)
    column_count [b, hq, nqb]          int32   number of vertical key columns of query block i
                                               that are NOT inside an active block of i
    column_index [b, hq, nqb, max_nc]  int32   their local key-token indices, ascending; padding
                                               beyond column_count is ignored
    causal       bool                          True iff ``o == r`` (same shard): tiles must then be
                                               masked by local index (key local <= query local),
                                               which equals the global causal mask because local
                                               order is monotone in global position. For ``o != r``
                                               the indices contain only keys strictly in the past
                                               of the whole query block, so no mask is needed.
                                               The mask applies to block tiles AND to columns (a
                                               column may sit in the diagonal block when d = 0 is
                                               not selected; leaving it unmasked leaks the future).

The head dimension ``hq`` is the query heads' for a pattern per query head; for a pattern per GQA
group (``VerticalSlashConfig.share_pattern="kv_group"``) it is ``hkv`` and query head ``h`` reads row
``h // (hq / hkv)`` (:meth:`StepIndices.per_query_head` repeats the rows for kernels that need one
per query head).

Padding written by :mod:`megatron_mtraining.patterns.convert` is ``-1`` (kernels must not read
entries at positions ``>= count``); widths are the max counts, at least 1.

Packed documents (optional, set by
:func:`~megatron_mtraining.patterns.convert.restrict_to_documents`): ``doc_lo, doc_hi`` ``[b, sq]``
int64, the global key bounds of every local query (key ``t`` visible iff ``doc_lo <= t <= doc_hi``,
:meth:`~megatron_mtraining.layout.PackedDocuments.key_bounds`; a padding query has ``doc_lo > doc_hi``),
and ``key_pos`` ``[sk]`` int64, the global position of every local key of the owner. A kernel must
then mask every (query, key) pair of a block tile or column by these bounds (which include
causality); ``None`` (default): no documents.

``nqb = s_local // block_size``. The layouts must keep 64-token blocks whole: striped with
``granularity % block_size == 0`` or zigzag with ``(seq_len / (2*cp)) % block_size == 0``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["BLOCK_SIZE", "ColumnUnion", "DiagonalBlocks", "KnownMax", "StepIndices", "packed_index_lists"]

BLOCK_SIZE = 64

#: Extra slots of :func:`packed_index_lists`'s buffer that take the dropped entries.
_LIST_SPREAD = 64


def packed_index_lists(mask: torch.Tensor, width: Optional[int] = None, fill: int = -1,
                       dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise lists of the ``True`` positions of a boolean map, ascending and packed left.

    Args:
        mask: ``[..., C]`` bool (e.g. a tile map: query block x key block); any strides.
        width: the lists' width; ``None``: ``max(1, count.max())`` (one host read), else a bound
            known on the host (no device read; lists longer than ``width`` are cut).
        fill: the value written at positions ``>= count``.
        dtype: dtype of both outputs.

    Returns:
        ``(count, index)``: ``count [...]`` = ``mask.sum(-1)``, ``index [..., width]`` (contiguous) the
        positions (``0 <= index < C``) at ``< count``, ``fill`` beyond.

    No sort: the slot of each ``True`` entry in its row's list is the running count before it
    (``cumsum - 1``); its column is scattered there, into a buffer ``_LIST_SPREAD`` slots wider than
    ``width`` whose extra slots take (and drop) the ``False`` entries and those past ``width`` (spread
    over several slots: writes to one shared slot would serialise on a GPU).
    """
    count = mask.sum(-1, dtype=dtype)
    if width is None:
        width = max(1, int(count.max()) if count.numel() else 1)
    c = mask.shape[-1]
    spread = max(1, min(c, _LIST_SPREAD))
    col = torch.arange(c, device=mask.device)
    slot = torch.cumsum(mask, -1)                                       # int64: 1 + the slot in the row's list
    keep = mask.bool() & (slot <= width)
    slot = torch.where(keep, slot.sub_(1), width + col % spread, out=slot)  # in place: one int64 temporary
    out = torch.full((*mask.shape[:-1], width + spread), fill, dtype=dtype, device=mask.device)
    out.scatter_(-1, slot, col.to(dtype).expand(mask.shape))
    return count, out[..., :width].contiguous()


class _PinnedToPair:
    """Base of the host records below that describe two tensors of one :class:`StepIndices`: valid only
    while those are the very tensors the record was made for, unmodified (identity and version
    counter). Writes that bypass the version counter (``.data``, NumPy views) are not seen."""

    __slots__ = ("_refs", "_versions")

    def _pin(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self._refs = (weakref.ref(a), weakref.ref(b))
        self._versions = (a._version, b._version)

    def valid_for(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return self._refs[0]() is a and self._refs[1]() is b and self._versions == (a._version, b._version)


class KnownMax(_PinnedToPair):
    """Host copies of ``block_count.max()`` and ``column_count.max()`` of one :class:`StepIndices`
    (the converter reads them anyway for the index widths), valid only while its two count tensors
    are the very tensors they were read from, unmodified (identity and version counter).

    ``exact=False``: ``block`` and ``column`` are upper bounds known on the host (the static index
    widths of a conversion that reads nothing back from the device), not the maxima.

    ``union`` (optional): a host upper bound of the number of distinct key columns that the query
    tiles of one index row list together (the converter's static column width bounds it: every
    column of a row is one of the row's vertical lines held by the owner). The Triton backward's
    column plan sizes its union buffer with it; ``None``: not known."""

    __slots__ = ("block", "column", "exact", "union")

    def __init__(self, block_count: torch.Tensor, column_count: torch.Tensor, block: int, column: int,
                 exact: bool = True, union: Optional[int] = None):
        self.block, self.column, self.exact = int(block), int(column), bool(exact)
        self.union = None if union is None else int(union)
        self._pin(block_count, column_count)

    @classmethod
    def of(cls, block_count: torch.Tensor, column_count: torch.Tensor, block: int, column: int,
           exact: bool = True, union: Optional[int] = None):
        """A record, or ``None`` for inference tensors (they keep no version counter)."""
        if block_count.is_inference() or column_count.is_inference():
            return None
        return cls(block_count, column_count, block, column, exact, union)


class DiagonalBlocks(_PinnedToPair):
    """Host record that the block lists of one :class:`StepIndices` are block diagonals: every index
    row ``(b, h)`` has one set ``D`` of offsets ``d >= 0`` and query block ``i`` lists exactly the key
    blocks ``i - d`` for ``d in D`` with ``d <= i``, ascending, with as many query as key blocks
    (MTraining §3.2's slash rule at ``cp_size == 1``, and on every ring step of the striped layout with one
    block per stripe, where global offset ``d`` between local blocks ``i`` and ``j`` is ``(i - j) * cp +
    rank - owner``). The last query block then lists every offset of its row. The Triton
    backward builds its inverted block index from these offsets without a sort
    (:func:`~megatron_mtraining.ops.triton.launch.plan_from_indices`).

    Valid only while ``block_count`` and ``block_index`` are the very tensors it was made for, unmodified
    (identity and version counter), like :class:`KnownMax`."""

    __slots__ = ()

    def __init__(self, block_count: torch.Tensor, block_index: torch.Tensor):
        self._pin(block_count, block_index)

    @classmethod
    def of(cls, block_count: torch.Tensor, block_index: torch.Tensor) -> Optional["DiagonalBlocks"]:
        """A record, or ``None`` for inference tensors (they keep no version counter). Writes that bypass
        the version counter (``.data``, NumPy views) are not seen, as for :class:`KnownMax`."""
        if block_count.is_inference() or block_index.is_inference() or block_index.dim() != 4:
            return None
        return cls(block_count, block_index)


class ColumnUnion(_PinnedToPair):
    """Device record, made by the conversion at ``cp_size == 1`` from a pattern whose vertical lists are
    strictly ascending (``VerticalSlashPattern.vertical_ascending``), of every index row's column union and of
    which of its columns each query block lists (MTraining §3.3; the Triton backward's column plan,
    :func:`~megatron_mtraining.ops.triton.launch.plan_from_indices`, takes them instead of building them
    from the lists).

    Attributes:
        union: ``[b, h, nv]`` int32, the row's vertical positions, strictly ascending, ``-1`` padded at the
            end: every column a query block of the row lists is one of them.
        bits: ``[b, h, nqb, ceil(nv / 64)]`` int64: bit ``j % 64`` of word ``j // 64`` is set iff query
            block ``i`` lists column ``union[b, h, j]``.

    Valid only while ``column_count`` and ``column_index`` are the very tensors it was made for, unmodified
    (identity and version counter), like :class:`KnownMax`: indices rebuilt from them (documents, head
    repeats) carry none, and their plans build the union from the lists."""

    __slots__ = ("union", "bits")

    def __init__(self, union: torch.Tensor, bits: torch.Tensor, column_count: torch.Tensor,
                 column_index: torch.Tensor):
        self.union, self.bits = union, bits
        self._pin(column_count, column_index)

    @classmethod
    def of(cls, union: torch.Tensor, bits: torch.Tensor, column_count: torch.Tensor,
           column_index: torch.Tensor) -> Optional["ColumnUnion"]:
        """A record, or ``None`` for inference tensors (they keep no version counter).

        Raises:
            ValueError: shapes that do not match (``union [b, h, nv]``, ``bits [b, h, nqb, ceil(nv / 64)]`` with
                the ``[b, h, nqb]`` of ``column_count``).
        """
        b, h, nqb = column_count.shape
        nv = union.shape[-1]
        if union.shape != (b, h, nv) or bits.shape != (b, h, nqb, -(-nv // 64)) or bits.dtype != torch.int64:
            raise ValueError(f"ColumnUnion: union {tuple(union.shape)} and bits {tuple(bits.shape)} {bits.dtype} do not "
                             f"match column_count {tuple(column_count.shape)} (union [b, h, nv], bits int64 "
                             "[b, h, nqb, ceil(nv / 64)])")
        if column_count.is_inference() or column_index.is_inference():
            return None
        return cls(union, bits, column_count, column_index)

    def repeat_blocks(self, f: int, column_count: torch.Tensor, column_index: torch.Tensor) -> Optional["ColumnUnion"]:
        """The record of indices whose query blocks are each split into ``f`` (every sub-block lists its
        block's columns: :func:`~megatron_mtraining.patterns.convert.refine_indices`), for their new
        ``column_count`` / ``column_index``."""
        return ColumnUnion.of(self.union, self.bits.repeat_interleave(f, dim=2), column_count, column_index)


@dataclass
class StepIndices:
    """Sparse work of one (query rank, K/V owner) pair; see the module docstring for shapes.

    ``known_max`` (optional, set by the converter): the counts' maxima on the host, so that
    :meth:`is_empty` needs no device read while they are valid (:class:`KnownMax`). ``diagonal``
    (optional, set by the converter where the layout allows it): the block lists are block diagonals
    (:class:`DiagonalBlocks`), which the Triton backward's plan uses. ``column_union`` (optional, set by the
    Triton conversion at cp 1): each row's column union and per-block column masks (:class:`ColumnUnion`),
    which the Triton backward's column plan uses."""

    block_count: torch.Tensor
    block_index: torch.Tensor
    column_count: torch.Tensor
    column_index: torch.Tensor
    causal: bool
    block_size: int = BLOCK_SIZE
    known_max: Optional[KnownMax] = field(default=None, compare=False, repr=False)
    doc_lo: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    doc_hi: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    key_pos: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    diagonal: Optional[DiagonalBlocks] = field(default=None, compare=False, repr=False)
    column_union: Optional[ColumnUnion] = field(default=None, compare=False, repr=False)

    @property
    def diagonal_blocks(self) -> bool:
        """True when the block lists are known block diagonals (a valid :class:`DiagonalBlocks`)."""
        return self.diagonal is not None and self.diagonal.valid_for(self.block_count, self.block_index)

    @property
    def given_column_union(self) -> Optional[ColumnUnion]:
        """The :class:`ColumnUnion` record when it is valid for these column lists (and there are no
        documents), else ``None``."""
        u = self.column_union
        if u is None or self.doc_lo is not None or not u.valid_for(self.column_count, self.column_index):
            return None
        return u

    @property
    def has_documents(self) -> bool:
        """True when the pairs must be masked by packed-document bounds (``doc_lo``/``doc_hi``/``key_pos``)."""
        return self.doc_lo is not None

    @property
    def num_heads(self) -> int:
        """Heads of the index tensors: ``hq`` (a pattern per query head), ``hkv`` (one per GQA
        group, ``share_pattern="kv_group"``: query head ``h`` reads row ``h // (hq / hkv)``) or 1."""
        return self.block_count.shape[1]

    def per_query_head(self, hq: int) -> "StepIndices":
        """These indices with one row per query head (``self`` if it has ``hq`` heads already): each
        row of a per-group (or shared) index repeated for the query heads that read it, so the heads
        of a group are adjacent. For kernels without grouped indices (the torch reference, FA4).

        Raises:
            ValueError: ``hq`` is not a multiple of :attr:`num_heads`.
        """
        h = self.num_heads
        if h == hq:
            return self
        if h < 1 or hq % h:
            raise ValueError(f"StepIndices with {h} heads cannot serve {hq} query heads (GQA needs hq % heads == 0)")
        r = hq // h
        rep = lambda t: t.repeat_interleave(r, dim=1)  # noqa: E731
        k = self.known_max
        out = StepIndices(rep(self.block_count), rep(self.block_index), rep(self.column_count),
                          rep(self.column_index), self.causal, self.block_size,
                          doc_lo=self.doc_lo, doc_hi=self.doc_hi, key_pos=self.key_pos)
        if k is not None and k.valid_for(self.block_count, self.column_count):
            out.known_max = KnownMax.of(out.block_count, out.column_count, k.block, k.column, k.exact, k.union)
        if self.diagonal_blocks:                     # repeated rows keep their offsets
            out.diagonal = DiagonalBlocks.of(out.block_count, out.block_index)
        return out

    def is_empty(self) -> bool:
        """True when no query block has any key on this step (the step is skipped). No host sync when
        ``known_max`` is valid for the count tensors, else two.

        With upper bounds only (``known_max.exact`` false, static widths) the answer comes from the
        bounds: ``False`` unless both are 0, so a step that happens to be empty still runs; its
        kernels see zero counts, which they treat as rows without keys (``out = 0``, ``lse = -inf``)."""
        k = self.known_max
        if k is not None and k.valid_for(self.block_count, self.column_count):
            return k.block == 0 and k.column == 0
        return int(self.block_count.max()) == 0 and int(self.column_count.max()) == 0

"""Launchers of the Triton sparse kernels and the index preprocessing they need.

A :class:`SparsePlan` holds, for one ring step, everything the kernels read besides Q/K/V:

* forward / dQ side (per 64-row query tile): ``block_count``, ``block_split`` (how many leading
  slots need no mask), ``block_index``, ``column_count``, ``column_index`` and the mask mode;
* packed documents (optional, sparse steps): per-query key bounds ``doc_lo``/``doc_hi`` and the
  keys' global positions ``k_pos``; every tile the splits leave masked is also masked by them;
* dK/dV side (built on the first backward, or ahead of it by :func:`prebuild_backward_plans`):
  the *inverted* block index in CSR form
  (``kv_offsets``, ``kv_entries``: for each (batch, KV head, key block) the ascending list of
  ``r * nqb + qb`` — query head ``g * rep + r`` and query tile ``qb`` that list the block), sorted
  from the block lists, or for block diagonals (``diagonal``: the slash blocks of most layouts) written from
  each row's offsets by one kernel; none for a plan whose indices list no block (``no_blocks``);
* vertical-column side (built on the first backward that adds the columns by the column kernel, i.e.
  unless ``KernelConfig.col_atomic_fast`` in the fast mode): per query head
  the union ``U`` of its columns (ascending), and per (query tile, 64-column chunk of ``U``) a
  64-bit mask of the columns the tile lists.

Index tensors may have size-1 batch / head dimensions (shared lists, e.g. dense ring steps);
they are broadcast through zero strides, never copied. Their head dimension is ``hq`` (a pattern
per query head), 1, or ``hkv`` (a pattern per GQA group): then query head ``h`` reads row
``h // (hq / hkv)``, the forward (and optionally the dQ) kernel packs several of a group's heads
into one tile (``KernelConfig.pack_gqa``, :func:`_heads`) and the column plan holds one union per group.

Besides the sparse kernels: :func:`attention_delta` (the backward's ``rowsum(dout * out)``) and
:func:`attention_merge` (the LSE merge of two partial results in one pass, e.g. FlashAttention-4's
slash blocks with the Triton columns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ...common import cuda_index, triton_runs_on

BLOCK = 64          # query tile rows = key block width (the StepIndices block size)
BLOCK_C = 64        # vertical columns gathered per tile
_SPREAD = 64        # sentinel slots that padding entries of the plans' scatters are spread over
_SCAN_BLOCK = 4096  # elements per loop step of the one-program scans (column union, diagonal offsets)


def _kernels():
    from . import kernels as K   # lazy: see kernels.py
    return K


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


@dataclass
class SparsePlan:
    block_count: torch.Tensor            # [B', H', nqb] int32
    block_split: torch.Tensor            # [B', H', nqb] int32 (slots [0, split) need no mask)
    block_index: torch.Tensor            # [B', H', nqb, max_nb] int32
    column_count: Optional[torch.Tensor]  # [B', H', nqb] int32 or None (no columns)
    column_index: Optional[torch.Tensor]  # [B', H', nqb, max_nc] int32
    mask_mode: int                       # 0 none, 1 local causal, 2 positions, 3 position bounds
    q_pos: Optional[torch.Tensor] = None  # [sq] int32 (mode 2); [2 * sq] = [hi; lo] (mode 3)
    k_pos: Optional[torch.Tensor] = None  # [sk] int32 (modes 2, 3)
    row_block: int = BLOCK                # query rows per tile of the forward / dQ kernels (64 or 128)
    kv_plan: Optional["SparsePlan"] = None  # plan with 64-row tiles for the dK/dV kernel (if row_block != 64)
    _kv: dict = field(default_factory=dict, repr=False)
    _col: dict = field(default_factory=dict, repr=False)
    _pending: Optional[object] = field(default=None, repr=False)  # CUDA event: backward plans built on a side stream
    _column_split: Optional[torch.Tensor] = field(default=None, repr=False)
    static: bool = False                  # backward plans at host-known sizes (no device read; see _kv_csr)
    column_union_max: Optional[int] = None  # host bound of the distinct columns of one index row (static plans)
    doc_lo: Optional[torch.Tensor] = None  # [B'', sq] int32 document key bounds (packed documents), with k_pos
    doc_hi: Optional[torch.Tensor] = None  # [B'', sq] int32 (a padding query: lo > hi)
    diagonal: bool = False                # block lists are block diagonals (StepIndices.diagonal_blocks)
    column_union: Optional[tuple] = None  # (union [B', H', nv] int32 ascending, -1 padded; masks [B', H', nqb,
    #                                       ceil(nv / 64)] int64): the column plan's union, given (ColumnUnion)
    _diag_rows: Optional[tuple] = field(default=None, repr=False)  # their _diagonal_rows (causal plans)
    no_blocks: bool = False               # every block count is 0 (a columns-only step, known on the host): no
    #                                       block split, no inverted block index; the backward writes zero dK/dV
    #                                       instead of running the dK/dV kernel and the dQ kernel skips its block
    #                                       loops (plan_from_indices(..., no_blocks=True))

    @property
    def has_documents(self) -> bool:
        """The kernels also mask by the per-query document bounds ``doc_lo <= k_pos <= doc_hi``."""
        return self.doc_lo is not None

    @property
    def has_columns(self) -> bool:
        return self.column_index is not None and self.column_index.shape[-1] > 0

    @property
    def kv_source(self) -> "SparsePlan":
        """The plan the dK/dV kernel reads (``kv_plan`` if set, else this one)."""
        return self.kv_plan if self.kv_plan is not None else self

    def column_split(self) -> Optional[torch.Tensor]:
        """``[B', H', nqb]`` int32: number of leading column slots that every row of the tile sees
        (mode 0: all of them; mode 1: the leading columns left of the tile's first row, all of the
        columns before the tile when the lists are ascending, as StepIndices requires; any order
        stays correct, it only leaves more chunks masked; with documents a column must also lie inside
        every row's document bounds). The kernels run whole 64-column chunks of
        them unmasked. ``None`` for position masks (mode 2) or 128-row tiles, where every column
        chunk is masked. Cached."""
        if not self.has_columns or self.mask_mode >= 2 or self.row_block != BLOCK:
            return None
        if self._column_split is None:
            ci, cc = self.column_index, self.column_count
            if self.mask_mode == 0 and not self.has_documents:
                self._column_split = cc
            elif self.mask_mode == 1 and not self.has_documents:
                self._column_split = _leading_below(ci, cc, BLOCK)
            else:
                ok = torch.ones_like(ci, dtype=torch.bool)
                if self.mask_mode == 1:
                    first_row = torch.arange(ci.shape[-2], device=ci.device, dtype=torch.int32)[:, None] * BLOCK
                    ok = ci < first_row
                if self.has_documents:
                    lo_max, hi_min = _tile_bounds(self.doc_lo, self.doc_hi)
                    t = self.k_pos.long()[ci.long().clamp(min=0)]
                    ok = ok & (t >= lo_max[:, None, :, None]) & (t <= hi_min[:, None, :, None])
                self._column_split = _leading_split(ci, cc, ok)
        return self._column_split

    def columns_by_atomics(self, deterministic: bool, config: "KernelConfig") -> bool:
        """Whether the backward adds the columns' dK/dV with atomics (fast mode) instead of the
        deterministic column kernel and its plan."""
        return (not deterministic) and self.has_columns and config.col_atomic_fast


def _leading_split(block_index: torch.Tensor, block_count: torch.Tensor, unmasked: torch.Tensor) -> torch.Tensor:
    """Number of leading valid slots whose block satisfies ``unmasked`` (robust to any order): the
    first slot that fails, found by one reduction (``argmax`` returns the first maximum)."""
    n = block_index.shape[-1]
    if n == 0:
        return torch.zeros(block_count.shape, dtype=torch.int32, device=block_count.device)
    slot = torch.arange(n, device=block_index.device)
    bad = ~(unmasked & (slot < block_count[..., None]))
    first = bad.to(torch.uint8).argmax(-1)                               # 0 when no slot fails ...
    return torch.where(bad.any(-1), first, n).to(torch.int32)            # ... then every slot passes


def _leading_below(index: torch.Tensor, count: torch.Tensor, scale: int) -> torch.Tensor:
    """:func:`_leading_split` of the causal rule ``index < tile * scale`` (``scale`` 1: key blocks left of
    the tile; ``BLOCK``: key columns left of its first row): ``[B', H', nqb]`` int32, any order of the
    lists. Where Triton runs, one kernel reads each row's slots only up to its first failing one
    (about the listed entries) instead of several passes over the whole ``[B', H', nqb, width]`` index."""
    lead = torch.broadcast_shapes(index.shape[:-1], count.shape)
    if len(lead) != 3 or 0 in index.shape[-2:] or not triton_runs_on(index.device):
        tile = torch.arange(index.shape[-2], device=index.device, dtype=torch.int32)[:, None] * scale
        return _leading_split(index, count, index < tile)
    index, count = index.expand(*lead, index.shape[-1]), count.expand(lead)
    B_, H_, nqb, width = index.shape
    out = torch.empty((B_, H_, nqb), dtype=torch.int32, device=index.device)
    _kernels()._leading_below_kernel[(nqb, H_, B_)](
        index, count, out, *index.stride(), *count.stride(), H_, nqb, SCALE=scale, BLOCK_J=64, num_warps=1)
    return out


def _tile_bounds(doc_lo: torch.Tensor, doc_hi: torch.Tensor):
    """``(lo_max, hi_min)`` ``[B'', nqb]`` int64 of 64-row query tiles: a key ``t`` with ``lo_max <= t
    <= hi_min`` is visible to every row of the tile (an empty range when the tile has a padding row)."""
    b, sq = doc_lo.shape
    lo = doc_lo.long().view(b, sq // BLOCK, BLOCK)
    hi = doc_hi.long().view(b, sq // BLOCK, BLOCK)
    real = (lo <= hi).all(-1)
    hi_min = hi.amin(-1)
    return lo.amax(-1), torch.where(real, hi_min, torch.full_like(hi_min, -1))


def plan_from_indices(block_count, block_index, column_count, column_index, causal: bool,
                      static: bool = False, column_union_max: Optional[int] = None,
                      doc_lo: Optional[torch.Tensor] = None, doc_hi: Optional[torch.Tensor] = None,
                      key_pos: Optional[torch.Tensor] = None, diagonal: bool = False,
                      column_union: Optional[tuple] = None, no_blocks: bool = False) -> SparsePlan:
    """Plan of a :class:`~megatron_mtraining.patterns.indices.StepIndices` (local-index causal mask).

    ``static``: the backward plans get sizes known on the host (no device read, the CUDA default of
    :func:`~megatron_mtraining.ops.triton.plan_for`); ``column_union_max``: a host upper bound of the
    distinct columns that one index row's query tiles list together (default: ``min(sk, nqb *
    max_nc)``, always valid; a smaller bound that is wrong would drop columns).

    ``doc_lo, doc_hi`` (``[b, sq]``) and ``key_pos`` (``[sk]``): packed documents
    (``StepIndices.has_documents``; key ``t`` visible to query ``i`` iff ``doc_lo[i] <= key_pos[t] <=
    doc_hi[i]``, global positions below 2**31). A block or column runs unmasked only if it lies
    inside the bounds of every row of the tile (and, causally, left of the tile); all others are
    masked by the bounds too.

    ``diagonal``: the block lists are block diagonals (:class:`~megatron_mtraining.patterns.indices.DiagonalBlocks`:
    query tile ``i`` lists ``i - d`` for one offset set ``d in D`` per index row, ascending, with as
    many query tiles as key blocks). Then the causal split and the backward's inverted block index
    come from each row's offsets (:func:`_diagonal_rows`) without a sort; the plan is the same.
    Ignored with documents.

    ``column_union``: ``(union, masks)`` of a
    :class:`~megatron_mtraining.patterns.indices.ColumnUnion` valid for ``column_index`` (each index row's
    columns, strictly ascending and ``-1`` padded, a superset of what its tiles list, and per tile the
    64-bit masks of the slots it lists): the backward's column plan takes them as its union and tile
    masks instead of building them from the lists (:func:`_col_plan`; the same columns, split into
    chunks of the given union). Ignored with documents.

    ``no_blocks``: the caller knows that every block count is 0 (a columns-only step, e.g. from a valid
    ``known_max`` with ``block == 0``; a wrong flag drops the listed blocks from the backward): the plan
    builds no block split (``block_split`` is the zero counts) and no diagonal rows, and its backward no
    inverted block index (:attr:`SparsePlan.no_blocks`). The same outputs."""
    block_count, block_index = _i32(block_count), _i32(block_index)
    docs = doc_lo is not None
    if docs and (doc_hi is None or key_pos is None):
        raise ValueError("packed documents need doc_lo, doc_hi and key_pos together")
    no_blocks = bool(no_blocks)
    diagonal = (bool(diagonal) and not docs and not no_blocks and block_index.dim() == 4
                and block_index.shape[-2] > 0)
    diag_rows = None
    if no_blocks:                # nothing to split: the kernels' block loops run zero steps
        split = block_count
    elif diagonal and causal:    # the diagonal tile (offset 0, the last slot) is the only masked one
        diag_rows, split = _diagonal_split(block_index, block_count)
    elif causal and not docs:
        split = _leading_below(block_index, block_count, 1)
    elif causal or docs:
        nqb = block_count.shape[-1]
        ok = torch.ones_like(block_index, dtype=torch.bool)
        if causal:
            qb = torch.arange(nqb, device=block_index.device, dtype=torch.int32)
            ok = block_index < qb[:, None]
        if docs:
            lo_max, hi_min = _tile_bounds(doc_lo, doc_hi)               # [B'', nqb]
            kp = key_pos.long().view(-1, BLOCK)
            kb = block_index.long().clamp(min=0)
            kmin, kmax = kp.amin(1)[kb], kp.amax(1)[kb]
            ok = ok & (kmin >= lo_max[:, None, :, None]) & (kmax <= hi_min[:, None, :, None])
        split = _leading_split(block_index, block_count, ok)
    else:
        split = block_count
    has_cols = column_index is not None and column_index.shape[-1] > 0
    bound = lambda t: _i32(t.clamp(-1, torch.iinfo(torch.int32).max)).contiguous() if docs else None  # noqa: E731
    return SparsePlan(block_count, split, block_index,
                      _i32(column_count) if has_cols else None, _i32(column_index) if has_cols else None,
                      1 if causal else 0, k_pos=bound(key_pos), static=bool(static),
                      column_union_max=column_union_max, doc_lo=bound(doc_lo), doc_hi=bound(doc_hi),
                      diagonal=diagonal, _diag_rows=diag_rows,
                      column_union=column_union if has_cols and not docs else None, no_blocks=no_blocks)


def dense_plan(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool = True, row_block: int = BLOCK
               ) -> Optional[SparsePlan]:
    """Plan of dense attention between two shards given the global positions of their tokens.

    Key block ``kb`` (64 keys) is listed for a query tile (``row_block`` rows) iff some key of it is
    visible to some query of the tile (``min k_pos <= max q_pos``); it needs a mask iff
    ``max k_pos > min q_pos``. Positions must be ascending. Returns ``None`` when no key is visible
    to any query. Lists are shared by every batch entry and head (size-1 dims). With
    ``row_block=128`` the forward/dQ kernels run 128-row tiles (8 warps) and the dK/dV kernel uses
    the 64-row plan in ``kv_plan``."""
    sq, sk = q_pos.numel(), k_pos.numel()
    if sq % row_block:
        row_block = BLOCK
    nqb, nkb = sq // row_block, sk // BLOCK
    dev = q_pos.device
    qp = q_pos.view(nqb, row_block)
    kp = k_pos.view(nkb, BLOCK)
    if causal:
        qmin, qmax = qp.min(1).values, qp.max(1).values
        kmin, kmax = kp.min(1).values, kp.max(1).values
        visible = kmin[None, :] <= qmax[:, None]            # [nqb, nkb]
        unmasked = kmax[None, :] <= qmin[:, None]
    else:
        visible = torch.ones(nqb, nkb, dtype=torch.bool, device=dev)
        unmasked = visible
    count = visible.sum(1).to(torch.int32)
    if int(count.max()) == 0:
        return None
    max_nb = int(count.max())
    # ascending key blocks: the visible ones are a prefix (k_pos ascending), unmasked a prefix of it
    index = torch.arange(nkb, device=dev, dtype=torch.int32)[None, :max_nb].expand(nqb, max_nb).contiguous()
    split = (unmasked & visible).sum(1).to(torch.int32)
    mode = 2 if causal and bool((split < count).any()) else 0
    plan = SparsePlan(count[None, None], split[None, None], index[None, None], None, None, mode,
                      _i32(q_pos).contiguous(), _i32(k_pos).contiguous(), row_block=row_block)
    if row_block != BLOCK:
        plan.kv_plan = dense_plan(q_pos, k_pos, causal, BLOCK)
        plan.kv_plan.mask_mode = plan.mask_mode
    return plan


def document_plan(q_lo: torch.Tensor, q_hi: torch.Tensor, k_pos: torch.Tensor) -> Optional[SparsePlan]:
    """Plan of dense attention between two shards under per-query key bounds (packed documents).

    Key ``t`` is visible to query ``i`` iff ``q_lo[i] <= k_pos[t] <= q_hi[i]`` (``[sq]`` int64 each;
    ``k_pos`` ascending). Key block ``kb`` is listed for a 64-row query tile iff it intersects the
    union of the tile's intervals (blocks of other documents are not listed); it runs unmasked iff it
    lies inside every row's interval, otherwise with the bounds mask (mode 3). Returns ``None`` when
    no key is visible to any query. 64-row tiles only."""
    sq, sk = q_lo.numel(), k_pos.numel()
    nqb, nkb = sq // BLOCK, sk // BLOCK
    dev = q_lo.device
    big = torch.iinfo(torch.int64).max
    lo, hi = q_lo.view(nqb, BLOCK), q_hi.view(nqb, BLOCK)
    real = lo <= hi
    tile_lo = torch.where(real, lo, torch.full_like(lo, big)).amin(1)
    tile_hi = torch.where(real, hi, torch.full_like(hi, -1)).amax(1)
    kp = k_pos.view(nkb, BLOCK)
    kmin, kmax = kp.amin(1), kp.amax(1)
    visible = (kmin[None, :] <= tile_hi[:, None]) & (kmax[None, :] >= tile_lo[:, None])
    unmasked = visible & real.all(1)[:, None] & (kmax[None, :] <= hi.amin(1)[:, None]) & \
        (kmin[None, :] >= lo.amax(1)[:, None])
    count = visible.sum(1).to(torch.int32)
    max_nb = int(count.max()) if nqb else 0
    if max_nb == 0:
        return None
    kb = torch.arange(nkb, device=dev)
    order = torch.where(visible, torch.where(unmasked, kb, nkb + kb), torch.full_like(kb, 2 * nkb))
    index = (order.sort(1).values[:, :max_nb] % nkb).to(torch.int32).contiguous()
    split = unmasked.sum(1).to(torch.int32)
    mode = 3 if bool((split < count).any()) else 0
    bounds = torch.cat([q_hi, q_lo]).clamp(-1, torch.iinfo(torch.int32).max)
    return SparsePlan(count[None, None], split[None, None], index[None, None], None, None, mode,
                      _i32(bounds).contiguous(), _i32(k_pos).contiguous())


# ----------------------------------------------------------------------------- head grouping
def _grouped(index_heads: int, hq: int, hkv: int) -> bool:
    """Whether index tensors with ``index_heads`` heads hold one row per GQA group (``hkv`` of them,
    ``share_pattern="kv_group"``) rather than one per query head (``hq``) or one shared row (1)."""
    return index_heads == hkv and index_heads not in (1, hq)


@dataclass(frozen=True)
class _Heads:
    """How the forward / dQ programs map to query heads (see ``kernels._tile_rows``)."""
    index_heads: int    # rows of the index tensors the kernels read (after broadcasting): hq, or hkv if grouped
    idx_rep: int        # query heads per index row (1, or hq / hkv if grouped)
    hpp: int            # query heads packed into one program's tile (1 without packing)
    hchunks: int        # programs per (KV head, query tile)
    num_hp: int         # head programs per query tile: hkv * hchunks


def _heads(plan: SparsePlan, hq: int, hkv: int, cfg: "KernelConfig", max_rows: Optional[int] = None) -> _Heads:
    """Head mapping of ``plan`` for ``hq`` query / ``hkv`` KV heads. Per-group indices with
    ``cfg.pack_gqa`` (64-row tiles only) pack ``hpp`` heads of a group into one tile of ``hpp * 64``
    rows, so each K/V tile a program loads serves ``hpp`` query heads: ``hpp`` is the largest power
    of two that divides the group size ``hq / hkv`` and fits ``max_rows / 64`` (default
    ``cfg.pack_gqa_rows``, the forward's limit; the dQ kernel passes ``cfg.pack_gqa_dq_rows``); with
    ``cfg.pack_gqa_partial`` the next power of two >= the group size, capped the same way (the last
    tile of a group then masks its missing heads). Below ``cfg.pack_gqa_min_heads`` heads no tile is
    packed (one program per query head, reading the group's index row).

    Raises:
        ValueError: index tensors whose head count is not 1, ``hq`` or ``hkv``.
    """
    ih = plan.block_index.shape[1]
    if plan.column_index is not None and plan.column_index.shape[1] != ih and plan.column_index.shape[1] != 1:
        raise ValueError(f"block and column indices disagree on their heads: {ih} vs {plan.column_index.shape[1]}")
    rep = hq // hkv
    if ih not in (1, hq, hkv):
        raise ValueError(f"index tensors with {ih} heads serve neither {hq} query heads nor {hkv} KV heads")
    if not _grouped(ih, hq, hkv):
        return _Heads(hq, 1, 1, rep, hq)
    hpp = 1
    if cfg.pack_gqa and plan.row_block == BLOCK:
        cap = max(1, (cfg.pack_gqa_rows if max_rows is None else max_rows) // BLOCK)
        if cfg.pack_gqa_partial:
            hpp = min(1 << (rep - 1).bit_length(), 1 << (cap.bit_length() - 1))
        else:
            hpp = min(rep & -rep, 1 << (cap.bit_length() - 1))       # largest power of two dividing rep
        if hpp < cfg.pack_gqa_min_heads:
            hpp = 1
    hchunks = -(-rep // hpp)
    return _Heads(hkv, rep, hpp, hchunks, hkv * hchunks)


# ----------------------------------------------------------------------------- backward plans
def _sorted_csr(keys: torch.Tensor, nseg: int, span: int):
    """``(offsets int32 [nseg + 1], mids int32 [nseg])`` of entries sorted by ``keys = (seg * 2 + masked) *
    span + val`` (ascending; ``0 <= val < span``; ``seg == nseg``: padding, after every real entry):
    segment ``s`` spans ``[offsets[s], offsets[s + 1])`` and its unmasked part ends at ``mids[s]``. Binary
    searches of the segment starts in the sorted keys: no device read and no atomics (a scatter-add of
    counts serialises on the padding sentinel)."""
    starts = torch.arange(nseg + 1, device=keys.device, dtype=torch.int64) * (2 * span)
    offsets = torch.searchsorted(keys, starts).to(torch.int32)
    mids = torch.searchsorted(keys, starts[:-1] + span).to(torch.int32)
    return offsets, mids


def _kv_csr(plan: SparsePlan, nkb: int, hq: int, hkv: int):
    """Inverted block index: CSR over (batch', kv head', key block) of entries ``r * nqb + qb``.

    Returns ``(offsets, mids, entries, B', G')``: the entries of segment ``s`` are
    ``entries[offsets[s]:offsets[s + 1]]``, those of slots the tile runs unmasked (``slot < split``)
    first, up to ``mids[s]`` (the dK/dV kernel skips their mask), then the masked ones, each part in
    ascending ``r * nqb + qb`` (a fixed order: bitwise deterministic sums)."""
    key = ("kv", nkb, hq, hkv)
    if key in plan._kv:
        return plan._kv[key]
    if plan.diagonal and plan.mask_mode < 2 and not plan.has_documents and nkb == plan.block_index.shape[-2]:
        res = plan._kv[key] = _kv_csr_diagonal(plan, nkb, hq, hkv)
        return res
    bi, bc = plan.block_index, plan.block_count
    B_, H_, nqb, max_nb = bi.shape
    rep = hq // hkv
    dev = bi.device
    slot = torch.arange(max_nb, device=dev)
    valid = slot < bc[..., None]
    unmasked = slot < plan.block_split[..., None]
    if unmasked.shape[0] != B_:      # one index for the batch, splits per entry (its document bounds):
        unmasked = unmasked.all(0, keepdim=True)      # unmasked only where every entry sees the block whole
    if plan.static:
        res = plan._kv[key] = _kv_csr_static(bi, valid, nkb, hq, hkv, unmasked=unmasked)
        return res
    bb, hh, qq, ss = valid.nonzero(as_tuple=True)
    kb = bi[bb, hh, qq, ss].long()
    masked = (~unmasked[bb, hh, qq, ss]).long()
    if H_ == 1 or _grouped(H_, hq, hkv):    # one row shared by all heads / by a group: one entry per head of it
        G_ = 1 if H_ == 1 else hkv
        r = torch.arange(rep, device=dev).repeat_interleave(bb.numel())
        g = (torch.zeros_like(hh) if H_ == 1 else hh).repeat(rep)
        bb, qq, kb, masked = bb.repeat(rep), qq.repeat(rep), kb.repeat(rep), masked.repeat(rep)
    else:
        G_ = hkv
        g, r = hh // rep, hh % rep
    res = plan._kv[key] = (*_csr_entries((bb * G_ + g) * nkb + kb, r * nqb + qq, masked, B_ * G_ * nkb, rep * nqb),
                           B_, G_)
    return res


def _diagonal_rows(bi: torch.Tensor, bc: torch.Tensor, causal: bool):
    """The offsets of diagonal block lists (``plan_from_indices(..., diagonal=True)``), row by row:
    ``(last, n, h0)`` with ``last [B', H', W]`` int32 the key blocks of the last query tile ascending
    (``kb = nqb - 1 - d`` for every offset ``d`` of the row; padding: int32 max, so rows stay sorted),
    ``n [B', H']`` int32 the number of offsets and ``h0 [B', H']`` int32 1 where the row has offset 0
    and ``causal`` (its diagonal tile is the one masked slot of every query tile), else 0."""
    nqb, width = bi.shape[-2], bi.shape[-1]
    last = bi[:, :, nqb - 1, :]
    n = bc[:, :, nqb - 1]
    slot = torch.arange(width, device=bi.device, dtype=torch.int32)
    lastp = torch.where(slot < n[..., None], last, torch.iinfo(torch.int32).max).contiguous()
    if not causal:
        return lastp, n.contiguous(), torch.zeros(n.shape, dtype=torch.int32, device=n.device)
    top = last.gather(-1, (n.long() - 1).clamp(min=0)[..., None])[..., 0]
    return lastp, n.contiguous(), ((n > 0) & (top == nqb - 1)).to(torch.int32).contiguous()


def _diagonal_split(bi: torch.Tensor, bc: torch.Tensor):
    """``(_diagonal_rows(bi, bc, True), split)`` of a causal diagonal plan, ``split = bc - h0[..., None]``
    (int32 ``[B', H', nqb]``): one kernel launch where Triton runs (:func:`~.kernels._diagonal_rows_kernel`),
    else torch."""
    if not triton_runs_on(bi.device):
        rows = _diagonal_rows(bi, bc, True)
        return rows, bc - rows[2][..., None]
    B_, H_, nqb, width = bi.shape
    dev = bi.device
    last = torch.empty((B_, H_, width), dtype=torch.int32, device=dev)
    n = torch.empty((B_, H_), dtype=torch.int32, device=dev)
    h0 = torch.empty((B_, H_), dtype=torch.int32, device=dev)
    split = torch.empty((B_, H_, nqb), dtype=torch.int32, device=dev)
    if B_ * H_:
        _kernels()._diagonal_rows_kernel[(B_ * H_, -(-nqb // 256))](
            bi, bc, last, n, h0, split, H_, nqb, width, *bi.stride(), *bc.stride(), BLOCK_W=64, BLOCK_Q=256,
            num_warps=1)
    return (last, n, h0), split


def _kv_csr_diagonal(plan: SparsePlan, nkb: int, hq: int, hkv: int):
    """:func:`_kv_csr` of a diagonal plan (``plan.diagonal``): the same offsets, mids and entries (in
    ``entries[:offsets[-1]]``; the buffer is sized by a host bound, nothing is read back) without a
    sort. Key block ``kb`` of row ``(b', h)`` is listed by the query tiles ``kb + d`` for the row's offsets
    ``d <= nqb - 1 - kb``: a prefix of the row's offsets taken from the last tile's list (a binary
    search). Three Triton launches: the segment sizes from these prefixes
    (:func:`~.kernels._kv_csr_diagonal_count_kernel`), their running sums as offsets and mids (one
    program, :func:`~.kernels._csr_offsets_kernel`), then one program per
    segment writes its entries (:func:`~.kernels._kv_csr_diagonal_kernel`): per query head of the group
    the unmasked tiles in ascending order, then the masked diagonal tiles (offset 0, causal)."""
    bi, bc = plan.block_index, plan.block_count
    B_, H_, nqb, width = bi.shape
    rep = hq // hkv
    dev = bi.device
    lastp, n, h0 = plan._diag_rows or _diagonal_rows(bi, bc, plan.mask_mode == 1)
    if H_ == 1 or _grouped(H_, hq, hkv):     # one row serves every head of the group: rep entries per tile
        G_, rows = (1 if H_ == 1 else hkv), (0 if H_ == 1 else 1)
    else:
        G_, rows = hkv, 2
    nseg = B_ * G_ * nkb
    # lo [B', H', nkb]: the row's offsets too large for kb are its slots [0, lo); the offsets count the
    # tiles listing each key block (n - lo per row) over the group's heads, the mids their unmasked part
    lo = torch.empty((B_, H_, nkb), dtype=torch.int32, device=dev)
    sizes = torch.empty((2, nseg), dtype=torch.int32, device=dev)      # per segment: entries, unmasked ones
    offsets = torch.empty(nseg + 1, dtype=torch.int32, device=dev)
    mids = torch.empty(nseg, dtype=torch.int32, device=dev)
    K = _kernels()
    K._kv_csr_diagonal_count_kernel[(math.ceil(nkb / 128), G_, B_)](
        lastp, n, h0, lo, sizes[0], sizes[1], width, nkb, rep, H_,
        ROWS=rows, BLOCK_K=128, LOG_W=max(1, width.bit_length()), num_warps=4)
    K._csr_offsets_kernel[(1,)](sizes[0], sizes[1], offsets, mids, nseg, BLOCK=_SCAN_BLOCK, num_warps=8)
    entries = torch.empty(max(1, nseg * rep * width), dtype=torch.int32, device=dev)
    K._kv_csr_diagonal_kernel[(nkb, G_, B_)](
        lastp, n, lo, h0, offsets, mids, entries, width, nkb, nqb, rep, H_,
        ROWS=rows, BLOCK_J=64, num_warps=1)
    return offsets, mids, entries, B_, G_


def _csr_entries(seg: torch.Tensor, val: torch.Tensor, masked: torch.Tensor, nseg: int, span: int):
    """``(offsets, mids, entries)`` of the inverted index from flat per-entry ``seg`` (segment; ``nseg``:
    a padding sentinel past the last one), ``val`` (``< span``) and ``masked`` (0/1): entries sorted by
    segment, unmasked first, then by value; ``mids[s]`` ends segment ``s``'s unmasked part."""
    keys, order = torch.sort((seg * 2 + masked) * span + val, stable=True)
    entries = val[order].to(torch.int32).contiguous()
    offsets, mids = _sorted_csr(keys, nseg, span)
    if entries.numel() == 0:
        entries = torch.zeros(1, dtype=torch.int32, device=seg.device)
    return offsets, mids, entries


def _kv_csr_static(bi: torch.Tensor, valid: torch.Tensor, nkb: int, hq: int, hkv: int,
                   unmasked: Optional[torch.Tensor] = None):
    """:func:`_kv_csr` at sizes known on the host: every slot of the block index (padding included)
    gets an entry; padding slots take a sentinel segment past the last one, so the stable sort puts
    them after every real entry and the offsets (a scatter-add of ones, then a cumsum) never reach
    them. The real entries and the offsets are those of the data-dependent plan; ``entries`` is
    longer (the kernel reads only ``[offsets[s], offsets[s + 1])``). ``unmasked``: the slots that
    run without a mask (``None``: every entry is masked)."""
    B_, H_, nqb, max_nb = bi.shape
    rep = hq // hkv
    dev = bi.device
    ar = lambda n: torch.arange(n, device=dev)  # noqa: E731
    bb, hh, qq = ar(B_)[:, None, None, None], ar(H_)[None, :, None, None], ar(nqb)[None, None, :, None]
    kb = bi.long()
    masked = torch.ones_like(kb) if unmasked is None else (~unmasked).long()
    if H_ == 1 or _grouped(H_, hq, hkv):    # one entry per head of the group: a leading dim r
        G_ = 1 if H_ == 1 else hkv
        r = ar(rep)[:, None, None, None, None]
        g = torch.zeros_like(hh) if H_ == 1 else hh
        valid, masked = valid[None], masked[None]
    else:
        G_ = hkv
        g, r = hh // rep, hh % rep
    nseg = B_ * G_ * nkb
    seg = torch.where(valid, (bb * G_ + g) * nkb + kb, nseg)          # padding: sentinel segment nseg
    val = r * nqb + qq
    shape = torch.broadcast_shapes(seg.shape, val.shape, masked.shape)
    seg, val, masked = (t.expand(shape).reshape(-1) for t in (seg, val, masked))
    return (*_csr_entries(seg, val, masked, nseg, rep * nqb), B_, G_)


def _row_ranks(present: torch.Tensor):
    """``(rank, count)`` of a contiguous 0/1 int32 ``[..., n]`` tensor: ``rank = cumsum(present, -1) - 1``
    (int32, the slot of each present entry among its row's) and ``count = present.sum(-1)`` (int32).
    One scan over the flattened tensor, then each row's base subtracted: on CUDA a single-segment
    scan of the whole tensor takes a fraction of the time of a per-row scan over a few long rows
    (H100, 9 rows of 32K: one plan build 216-217 against 173-178 us of device time; docs/results.md,
    "plan scan"). Per row for empty tensors and where the running total could reach 2**31."""
    if present.numel() == 0 or present.numel() >= 2 ** 31 or present.dim() < 2:
        return torch.cumsum(present, -1, dtype=torch.int32) - 1, present.sum(-1, dtype=torch.int32)
    flat = torch.cumsum(present.reshape(-1), 0, dtype=torch.int32).view(present.shape)
    end = flat[..., -1]                                                # inclusive prefix at each row's end
    base = torch.cat([end.new_zeros(1), end.reshape(-1)[:-1]]).view(end.shape)   # exclusive: before the row
    return flat - (base + 1)[..., None], end - base


def _union_rows(union: torch.Tensor, upad: int):
    """``(col_u [B', H', upad], ucount [B', H'])`` int32 of a given column union (``union [B', H', nv]`` int32,
    ascending, -1 padded, ``nv <= upad``): its entries with the padding as 0, and how many are ``>= 0``. One
    kernel launch where Triton runs (:func:`~.kernels._union_pad_kernel`), else torch."""
    B_, H_, nv = union.shape
    if not triton_runs_on(union.device) or union.stride(-1) != 1:
        ok = union >= 0
        return (torch.nn.functional.pad(torch.where(ok, union, 0), (0, upad - nv)),
                ok.sum(-1, dtype=torch.int32))
    col_u = torch.empty((B_, H_, upad), dtype=torch.int32, device=union.device)
    ucount = torch.empty((B_, H_), dtype=torch.int32, device=union.device)
    if B_ * H_:
        _kernels()._union_pad_kernel[(B_ * H_,)](union, col_u, ucount, nv, upad, union.stride(0), union.stride(1), H_,
                                                 BLOCK=1024, num_warps=4)
    return col_u, ucount


def _col_plan(plan: SparsePlan, sk: int, b: int, hq: int):
    """Per-head column union ``U`` and the inverted column index of the deterministic kernel.

    Returns ``(col_u [B',H',upad], ucount [B',H'], offsets, mid, entries_qb, entries_bits, upad, nchunks,
    nsplit, B', H')``: for segment ``((b'*H' + h')*nchunks + c)*nsplit + sp`` the entries are the
    query tiles of split ``sp`` (``qbps`` tiles each) that list a column of chunk ``c`` of ``U``, each
    with the 64-bit mask of the chunk's columns it lists: first (``[offsets[seg], mid[seg])``) the
    tiles that list all 64 columns (causal plans: every one left of the tile's first row), computed
    unmasked, then the others, each group in ascending tile order."""
    ci, cc = plan.column_index, plan.column_count
    B_, H_, nqb, max_nc = ci.shape
    key = ("col", sk, b, hq)
    if key in plan._col:
        return plan._col[key]
    dev = ci.device
    if plan.column_union is not None:      # given by the conversion (ColumnUnion): no present / rank / bits pass
        union, bits = plan.column_union
        nv = union.shape[-1]
        upad = BLOCK_C * max(1, math.ceil(nv / BLOCK_C))
        nchunks = upad // BLOCK_C
        col_u, ucount = _union_rows(_i32(union), upad)
        bits = bits if bits.shape[-1] == nchunks else torch.nn.functional.pad(bits, (0, nchunks - bits.shape[-1]))
        return _col_finish(plan, key, col_u, ucount, bits, upad, nchunks, b, hq, triton_runs_on(dev))
    # where Triton runs, kernels read only the listed slots (present columns, then the tiles' chunk masks)
    # and scan each row once (ranks, union); else torch ops over every slot of the index
    fused = triton_runs_on(dev)
    cc = cc.expand(B_, H_, nqb)
    width = sk + _SPREAD
    present = torch.zeros(B_, H_, width, dtype=torch.int32, device=dev)
    if fused:
        _kernels()._col_present_kernel[(nqb, H_, B_)](ci, cc, present, *ci.stride(), *cc.stride(), width,
                                                      BLOCK_J=64, num_warps=2)
    else:
        slot = torch.arange(max_nc, device=dev)
        valid = slot < cc[..., None]
        # padding slots write to SPREAD sentinels past sk (one shared sentinel serialises the scatters)
        cidx = torch.where(valid, ci.long(), sk + slot % _SPREAD)
        present.scatter_(2, cidx.view(B_, H_, -1), 1)
    if plan.static:     # a host bound of the union width (chunks past a row's union have no entries)
        umax = max(min(sk, nqb * max_nc, sk if plan.column_union_max is None else plan.column_union_max), 1)
    col_u = None
    if fused:           # one program per row: ranks, union sizes and (with a host bound) the union itself
        rank = torch.empty(B_, H_, width, dtype=torch.int32, device=dev)
        ucount = torch.empty(B_, H_, dtype=torch.int32, device=dev)
        if plan.static:
            upad = BLOCK_C * math.ceil(umax / BLOCK_C)
            col_u = torch.empty(B_, H_, upad, dtype=torch.int32, device=dev)
        _kernels()._col_union_kernel[(B_ * H_,)](present, rank, rank if col_u is None else col_u, ucount, width, sk,
                                                 upad if plan.static else 0, WRITE_U=plan.static, BLOCK=_SCAN_BLOCK,
                                                 num_warps=8)
    else:
        present[..., sk:] = 0
        rank, ucount = _row_ranks(present)          # slot of column p in U; [B', H'] union sizes
    if not plan.static:
        umax = max(int(ucount.max()), 1)
    upad = BLOCK_C * math.ceil(umax / BLOCK_C)
    nchunks = upad // BLOCK_C
    if col_u is None:
        col_u = torch.zeros(B_, H_, upad + _SPREAD, dtype=torch.int32, device=dev)
        pos = torch.arange(width, device=dev, dtype=torch.int32)
        # union slots past upad (a host bound below the real union) are dropped, as by the kernels
        dst = torch.where(present.bool() & (pos < sk) & (rank < upad), rank.long(), upad + (pos % _SPREAD).long())
        col_u.scatter_(2, dst, pos.expand(B_, H_, width))   # non-present positions land past slot upad (dropped)
        col_u = col_u[..., :upad].contiguous()
    if fused:
        bits = torch.zeros(B_, H_, nqb, nchunks, dtype=torch.int64, device=dev)
        # one warp per program: 29.8 against 43.6 us per 32K step (2 warps), 151 against 243 at 128K (H100, alone;
        # docs/results.md, select-candidates)
        _kernels()._col_bits_kernel[(nqb, H_, B_)](ci, cc, rank, bits, *ci.stride(), *cc.stride(), width, nchunks,
                                                   BLOCK_J=64, BLOCK_C=BLOCK_C, SPAN=4, num_warps=1)
    else:
        slots = rank.gather(2, cidx.view(B_, H_, -1)).view(B_, H_, nqb, max_nc).long()
        kept = valid & (slots < nchunks * BLOCK_C)        # slots past the union bound are dropped
        chunk = torch.where(kept, slots // BLOCK_C, nchunks + slot % _SPREAD)
        bit = torch.where(kept, torch.bitwise_left_shift(torch.ones_like(slots), slots % BLOCK_C),
                          torch.zeros_like(slots))
        bits = torch.zeros(B_, H_, nqb, nchunks + _SPREAD, dtype=torch.int64, device=dev)
        bits.scatter_add_(3, chunk, bit)                  # distinct powers of two: the sum is the OR
        bits = bits[..., :nchunks]
    return _col_finish(plan, key, col_u, ucount, bits, upad, nchunks, b, hq, fused)


def _col_finish(plan: SparsePlan, key: tuple, col_u, ucount, bits, upad: int, nchunks: int, b: int, hq: int,
                fused: bool):
    """The rest of :func:`_col_plan` from the union ``col_u [B', H', upad]`` (``ucount`` slots used), and the
    tiles' chunk masks ``bits [B', H', nqb, nchunks]``: the entries, cached on ``plan`` under ``key``."""
    B_, H_, nqb = bits.shape[:3]
    dev = bits.device
    # split the query tiles so that there are enough programs to fill the GPU
    qbps = max(16, min(nqb, 256))
    while qbps > 16 and b * hq * nchunks * math.ceil(nqb / qbps) < 4 * 132:
        qbps //= 2
    nsplit = math.ceil(nqb / qbps)
    nseg = B_ * H_ * nchunks * nsplit
    if fused:
        res = plan._col[key] = (col_u, ucount.contiguous(), *_col_entries(plan, bits, col_u, nchunks, nsplit, qbps),
                                upad, nchunks, nsplit, B_, H_)
        return res
    if plan.static:
        res = plan._col[key] = (col_u, ucount.contiguous(),
                                *_col_entries_static(plan, bits, col_u, nchunks, nsplit, qbps),
                                upad, nchunks, nsplit, B_, H_)
        return res
    bb, hh, qq, c = (bits != 0).nonzero(as_tuple=True)
    ebits = bits[bb, hh, qq, c]
    full = ebits == -1                                # all 64 columns of the chunk listed
    if plan.mask_mode == 1:                           # ... and left of the tile's first row
        full &= col_u[bb, hh, c * BLOCK_C + BLOCK_C - 1] < qq * BLOCK
    seg = ((bb * H_ + hh) * nchunks + c) * nsplit + qq // qbps
    keys, order = torch.sort((seg * 2 + (~full).long()) * nqb + qq, stable=True)
    entries_qb = qq[order].to(torch.int32).contiguous()
    entries_bits = ebits[order].contiguous()
    offsets, mid = _sorted_csr(keys, nseg, nqb)
    if entries_qb.numel() == 0:
        entries_qb = torch.zeros(1, dtype=torch.int32, device=dev)
        entries_bits = torch.zeros(1, dtype=torch.int64, device=dev)
    res = (col_u, ucount.contiguous(), offsets, mid, entries_qb, entries_bits, upad, nchunks, nsplit, B_, H_)
    plan._col[key] = res
    return res


def _col_entries(plan: SparsePlan, bits: torch.Tensor, col_u: torch.Tensor, nchunks: int, nsplit: int, qbps: int):
    """The entries of :func:`_col_plan` by three kernels where Triton runs (no sort, no device read): per
    segment the counts of its listed and of its whole-chunk tiles (one program sums them into the
    offsets and mid),
    then each segment's entries by prefix sums of its tiles' flags. The offsets, mid and
    ``entries[:offsets[-1]]`` are those of :func:`_col_entries_static`; the entry buffers hold one slot
    per (row, tile, chunk)."""
    B_, H_, nqb, _ = bits.shape
    dev = bits.device
    bits = bits.contiguous()
    nseg = B_ * H_ * nchunks * nsplit
    counts = torch.empty(nseg, dtype=torch.int32, device=dev)
    fulls = torch.empty(nseg, dtype=torch.int32, device=dev)
    args = (qbps, nqb, nchunks, col_u.shape[-1])
    import triton       # where the kernels run (this path), Triton imports

    meta = dict(CAUSAL=plan.mask_mode == 1, QBPS=triton.next_power_of_2(qbps), BLOCK_C=BLOCK_C, num_warps=4)
    grid = (nsplit, nchunks, B_ * H_)
    K = _kernels()
    K._col_entry_count_kernel[grid](bits, col_u, counts, fulls, *args, **meta)
    offsets = torch.empty(nseg + 1, dtype=torch.int32, device=dev)
    mid = torch.empty(nseg, dtype=torch.int32, device=dev)
    K._csr_offsets_kernel[(1,)](counts, fulls, offsets, mid, nseg, BLOCK=_SCAN_BLOCK, num_warps=8)
    size = max(1, bits.numel())
    entries_qb = torch.empty(size, dtype=torch.int32, device=dev)
    entries_bits = torch.empty(size, dtype=torch.int64, device=dev)
    K._col_entry_fill_kernel[grid](bits, col_u, offsets, mid, entries_qb, entries_bits, *args, **meta)
    return offsets, mid, entries_qb, entries_bits


def _col_entries_static(plan: SparsePlan, bits: torch.Tensor, col_u: torch.Tensor, nchunks: int, nsplit: int,
                        qbps: int):
    """The entries of :func:`_col_plan` at sizes known on the host: one per (row, query tile, chunk),
    those without a listed column (``bits == 0``) in a sentinel segment after every real one (never
    inside an ``[offsets[s], offsets[s + 1])`` range); offsets and mid by scatter-adds and a cumsum.
    The real entries, the offsets and mid are those of the data-dependent plan at the same ``upad``."""
    B_, H_, nqb, _ = bits.shape
    dev = bits.device
    ar = lambda n: torch.arange(n, device=dev)  # noqa: E731
    bb, hh = ar(B_)[:, None, None, None], ar(H_)[None, :, None, None]
    qq, c = ar(nqb)[None, None, :, None], ar(nchunks)[None, None, None, :]
    listed = bits != 0
    full = bits == -1                                 # all 64 columns of the chunk listed
    if plan.mask_mode == 1:                           # ... and left of the tile's first row
        last = col_u.view(B_, H_, nchunks, BLOCK_C)[..., BLOCK_C - 1]            # [B', H', nchunks]
        full &= last[:, :, None, :] < qq * BLOCK
    nseg = B_ * H_ * nchunks * nsplit
    seg = torch.where(listed, ((bb * H_ + hh) * nchunks + c) * nsplit + qq // qbps, nseg).reshape(-1)
    qqf = qq.expand(bits.shape).reshape(-1)
    fullf = full.reshape(-1)
    keys, order = torch.sort((seg * 2 + (~fullf).long()) * nqb + qqf, stable=True)
    entries_qb = qqf[order].to(torch.int32).contiguous()
    entries_bits = bits.reshape(-1)[order].contiguous()
    offsets, mid = _sorted_csr(keys, nseg, nqb)
    if entries_qb.numel() == 0:
        entries_qb = torch.zeros(1, dtype=torch.int32, device=dev)
        entries_bits = torch.zeros(1, dtype=torch.int64, device=dev)
    return offsets, mid, entries_qb, entries_bits


# ----------------------------------------------------------------------------- backward plans, ahead of time
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    idx = cuda_index(device)
    s = _SIDE_STREAMS.get(idx)
    if s is None:
        s = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx, priority=-1)   # high priority
    return s


def _plan_tensors(plan: SparsePlan):
    return [t for t in (plan.block_count, plan.block_split, plan.block_index, plan.column_count,
                        plan.column_index, plan.q_pos, plan.k_pos, plan.doc_lo, plan.doc_hi) if t is not None]


def prebuild_backward_plans(plan: SparsePlan, q_shape, k_shape, deterministic: bool = True,
                            config: Optional["KernelConfig"] = None, after=None) -> None:
    """Build now the index plans that :func:`sparse_backward` of this step will need (cached on ``plan``).

    The plans (the inverted block index in CSR form, and unless the fast mode adds the columns by
    atomics (``KernelConfig.col_atomic_fast``) the column union and its per-tile bit masks) take a few
    small torch ops and kernels that read only the listed slots (the inverted index of diagonal block
    lists, ``plan.diagonal``, from each row's offsets; of other lists by a sort of every listed block);
    where Triton does not run, about 75 torch ops and sorts over every slot of the indices. With ``plan.static`` (the
    CUDA default, :func:`~megatron_mtraining.ops.triton.plan_for`) their sizes are host bounds and
    they read nothing back from the device; otherwise they read up to 1 (block index: ``nonzero``) plus
    3 (column plan: the union width, ``nonzero``, boolean indexing) values back. Built here, right after the forward kernel is launched, their host
    work overlaps that kernel. On CUDA they run on a high-priority side stream that first waits for
    ``after`` (a ``torch.cuda.Event`` recorded on the current stream once the index tensors were
    written and before the forward kernel was launched; ``None``: wait for all work queued so far),
    and :func:`sparse_backward` makes its stream wait for them. Elsewhere (the Triton CPU
    interpreter, or while a CUDA graph is being captured) they are built in place.

    Args:
        plan: the step's forward plan (:func:`~megatron_mtraining.ops.triton.plan_for`).
        q_shape, k_shape: ``(b, sq, hq, d)`` and ``(b, sk, hkv, d)`` of the step's q and k/v.
        deterministic, config: as for :func:`sparse_backward` (which plans it will read).
    """
    cfg = config or DEFAULT_CONFIG
    b, _, hq, _ = q_shape
    sk, hkv = k_shape[1], k_shape[2]
    kv_src = plan.kv_source
    need_col = plan.has_columns and not plan.columns_by_atomics(deterministic, cfg) and plan.mask_mode < 2

    def build():
        if not kv_src.no_blocks:
            _kv_csr(kv_src, sk // BLOCK, hq, hkv)
        if need_col:
            _col_plan(plan, sk, b, hq)

    dev = plan.block_index.device
    if dev.type != "cuda" or torch.cuda.is_current_stream_capturing():
        build()            # the Triton CPU interpreter, or a CUDA graph capture (one stream, no host to overlap)
        return
    side = _side_stream(dev)
    if after is not None:
        side.wait_event(after)
    else:
        side.wait_stream(torch.cuda.current_stream(dev))
    for t in _plan_tensors(plan) + (_plan_tensors(kv_src) if kv_src is not plan else []):
        t.record_stream(side)          # read on the side stream: not reused before it is done
    with torch.cuda.stream(side):
        build()
    done = torch.cuda.Event()
    done.record(side)
    plan._pending = done


def _await_prebuilt(plan: SparsePlan) -> None:
    """Make the current stream wait for plans built by :func:`prebuild_backward_plans` (no-op otherwise)."""
    ev = plan._pending
    if ev is None:
        return
    cur = torch.cuda.current_stream(plan.block_index.device)
    cur.wait_event(ev)
    for res in list(plan.kv_source._kv.values()) + list(plan._col.values()):
        for t in res:
            if isinstance(t, torch.Tensor):
                t.record_stream(cur)   # allocated on the side stream, used on this one
    plan._pending = None


# ----------------------------------------------------------------------------- helpers
def _record(stats: Optional[dict], name: str, compiled):
    """Record the compiled kernel's registers per thread and spilled bytes in ``stats[name]`` (when
    ``stats`` is a dict, e.g. a benchmark's collector). Returns ``compiled``."""
    if stats is not None and compiled is not None:
        stats[name] = dict(n_regs=getattr(compiled, "n_regs", None), n_spills=getattr(compiled, "n_spills", None))
    return compiled


def _dq_descriptor(dq: torch.Tensor, rows: int):
    """A tensor descriptor over the fp32 ``dq [b, sq, hq, d]`` (contiguous) viewed as ``[b * sq, hq * d]``,
    in ``[rows, d]`` blocks: the dK/dV kernel's bulk dQ reductions (``KernelConfig.dq_tma``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, sq, hq, d = dq.shape
    return TensorDescriptor.from_tensor(dq.view(b * sq, hq * d), [rows, d])


def _use_tma(cfg: KernelConfig, t: torch.Tensor) -> bool:
    """Whether the kernels take ``KernelConfig.tma_loads`` bulk copies for tensors like ``t``. ``None``: for
    CUDA tensors of bf16/fp16 with head_dim 64 or 128, the inputs measured and checked on an H200 (others:
    pointer loads unless forced); :func:`_tma_descriptors` still falls back to pointer loads where TMA
    cannot address them."""
    if cfg.tma_loads is not None:
        return cfg.tma_loads
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and t.shape[-1] in (64, 128)


def _tma_args(cfg: KernelConfig, *tensors):
    """The kernels' descriptor arguments for ``tensors`` (``[b, s, h, d]``, one dtype and head_dim): their
    :func:`_tma_descriptors` in 64-row boxes where :func:`_use_tma` takes them, else ``None`` for each."""
    return _tma_descriptors(BLOCK, *tensors) if _use_tma(cfg, tensors[0]) else (None,) * len(tensors)


def _tma_descriptors(rows: int, *tensors):
    """Tensor descriptors over ``tensors`` (each ``[b, s, h, d]``) in ``[1, rows, 1, d]`` boxes: the bulk
    tensor copies of ``KernelConfig.tma_loads``. ``None`` for all when one of them cannot be addressed
    that way (a stride that is zero, negative or not a multiple of 16 bytes, a base address not a multiple
    of 16 bytes, a last dimension that is not contiguous, an empty tensor, rows over 256 bytes on CUDA),
    the device has no tensor memory accelerator (CUDA before compute capability 9; ROCm) or Triton has
    no host-side tensor descriptors (before 3.4); the kernels then load through pointers. The Triton
    interpreter (CPU) runs them too."""
    none = (None,) * len(tensors)
    for t in tensors:
        es = t.element_size()
        if t.is_cuda and (torch.version.hip is not None or torch.cuda.get_device_capability(t.device)[0] < 9
                          or t.shape[-1] * es > 256):     # one box row: at most 256 bytes (bf16/fp16 d 128)
            return none
        if (t.numel() == 0 or t.stride(-1) != 1 or t.data_ptr() % 16
                or any(t.stride(i) <= 0 or (t.stride(i) * es) % 16 for i in range(t.dim() - 1))):
            return none
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:             # Triton before 3.4
        return none
    return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, t.shape[-1]]) for t in tensors)


def _check(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q [b,s,hq,d], k/v [b,s,hkv,d] expected; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree")
    if sq % BLOCK or k.shape[1] % BLOCK:
        raise ValueError(f"sequence lengths must be multiples of {BLOCK}: {sq}, {k.shape[1]}")
    if d not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim {d} not supported by the Triton kernels")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("last dimension must be contiguous")


def _idx_args(plan: SparsePlan, b: int, hq: int, nqb: int, col_split: bool = True):
    """Index tensors and strides of the forward / dQ kernels, and whether the column split is passed."""
    bc = plan.block_count.expand(b, hq, nqb)
    bs = plan.block_split.expand(b, hq, nqb)
    bi = plan.block_index.expand(b, hq, nqb, plan.block_index.shape[-1])
    if plan.has_columns:
        cc = plan.column_count.expand(b, hq, nqb)
        ci = plan.column_index.expand(b, hq, nqb, plan.column_index.shape[-1])
    else:
        cc, ci = bc, bi           # dummies, never read
    csp = plan.column_split() if col_split else None     # None without columns too
    cs = csp.expand(b, hq, nqb) if csp is not None else bc      # dummy when not passed
    qp = plan.q_pos if plan.q_pos is not None else bc
    kp = plan.k_pos if plan.k_pos is not None else bc
    dlo, dhi, s_dlb = _doc_args(plan, b, nqb * plan.row_block, bc)
    tensors = (bc, bs, bi, cc, cs, ci, qp, kp, dlo, dhi)
    strides = (bc.stride(0), bc.stride(1), bs.stride(0), bs.stride(1), bi.stride(0), bi.stride(1), bi.stride(2),
               cc.stride(0), cc.stride(1), cs.stride(0), cs.stride(1), ci.stride(0), ci.stride(1), ci.stride(2), s_dlb)
    return tensors, strides, csp is not None


def _doc_args(plan: SparsePlan, b: int, sq: int, dummy: torch.Tensor):
    """``(doc_lo, doc_hi, batch stride)`` for the kernels (``dummy`` tensors and 0 without documents)."""
    if not plan.has_documents:
        return dummy, dummy, 0
    lo, hi = plan.doc_lo, plan.doc_hi
    if lo.shape != hi.shape or lo.dim() != 2 or lo.shape[0] not in (1, b) or lo.shape[1] != sq or \
            plan.k_pos is None:
        raise ValueError(f"document bounds {tuple(lo.shape)} / {tuple(hi.shape)} must be [b, sq] = {(b, sq)} (or "
                         f"[1, sq]) with the keys' positions")
    return lo, hi, (lo.stride(0) if lo.shape[0] > 1 else 0)


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters (chosen by measurement on an H200; docs/results.md). Immutable: pass
    a modified copy (``dataclasses.replace``) to the launchers or to
    :func:`~megatron_mtraining.ops.backends.select_backend`."""
    fwd_warps: int = 4
    fwd_stages: int = 3
    dq_warps: int = 4
    dq_stages: int = 2
    dkdv_warps: int = 4
    dkdv_stages: int = 2
    col_warps: int = 4
    col_stages: int = 2
    dq_atomic_fast: bool = False   # fast mode: dQ of blocks by atomics in the dK/dV kernel
    col_atomic_fast: bool = False  # fast mode: columns' dK/dV by atomics in the dQ kernel, without the
                                   # deterministic column kernel and its plan. Off: slower on an H200
                                   # (fwd+bwd at 128K, 95 %, plans prebuilt: 50.3 against 37.9 ms at
                                   # d 128, 13.6 against 12.6 at d 64; SmolLM2-135M training, plans
                                   # included: 64K 3.64 against 3.57 s per iteration, 128K 4.09 against
                                   # 3.98; 32K 3.01 against 3.05)
    column_split: bool = True      # run whole column chunks that every row sees without a mask
    pack_gqa: bool = True          # per-group indices (share_pattern kv_group): pack the query heads of a
                                   # group into one forward / dQ tile (each K/V tile loaded once for them)
    pack_gqa_rows: int = 256       # largest packed forward tile (rows = heads per program * 64)
    pack_gqa_dq_rows: int = 64     # the same for the dQ kernel (64: no packing)
    pack_gqa_min_heads: int = 4    # pack only tiles of at least this many heads (H200, 128K, 95 %: 4 heads
                                   # of 16/2 at d 128 forward -14 %; 2 heads +10 %; dQ packing no gain)
    pack_gqa_partial: bool = False  # allow a partial last tile (masked heads; 9/3 at d 64: +55 % forward)
    fwd_pair: bool = False         # forward: two listed 64-key blocks per loop step (128-wide products;
                                   # the pattern stays 64-granular). Off: slower at d 128 on an H200
                                   # (17.1 against 10.3 ms at 128K, 95 %); d 64: -7 % forward at 4 warps,
                                   # 2 stages, under 2 % of a training step (docs/results.md, record 31)
    dq_pair: bool = False          # dQ: the same
    dkdv_pair: bool = False        # dK/dV: two inverted-index entries (128 query rows) per loop step
    col_chunk: int = 64            # vertical columns gathered per loop step in the forward and dQ (64 or 128)
    dq_tma: bool = False           # with dq_atomic_fast on CUDA: each tile's dQ is one bulk (TMA) reduction
                                   # through a tensor descriptor, not one atomic per element
    tma_loads: Optional[bool] = None  # listed blocks' K/V (forward, dQ) and query tiles' q/dO (dK/dV) by bulk
                                   # tensor copies (TMA on Hopper) through tensor descriptors, where the
                                   # tensors and the device allow it (else pointer loads); unpaired loops only.
                                   # None: on for CUDA bf16/fp16 tensors of head_dim 64 or 128 (H200, 128K,
                                   # 95 %: fwd+bwd 38.78 against 40.52 ms at d 128, 12.50 against 12.83 at
                                   # d 64); True: for every tensor (CPU: the Triton interpreter) where the
                                   # descriptors can address it; False: pointer loads
    fwd128_warps: int = 8          # 128-row tiles (dense plans)
    fwd128_stages: int = 2
    dq128_warps: int = 8
    dq128_stages: int = 2

    def __post_init__(self):
        if self.col_chunk not in (64, 128):
            raise ValueError(f"KernelConfig.col_chunk must be 64 or 128, got {self.col_chunk!r}")


DEFAULT_CONFIG = KernelConfig()   # immutable defaults


# ----------------------------------------------------------------------------- forward
def sparse_forward(q, k, v, plan: SparsePlan, softmax_scale: float, out_dtype=torch.float32,
                   config: Optional[KernelConfig] = None, stats: Optional[dict] = None):
    """Sparse attention forward: ``(out [b,sq,hq,d] out_dtype, lse [b,hq,sq] fp32, natural log)``.

    ``config``: launch parameters (default :class:`KernelConfig`); ``stats``: a dict that receives the
    registers and spills of each launched kernel (``None``: not recorded)."""
    _check(q, k, v)
    cfg = config or DEFAULT_CONFIG
    K = _kernels()
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    bm = plan.row_block
    nqb = sq // bm
    if q.numel() >= 2 ** 31 or k.numel() >= 2 ** 31:
        raise ValueError("tensors of 2**31 or more elements are not supported (int32 offsets)")
    out = torch.empty((b, sq, hq, d), dtype=out_dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    hd = _heads(plan, hq, hkv, cfg)
    tensors, istr, col_split = _idx_args(plan, b, hd.index_heads, nqb, cfg.column_split)
    grid = (nqb * hd.num_hp, b)
    tile = hd.hpp * bm
    kd, vd = _tma_args(cfg, k, v)
    _record(stats, "_sparse_fwd_kernel", K._sparse_fwd_kernel[grid](
        q, k, v, out, lse, *tensors,
        softmax_scale * K.LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        *istr,
        hd.num_hp, nqb, hq // hkv, hd.hchunks, hd.idx_rep,
        MASK_MODE=plan.mask_mode, HAS_COLS=plan.has_columns, COL_SPLIT=col_split, FP32=q.dtype == torch.float32,
        DOC=plan.has_documents, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=BLOCK, BLOCK_C=cfg.col_chunk,
        HPP=hd.hpp, TILE_M=tile, HEAD_MASK=(hq // hkv) % hd.hpp != 0, PAIR=cfg.fwd_pair,
        TMA=kd is not None, KD=kd, VD=vd,
        num_warps=cfg.fwd_warps if tile == BLOCK else cfg.fwd128_warps,
        num_stages=cfg.fwd_stages if tile == BLOCK else cfg.fwd128_stages,
    ))
    return out, lse


# ----------------------------------------------------------------------------- backward
def sparse_backward(dout, q, k, v, lse, delta, plan: SparsePlan, softmax_scale: float,
                    deterministic: bool = True, config: Optional[KernelConfig] = None,
                    stats: Optional[dict] = None):
    """Gradients through one sparse step given the *final* ``lse`` and ``delta = rowsum(dout*out)``.

    Returns fp32 ``(dq [b,sq,hq,d], dk [b,sk,hkv,d], dv [b,sk,hkv,d])``. ``deterministic=True``
    uses no floating-point atomics (bitwise repeatable); ``False`` lets ``config`` add the vertical
    columns' dK/dV (``col_atomic_fast``) and the blocks' dQ (``dq_atomic_fast``) with fp32 atomics
    (both off by default: slower where measured, so the default ``False`` runs the deterministic
    kernels). ``config`` and ``stats``: as for :func:`sparse_forward`.
    """
    _check(q, k, v)
    cfg = config or DEFAULT_CONFIG
    K = _kernels()
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    nqb, nkb = sq // BLOCK, sk // BLOCK
    dev = q.device
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    lse = lse.to(torch.float32).contiguous()
    delta = delta.to(torch.float32).contiguous()
    if lse.shape != (b, hq, sq) or delta.shape != (b, hq, sq):
        raise ValueError(f"lse/delta must be [b, hq, sq] = {(b, hq, sq)}")
    fp32 = q.dtype == torch.float32
    scale_log2 = softmax_scale * K.LOG2E
    dq = torch.empty((b, sq, hq, d), dtype=torch.float32, device=dev)
    dk = torch.empty((b, sk, hkv, d), dtype=torch.float32, device=dev)
    dv = torch.empty((b, sk, hkv, d), dtype=torch.float32, device=dev)
    common = (q.stride(0), q.stride(1), q.stride(2),
              k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2),
              dout.stride(0), dout.stride(1), dout.stride(2),
              dq.stride(0), dq.stride(1), dq.stride(2),
              dk.stride(0), dk.stride(1), dk.stride(2),
              lse.stride(0), lse.stride(1))
    dq_atomic = (not deterministic) and cfg.dq_atomic_fast
    for t in (q, k, v, dout):
        if t.numel() >= 2 ** 31:
            raise ValueError("tensors of 2**31 or more elements are not supported (int32 offsets)")
    if dq_atomic:
        dq.zero_()
    _await_prebuilt(plan)

    # 1) dK/dV of the blocks, column-parallel over key blocks (stores every row of dk/dv)
    kv_src = plan.kv_source
    if dq_atomic and kv_src is not plan:
        raise ValueError("dq_atomic_fast needs a plan with 64-row tiles")
    if kv_src.no_blocks:     # no block: what the kernel would store (zeros), without its inverted index
        dk.zero_()
        dv.zero_()
    else:
        offsets, mids, entries, B_, G_ = _kv_csr(kv_src, nkb, hq, hkv)
        qp = plan.q_pos if plan.q_pos is not None else offsets
        kp = plan.k_pos if plan.k_pos is not None else offsets
        dlo, dhi, s_dlb = _doc_args(kv_src, b, sq, offsets)
        dq_tma = dq_atomic and cfg.dq_tma and dq.is_cuda
        dq_arg = _dq_descriptor(dq, BLOCK) if dq_tma else dq
        qd, dod = _tma_args(cfg, q, dout)
        _record(stats, "_sparse_bwd_dkdv_kernel", K._sparse_bwd_dkdv_kernel[(nkb * hkv, b)](
            q, k, v, dout, lse, delta, dq_arg, dk, dv, offsets, mids, entries, qp, kp, dlo, dhi,
            scale_log2, softmax_scale, *common,
            (G_ * nkb) if B_ > 1 else 0, nkb if G_ > 1 else 0, s_dlb,
            hkv, nqb, rep,
            MASK_MODE=kv_src.mask_mode, DQ_ATOMIC=dq_atomic, FP32=fp32, DOC=kv_src.has_documents,
            HEAD_DIM=d, BLOCK_M=BLOCK, BLOCK_N=BLOCK, PAIR=cfg.dkdv_pair, DQ_TMA=dq_tma,
            TMA=qd is not None, QD=qd, DOD=dod,
            num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
        ))

    # 2) dQ (row-parallel); with col_atomic_fast the fast mode also adds the columns' dK/dV with atomics
    bm = plan.row_block
    nqt = sq // bm
    col_atomic = plan.columns_by_atomics(deterministic, cfg)
    hd = _heads(plan, hq, hkv, cfg, cfg.pack_gqa_dq_rows)
    tile = hd.hpp * bm
    tensors, istr, col_split = _idx_args(plan, b, hd.index_heads, nqt, cfg.column_split and not col_atomic)
    do_blocks = not (dq_atomic or plan.no_blocks)      # the blocks' dQ here (else by atomics, or none)
    if not (do_blocks or plan.has_columns or dq_atomic):
        dq.zero_()                                     # no block, no column: a zero dQ (no kernel)
    if do_blocks or plan.has_columns:
        kd, vd = _tma_args(cfg, k, v)
        _record(stats, "_sparse_bwd_dq_kernel", K._sparse_bwd_dq_kernel[(nqt * hd.num_hp, b)](
            q, k, v, dout, lse, delta, dq, dk, dv, *tensors,
            scale_log2, softmax_scale, *common, *istr,
            hd.num_hp, nqt, rep, hd.hchunks, hd.idx_rep,
            MASK_MODE=plan.mask_mode, DO_BLOCKS=do_blocks, HAS_COLS=plan.has_columns,
            COL_SPLIT=col_split, COL_ATOMIC=col_atomic, ACCUM_DQ=dq_atomic, FP32=fp32,
            HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=BLOCK, BLOCK_C=cfg.col_chunk,
            HPP=hd.hpp, TILE_M=tile, HEAD_MASK=rep % hd.hpp != 0, DOC=plan.has_documents, PAIR=cfg.dq_pair,
            TMA=kd is not None, KD=kd, VD=vd,
            num_warps=cfg.dq_warps if tile == BLOCK else cfg.dq128_warps,
            num_stages=cfg.dq_stages if tile == BLOCK else cfg.dq128_stages,
        ))

    # 3) deterministic columns: per-head partials, fixed-order reduction
    if plan.has_columns and not col_atomic:
        if plan.mask_mode >= 2:
            raise ValueError("vertical columns are not supported with position masks")
        col_u, ucount, offsets_c, mid_c, ent_qb, ent_bits, upad, nchunks, nsplit, B_, H_ = _col_plan(plan, sk, b, hq)
        nih = hkv if _grouped(H_, hq, hkv) else hq       # index rows: per group, or per query head
        per_row = hq // nih                               # query heads reading one index row
        col_u_e = col_u.expand(b, nih, upad)
        ucount_e = ucount.expand(b, nih)
        dkp = torch.empty((nsplit, b, nih, upad, d), dtype=torch.float32, device=dev)
        dvp = torch.empty_like(dkp)
        dlo, dhi, s_dlb = _doc_args(plan, b, sq, ucount_e)
        _record(stats, "_sparse_bwd_col_kernel", K._sparse_bwd_col_kernel[(nchunks * nsplit * nih, b)](
            q, k, v, dout, lse, delta, dkp, dvp, col_u_e, ucount_e, offsets_c, mid_c, ent_qb, ent_bits,
            plan.k_pos if plan.has_documents else ucount_e, dlo, dhi,
            scale_log2, softmax_scale,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            lse.stride(0), lse.stride(1),
            dkp.stride(0), dkp.stride(1), dkp.stride(2), dkp.stride(3),
            col_u_e.stride(0), col_u_e.stride(1), ucount_e.stride(0), ucount_e.stride(1),
            (H_ * nchunks * nsplit) if B_ > 1 else 0, (nchunks * nsplit) if H_ > 1 else 0, s_dlb,
            nih, nchunks, nsplit, rep, per_row,
            CAUSAL=plan.mask_mode == 1, FP32=fp32, DOC=plan.has_documents,
            HEAD_DIM=d, BLOCK_M=BLOCK, BLOCK_C=BLOCK_C,
            num_warps=cfg.col_warps, num_stages=cfg.col_stages,
        ))
        rows_per_kv = nih // hkv
        for r in range(rows_per_kv):   # index rows of a KV head one after another: each key row updated once per launch
            K._col_scatter_kernel[(nchunks, hkv, b)](
                dk, dv, dkp, dvp, col_u_e, ucount_e, r,
                dk.stride(0), dk.stride(1), dk.stride(2),
                dkp.stride(0), dkp.stride(1), dkp.stride(2), dkp.stride(3),
                col_u_e.stride(0), col_u_e.stride(1), ucount_e.stride(0), ucount_e.stride(1),
                nsplit, rows_per_kv,
                HEAD_DIM=d, BLOCK_C=BLOCK_C, num_warps=4, num_stages=1,
            )
    return dq, dk, dv


# ----------------------------------------------------------------------------- delta
def delta_unsupported(dout: torch.Tensor, out: torch.Tensor) -> Optional[str]:
    """Why :func:`attention_delta` cannot take these shapes (``None``: it can)."""
    if dout.shape != out.shape or dout.dim() != 4:
        return f"dout and out must both be [b, s, hq, d]; got {tuple(dout.shape)}, {tuple(out.shape)}"
    d = out.shape[-1]
    if out.numel() >= 2 ** 31:
        return "tensors of 2**31 or more elements are not supported (int32 offsets)"
    if d <= 0 or d & (d - 1) or d > 256:
        return f"head_dim {d} not supported by the delta kernel (a power of two <= 256)"
    if dout.stride(-1) != 1 or out.stride(-1) != 1:
        return "last dimension must be contiguous"
    return None


def attention_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)`` of the backward: ``[b, hq, s]`` fp32 from ``[b, s, hq, d]`` inputs
    of any float dtype (read as they are, no fp32 copies). One Triton launch.

    Raises:
        ValueError: the shapes :func:`delta_unsupported` names (``d`` not a power of two <= 256, a
            strided last dimension, 2**31 or more elements, mismatched shapes)."""
    why = delta_unsupported(dout, out)
    if why is not None:
        raise ValueError(why)
    b, s, h, d = out.shape
    delta = torch.empty((b, h, s), dtype=torch.float32, device=out.device)
    block_s = max(16, min(128, 8192 // d))
    _kernels()._delta_kernel[(-(-s // block_s), b * h)](
        dout, out, delta, dout.stride(0), dout.stride(1), dout.stride(2), out.stride(0), out.stride(1), out.stride(2),
        delta.stride(0), delta.stride(1), s, h, HEAD_DIM=d, BLOCK_S=block_s, num_warps=4)
    return delta


# ----------------------------------------------------------------------------- LSE merge
_MERGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MERGE_WARPS = 4     # warps per program of the merge kernel


def merge_launch_shape(head_dim: int) -> tuple:
    """``(BLOCK_D, BLOCK_S)`` of :func:`attention_merge`: the head dimension padded to a power of two, and
    rows per program (about 1024 elements of each tensor per program, 8 to 128 rows: about 64 registers
    and no spills at head_dim 64 to 128 on sm_90, tests/workers/merge_aot.py; not tuned on a GPU)."""
    block_d = 1 << (head_dim - 1).bit_length()
    return block_d, max(8, min(128, 1024 // block_d))


def _max_offset(t: torch.Tensor) -> int:
    """The largest element offset a kernel computes into ``t`` (its strides as they are)."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)


def merge_unsupported(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor) -> Optional[str]:
    """Why :func:`attention_merge` cannot take these tensors (``None``: it can). The rules: ``out``/``out2``
    ``[b, s, h, d]`` of one shape, bf16/fp16/fp32, ``d >= 1`` with unit stride; ``lse``/``lse2``
    ``[b, h, s]`` fp32 (any strides); one device; ``b * h < 65536`` (the launch grid's second
    dimension); every element offset of the inputs and outputs below 2**31 (int32 indexing)."""
    if out.dim() != 4 or out2.shape != out.shape:
        return f"out and out2 must both be [b, s, h, d]; got {tuple(out.shape)}, {tuple(out2.shape)}"
    b, s, h, d = out.shape
    if tuple(lse.shape) != (b, h, s) or tuple(lse2.shape) != (b, h, s):
        return f"lse and lse2 must be [b, h, s] = {(b, h, s)}; got {tuple(lse.shape)}, {tuple(lse2.shape)}"
    if out.dtype not in _MERGE_DTYPES or out2.dtype not in _MERGE_DTYPES:
        return f"out and out2 must be bf16, fp16 or fp32; got {out.dtype}, {out2.dtype}"
    if lse.dtype != torch.float32 or lse2.dtype != torch.float32:
        return f"lse and lse2 must be fp32; got {lse.dtype}, {lse2.dtype}"
    if len({t.device for t in (out, lse, out2, lse2)}) != 1:
        return "out, lse, out2 and lse2 must be on one device"
    if d < 1:
        return f"head_dim must be >= 1, got {d}"
    if out.stride(-1) != 1 or out2.stride(-1) != 1:
        return "out and out2 need a unit stride in their last dimension (head_dim)"
    if b * h >= 65536:
        return f"b * h = {b * h} must be below 65536 (the merge kernel's grid has one program row per (batch, head))"
    if max(out.numel() - 1, *(_max_offset(t) for t in (out, lse, out2, lse2))) >= 2 ** 31:
        return "element offsets of 2**31 or more are not supported (int32 indexing)"
    return None


def attention_merge(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor):
    """Two partial attention results merged by their LSEs in one Triton launch: the values of
    :func:`~megatron_mtraining.ops.merge.merge_attention` (max-subtracted: any LSE gap is safe, a ``-inf``
    partial changes nothing, two ``-inf`` give out 0 and lse ``-inf``, no NaN).

    Args:
        out, out2: ``[b, s, h, d]`` partial outputs, bf16/fp16/fp32 (each read in its own dtype, e.g.
            FlashAttention-4's bf16 output), unit stride in ``d``, other strides as they are.
        lse, lse2: ``[b, h, s]`` fp32, their natural-log LSEs, any strides (views allowed).

    Returns:
        ``(out [b, s, h, d] fp32, lse [b, h, s] fp32)``, new contiguous tensors.

    Raises:
        ValueError: the rules :func:`merge_unsupported` names (shapes, dtypes, devices, an empty or strided
            head dimension, ``b * h >= 65536``, element offsets of 2**31 or more).
    """
    why = merge_unsupported(out, lse, out2, lse2)
    if why is not None:
        raise ValueError(why)
    b, s, h, d = out.shape
    res = torch.empty((b, s, h, d), dtype=torch.float32, device=out.device)
    res_lse = torch.empty((b, h, s), dtype=torch.float32, device=out.device)
    if res.numel() == 0:
        return res, res_lse
    block_d, block_s = merge_launch_shape(d)
    _kernels()._merge_kernel[(-(-s // block_s), b * h)](
        out, lse, out2, lse2, res, res_lse,
        out.stride(0), out.stride(1), out.stride(2), *lse.stride(),
        out2.stride(0), out2.stride(1), out2.stride(2), *lse2.stride(),
        res.stride(0), res.stride(1), res.stride(2), res_lse.stride(0), res_lse.stride(1),
        s, h, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s, num_warps=MERGE_WARPS)
    return res, res_lse

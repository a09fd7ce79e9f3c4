"""Global vertical-slash pattern → per-ring-step :class:`StepIndices` (MTraining §3.3).

For query rank ``r`` and K/V owner ``o`` (one ring step), local query block ``i`` of ``r`` (global
block ``QB_i``) and local key block ``j`` of ``o`` (global block ``KB_j``):

* block ``j`` is **active** for ``i`` iff ``QB_i - KB_j`` is a selected slash offset (``>= 0``,
  so never a future block);
* a vertical column at global position ``t`` owned by ``o`` (local index ``lt``, local block
  ``lt // bs``) is a **column** of ``i`` iff ``t // bs <= QB_i`` (not in a future block) and its
  block is not active for ``i`` (every (query block, key) pair is computed exactly once);
* ``causal = (o == r)``. Only then can a key share a block with the query block (the diagonal
  block, for blocks *and* columns); such tiles and columns must be masked by local index, which
  is the global causal mask because local order is monotone in global position. For ``o != r``
  every emitted key lies in a block strictly before the query block — no mask is needed.
  (Unlike the reference's flex mode, a column inside the diagonal block is never left unmasked;
  with the estimator's ``local_blocks >= 1`` floor the diagonal block is always active anyway,
  so such columns do not even occur.)

Padding: ``block_index`` / ``column_index`` entries at positions ``>= count`` are ``-1``. Widths are
the maximum counts over (b, hq, query block), at least 1.

Layouts must keep ``block_size`` blocks whole on one rank: striped with ``granularity %
block_size == 0``, zigzag with ``(S / (2 * cp)) % block_size == 0``, contiguous with ``(S / cp) %
block_size == 0``. Work is vectorized over (b, hq, blocks, columns); Python loops run only over owners.
:func:`convert_pattern` copies nothing to the device and, with static widths (the default on CUDA:
host upper bounds of the counts), reads nothing from it; with data-dependent widths it reads once
(every output width of every owner; twice at cp > 1).

Packed documents (:func:`restrict_to_documents`, after the conversion): a key block none of whose
keys is visible to any query of the query block (wholly in other documents, or padding) is
dropped, and so is a vertical column no query of the block may see; the kept entries carry the
document bounds so that the kernels mask the mixed blocks exactly.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..common import REGION_CONVERT, record_function, triton_runs_on
from ..layout import Layout
from .estimator import VerticalSlashPattern
from .indices import ColumnUnion, DiagonalBlocks, KnownMax, StepIndices, packed_index_lists

__all__ = ["check_block_layout", "local_block_ids", "step_indices", "convert_pattern", "step_key_mask",
           "without_columns", "refine_indices", "step_column_positions", "column_phase_indices",
           "restrict_to_documents"]


def check_block_layout(layout: Layout, seq_len: int, block_size: int) -> None:
    """Raise ``ValueError`` naming the rule when ``layout`` splits ``block_size`` blocks across ranks."""
    layout.check_seq_len(seq_len)
    if seq_len % block_size:
        raise ValueError(f"sequence length {seq_len} must be a multiple of the block size {block_size}")
    if layout.kind == "striped":
        if layout.granularity % block_size:
            raise ValueError(f"striped layout: granularity ({layout.granularity}) must be a multiple of the "
                             f"sparse block size ({block_size}) so that blocks stay whole on one rank")
    elif layout.kind == "zigzag":
        chunk = seq_len // (2 * layout.cp_size)
        if chunk % block_size:
            raise ValueError(f"zigzag layout: chunk length S/(2*cp) = {seq_len}/(2*{layout.cp_size}) = {chunk} "
                             f"must be a multiple of the sparse block size ({block_size})")
    else:
        chunk = seq_len // layout.cp_size
        if chunk % block_size:
            raise ValueError(f"contiguous layout: chunk length S/cp = {chunk} must be a multiple of the sparse "
                             f"block size ({block_size})")


def local_block_ids(layout: Layout, rank: int, seq_len: int, block_size: int, device=None) -> torch.Tensor:
    """Global block index of each local block of ``rank`` (``[S_local / bs]`` int64, ascending)."""
    pos = layout.positions(rank, seq_len, device=device)
    return pos[::block_size] // block_size


def _prefix(mask: torch.Tensor):
    """``(cs, count)`` of an order-preserving compaction along the last dim: ``cs`` the int32 inclusive
    cumsum of ``mask``, ``count`` int32 ``[...]`` (its last column)."""
    cs = torch.cumsum(mask, -1, dtype=torch.int32)
    if mask.shape[-1] == 0:
        return cs, torch.zeros(mask.shape[:-1], dtype=torch.int32, device=mask.device)
    return cs, cs[..., -1].contiguous()


def _pick(cs: torch.Tensor, values: torch.Tensor, fill: int, width: int) -> torch.Tensor:
    """Compaction: slot ``m < width`` holds ``values`` (broadcastable to ``cs``; pass it unexpanded) at
    the ``(m+1)``-th kept entry, in order, or ``fill`` past the row's count: ``[..., width]``,
    contiguous, ``values.dtype``.

    The ``(m+1)``-th kept entry is the first index where the cumsum reaches ``m + 1``: a binary search
    per output slot (no sort, no int64 scatter index, nothing of the mask's size but the cumsum);
    "not found" is index ``n``, where ``fill`` is appended to ``values``."""
    lead = cs.shape[:-1]
    ext = torch.cat([values, values.new_full((*values.shape[:-1], 1), fill)], -1)
    want = torch.arange(1, width + 1, dtype=torch.int32, device=cs.device).expand(*lead, width).contiguous()
    return ext.expand(*lead, ext.shape[-1]).gather(-1, torch.searchsorted(cs, want))


def _maxima(counts, bounds=None) -> list:
    """``count.max()`` of every count tensor (0 when empty), one host sync for all (the output widths
    ``max(1, .)`` are data dependent). ``bounds`` (static widths): the host upper bounds of the
    counts, returned as they are (no device read)."""
    if bounds is not None:
        return [int(x) for x in bounds]
    live = [i for i, c in enumerate(counts) if c.numel()]
    maxes = torch.stack([counts[i].amax() for i in live]).tolist() if live else []
    out = [0] * len(counts)
    for i, m in zip(live, maxes):
        out[i] = int(m)
    return out


_IMPLS = ("auto", "torch", "triton")


def _use_triton(impl: str, t: torch.Tensor, cp: int) -> bool:
    """Whether :func:`convert_pattern` runs the Triton kernel (:mod:`megatron_mtraining.patterns.triton.convert`):
    ``"auto"`` on CUDA at cp 1; ``"triton"`` at cp 1 where Triton runs (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``); ``"torch"`` never."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "torch" or (impl == "auto" and not (cp == 1 and t.is_cuda)):
        return False             # decided before importing triton (its interpreter mode is fixed at import)
    if impl == "triton":
        if cp != 1:
            raise ValueError(f"impl='triton': the conversion kernel supports cp 1 only, got cp {cp}")
        if not triton_runs_on(t.device):
            raise ValueError(f"impl='triton' cannot run on {t.device}: it needs Triton and a CUDA tensor, or a CPU "
                             "tensor with TRITON_INTERPRET=1 set before triton is imported")
        return True
    return triton_runs_on(t.device)


def _sees(layout: Layout, rank: int, owner: int, seq_len: int) -> bool:
    """Whether some key of ``owner`` precedes some query of ``rank`` (host arithmetic on the chunks)."""
    c = layout.chunk_len(seq_len)
    return min(layout.chunk_ids(owner, seq_len)) * c <= (max(layout.chunk_ids(rank, seq_len)) + 1) * c - 1


def _convert(pattern: VerticalSlashPattern, layout: Layout, rank: int, owners, impl: str = "torch",
             static_widths: bool = False) -> List[StepIndices]:
    """:class:`StepIndices` of ``rank``'s queries against each owner in ``owners`` (layout checked).

    The indices of the module docstring, built with few device ops and host syncs: one sync for all
    widths of all owners (plus one at cp > 1, for the per-owner column lists).

    * Blocks: the selected offsets ``d`` (from the slash mask: unique, descending, padded with a huge
      value) give the key blocks ``QB_i - d`` of every query block in ascending order; those ``>= 0``
      held by the owner (cp 1: all) are compacted. Work ``[b, hq, nqb, #offsets]`` instead of
      ``[b, hq, nqb, nkb]``.
    * Columns: visible (``t // bs <= QB_i``) and not in an active block (the owner's active-block
      matrix gathered at the column's block), compacted in the order of ``pattern.vertical``.
    * Compaction (:func:`_prefix`, :func:`_pick`): int32 cumsum of the mask, a binary search per
      output slot, a gather. With ``impl`` resolving to Triton (cp 1, ``owners == [rank]``), the
      kernel of :mod:`megatron_mtraining.patterns.triton.convert` builds the same lists in one launch.
    * ``static_widths``: the index widths are host upper bounds (blocks: ``min(#offset slots, owner
      blocks)``; columns: the pattern's vertical width, at most the owner's length; 0 for an owner
      whose keys all follow this rank's queries) instead of the largest counts: no host sync, the
      same lists with more ``-1`` padding, ``known_max`` holding the bounds (``exact=False``).
    """
    S, bs = pattern.seq_len, pattern.block_size
    dev = pattern.slash.device
    b, hq, ns = pattern.slash.shape
    nb, cp = S // bs, layout.cp_size
    i32 = torch.int32
    big = 1 << 30                                                       # > any block index
    if _use_triton(impl, pattern.slash, cp):   # cp 1: one owner, the rank itself; the same lists in one launch
        from .triton.convert import convert_rows

        nqb = nb                                                        # cp 1: every block is local
        sm = pattern.slash_mask(torch.int8)                             # int8 for the kernel: no bool copy
        # an ascending vertical list is each row's column union: its slot masks come from the same pass
        ascending = pattern.vertical_ascending
        # the offsets in descending order (padding last): ns slots always suffice; an estimated pattern's
        # (strictly ascending) are read backwards by the kernel instead of sorted
        rev = pattern.slash_ascending
        d_desc = pattern.slash if rev else pattern.slash.sort(dim=-1, descending=True).values
        b_cnt, b_idx, c_cnt, c_idx, *masks = convert_rows(d_desc, pattern.vertical, sm, nqb, bs,
                                                          bits=ascending, reversed_offsets=rev,
                                                          ascending_columns=ascending)
        bounds = (min(ns, nqb), min(pattern.vertical.shape[-1], S)) if static_widths else None
        mb, mc = _maxima([b_cnt, c_cnt], bounds)                        # the host sync (unless static)
        b_idx = b_idx[..., :max(1, mb)].contiguous()
        c_idx = c_idx[..., :max(1, mc)].contiguous()
        return [StepIndices(block_count=b_cnt, block_index=b_idx, column_count=c_cnt,
                            column_index=c_idx, causal=True, block_size=bs,
                            known_max=KnownMax.of(b_cnt, c_cnt, mb, mc, exact=not static_widths,
                                                                 union=mc if static_widths else None),
                            diagonal=DiagonalBlocks.of(b_cnt, b_idx),
                            column_union=ColumnUnion.of(pattern.vertical.to(i32), masks[0], c_cnt, c_idx)
                            if ascending else None)]
    qB = local_block_ids(layout, rank, S, bs, dev)                      # [nqb] ascending
    nqb = qB.numel()
    smask = pattern.slash_mask()                                        # [b, hq, nb]
    # --- selected offsets, unique and descending, padded with `big` (entry j of the flipped mask is
    # offset nb - 1 - j); ns slots always suffice (every selected offset is an entry of pattern.slash)
    rc = torch.cumsum(smask.flip(-1), -1, dtype=i32)
    d_desc = _pick(rc, torch.arange(nb - 1, -1, -1, dtype=i32, device=dev), big, ns)[:, :, None, :]
    qB32 = qB.to(i32)[:, None]                                          # [nqb, 1]
    if cp > 1:
        g_owner, g_loc = layout.global_to_local(torch.arange(nb, device=dev) * bs, S)

    # --- vertical columns: per owner (cp > 1: compacted to the owner's own columns first)
    vert = pattern.vertical                                             # [b, hq, nv], -1 padded
    if cp == 1:
        own_cols = {owners[0]: vert}
    else:
        o_rank, _ = layout.global_to_local(vert.clamp(min=0), S)
        pre = {o: _prefix((vert >= 0) & (o_rank == o)) for o in owners}
        s_loc = S // cp
        widths = _maxima([pre[o][1] for o in owners],                   # host sync (cp > 1, unless static)
                         [min(vert.shape[-1], s_loc)] * len(owners) if static_widths else None)
        own_cols = {o: _pick(pre[o][0], vert, -1, max(1, w)) for o, w in zip(owners, widths)}

    pending = []
    for o in owners:
        kB = qB if o == rank else local_block_ids(layout, o, S, bs, dev)    # [nkb]
        nkb = kB.numel()
        # blocks: key block QB_i - d exists (d <= QB_i) and, at cp > 1, is held by o
        table = None
        if cp == 1:
            blk_ok = d_desc <= qB32                                     # [b, hq, nqb, ns]
        else:
            table = torch.full((nb + 1,), -1, dtype=i32, device=dev)    # global block + 1 -> local block
            table[1:] = torch.where(g_owner == o, g_loc // bs, -1).to(i32)
            blk_ok = table[(qB32 - d_desc).clamp_(min=-1).add_(1)] >= 0
        b_cs, b_cnt = _prefix(blk_ok)
        # columns: visible (block <= QB_i) and not inside an active block of the owner
        cols = own_cols[o]
        t = cols.clamp(min=0)
        if cp == 1:                                                     # local index = position
            loc, tb = t, t // bs
            gblk = torch.where(cols >= 0, tb, big)                      # padding: never visible
            lkb = tb.clamp_(max=nkb - 1)
        else:
            loc = layout.global_to_local(t, S)[1]
            gblk = torch.where(cols >= 0, t // bs, big)
            lkb = (loc // bs).clamp_(max=nkb - 1)                       # only meaningful where owned
        kept = gblk[:, :, None, :] <= qB[None, None, :, None]           # visible, [b, hq, nqb, nv]
        # active[i, j] = slash mask at QB_i - KB_j (a negative offset only meets invisible columns)
        active = smask[..., (qB[:, None] - kB[None, :]).clamp_(min=0)]  # [b, hq, nqb, nkb]
        kept.masked_fill_(active.gather(-1, lkb[:, :, None, :].expand(b, hq, nqb, cols.shape[-1])), False)
        c_cs, c_cnt = _prefix(kept)
        pending.append((o, table, b_cs, b_cnt, c_cs, c_cnt, loc))

    if static_widths:                                                   # host bounds of every count
        bounds = []
        for o, *_ in pending:
            seen = _sees(layout, rank, o, S)
            nkb = nqb if o == rank else S // cp // bs
            bounds += [min(ns, nkb) if seen else 0, min(own_cols[o].shape[-1], S // cp) if seen else 0]
    maxima = _maxima([x for p in pending for x in (p[3], p[5])],       # the host sync (unless static)
                     bounds if static_widths else None)
    # cp 1, or striped with one block per stripe (QB_i = i * cp + rank): QB_i - KB_j = (i - j) * cp + rank - owner
    # is an offset d >= 0 only for i - j >= 0, so every step lists local diagonals i - j >= 0. (Contiguous
    # chunks are not: a later rank sees an earlier owner's blocks j > i.)
    affine = cp == 1 or (layout.kind == "striped" and layout.granularity == bs)
    steps = []
    for j, (o, table, b_cs, b_cnt, c_cs, c_cnt, loc) in enumerate(pending):
        mb, mc = maxima[2 * j], maxima[2 * j + 1]
        kb = qB32 - _pick(b_cs, d_desc, big, max(1, mb))                # ascending; padding: < 0
        kb = kb.clamp_(min=-1) if table is None else table[kb.clamp_(min=-1).add_(1)]
        steps.append(StepIndices(
            block_count=b_cnt, block_index=kb, column_count=c_cnt,
            column_index=_pick(c_cs, loc.to(i32)[:, :, None, :], -1, max(1, mc)),
            causal=(o == rank), block_size=bs, known_max=KnownMax.of(b_cnt, c_cnt, mb, mc, exact=not static_widths,
                                                                 union=mc if static_widths else None),
            diagonal=DiagonalBlocks.of(b_cnt, kb) if affine else None))
    return steps


def step_indices(pattern: VerticalSlashPattern, layout: Layout, rank: int, owner: int) -> StepIndices:
    """:class:`StepIndices` of queries on ``rank`` against the K/V shard of ``owner``."""
    check_block_layout(layout, pattern.seq_len, pattern.block_size)
    return _convert(pattern, layout, rank, [owner])[0]


def convert_pattern(pattern: VerticalSlashPattern, layout: Layout, rank: int, impl: str = "auto",
                    static_widths: Optional[bool] = None) -> List[StepIndices]:
    """Per-owner :class:`StepIndices` of ``rank``: element ``o`` is the step against owner ``o``'s K/V.

    ``impl``: ``"torch"`` (the reference, any device and cp), ``"triton"`` (one kernel launch,
    :mod:`megatron_mtraining.patterns.triton.convert`; cp 1 only; bitwise the same tensors) or ``"auto"``
    (default: the kernel on CUDA at cp 1, else torch).

    ``static_widths``: index widths from host upper bounds (the pattern's widths, the owners'
    lengths) instead of the largest counts, so that nothing is read back from the device; the
    lists are the same up to their ``-1`` padding, ``known_max`` then holds the bounds. ``None``
    (default): static on CUDA, the largest counts elsewhere.

    Raises:
        ValueError: the layout does not keep blocks whole (see :func:`check_block_layout`); a hand-built
            pattern that breaks :meth:`VerticalSlashPattern.check`; an unknown ``impl``, or ``impl="triton"``
            at cp > 1 or where Triton cannot run.
    """
    check_block_layout(layout, pattern.seq_len, pattern.block_size)
    if pattern.est_slash_mass is None:      # hand-built (the estimator's hold the rules by construction)
        pattern.check()
    static = pattern.slash.is_cuda if static_widths is None else bool(static_widths)
    with record_function(REGION_CONVERT):
        return _convert(pattern, layout, rank, list(range(layout.cp_size)), impl, static)


def without_columns(idx: StepIndices) -> StepIndices:
    """``idx`` with its vertical columns removed (block/slash work only)."""
    b, hq, nqb = idx.column_count.shape
    k = idx.known_max
    cc = torch.zeros_like(idx.column_count)
    known = (KnownMax.of(idx.block_count, cc, k.block, 0, k.exact, 0 if k.union is not None else None)
             if k is not None and k.valid_for(idx.block_count, idx.column_count) else None)
    return StepIndices(idx.block_count, idx.block_index, cc,
                       torch.full((b, hq, nqb, 1), -1, dtype=idx.column_index.dtype, device=idx.column_index.device),
                       idx.causal, idx.block_size, known_max=known, diagonal=idx.diagonal)


def refine_indices(idx: StepIndices, block_size: int) -> StepIndices:
    """``idx`` re-expressed with smaller blocks of ``block_size`` tokens (the same token-level mask).

    Query block ``i`` of ``idx`` (``f = idx.block_size // block_size`` times larger) becomes the
    ``f`` query blocks ``i*f .. i*f+f-1``; each listed key block ``j`` becomes ``j*f .. j*f+f-1``
    (ascending, so lists stay sorted); the vertical columns of ``i`` are listed for each of its
    ``f`` sub-blocks. ``causal`` is kept: the local-index mask still removes the sub-tiles above the
    diagonal. Pure and vectorized (no host sync); ``known_max`` carries over, scaled, and a valid
    ``column_union`` with its masks repeated per sub-block; document bounds (token-level) carry over unchanged.

    Lets kernels with a fixed tile (the Triton kernels' 64 rows) run patterns estimated at a coarser
    slash granularity (e.g. 128, the tile of FlashAttention-4's block-sparse backward).

    Args:
        idx: a :class:`StepIndices`.
        block_size: the new block size; must divide ``idx.block_size``.

    Returns:
        a :class:`StepIndices` with ``block_size`` blocks (``idx`` itself when the sizes are equal).

    Raises:
        ValueError: ``block_size`` does not divide ``idx.block_size``.
    """
    if block_size < 1 or idx.block_size % block_size:
        raise ValueError(f"block size {block_size} must divide the indices' block size {idx.block_size}")
    f = idx.block_size // block_size
    if f == 1:
        return idx
    b, hq, nqb = idx.block_count.shape
    w = idx.block_index.shape[-1]
    dev = idx.block_index.device
    sub = torch.arange(f, device=dev, dtype=idx.block_index.dtype)
    bi = idx.block_index[..., :, None] * f + sub                                   # [b, hq, nqb, w, f]
    valid = (torch.arange(w, device=dev) < idx.block_count[..., None].long())[..., None]
    bi = torch.where(valid, bi, torch.full_like(bi, -1)).flatten(-2)               # padding stays -1
    bi = bi.repeat_interleave(f, dim=2)
    bc = (idx.block_count * f).repeat_interleave(f, dim=2)
    cc = idx.column_count.repeat_interleave(f, dim=2)
    ci = idx.column_index.repeat_interleave(f, dim=2)
    k = idx.known_max
    known = (KnownMax.of(bc, cc, k.block * f, k.column, k.exact, k.union)
             if k is not None and k.valid_for(idx.block_count, idx.column_count) else None)
    cc, ci = cc.contiguous(), ci.contiguous()
    u = idx.given_column_union
    return StepIndices(bc.contiguous(), bi.contiguous(), cc, ci, idx.causal, block_size,
                       known_max=known, doc_lo=idx.doc_lo, doc_hi=idx.doc_hi, key_pos=idx.key_pos,
                       column_union=u.repeat_blocks(f, cc, ci) if u is not None else None)


def step_column_positions(steps: List[StepIndices], layout: Layout, seq_len: int):
    """Global positions of the columns of this rank's per-owner ``steps`` (``steps[o]``: the step
    against owner ``o``), concatenated over owners: ``(pos int64 [b, hq, nqb, sum of widths], valid
    bool, same shape)``; invalid (padding) slots hold 0."""
    glob, valid = [], []
    for o, st in enumerate(steps):
        slot = torch.arange(st.column_index.shape[-1], device=st.column_index.device)
        ok = slot < st.column_count[..., None].long()
        t = layout.local_to_global(o, st.column_index.long().clamp(min=0), seq_len)
        glob.append(torch.where(ok, t, torch.zeros_like(t)))
        valid.append(ok)
    return torch.cat(glob, -1), torch.cat(valid, -1)


def column_phase_indices(steps: List[StepIndices], layout: Layout, seq_len: int, union: torch.Tensor,
                         static: bool = False) -> StepIndices:
    """One :class:`StepIndices` holding every column of this rank's per-owner ``steps`` (the
    out-of-ring column phase, MTraining §3.3 balancing): no blocks; per query block, exactly the
    columns the converter put into its ring steps, as indices into ``union`` (ascending global
    positions, a superset of those columns; may be padded with larger values), ascending, ``-1``
    padded; ``causal=False``.

    ``static``: the width is the host bound ``sum of the steps' widths`` (no device read) and
    ``known_max`` holds the bounds (``exact=False``; ``union``: the sum of the steps' union bounds
    when they all have one, else ``union.numel()``); otherwise the largest count."""
    glob, valid = step_column_positions(steps, layout, seq_len)
    dev = glob.device
    pos = torch.searchsorted(union, glob)
    big = torch.iinfo(torch.int64).max
    packed = torch.sort(torch.where(valid, pos, torch.full_like(pos, big)), dim=-1).values
    count = valid.sum(-1).to(torch.int32)
    if static:
        width = max(1, packed.shape[-1])
    else:
        width = max(1, int(count.max()) if count.numel() else 1)
    packed = packed[..., :width]
    packed = torch.where(packed == big, torch.full_like(packed, -1), packed).to(torch.int32)
    b, hq, nqb = count.shape
    bc = torch.zeros((b, hq, nqb), dtype=torch.int32, device=dev)
    known = None
    if static:
        unions = [st.known_max.union if st.known_max is not None and st.known_max.valid_for(
            st.block_count, st.column_count) else None for st in steps]
        bound = sum(unions) if None not in unions else union.numel()
        known = KnownMax.of(bc, count, 0, packed.shape[-1], exact=False,
                            union=min(bound, union.numel()))
    return StepIndices(bc, torch.full((b, hq, nqb, 1), -1, dtype=torch.int32, device=dev),
                       count, packed, causal=False, block_size=steps[0].block_size, known_max=known)


def step_key_mask(idx: StepIndices, s_local: int, counts: bool = False) -> torch.Tensor:
    """``[b, hq, s_local (query), s_local (key)]`` token-level mask of one step, local coordinates,
    causal mask applied iff ``idx.causal``. For tests and diagnostics (small sizes only).

    With ``counts=True`` returns int32 multiplicities (block hit + column hit) instead of a bool
    union, so a key listed twice shows up as 2."""
    bs = idx.block_size
    b, hq, nqb = idx.block_count.shape
    dev = idx.block_count.device
    nkb = s_local // bs
    blk = torch.zeros(b, hq, nqb, nkb + 1, dtype=torch.int32, device=dev)
    slot = torch.arange(idx.block_index.shape[-1], device=dev)
    bi = torch.where(slot < idx.block_count[..., None], idx.block_index.long(), nkb).clamp(min=0, max=nkb)
    blk.scatter_add_(-1, bi, torch.ones_like(bi, dtype=torch.int32))
    tok = blk[..., :nkb].repeat_interleave(bs, dim=-1)                    # [b, hq, nqb, s_local]
    col = torch.zeros(b, hq, nqb, s_local + 1, dtype=torch.int32, device=dev)
    slot = torch.arange(idx.column_index.shape[-1], device=dev)
    ci = torch.where(slot < idx.column_count[..., None], idx.column_index.long(), s_local).clamp(min=0, max=s_local)
    col.scatter_add_(-1, ci, torch.ones_like(ci, dtype=torch.int32))
    m = tok + col[..., :s_local]
    m = m.repeat_interleave(bs, dim=2)                                    # rows: query tokens
    if idx.causal:
        r = torch.arange(nqb * bs, device=dev)
        m = m * (torch.arange(s_local, device=dev)[None, :] <= r[:, None])
    return m if counts else m > 0


def _compact(index: torch.Tensor, keep: torch.Tensor):
    """Kept entries of ``index [..., W]`` first (order preserved), ``-1`` after; ``(count int32, index)``
    with the width cut to ``max(1, max count)`` (one host read)."""
    cnt, pos = packed_index_lists(keep, fill=-1)                       # slots of the kept entries
    idx = index.gather(-1, pos.long().clamp(min=0)).masked_fill(pos < 0, -1)
    return cnt, idx.contiguous()


#: elements of one ``[b, h, query blocks, entries]`` temporary of :func:`restrict_to_documents`; the
#: entries are tested in chunks of at most this size, so a stream of many short documents (tens of
#: thousands of sink columns) does not materialise a many-GiB temporary at once
RESTRICT_CHUNK_ELEMENTS = 1 << 26


def _any_row_sees(test, rows: int, width: int) -> torch.Tensor:
    """``test(j0, j1)`` (``[..., j1 - j0]`` bool: some query row of the block sees entry ``j``) over the
    entries ``0 .. width``, in chunks of at most :data:`RESTRICT_CHUNK_ELEMENTS` // ``rows`` entries
    (``rows``: the elements one entry spans, ``b * h * query blocks``); the result is the same as one
    call on all entries."""
    step = max(1, RESTRICT_CHUNK_ELEMENTS // max(rows, 1))
    if step >= width:
        return test(0, width)
    return torch.cat([test(j, min(j + step, width)) for j in range(0, width, step)], dim=-1)


def restrict_to_documents(steps: List[StepIndices], documents, layout: Layout, rank: int) -> List[StepIndices]:
    """``rank``'s per-owner :class:`StepIndices` restricted to packed ``documents``.

    For query block ``i`` (queries ``q`` with key bounds ``lo[q] <= t <= hi[q]``,
    :meth:`~megatron_mtraining.layout.PackedDocuments.key_bounds`) a listed key block is kept iff
    some query of ``i`` may see some key of it, a vertical column ``t`` iff ``lo[q] <= t <= hi[q]``
    for some query of ``i``. Dropped entries cost nothing in the kernels; the kept ones carry
    ``doc_lo``/``doc_hi``/``key_pos`` so the kernels mask every pair exactly.

    The test runs per query block, not per query: a block's queries are ``block_size`` consecutive
    global positions and a document's real tokens are consecutive, so the union of their key
    intervals is ``[min lo, max hi]`` less the padding positions in it (which lie between documents
    that both have queries in the block, fewer than ``block_size`` of them). Hence a key block (whole
    and aligned) is kept iff it meets ``[min lo, max hi]``, and a column iff it lies in it and is a
    real token -- the same entries as the per-query definition, at ``1 / block_size`` of its work.

    Args:
        steps: ``steps[o]`` against owner ``o`` (from :func:`convert_pattern`).
        documents: :class:`~megatron_mtraining.layout.PackedDocuments` of the global sequence.
        layout, rank: the CP layout and this rank.

    Returns:
        new per-owner :class:`StepIndices` (``known_max`` unset: emptiness is read from the counts).

    Raises:
        ValueError: documents of another batch size than the indices.
    """
    S = documents.seq_len
    lo, hi = documents.key_bounds(layout, rank)                        # [b, sl] int64
    real_key = documents.hi >= 0                                       # [b, S]: a real token (not padding)
    out = []
    for o, st in enumerate(steps):
        b, h, nqb = st.block_count.shape
        if lo.shape[0] != b:
            raise ValueError(f"packed documents describe {lo.shape[0]} streams but the sparse indices have batch {b}")
        bs = st.block_size
        dev = st.block_count.device
        # per query block: the smallest lo and the largest hi of its queries (padding: lo = S, hi = -1)
        lo_q = lo.view(b, nqb, bs).amin(-1).view(b, 1, nqb, 1)
        hi_q = hi.view(b, nqb, bs).amax(-1).view(b, 1, nqb, 1)
        kpos = layout.positions(o, S, device=dev)                        # ascending, blocks contiguous
        rows = b * h * nqb
        bi = st.block_index.long()
        b_ok = torch.arange(bi.shape[-1], device=dev) < st.block_count[..., None].long()
        t0 = kpos[bi.clamp(min=0) * bs]
        t1 = kpos[bi.clamp(min=0) * bs + bs - 1]
        live = _any_row_sees(lambda j0, j1: torch.maximum(lo_q, t0[..., j0:j1]) <= torch.minimum(hi_q, t1[..., j0:j1]),
                             rows, bi.shape[-1]) & b_ok
        bc, bidx = _compact(st.block_index, live)
        ci = st.column_index.long()
        c_ok = torch.arange(ci.shape[-1], device=dev) < st.column_count[..., None].long()
        t = kpos[ci.clamp(min=0)]                                        # [b, h, nqb, W] global positions
        real = real_key.gather(1, t.reshape(b, -1)).view_as(t)

        def col_test(j0, j1):
            tt = t[..., j0:j1]
            return (lo_q <= tt) & (tt <= hi_q) & real[..., j0:j1]

        c_live = _any_row_sees(col_test, rows, ci.shape[-1]) & c_ok
        cc, cidx = _compact(st.column_index, c_live)
        out.append(StepIndices(bc, bidx, cc, cidx, st.causal, bs, doc_lo=lo, doc_hi=hi, key_pos=kpos))
    return out

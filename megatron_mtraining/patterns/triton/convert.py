"""Triton index conversion of a vertical-slash pattern at CP=1 (MTraining §3.3): the per-query-block
block and column lists of :func:`megatron_mtraining.patterns.convert.convert_pattern`, bitwise the
torch path's, in one kernel launch.

The torch path builds ``[b, hq, nqb, width]`` masks, int32 cumsums and a binary search per output slot
(three ``searchsorted`` at 128K tokens: about 1 ms on an H200). Here one program
owns one (sample·head, query block) row: it streams the row's candidates in chunks of ``CHUNK``,
compacts the kept ones with an in-register prefix sum and writes them at their final slots; slots past
the row's count get -1. Per row ``i`` (query block ``i``, keys in local = global order at CP=1):

* blocks: the selected block-diagonal offsets ``d`` (sorted descending, -1 padding last; a repeated
  offset is skipped; or strictly ascending with -1 padding last, read backwards) with ``d <= i``, in
  descending order, as key blocks ``i - d`` (ascending);
* columns: the pattern's vertical positions ``t`` (in the pattern's order; -1 = padding) with
  ``t // bs <= i`` whose block ``t // bs`` is not active for ``i`` (offset ``i - t // bs`` not selected);
  optionally also as 64-bit masks over the slots of the row's vertical list (bit ``j % 64`` of word
  ``j // 64``: slot ``j`` listed), the per-block masks of the backward's column plan.

Imported lazily (``triton.jit`` picks compiled or interpreted mode at decoration time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["convert_rows", "CHUNK"]

CHUNK = 256         # candidates per step of a program's loop (one tl.cumsum)


@triton.jit
def _convert_rows_kernel(
    DDesc, Vert, SMask, BCnt, BIdx, CCnt, CIdx, Bits,
    NS, NV, WB, WC, NQB, BS, NW,
    s_dr, s_vr, s_mr,
    CHUNK: tl.constexpr, WRITE_BITS: tl.constexpr, REVERSED: tl.constexpr, ASC_COLS: tl.constexpr,
):
    i = tl.program_id(0)                 # query block = local row
    r = tl.program_id(1)                 # sample * hq + head
    offs = tl.arange(0, CHUNK)
    out_row = (r * NQB + i).to(tl.int64)
    # --- blocks: offsets d <= i in descending order (ascending key block); the previous slot's offset
    # equal (a repeated offset) or padding (-1) is skipped, so at most NS = WB of them; REVERSED: the list
    # is ascending, slot idx of the descending order is slot NS - 1 - idx (its padding then comes first)
    base = i * 0
    for c0 in range(0, NS, CHUNK):
        idx = c0 + offs
        src = NS - 1 - idx if REVERSED else idx
        prev = src + 1 if REVERSED else src - 1
        d = tl.load(DDesc + r * s_dr + src, mask=idx < NS, other=-1)
        dp = tl.load(DDesc + r * s_dr + prev, mask=(idx > 0) & (idx < NS), other=-1)
        ok = (d >= 0) & (d <= i) & (d != dp)
        ok32 = ok.to(tl.int32)
        pos = base + tl.cumsum(ok32, 0) - 1
        tl.store(BIdx + out_row * WB + pos, (i - d).to(tl.int32), mask=ok)
        base += tl.sum(ok32, 0)
    tl.store(BCnt + out_row, base)
    for c0 in range(0, WB, CHUNK):
        idx = c0 + offs
        tl.store(BIdx + out_row * WB + idx, tl.full([CHUNK], -1, tl.int32), mask=(idx >= base) & (idx < WB))
    # --- columns: visible (t // bs <= i) and not in an active block, in the pattern's order; a chunk
    # without a visible column (past the tile or padding: most chunks of the early tiles) is skipped
    # with WRITE_BITS also the chunk's CHUNK // 64 words of slot masks (zero for a skipped chunk).
    # ASC_COLS (an ascending list, -1 padding last): the loop stops after the first chunk whose last
    # slot is not visible (no later slot is), and the remaining mask words are written as zeros
    base = i * 0
    wid = tl.arange(0, CHUNK // 64)
    c0 = i * 0
    go = c0 < NV
    while go:
        idx = c0 + offs
        t = tl.load(Vert + r * s_vr + idx, mask=idx < NV, other=-1)
        valid = t >= 0
        tb = tl.where(valid, t // BS, 0)
        vis = valid & (tb <= i)
        words = tl.zeros([CHUNK // 64], dtype=tl.int64)
        if tl.max(vis.to(tl.int32), 0) > 0:
            act = tl.load(SMask + r * s_mr + (i - tb), mask=vis, other=0)
            keep = vis & (act == 0)
            keep32 = keep.to(tl.int32)
            pos = base + tl.cumsum(keep32, 0) - 1
            tl.store(CIdx + out_row * WC + pos, t.to(tl.int32), mask=keep)
            base += tl.sum(keep32, 0)
            if WRITE_BITS:
                bit = tl.where(keep, tl.full([CHUNK], 1, tl.int64) << (offs % 64).to(tl.int64), 0)
                # distinct powers of two per word: their sum is their OR (two's complement for bit 63)
                words = tl.sum(tl.where((offs // 64)[None, :] == wid[:, None], bit[None, :], 0), 1)
        if WRITE_BITS:
            w = c0 // 64 + wid
            tl.store(Bits + out_row * NW + w, words, mask=w < NW)
        c0 += CHUNK
        if ASC_COLS:
            last = tl.load(Vert + r * s_vr + c0 - 1, mask=c0 - 1 < NV, other=-1)
            go = (c0 < NV) & (last >= 0) & (last // BS <= i)
        else:
            go = c0 < NV
    if ASC_COLS and WRITE_BITS:
        for w0 in range(c0 // 64, NW, CHUNK // 64):
            w = w0 + wid
            tl.store(Bits + out_row * NW + w, tl.zeros([CHUNK // 64], dtype=tl.int64), mask=w < NW)
    tl.store(CCnt + out_row, base)
    for c0 in range(0, WC, CHUNK):
        idx = c0 + offs
        tl.store(CIdx + out_row * WC + idx, tl.full([CHUNK], -1, tl.int32), mask=(idx >= base) & (idx < WC))


def convert_rows(d_desc: torch.Tensor, vertical: torch.Tensor, slash_mask: torch.Tensor, nqb: int, block_size: int,
                 bits: bool = False, reversed_offsets: bool = False, ascending_columns: bool = False):
    """Block and column lists of every (sample, head, query block) row at CP=1.

    Args:
        d_desc: ``[b, hq, ns]`` int64 (or int32) selected offsets sorted descending, padded with -1 (a
            pattern's ``slash`` sorted descending: repeated offsets are listed once); with
            ``reversed_offsets``, strictly ascending with the -1 padding last (an estimated pattern's
            ``slash`` as it is, ``VerticalSlashPattern.slash_ascending``), read backwards.
        vertical: ``[b, hq, nv]`` int64 (or int32) column positions, -1 = padding.
        slash_mask: ``[b, hq, nb]`` bool or int8 (nonzero: offset ``d`` selected), ``nb >= nqb``; any
            strides of its first two dimensions, the last contiguous.
        nqb: query blocks (= key blocks = ``S / block_size``); block_size: tokens per block.
        bits: also return the column lists as slot masks over ``vertical`` (below).
        reversed_offsets: ``d_desc`` holds the offsets ascending (above), not descending.
        ascending_columns: every row of ``vertical`` is strictly ascending with its -1 padding last
            (``VerticalSlashPattern.vertical_ascending``): a row's loop stops after its last visible chunk.

    Returns:
        ``(block_count [b, hq, nqb] int32, block_index [b, hq, nqb, max(1, ns)] int32, column_count
        [b, hq, nqb] int32, column_index [b, hq, nqb, max(1, nv)] int32)``; index slots past the count hold
        -1 (the caller trims the widths to the largest count, at least 1). With ``bits``, a fifth tensor
        ``[b, hq, nqb, ceil(nv / 64)]`` int64: bit ``j % 64`` of word ``j // 64`` is set iff the row lists
        ``vertical[..., j]``.
    """
    b, hq, nv = vertical.shape
    ns = d_desc.shape[-1]
    dev = vertical.device
    dd = d_desc.reshape(b * hq, ns).contiguous()
    vt = vertical.reshape(b * hq, nv).contiguous()
    sm = slash_mask if slash_mask.dtype == torch.int8 else slash_mask.to(torch.int8)
    sm = sm.reshape(b * hq, sm.shape[-1])
    if sm.stride(-1) != 1:
        sm = sm.contiguous()
    bcnt = torch.empty((b, hq, nqb), dtype=torch.int32, device=dev)
    ccnt = torch.empty((b, hq, nqb), dtype=torch.int32, device=dev)
    wb, wc = max(1, ns), max(1, nv)        # at least one (-1) slot, as the torch path
    bidx = torch.empty((b, hq, nqb, wb), dtype=torch.int32, device=dev)
    cidx = torch.empty((b, hq, nqb, wc), dtype=torch.int32, device=dev)
    nw = -(-nv // 64)
    masks = torch.empty((b, hq, nqb, nw), dtype=torch.int64, device=dev) if bits else None   # every word written
    out = (bcnt, bidx, ccnt, cidx) + ((masks,) if bits else ())
    if b * hq * nqb == 0:
        return out
    _convert_rows_kernel[(nqb, b * hq)](
        dd, vt, sm, bcnt, bidx, ccnt, cidx, masks if bits else ccnt,
        ns, nv, wb, wc, nqb, block_size, nw,
        dd.stride(0), vt.stride(0), sm.stride(0),
        CHUNK=CHUNK, WRITE_BITS=bool(bits), REVERSED=bool(reversed_offsets),
        ASC_COLS=bool(ascending_columns), num_warps=4,
    )
    return out

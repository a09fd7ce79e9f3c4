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
"""

from __future__ import annotations

from typing import List

import torch

from ..layout import Layout
from .estimator import VerticalSlashPattern
from .indices import StepIndices

__all__ = ["check_block_layout", "local_block_ids", "step_indices", "convert_pattern", "step_key_mask",
           "without_columns", "step_column_positions", "column_phase_indices"]


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


def _compact(mask: torch.Tensor, values: torch.Tensor):
    """Keep ``values`` where ``mask`` (order preserved), left-aligned, padded with -1.

    O(n) (cumsum + scatter, no sort). Returns ``(count int32 [...], packed int32 [..., max(1, max count)])``.
    """
    cnt = mask.sum(-1)
    width = max(1, int(cnt.max())) if cnt.numel() else 1
    slot = torch.where(mask, mask.cumsum(-1) - 1, torch.full_like(cnt[..., None], width))   # width = dump slot
    out = torch.full((*mask.shape[:-1], width + 1), -1, dtype=torch.int64, device=mask.device)
    out.scatter_(-1, slot, torch.where(mask, values.expand(mask.shape).long(), -1))
    return cnt.to(torch.int32), out[..., :width].to(torch.int32)


def step_indices(pattern: VerticalSlashPattern, layout: Layout, rank: int, owner: int) -> StepIndices:
    """:class:`StepIndices` of queries on ``rank`` against the K/V shard of ``owner``."""
    S, bs = pattern.seq_len, pattern.block_size
    check_block_layout(layout, S, bs)
    dev = pattern.slash.device
    qB = local_block_ids(layout, rank, S, bs, dev)                      # [nqb]
    kB = local_block_ids(layout, owner, S, bs, dev)                     # [nkb]
    diff = qB[:, None] - kB[None, :]                                     # [nqb, nkb]
    active = pattern.slash_mask()[..., diff.clamp(min=0)] & (diff >= 0)  # [b, hq, nqb, nkb]
    nkb = kB.numel()
    block_count, block_index = _compact(active, torch.arange(nkb, device=dev))

    vert = pattern.vertical                                              # [b, hq, nv], -1 padded
    o_rank, _ = layout.global_to_local(vert.clamp(min=0), S)
    _, vert = _compact((vert >= 0) & (o_rank == owner), vert)            # this owner's columns only
    vert = vert.long()
    owned = vert >= 0
    t = vert.clamp(min=0)
    _, o_loc = layout.global_to_local(t, S)
    lkb = (o_loc // bs).clamp(max=nkb - 1)                              # only meaningful where owned
    b, hq, nv = vert.shape
    nqb = qB.numel()
    visible = owned[:, :, None, :] & ((t // bs)[:, :, None, :] <= qB[None, None, :, None])
    covered = active.gather(-1, lkb[:, :, None, :].expand(b, hq, nqb, nv))
    column_count, column_index = _compact(visible & ~covered, o_loc[:, :, None, :])
    return StepIndices(block_count=block_count, block_index=block_index, column_count=column_count,
                       column_index=column_index, causal=(owner == rank), block_size=bs)


def convert_pattern(pattern: VerticalSlashPattern, layout: Layout, rank: int) -> List[StepIndices]:
    """Per-owner :class:`StepIndices` of ``rank``: element ``o`` is the step against owner ``o``'s K/V.

    Raises:
        ValueError: the layout does not keep blocks whole (see :func:`check_block_layout`).
    """
    check_block_layout(layout, pattern.seq_len, pattern.block_size)
    return [step_indices(pattern, layout, rank, o) for o in range(layout.cp_size)]


def without_columns(idx: StepIndices) -> StepIndices:
    """``idx`` with its vertical columns removed (block/slash work only)."""
    b, hq, nqb = idx.column_count.shape
    return StepIndices(idx.block_count, idx.block_index, torch.zeros_like(idx.column_count),
                       torch.full((b, hq, nqb, 1), -1, dtype=idx.column_index.dtype, device=idx.column_index.device),
                       idx.causal, idx.block_size)


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


def column_phase_indices(steps: List[StepIndices], layout: Layout, seq_len: int, union: torch.Tensor) -> StepIndices:
    """One :class:`StepIndices` holding every column of this rank's per-owner ``steps`` (the
    out-of-ring column phase, MTraining §3.3 balancing): no blocks; per query block, exactly the
    columns the converter put into its ring steps, as indices into ``union`` (ascending global
    positions, a superset of those columns), ascending, ``-1`` padded; ``causal=False``."""
    glob, valid = step_column_positions(steps, layout, seq_len)
    dev = glob.device
    pos = torch.searchsorted(union, glob)
    big = torch.iinfo(torch.int64).max
    packed = torch.sort(torch.where(valid, pos, torch.full_like(pos, big)), dim=-1).values
    count = valid.sum(-1)
    packed = packed[..., :max(1, int(count.max()) if count.numel() else 1)]
    packed = torch.where(packed == big, torch.full_like(packed, -1), packed).to(torch.int32)
    b, hq, nqb = count.shape
    return StepIndices(torch.zeros((b, hq, nqb), dtype=torch.int32, device=dev),
                       torch.full((b, hq, nqb, 1), -1, dtype=torch.int32, device=dev),
                       count.to(torch.int32), packed, causal=False, block_size=steps[0].block_size)


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

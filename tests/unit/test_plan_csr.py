"""The Triton backward plans' index helpers against plain Python loops (CPU, no Triton needed):
the CSR offsets and unmasked ends of the inverted indices (binary searches in the sorted keys) and
the leading unmasked split of a tile's slots, and the column union's per-row ranks."""
from __future__ import annotations

import torch

from megatron_mtraining.ops.triton.launch import _csr_entries, _leading_split, _row_ranks


def _csr_reference(seg, val, masked, nseg):
    offsets, mids, entries = [0], [], []
    for s in range(nseg):
        rows = [(int(m), int(v)) for g, v, m in zip(seg.tolist(), val.tolist(), masked.tolist()) if g == s]
        rows.sort()
        entries += [v for _, v in rows]
        mids.append(offsets[-1] + sum(1 for m, _ in rows if m == 0))
        offsets.append(offsets[-1] + len(rows))
    return offsets, mids, entries


def test_csr_entries_match_a_loop():
    g = torch.Generator().manual_seed(0)
    nseg, span, n = 7, 13, 200
    seg = torch.randint(0, nseg + 1, (n,), generator=g)          # nseg: padding entries
    val = torch.randint(0, span, (n,), generator=g)
    masked = torch.randint(0, 2, (n,), generator=g)
    offsets, mids, entries = _csr_entries(seg, val, masked, nseg, span)
    ref_off, ref_mid, ref_ent = _csr_reference(seg, val, masked, nseg)
    assert offsets.dtype == mids.dtype == entries.dtype == torch.int32
    assert offsets.tolist() == ref_off and mids.tolist() == ref_mid
    assert entries[:ref_off[-1]].tolist() == ref_ent
    # negative control: the unmasked ends depend on the flags
    assert _csr_reference(seg, val, 1 - masked, nseg)[1] != ref_mid


def test_csr_entries_empty_segments_and_no_entries():
    offsets, mids, entries = _csr_entries(torch.full((5,), 3), torch.arange(5), torch.zeros(5, dtype=torch.long), 3, 5)
    assert offsets.tolist() == [0, 0, 0, 0] and mids.tolist() == [0, 0, 0]
    assert entries.numel() >= 1


def test_leading_split_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    bi = torch.randint(0, 9, (2, 3, 5, 6), generator=g)
    bc = torch.randint(0, 7, (2, 3, 5), generator=g)
    ok = torch.rand(2, 3, 5, 6, generator=g) < 0.8
    got = _leading_split(bi, bc, ok)
    assert got.dtype == torch.int32
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in bc.shape)).tolist():
        want = 0
        while want < min(int(bc[tuple(idx)]), 6) and bool(ok[tuple(idx)][want]):
            want += 1
        assert int(got[tuple(idx)]) == want, idx


def test_leading_split_of_an_empty_index():
    bi = torch.zeros((1, 2, 3, 0), dtype=torch.int32)
    got = _leading_split(bi, torch.zeros((1, 2, 3), dtype=torch.int32), torch.zeros((1, 2, 3, 0), dtype=torch.bool))
    assert got.shape == (1, 2, 3) and got.dtype == torch.int32 and not got.any()


def test_row_ranks_match_a_loop():
    """One flattened scan minus each row's base equals a per-row running count (rows that start and end
    with a present entry, empty rows, a single column)."""
    g = torch.Generator().manual_seed(1)
    for shape in [(2, 3, 37), (1, 4, 1), (3, 1, 8)]:
        present = (torch.rand(shape, generator=g) < 0.4).to(torch.int32)
        present[0, 0].fill_(1)
        present[-1, -1].zero_()
        rank, count = _row_ranks(present)
        assert rank.dtype == count.dtype == torch.int32
        for idx in torch.cartesian_prod(*(torch.arange(n) for n in shape[:-1])).view(-1, len(shape) - 1).tolist():
            row, run = present[tuple(idx)].tolist(), 0
            for j, p in enumerate(row):
                run += p
                assert rank[tuple(idx) + (j,)] == run - 1
            assert count[tuple(idx)] == sum(row)
    # negative control: a rank of the whole flattened tensor (no base subtracted) differs from row 1 on
    flat = torch.cumsum(present.view(-1), 0).view(present.shape) - 1
    assert not torch.equal(flat, _row_ranks(present)[0])
    # the per-row fallback: one row, and empty batch / head / column dims
    for t in (torch.tensor([0, 1, 1, 0, 1], dtype=torch.int32), torch.zeros(0, 3, 5, dtype=torch.int32),
              torch.zeros(2, 0, 5, dtype=torch.int32), torch.zeros(2, 3, 0, dtype=torch.int32)):
        rank, count = _row_ranks(t)
        assert torch.equal(rank, torch.cumsum(t, -1, dtype=torch.int32) - 1), t.shape
        assert torch.equal(count, t.sum(-1, dtype=torch.int32)) and count.shape == t.shape[:-1]
    assert _row_ranks(torch.tensor([0, 1, 1, 0, 1], dtype=torch.int32))[0].tolist() == [-1, 0, 1, 1, 2]

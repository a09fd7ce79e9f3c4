"""Triton index conversion (patterns/triton/convert.py), run by the Triton CPU interpreter: at cp 1,
``convert_pattern(impl="triton")`` returns bitwise the tensors of the torch reference
(``impl="torch"``, itself checked against a frozen copy of the original code in
tests/unit/test_selection_equivalence.py) and the same recorded maxima, on the randomized patterns of
that file (canonical, and unsorted / duplicated / extra-padded ones), on estimated patterns, and on
rows longer than one kernel chunk, on zero-width lists; ``auto`` stays on torch on the CPU; bad
``impl`` values raise; a corrupted kernel output is caught (negative control).

The interpreter must be chosen before triton is imported (same mechanism as
test_triton_kernels.py): if another test module imported triton earlier in this pytest process,
the tests re-run this file in a fresh subprocess instead.
"""

import dataclasses
import os
import random
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:  # else compiled Triton is in use (GPU session): the tests run in a subprocess
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.triton_interp import rerun_in_fresh_interpreter, use_interpreted_kernels

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from megatron_mtraining.layout import Layout  # noqa: E402
from megatron_mtraining.patterns.convert import convert_pattern  # noqa: E402
from megatron_mtraining.patterns.estimator import (  # noqa: E402
    VerticalSlashConfig, VerticalSlashPattern, estimate_vertical_slash,
)
from tests.unit.test_selection_equivalence import assert_same_steps, random_pattern, tie_heavy_qkv  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.patterns.triton.convert", "_convert_rows_kernel")
    yield


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


def assert_same_with_maxima(new, ref, ctx):
    assert_same_steps(new, ref, ctx)
    for a, b in zip(new, ref):
        assert a.known_max is not None and a.known_max.valid_for(a.block_count, a.column_count), ctx
        assert (a.known_max.block, a.known_max.column) == (b.known_max.block, b.known_max.column), ctx
        assert a.is_empty() == b.is_empty(), ctx


def expected_masks(step, vertical):
    """``[b, h, nqb, ceil(nv / 64)]`` int64: bit ``j % 64`` of word ``j // 64`` set iff the block lists
    ``vertical[..., j]`` (brute force over the lists)."""
    ci, cc = step.column_index.long(), step.column_count.long()
    listed_slot = torch.arange(ci.shape[-1]) < cc[..., None]                            # [b, h, nqb, w]
    hit = (vertical[:, :, None, :, None] == ci[:, :, :, None, :]) & listed_slot[:, :, :, None, :]
    listed = hit.any(-1) & (vertical >= 0)[:, :, None, :]                                 # [b, h, nqb, nv]
    nv = vertical.shape[-1]
    nw = -(-nv // 64)
    listed = torch.nn.functional.pad(listed, (0, nw * 64 - nv)).view(*listed.shape[:3], nw, 64)
    return (listed.long() << torch.arange(64)).sum(-1)         # distinct powers of two (two's complement)


def test_triton_conversion_column_union_masks():
    """Estimated patterns (ascending vertical lists, ``vertical_ascending``): the Triton conversion records
    each row's vertical list as its column union with the per-block masks of what the block lists
    (brute force from the lists), refine_indices repeats them per sub-block, and the record stops being
    valid once the lists are modified in place (negative control). Patterns not known to be ascending get
    none."""
    from megatron_mtraining.patterns.convert import refine_indices

    gen, rng = torch.Generator().manual_seed(321), random.Random(321)
    S = 1024
    q, k = tie_heavy_qkv(gen, rng, 1, S, 2, 1, 16)
    for bs in (64, 128):
        cfg = VerticalSlashConfig(recall=0.9, last_q=64, block_size=bs, sink_tokens=8, local_blocks=1,
                                  max_vertical=150, max_slash=4)
        layout = Layout("striped", 1, bs)
        pat = estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="torch")
        assert pat.vertical_ascending and pat.to("cpu").vertical_ascending and pat.coarsen(2 * bs).vertical_ascending
        assert pat.slash_ascending and pat.to("cpu").slash_ascending and pat.coarsen(2 * bs).slash_ascending
        st = convert_pattern(pat, layout, 0, impl="triton")[0]
        u = st.given_column_union
        assert u is not None and torch.equal(u.union, pat.vertical.to(torch.int32))
        masks = expected_masks(st, pat.vertical)
        assert int((masks != 0).sum()) > 0 and torch.equal(u.bits, masks)
        fine = refine_indices(st, 64)
        if bs != 64:
            assert torch.equal(fine.given_column_union.bits, expected_masks(fine, pat.vertical))
        st.column_index.add_(0)                            # an in-place write: the record no longer holds
        assert st.given_column_union is None
        plain = convert_pattern(dataclasses.replace(pat, vertical_ascending=False), layout, 0, impl="triton")[0]
        assert plain.column_union is None
        assert_same_steps([plain], convert_pattern(pat, layout, 0, impl="torch"), bs)


@pytest.mark.parametrize("seed", range(24))
def test_triton_conversion_matches_torch_on_random_patterns(seed):
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    bs = rng.choice([16, 64])
    g = bs * rng.choice([1, 2])
    kind = rng.choice(["striped", "zigzag", "contiguous"])
    layout = Layout(kind, 1, g)
    unit = {"striped": g, "zigzag": 2 * bs, "contiguous": bs}[kind]
    S = unit * rng.choice([1, 2, 3, 8])
    b, hq = rng.choice([1, 2]), rng.choice([1, 3])
    for canonical in (True, False):
        pat = random_pattern(gen, rng, b, hq, S, bs, canonical)
        assert_same_with_maxima(convert_pattern(pat, layout, 0, impl="triton"),
                                convert_pattern(pat, layout, 0, impl="torch"), (seed, canonical))


@pytest.mark.parametrize("seed", range(6))
def test_triton_conversion_matches_torch_on_estimated_patterns(seed):
    gen, rng = torch.Generator().manual_seed(100 + seed), random.Random(100 + seed)
    S, bs = 512, 32
    q, k = tie_heavy_qkv(gen, rng, 2, S, 4, 2, 16)
    cfg = VerticalSlashConfig(recall=rng.choice([0.5, 0.9, 1.0]), last_q=48, block_size=bs, sink_tokens=rng.choice([0, 8]),
                              local_blocks=rng.choice([1, 2]), max_vertical=rng.choice([16, 200, 600]),
                              max_slash=rng.choice([2, 5, 16]))
    layout = Layout("striped", 1, 64)
    pat = estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="torch")
    assert_same_with_maxima(convert_pattern(pat, layout, 0, impl="triton"),
                            convert_pattern(pat, layout, 0, impl="torch"), (seed, cfg))


def test_triton_conversion_rows_longer_than_a_chunk(monkeypatch):
    """Offset and column lists over several kernel chunks (the running offset between chunks), and the
    column masks over them, b=2, hq=2; negative control: one corrupted column entry fails the comparison. The kernel's chunk width is a
    launch constant (``CHUNK``, 1024): here it is set to 64, so that rows of a few chunks stay small
    enough for the interpreter; the chunk loop and the running offsets are the same code."""
    from megatron_mtraining.patterns.triton import convert as triton_convert

    monkeypatch.setattr(triton_convert, "CHUNK", 64)
    CHUNK = triton_convert.CHUNK
    rng = random.Random(7)
    bs = 16
    nb = CHUNK + 80
    S = nb * bs
    # head 0: more offsets than a chunk; head 1: few offsets, so that most of its columns are kept
    slash = [[sorted(rng.sample(range(nb), CHUNK + 20)), sorted(rng.sample(range(nb), 40))] for _ in range(2)]
    vert = [[sorted(rng.sample(range(S), CHUNK + CHUNK // 2)), sorted(rng.sample(range(S), 2 * CHUNK + 5))]
            for _ in range(2)]
    pat = VerticalSlashPattern.from_lists(S, bs, slash, vert)   # ascending lists: the column masks too
    pat = dataclasses.replace(pat, vertical_ascending=True)
    assert pat.slash_ascending                                  # offsets read backwards over several chunks
    layout = Layout("striped", 1, bs)
    new, ref = convert_pattern(pat, layout, 0, impl="triton"), convert_pattern(pat, layout, 0, impl="torch")
    assert ref[0].block_index.shape[-1] > CHUNK and ref[0].column_index.shape[-1] > CHUNK
    assert_same_with_maxima(new, ref, "long rows")
    assert_same_with_maxima(convert_pattern(dataclasses.replace(pat, slash_ascending=False), layout, 0, impl="triton"),
                            ref, "long rows, sorted")
    assert torch.equal(new[0].given_column_union.bits, expected_masks(new[0], pat.vertical))  # over several chunks
    # ascending columns: each row's loop stops after its last visible chunk (the early rows see few); on
    # a shuffled list the same early stop drops columns (negative control: the flag is what stops it)
    from megatron_mtraining.patterns.triton.convert import convert_rows
    sm = pat.slash_mask(torch.int8)
    perm = torch.randperm(pat.vertical.shape[-1], generator=torch.Generator().manual_seed(3))
    shuffled = pat.vertical[..., perm]
    full = convert_rows(pat.slash, shuffled, sm, nb, bs, reversed_offsets=True)
    cut = convert_rows(pat.slash, shuffled, sm, nb, bs, reversed_offsets=True, ascending_columns=True)
    assert not torch.equal(full[2], cut[2])
    bad = new[0].column_index.clone()
    bad[0, 0, -1, 0] += 1
    corrupted = [dataclasses.replace(new[0], column_index=bad)]
    with pytest.raises(AssertionError):
        assert_same_steps(corrupted, ref, "corrupted")


@pytest.mark.parametrize("empty", ["slash", "vertical", "both"])
def test_triton_conversion_zero_width_lists(empty):
    """Hand-built patterns with zero-width slash and/or vertical lists: width-1 (-1) index lists, as the
    torch path."""
    S, bs, b, hq = 256, 16, 1, 2
    nb = S // bs
    slash = torch.tensor([[[0, 3], [1, -1]]])
    vert = torch.tensor([[[5, 100], [-1, -1]]])
    if empty in ("slash", "both"):
        slash = torch.zeros(b, hq, 0, dtype=torch.long)
    if empty in ("vertical", "both"):
        vert = torch.zeros(b, hq, 0, dtype=torch.long)
    cnt = lambda x: (x >= 0).sum(-1)  # noqa: E731
    pat = VerticalSlashPattern(S, bs, slash, cnt(slash), vert, cnt(vert))
    assert nb == 16
    assert_same_with_maxima(convert_pattern(pat, Layout("striped", 1, bs), 0, impl="triton"),
                            convert_pattern(pat, Layout("striped", 1, bs), 0, impl="torch"), empty)


def test_impl_errors():
    pat = VerticalSlashPattern.from_lists(128, 16, [[[0, 1]]], [[[3, 40]]])
    with pytest.raises(ValueError, match="impl must be one of"):
        convert_pattern(pat, Layout("striped", 1, 16), 0, impl="cuda")
    with pytest.raises(ValueError, match="cp 1 only"):
        convert_pattern(pat, Layout("striped", 2, 16), 0, impl="triton")
    # auto on the CPU: the torch path, the kernel is not called
    import megatron_mtraining.patterns.triton.convert as kc

    def refuse(*a, **k):
        raise AssertionError("auto ran the kernel on the CPU")
    orig, kc.convert_rows = kc.convert_rows, refuse
    try:
        assert_same_steps(convert_pattern(pat, Layout("striped", 1, 16), 0),
                          convert_pattern(pat, Layout("striped", 1, 16), 0, impl="torch"), "auto")
        with pytest.raises(AssertionError, match="kernel"):      # and impl="triton" does call it
            convert_pattern(pat, Layout("striped", 1, 16), 0, impl="triton")
    finally:
        kc.convert_rows = orig


def test_ascending_offsets_are_read_backwards_instead_of_sorted():
    """A pattern whose offsets are recorded as strictly ascending (``slash_ascending``: the estimator's
    patterns and those of ``from_lists``): the kernel reads each row backwards, the same lists as the sorted path (flag off) and
    the torch path, over several kernel chunks too. Negative control: descending rows flagged ascending
    give other lists (the flag is what the kernel follows), and ``check`` refuses them by rule."""
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    S, bs = 512, 32
    q, k = tie_heavy_qkv(gen, rng, 2, S, 4, 2, 16)
    cfg = VerticalSlashConfig(recall=0.9, last_q=48, block_size=bs, sink_tokens=8, local_blocks=1,
                              max_vertical=64, max_slash=6)
    layout = Layout("striped", 1, 64)
    pat = estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="torch")
    assert pat.slash_ascending and int(pat.slash_count.min()) >= 2
    ref = convert_pattern(pat, layout, 0, impl="torch")
    assert_same_with_maxima(convert_pattern(pat, layout, 0, impl="triton"), ref, "read backwards")
    assert_same_with_maxima(convert_pattern(dataclasses.replace(pat, slash_ascending=False), layout, 0,
                                            impl="triton"), ref, "sorted")
    # descending rows, padding last: a valid pattern (the sorted path lists it right), not an ascending one
    desc = pat.slash.sort(dim=-1, descending=True).values
    wrong = dataclasses.replace(pat, slash=desc)
    assert_same_with_maxima(convert_pattern(dataclasses.replace(wrong, slash_ascending=False), layout, 0,
                                            impl="triton"), ref, "descending, sorted")
    with pytest.raises(AssertionError):
        assert_same_steps(convert_pattern(wrong, layout, 0, impl="triton"), ref, "descending read backwards")
    with pytest.raises(ValueError, match="slash_ascending is set, but a row of slash is not strictly ascending"):
        wrong.check()
    with pytest.raises(ValueError, match="vertical_ascending is set"):
        dataclasses.replace(pat, vertical=pat.vertical.flip(-1)).check()
    pat.check()
    # from_lists: a -1 written inside a row is padding (dropped, not counted), so its rows stay ascending
    hand = VerticalSlashPattern.from_lists(128, 16, [[[-1, 3], [0]]], [[[5, -1], [7]]])
    assert hand.slash.tolist() == [[[3], [0]]] and hand.slash_count.tolist() == [[1, 1]]
    assert hand.vertical_count.tolist() == [[1, 1]] and hand.slash_ascending
    lay = Layout("striped", 1, 16)
    assert_same_steps(convert_pattern(hand, lay, 0, impl="triton"), convert_pattern(hand, lay, 0, impl="torch"), "hand")

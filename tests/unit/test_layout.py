"""Layout index maps: striped / zigzag / contiguous are bijections with the documented owners."""
import pytest
import torch

from megatron_mtraining.layout import Layout

CASES = [("striped", 1, 1), ("striped", 2, 1), ("striped", 2, 16), ("striped", 4, 64), ("striped", 3, 8),
         ("zigzag", 1, 64), ("zigzag", 2, 64), ("zigzag", 4, 64), ("contiguous", 4, 64)]


@pytest.mark.parametrize("kind,cp,g", CASES)
def test_positions_partition_the_sequence(kind, cp, g):
    lay = Layout(kind, cp, g)
    s = lay.divisor * 3
    pos = [lay.positions(r, s) for r in range(cp)]
    assert all(p.numel() == s // cp for p in pos)
    assert all(bool((p[1:] > p[:-1]).all()) for p in pos), "local positions must ascend"
    assert torch.equal(torch.sort(torch.cat(pos)).values, torch.arange(s))


@pytest.mark.parametrize("kind,cp,g", CASES)
def test_global_local_maps_are_inverse(kind, cp, g):
    lay = Layout(kind, cp, g)
    s = lay.divisor * 2
    t = torch.arange(s)
    rank, local = lay.global_to_local(t, s)
    for r in range(cp):
        sel = rank == r
        assert torch.equal(lay.local_to_global(r, local[sel], s), t[sel])
        assert torch.equal(lay.positions(r, s)[local[sel]], t[sel])
    for tt in (0, s // 2 + 1, s - 1):                   # plain ints too
        r, i = lay.global_to_local(tt, s)
        assert lay.local_to_global(int(r), int(i), s) == tt


def test_striped_owner_rule():
    lay = Layout("striped", 4, 64)
    s = 4 * 64 * 4
    for t in range(0, s, 37):
        r, i = lay.global_to_local(t, s)
        assert r == (t // 64) % 4
        assert i == (t // (64 * 4)) * 64 + t % 64


def test_zigzag_owner_rule():
    lay = Layout("zigzag", 3, 64)
    s = 6 * 10
    assert lay.positions(0, s).tolist() == list(range(0, 10)) + list(range(50, 60))
    assert lay.positions(2, s).tolist() == list(range(20, 30)) + list(range(30, 40))


@pytest.mark.parametrize("kind,cp,g", CASES)
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_shard_unshard_roundtrip_any_batch(kind, cp, g, dim):
    lay = Layout(kind, cp, g)
    shape = [2, 3, 5]
    shape[dim] = lay.divisor * 2
    x = torch.randn(*shape)
    parts = [lay.shard(x, r, dim) for r in range(cp)]
    assert all(p.shape[dim] == shape[dim] // cp for p in parts)
    assert torch.equal(lay.unshard(parts, dim), x)
    for r in range(cp):                                   # shard r holds exactly its positions
        assert torch.equal(parts[r], x.index_select(dim, lay.positions(r, shape[dim])))


@pytest.mark.parametrize("kind,cp,g,bad,rule", [
    ("striped", 2, 64, 192, "divisible by cp_size\\*granularity = 2\\*64 = 128"),
    ("striped", 4, 1, 6, "= 4"),
    ("zigzag", 4, 64, 12, "divisible by 2\\*cp_size = 8"),
    ("contiguous", 3, 64, 10, "divisible by cp_size = 3"),
])
def test_unsplittable_length_names_the_rule(kind, cp, g, bad, rule):
    lay = Layout(kind, cp, g)
    with pytest.raises(ValueError, match=rule):
        lay.shard(torch.zeros(1, bad), 0, 1)
    with pytest.raises(ValueError, match=rule):
        lay.positions(0, bad)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="layout kind"):
        Layout("ring", 2)
    with pytest.raises(ValueError, match="cp_size"):
        Layout("striped", 0)
    with pytest.raises(ValueError, match="granularity"):
        Layout("striped", 2, 0)
    with pytest.raises(ValueError, match="parts"):
        Layout("striped", 2, 1).unshard([torch.zeros(1, 2)], 1)


@pytest.mark.parametrize("args, name", [(("striped", 2, 64.0), "granularity"), (("zigzag", True), "cp_size"),
                                        (("striped", 2.0), "cp_size"), (("striped", 2, True), "granularity"),
                                        (("striped", "2"), "cp_size")])
def test_sizes_that_are_not_ints_are_refused(args, name):
    """Floats and bools (an int subclass) are refused when the layout is built (before: accepted, then a
    TypeError deep in a later call), as the YAML config already refuses them."""
    with pytest.raises(TypeError, match=f"Layout {name} must be an int"):
        Layout(*args)


def test_integral_sizes_are_accepted_as_int():
    # negative control: numpy and python ints are fine and compare equal
    import numpy as np

    lay = Layout("striped", np.int64(2), np.int32(64))
    assert lay == Layout("striped", 2, 64) and type(lay.cp_size) is int and type(lay.granularity) is int

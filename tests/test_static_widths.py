"""``static_widths=True`` of the estimator and the converter (no host sync: what a CUDA graph of the
estimate needs) against the default data-dependent widths, on the randomized tie-heavy cases of
tests/test_selection_equivalence.py: the same counts and masses; the index lists equal up to the
default width and ``-1`` beyond it; the widths are the documented static ones (the caps / the
pattern's widths), whatever the data."""
import random

import pytest
import torch

from megatron_mtraining.layout import Layout
from megatron_mtraining.patterns.convert import convert_pattern
from megatron_mtraining.patterns.estimator import estimate_vertical_slash
from tests.test_selection_equivalence import (
    cases_cp1, convert_cases, random_config, random_pattern, tie_heavy_qkv,
)


def assert_padded_extension(static: torch.Tensor, dyn: torch.Tensor, width: int, ctx):
    """``static`` is ``dyn`` followed by ``-1`` columns, ``width`` wide in all."""
    assert static.dtype == dyn.dtype and static.shape[:-1] == dyn.shape[:-1], ctx
    assert static.shape[-1] == width >= dyn.shape[-1], (ctx, static.shape, dyn.shape, width)
    assert torch.equal(static[..., :dyn.shape[-1]], dyn), ctx
    assert bool((static[..., dyn.shape[-1]:] == -1).all()), ctx


def assert_same_steps_padded(static, dyn, pattern, ctx):
    assert len(static) == len(dyn), ctx
    for o, (a, b) in enumerate(zip(static, dyn)):
        assert (a.causal, a.block_size) == (b.causal, b.block_size), (o, ctx)
        assert torch.equal(a.block_count, b.block_count) and torch.equal(a.column_count, b.column_count), (o, ctx)
        assert_padded_extension(a.block_index, b.block_index, pattern.slash.shape[-1], (o, ctx, "blocks"))
        assert a.column_index.shape[-1] >= b.column_index.shape[-1], (o, ctx)
        assert_padded_extension(a.column_index, b.column_index, a.column_index.shape[-1], (o, ctx, "columns"))
        assert a.known_max is None and a.is_empty() == b.is_empty(), (o, ctx)


@pytest.mark.parametrize("seed,b,S,hq,hkv,bs,L,kind", cases_cp1(30))
def test_static_widths_estimate_and_convert_cp1(seed, b, S, hq, hkv, bs, L, kind):
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    q, k = tie_heavy_qkv(gen, rng, b, S, hq, hkv, 16)
    layout = Layout(kind, 1, rng.choice([bs, 2 * bs]) if kind == "striped" else 64)
    for _ in range(3):
        cfg = random_config(rng, S, bs, L)
        dyn = estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="torch")
        sta = estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="torch", static_widths=True)
        ctx = (seed, cfg)
        for f in ("slash_count", "vertical_count", "est_slash_mass", "est_vertical_mass"):
            assert torch.equal(getattr(sta, f), getattr(dyn, f)), (f, ctx)
        assert_padded_extension(sta.slash, dyn.slash, max(1, min(S // bs, cfg.max_slash)), ctx)
        assert_padded_extension(sta.vertical, dyn.vertical, max(1, min(S, cfg.max_vertical)), ctx)
        if S % bs == 0 and (kind != "striped" or layout.granularity % bs == 0):
            assert_same_steps_padded(convert_pattern(sta, layout, 0, static_widths=True),
                                     convert_pattern(dyn, layout, 0), sta, ctx)


@pytest.mark.parametrize("seed,cp,bs,kind,g,b,hq", convert_cases(40))
def test_static_widths_convert_every_layout_and_rank(seed, cp, bs, kind, g, b, hq):
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    layout = Layout(kind, cp, g)
    unit = {"striped": cp * g, "zigzag": 2 * cp * bs, "contiguous": cp * bs}[kind]
    S = unit * rng.choice([1, 2, 3, 8])
    pat = random_pattern(gen, rng, b, hq, S, bs, canonical=True)
    for rank in range(cp):
        sta = convert_pattern(pat, layout, rank, static_widths=True)
        assert_same_steps_padded(sta, convert_pattern(pat, layout, rank), pat, (seed, rank))
        for st in sta:     # the columns are padded to the pattern's width, whatever the owner holds
            assert st.column_index.shape[-1] == pat.vertical.shape[-1], (seed, rank)


def test_static_widths_negative_control():
    """The comparison above can fail: a data-dependent width differs from the static one when the
    budget stops below the cap."""
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    q, k = tie_heavy_qkv(gen, rng, 1, 256, 2, 1, 16)
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    cfg = VerticalSlashConfig(recall=0.3, last_q=32, block_size=32, sink_tokens=1, local_blocks=1,
                              max_vertical=200, max_slash=8)
    dyn = estimate_vertical_slash(q, k, layout=Layout("striped", 1, 32), config=cfg, impl="torch")
    sta = estimate_vertical_slash(q, k, layout=Layout("striped", 1, 32), config=cfg, impl="torch", static_widths=True)
    assert dyn.vertical.shape[-1] < sta.vertical.shape[-1] == 200
    with pytest.raises(AssertionError):
        assert_padded_extension(dyn.vertical, sta.vertical, 200, "swapped")


def test_graphed_estimate_eager_path_and_errors():
    """estimate_and_convert_graphed(use_graph=False) is the eager static-widths estimate + conversion
    (the computation the CUDA graph captures); CP > 1 and use_graph off CUDA are refused."""
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig
    from megatron_mtraining.patterns.graphed import estimate_and_convert_graphed

    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    q, k = tie_heavy_qkv(gen, rng, 2, 512, 4, 2, 16)
    layout, cfg = Layout("striped", 1, 64), VerticalSlashConfig(recall=0.9, last_q=64, max_vertical=128, max_slash=6)
    pat, steps = estimate_and_convert_graphed(q, k, layout=layout, config=cfg, softmax_scale=0.3, use_graph=False)
    ref = estimate_vertical_slash(q, k, layout=layout, config=cfg, softmax_scale=0.3, static_widths=True)
    for f in ("slash", "slash_count", "vertical", "vertical_count", "est_slash_mass", "est_vertical_mass"):
        assert torch.equal(getattr(pat, f), getattr(ref, f)), f
    dyn = estimate_vertical_slash(q, k, layout=layout, config=cfg, softmax_scale=0.3)
    assert_same_steps_padded(steps, convert_pattern(dyn, layout, 0), pat, "graphed eager")
    with pytest.raises(ValueError, match="CP=1"):
        estimate_and_convert_graphed(q, k, layout=Layout("striped", 2, 64), config=cfg)
    with pytest.raises(ValueError, match="CUDA"):
        estimate_and_convert_graphed(q, k, layout=layout, config=cfg, use_graph=True)

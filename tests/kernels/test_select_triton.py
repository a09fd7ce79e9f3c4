"""Triton selection kernel (patterns/triton/select.py), run by the Triton CPU interpreter: the kept lines
and counts are bitwise those of the estimator's torch selection (segment sorts, fp64 cumsum budgets,
sorted kept sets; itself checked against a frozen copy of the original code in
tests/unit/test_selection_equivalence.py), and the covered fractions agree to the rounding of an fp64
sum in another order (``n * 2**-53`` relative). Cases: tie-heavy scores (exact ties, zeros, all-zero
rows), fp32 and fp64 scores, rows longer than one kernel chunk, strided rows, floors beyond the row,
caps at the floors, ``recall == 1``, targets reached by the floors alone, and the estimator's own
``_select`` at cp 1 and (slash lines) simulated cp 2 / 4. Negative control: a target rounded to fp32
changes the count where the fp64 target does not (the kernel must take the fp64 value).

The interpreter must be chosen before triton is imported (as test_convert_triton.py).
"""

import os
import random
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:  # else compiled Triton is in use (GPU session): the tests run in a subprocess
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.triton_interp import rerun_in_fresh_interpreter, run_aot_worker, use_interpreted_kernels

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from megatron_mtraining.layout import Layout  # noqa: E402
from megatron_mtraining.patterns import estimator as E  # noqa: E402
from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash  # noqa: E402
from tests.helpers.select_ref import assert_mass_close, assert_same_selection, same, torch_select  # noqa: E402
from tests.unit.test_selection_equivalence import random_config, tie_heavy_qkv, tie_heavy_scores  # noqa: E402

F64 = torch.float64


@pytest.fixture(autouse=True)
def _interpreted_kernels(request):
    use_interpreted_kernels(request, _TRITON_PREIMPORTED, "megatron_mtraining.patterns.triton.select", "_select_kernel")
    yield


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="the tests below run in this process")
def test_all_in_fresh_interpreter():
    rerun_in_fresh_interpreter(__file__)


def select_lines(*args):
    from megatron_mtraining.patterns.triton.select import select_lines as f
    return f(*args)


def score_cases():
    """(seed, n, kind, dtype): every tie-heavy kind within one loop step and over several (CHUNK = 2048 lines;
    the bisection finishes in registers once at most CAND = 2048 candidates are left)."""
    out = [(0, 4096, "zeros", F64), (1, 1, "rand", torch.float32)]
    for kind in ("quantized", "sparse", "rand"):
        for n in (5, 700, 9000):
            for dtype in (torch.float32, F64):
                out.append((len(out), n, kind, dtype))
    return out


@pytest.mark.parametrize("seed,n,kind,dtype", score_cases())
def test_kernel_matches_torch_selection(seed, n, kind, dtype):
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    b, h = rng.choice([(1, 1), (2, 3)])
    score = tie_heavy_scores(gen, (b, h, n), kind)
    if kind != "zeros":
        score = score / score.sum(-1, keepdim=True).clamp(min=1e-300) * 64     # mass 64 per row, as the probes
    score = score.to(dtype)
    L = 64
    for _ in range(3):
        nf = rng.choice([0, 1, 3, n // 2, n, n + 4])
        cap = nf + rng.choice([0, 1, 7, n // 3, n + 9])
        if cap == 0:
            cap = 1
        recall = rng.choice([0.05, 0.5, 0.9, 0.95, 0.999, 1.0])
        width = max(1, min(n, cap)) + rng.choice([0, 0, 3])
        args = (score, nf, cap, recall * L, recall >= 1.0, width, L)
        assert_same_selection(select_lines(*args), torch_select(*args), n, (seed, nf, cap, recall, width))


def test_kernel_strided_rows_and_floors_reaching_the_target():
    gen = torch.Generator().manual_seed(3)
    base = torch.rand(2, 4, 3, 900, generator=gen, dtype=F64)
    score = base.float()[:, :, 1]                       # [2, 4, 900] view, unit inner stride
    assert not score.is_contiguous()
    for nf, target in ((100, 1.0), (0, 1e-9), (5, 1e-9), (40, 30.0)):
        args = (score, nf, 300, target, False, 300, 64)
        assert_same_selection(select_lines(*args), torch_select(*args), 900, (nf, target))


def test_tie_run_longer_than_a_chunk():
    """The threshold's tie run (4500 equal scores) holds more than the kernel's CAND candidates: the
    bisection isolates it by full passes and keeps the first ties by index."""
    gen = torch.Generator().manual_seed(5)
    score = (torch.randint(0, 2, (1, 2, 9000), generator=gen).to(F64) / 8)
    for recall, cap in ((0.5, 9000), (0.9, 9000), (1.0, 7000), (0.9, 1000)):
        args = (score.float(), 3, cap, recall * float(score[0, 0].sum()), recall >= 1.0, cap, 64)
        assert_same_selection(select_lines(*args), torch_select(*args), 9000, (recall, cap))


def test_floors_and_rest_are_summed_as_the_torch_path():
    """The budget compares floors' sum + rest's partial sum with the target, as the torch cumsum does (not the
    rest against target - floors: 1 + 0.75 ulp rounds to 1 + 1 ulp, which reaches this target)."""
    score = torch.tensor([[[1.0, 0.75 * 2.0 ** -52, 0.0, 0.0]]], dtype=F64)
    args = (score, 1, 4, 1.0 + 2.0 ** -52, False, 4, 1.0)
    ref = torch_select(*args)
    assert ref[1].item() == 2
    assert_same_selection(select_lines(*args), ref, 4, "floors + rest")


def test_nan_scores_stay_inside_the_row():
    """A NaN score (any bit pattern, the largest one included) ranks first and the row keeps at most the cap,
    written only inside its slots; the other rows are unaffected."""
    base = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.0, 0.03, 0.02, 0.01], dtype=F64)
    for dtype, bits in ((F64, 0x7FFFFFFFFFFFFFFF), (F64, 0x7FF8000000000000),
                        (torch.float32, 0x7FFFFFFF), (torch.float32, -1)):
        score = base.to(dtype).repeat(1, 2, 1).contiguous()
        view = score.view(torch.int64 if dtype == F64 else torch.int32)
        view[0, 0, 3] = bits
        assert torch.isnan(score[0, 0, 3])
        sel, cnt, _ = select_lines(score, 1, 3, 0.6, False, 3, 1.0)
        row = sel[0, 0][: int(cnt[0, 0])]
        assert 1 <= int(cnt[0, 0]) <= 3 and 3 in row.tolist(), (dtype, bits, sel, cnt)
        assert torch.equal(row, row.sort().values) and len(set(row.tolist())) == len(row)
        clean = score[:, 1:]
        assert_same_selection((sel[:, 1:], cnt[:, 1:], select_lines(clean, 1, 3, 0.6, False, 3, 1.0)[2]),
                              torch_select(clean, 1, 3, 0.6, False, 3, 1.0), 8, (dtype, "other row"))


def test_target_is_taken_in_fp64():
    """Negative control: cumulative score 60.7999995 lies between fp32(60.8) and the fp64 60.8; the torch
    selection keeps two lines, and would keep one with the target rounded to fp32."""
    score = torch.tensor([[[60.7999995, 1.0, 0.5]]], dtype=F64)
    target = 0.95 * 64
    assert float(torch.tensor(target, dtype=torch.float32)) <= 60.7999995 < target
    ref = torch_select(score, 0, 3, target, False, 3, 64)
    rounded = torch_select(score, 0, 3, float(torch.tensor(target, dtype=torch.float32)), False, 3, 64)
    assert ref[1].item() == 2 and rounded[1].item() == 1        # the control distinguishes the two targets
    assert_same_selection(select_lines(score, 0, 3, target, False, 3, 64), ref, 3, "fp64 target")


@pytest.mark.parametrize("seed", range(8))
def test_estimator_select_with_kernel_matches_torch(seed):
    """``_select(fused=True)`` against ``fused=False`` on the same scores: cp 1 (both line kinds by the
    kernel) and cp 2 / 4 simulated (slash lines by the kernel, columns by the torch merge)."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    bs = rng.choice([16, 64])
    cp = rng.choice([1, 2, 4])
    layout = Layout("striped", cp, bs)
    S = layout.divisor * bs * rng.choice([2, 4])
    L = rng.choice([1, bs, min(S, 2 * bs)])
    b, hq = rng.choice([(1, 1), (2, 3)])
    col = tie_heavy_scores(gen, (b, hq, S), rng.choice(["quantized", "zeros", "sparse", "rand"]))
    slash = tie_heavy_scores(gen, (b, hq, S // bs), rng.choice(["quantized", "sparse", "rand"]))
    if rng.random() < 0.5:
        col = col.float()
    cfg = random_config(rng, S, bs, L)
    pos = [layout.positions(r, S) for r in range(cp)]
    cols = [col[..., p].contiguous() for p in pos]

    def gather(score, p):
        parts = [E._local_candidates(cols[o], pos[o], E._count_below(layout, o, S, cfg.sink_tokens),
                                     min(cfg.max_vertical, cols[o].shape[-1]), cp == 1) for o in range(cp)]
        return torch.cat([s for s, _ in parts], -1), torch.cat([q for _, q in parts], -1)

    for r in range(cp):
        new = E._select(slash, cols[r], pos[r], layout, r, S, L, cfg, gather, static_widths=True, fused=True)
        ref = E._select(slash, cols[r], pos[r], layout, r, S, L, cfg, gather, static_widths=True, fused=False)
        for f in ("slash", "slash_count", "vertical", "vertical_count"):
            assert same(getattr(new, f), getattr(ref, f)), (f, seed, r, cfg)
        assert_mass_close(new.est_slash_mass, ref.est_slash_mass, S // bs, (seed, r))
        assert_mass_close(new.est_vertical_mass, ref.est_vertical_mass, S, (seed, r))


def test_estimate_vertical_slash_static_widths_uses_the_kernel(monkeypatch):
    """``impl="triton"`` with static widths (the CUDA default) selects through the kernel, and the
    pattern is the one the torch selection keeps from the same scores."""
    from megatron_mtraining.patterns.triton import select as S_mod

    calls = []
    orig = S_mod.select_line_kinds
    monkeypatch.setattr(S_mod, "select_line_kinds", lambda *k: calls.append(len(k)) or orig(*k))
    q, k = tie_heavy_qkv(torch.Generator().manual_seed(11), random.Random(11), 2, 256, 4, 2, 16)
    q, k = q.float(), k.float()
    cfg = VerticalSlashConfig(recall=0.9, last_q=64, block_size=64, sink_tokens=4, local_blocks=1,
                              max_vertical=40, max_slash=3)
    layout = Layout("striped", 1, 64)
    new = estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="triton", static_widths=True)
    assert calls == [2]                                 # slash lines and columns in one launch
    ref = estimate_vertical_slash(q, k, layout=layout, config=cfg, impl="triton", static_widths=False)
    assert new.same_selection(ref)


def test_kernel_input_errors():
    x = torch.rand(1, 2, 10, dtype=F64)
    with pytest.raises(ValueError, match="fp32/fp64"):
        select_lines(x.half(), 1, 4, 1.0, False, 4, 64)
    with pytest.raises(ValueError, match="floors must fit under the cap"):
        select_lines(x, 5, 3, 1.0, False, 5, 64)
    with pytest.raises(ValueError, match="width 3 is below"):
        select_lines(x, 1, 4, 1.0, False, 3, 64)
    with pytest.raises(ValueError, match="unit stride"):
        select_lines(x.transpose(1, 2).contiguous().transpose(1, 2), 1, 4, 1.0, False, 4, 64)


def test_launch_registers():
    """8-warp launches with at most one program per SM may take MAX_REGISTERS registers per thread (the
    compiler's 128 spills); more programs than SMs, and 16-warp launches, keep the default."""
    from megatron_mtraining.patterns.triton.select import MAX_REGISTERS, launch_registers

    assert launch_registers(8, 18, 132) == {"maxnreg": MAX_REGISTERS}
    assert launch_registers(8, 18, None) == {"maxnreg": MAX_REGISTERS}
    assert launch_registers(8, 133, 132) == {}
    assert launch_registers(16, 1, 132) == {}


def test_kernel_refuses_rows_its_packed_counts_cannot_hold(monkeypatch):
    """A pass packs two per-lane counts (each at most lines / loop step) in 16 bits: rows of 2**15 loop steps or
    more are refused by name (2**15 * 8192 lines with the real step; here a 1-line step makes that 32768)."""
    from megatron_mtraining.patterns.triton import select as S_mod

    monkeypatch.setattr(S_mod, "launch_shape", lambda n: (1, 1))
    with pytest.raises(ValueError, match="packed in 16 bits"):
        select_lines(torch.rand(1, 1, 2 ** 15, dtype=F64), 1, 4, 1.0, False, 4, 64)


def test_kernel_compiles_for_sm90():
    """The interpreter does not compile: the real Triton compiler builds the estimator's launches of the kernel
    for sm_90 in a subprocess without TRITON_INTERPRET (tests/workers/select_aot.py), no GPU needed; the
    2048-line step does not spill registers."""
    out = run_aot_worker("select_aot.py")
    short = [x for x in out.splitlines() if "CHUNK=2048" in x and "STACK:" in x]
    assert all("STACK:0 " in x for x in short), out

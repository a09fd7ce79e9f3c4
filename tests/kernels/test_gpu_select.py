"""Triton selection kernel on a GPU (marker ``gpu``; skipped without CUDA): the kept lines and counts of the
estimator's torch selection, bit for bit, at training sizes; covered fractions within the rounding of an fp64
sum in another order.

Cases (CP=1, ``configs/e2e_sparse.yaml``-like budgets: 64 sink columns, caps 4096 columns / 1024
diagonals, and ``configs/long_context_r098.yaml``'s 2048 / 256): column scores ``[1, 9, S]`` fp32 (heavy-tailed, and quantized: exact ties) at 32K and 128K,
block-diagonal scores ``[1, 16, S / 64]`` fp64, recall 0.95, 0.98 and 1; and ``_select`` with the kernel
against the torch selection on the same scores. The CPU interpreter runs the same comparisons at small
sizes in tests/kernels/test_select_triton.py.
"""
import pytest
import torch

from tests.helpers.select_ref import assert_same_selection, torch_select

SEQS = (32768, 131072)


def _scores(S, kind, gen):
    if kind == "heavy":
        x = torch.rand(1, 9, S, generator=gen, dtype=torch.float64) ** 12
        x[..., :4] += 5.0
    else:                                                  # exact ties and zeros
        x = torch.randint(0, 4, (1, 9, S), generator=gen).to(torch.float64) / 8
    return (x / x.sum(-1, keepdim=True) * 64).float()


@pytest.mark.gpu
@pytest.mark.parametrize("S", SEQS, ids=lambda s: f"S{s}")
@pytest.mark.parametrize("kind", ["heavy", "quantized"])
def test_select_kernel_matches_torch_on_gpu(S, kind):
    from megatron_mtraining.patterns.triton.select import select_lines

    gen = torch.Generator().manual_seed(S)
    col = _scores(S, kind, gen).cuda()
    nb = S // 64
    d = torch.arange(nb, dtype=torch.float64)
    slash = (1.0 / (d + 1) ** 1.1) * (0.2 + torch.rand(1, 16, nb, generator=gen, dtype=torch.float64))
    slash = (slash / slash.sum(-1, keepdim=True) * 64).cuda()
    for recall in (0.95, 0.98, 1.0):
        for score, nf, cap in ((col, 64, 4096), (col, 64, 2048), (slash, 2, 1024), (slash, 2, 256)):
            w = min(cap, score.shape[-1])
            args = (score, nf, cap, recall * 64, recall >= 1.0, w, 64)
            assert_same_selection(select_lines(*args), torch_select(*args), score.shape[-1], (S, kind, recall, nf))


@pytest.mark.gpu
def test_estimator_select_with_kernel_on_gpu():
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns import estimator as E

    S = 65536
    gen = torch.Generator().manual_seed(7)
    col = _scores(S, "heavy", gen).cuda()
    slash = torch.rand(1, 9, S // 64, generator=gen, dtype=torch.float64).cuda()
    cfg = E.VerticalSlashConfig(recall=0.98, last_q=64, block_size=64, sink_tokens=64, local_blocks=2,
                                max_vertical=4096, max_slash=1024)
    kp = torch.arange(S, device="cuda")
    layout = Layout("striped", 1, 64)
    new = E._select(slash, col, kp, layout, 0, S, 64, cfg, static_widths=True, fused=True)
    ref = E._select(slash, col, kp, layout, 0, S, 64, cfg, static_widths=True, fused=False)
    for f in ("slash", "slash_count", "vertical", "vertical_count"):
        assert torch.equal(getattr(new, f), getattr(ref, f)), f

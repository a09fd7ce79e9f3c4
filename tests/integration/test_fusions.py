"""The trainer's fused RoPE without Transformer Engine (megatron_mtraining/megatron/fusions.py).

* :func:`rope_bshd` against an independent fp64 reference (each channel pair rotated as a complex
  number): output and the input gradient, halves and interleaved pairs, partial rotary, per-sample
  angles; fp32 within 1e-5 relative. A negative control (the sine's sign flipped) fails it.
* bf16: within 2x the error of megatron-core's unfused bf16 RoPE against fp64, forward and backward.
* The wiring: ``--no-rope-fusion`` / ``--no-bias-swiglu-fusion``, nothing fused on the CPU, and on CUDA
  megatron-core's ``apply_rotary_pos_emb`` routed to the compiled kernel (``test_fused_rope_gpu``,
  bf16 against fp64 and against the uncompiled function).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_mtraining.megatron.fusions import fused_rope, fusion_config_kwargs, rope_bshd

S, B, H, D = 48, 2, 3, 16


def _freqs(s, rot, b=1, interleaved=False, base=10000.0, offset=0):
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    pos = torch.arange(s, dtype=torch.float64)[:, None] + offset * torch.arange(b, dtype=torch.float64)[None]
    ang = pos[..., None] * inv                                            # [s, b, rot/2]
    emb = torch.stack((ang, ang), -1).flatten(-2) if interleaved else torch.cat((ang, ang), -1)
    return emb[:, :, None, :].float()                                     # [s, b, 1, rot]


def _reference(t, freqs, interleaved, flip=1.0):
    """fp64: channel pair (a, b) as a + ib, multiplied by exp(i θ); channels past rot unchanged."""
    t, f = t.double(), freqs.double()
    rot = f.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    if interleaved:
        a, b, th = x[..., 0::2], x[..., 1::2], f[..., 0::2]
    else:
        a, b, th = x[..., :rot // 2], x[..., rot // 2:], f[..., :rot // 2]
    z = torch.complex(a, b) * torch.polar(torch.ones_like(th), flip * th)
    if interleaved:
        y = torch.stack((z.real, z.imag), -1).flatten(-2)
    else:
        y = torch.cat((z.real, z.imag), -1)
    return torch.cat((y, rest), -1)


def _fwd_bwd(fn, t, freqs, grad):
    t = t.detach().clone().requires_grad_(True)
    out = fn(t, freqs)
    out.backward(grad.to(out.dtype))
    return out.detach().double(), t.grad.double()


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot,b_freqs", [(D, 1), (D // 2, 1), (D, B)])
def test_rope_bshd_matches_fp64(interleaved, rot, b_freqs):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(S, B, H, D, generator=g)
    grad = torch.randn(S, B, H, D, generator=g)
    freqs = _freqs(S, rot, b_freqs, interleaved, offset=5)
    out, dt = _fwd_bwd(lambda x, f: rope_bshd(x, f, interleaved), t, freqs, grad)
    ref, dref = _fwd_bwd(lambda x, f: _reference(x, f, interleaved), t.double(), freqs, grad.double())
    assert _rel(out, ref) <= 1e-5 and _rel(dt, dref) <= 1e-5, (_rel(out, ref), _rel(dt, dref))
    # negative control: the rotation the other way round is far off
    bad = _reference(t, freqs, interleaved, flip=-1.0)
    assert _rel(bad, ref) > 1e-2


def test_rope_bshd_bf16_within_twice_megatron_unfused():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(1)
    t = torch.randn(512, 1, 4, 64, generator=g)
    grad = torch.randn(512, 1, 4, 64, generator=g)
    freqs = _freqs(512, 64, base=1e6)
    ref, dref = _fwd_bwd(lambda x, f: _reference(x, f, False), t.double(), freqs, grad.double())
    tb = t.bfloat16()
    ours, dours = _fwd_bwd(lambda x, f: rope_bshd(x, f), tb, freqs, grad)
    mc, dmc = _fwd_bwd(lambda x, f: _apply_rotary_pos_emb_bshd(x, f), tb, freqs, grad)
    # the bf16 input itself is the reference's input here: the errors are the kernels' own
    ref_b, dref_b = _fwd_bwd(lambda x, f: _reference(x, f, False), tb.double(), freqs, grad.bfloat16().double())
    assert _rel(ours, ref_b) <= 2 * _rel(mc, ref_b), (_rel(ours, ref_b), _rel(mc, ref_b))
    assert _rel(dours, dref_b) <= 2 * _rel(dmc, dref_b), (_rel(dours, dref_b), _rel(dmc, dref_b))
    assert _rel(ours, ref) < 1e-2 and _rel(dours, dref) < 1e-2


def test_rope_bshd_refuses_odd_or_wide_freqs():
    t = torch.zeros(4, 1, 1, 8)
    for rot in (7, 10):
        with pytest.raises(ValueError, match="even number no larger than the head dimension"):
            rope_bshd(t, torch.zeros(4, 1, 1, rot))


def test_fused_rope_falls_back_with_a_warning_when_compile_fails(monkeypatch):
    import megatron_mtraining.megatron.fusions as fu

    def broken(*a, **k):
        raise RuntimeError("no backend here\nsecond line")

    monkeypatch.setattr(fu, "_COMPILED", broken)
    monkeypatch.setattr(fu, "_COMPILE_FAILED", None)
    t, freqs = torch.randn(8, 1, 2, 8), _freqs(8, 8)
    with pytest.warns(RuntimeWarning, match="torch.compile failed \\(RuntimeError: no backend here\\)"):
        out = fu.fused_rope(t, freqs)
    torch.testing.assert_close(out, rope_bshd(t, freqs), rtol=0, atol=0)
    assert fu._COMPILE_FAILED == "RuntimeError: no backend here"
    torch.testing.assert_close(fu.fused_rope(t, freqs), out, rtol=0, atol=0)     # no second warning, same path
    with pytest.raises(ValueError, match="even number"):                           # bad input still an error
        fu.fused_rope(t, torch.zeros(8, 1, 1, 7))

    def oom(*a, **k):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(fu, "_COMPILED", oom)
    monkeypatch.setattr(fu, "_COMPILE_FAILED", None)
    with pytest.raises(torch.OutOfMemoryError):                                    # not a compile failure
        fu.fused_rope(t, freqs)
    assert fu._COMPILE_FAILED is None


def _args(*argv):
    from megatron_mtraining.megatron.args import build_parser

    return build_parser().parse_args(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
                                      "--seq-length", "128", "--train-iters", "1", "--lr", "1e-3",
                                      "--position-embedding-type", "rope", "--swiglu", *argv])


def test_fusion_flags(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    on = _args()
    assert on.rope_fusion and on.bias_swiglu_fusion
    assert fusion_config_kwargs(on, cuda=False) == {}                     # the CPU fuses nothing
    assert rope_utils.fused_apply_rotary_pos_emb is None
    assert fusion_config_kwargs(on, cuda=True) == {"apply_rope_fusion": True, "bias_activation_fusion": True}
    assert rope_utils.fused_apply_rotary_pos_emb is fused_rope             # installed only without TE
    off = _args("--no-rope-fusion", "--no-bias-swiglu-fusion")
    assert fusion_config_kwargs(off, cuda=True) == {}
    no_rope = argparse.Namespace(**{**vars(on), "position_embedding_type": "learned_absolute", "swiglu": False})
    assert fusion_config_kwargs(no_rope, cuda=True) == {}
    te = object()
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te)      # Transformer Engine's is kept
    fusion_config_kwargs(on, cuda=True)
    assert rope_utils.fused_apply_rotary_pos_emb is te
    fusion_config_kwargs(_args("--reset-position-ids"), cuda=True)         # one sample per micro-batch: kept
    assert rope_utils.fused_apply_rotary_pos_emb is te
    # per-document positions in a micro-batch of 2: TE's kernel takes one row of angles per position
    assert fusion_config_kwargs(_args("--reset-position-ids", "--micro-batch-size", "2"), cuda=True)["apply_rope_fusion"]
    assert rope_utils.fused_apply_rotary_pos_emb is fused_rope


def test_positions_hook_refuses_only_te_fused_rope_with_per_sample_positions(monkeypatch):
    """Positions that restart at every document with a micro-batch above 1 and ``apply_rope_fusion``: an error
    naming the rule with Transformer Engine's kernel (one row of angles per position), accepted with
    :func:`fused_rope`, which takes per-sample angles."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    from megatron_mtraining.megatron.rope import _positions_hook

    seen = []
    module = SimpleNamespace(config=SimpleNamespace(apply_rope_fusion=True),
                             rotary_pos_emb=SimpleNamespace(set_positions=seen.append))
    pos = torch.arange(8).repeat(2, 1)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda t, f, interleaved=False: t)
    with pytest.raises(ValueError, match="needs --no-rope-fusion"):
        _positions_hook(module, (None, pos), {})
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", fused_rope)
    _positions_hook(module, (None, pos), {})
    assert len(seen) == 1 and seen[0] is pos


@pytest.mark.gpu
def test_fused_rope_gpu(monkeypatch):
    """CUDA, bf16, the compiled kernel: megatron-core's ``apply_rotary_pos_emb`` with ``apply_rope_fusion``
    reaches it; forward and backward within 2x megatron-core's unfused bf16 error against fp64, with
    per-sample angles; equal to the uncompiled function to 1 bf16 ulp."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                            **fusion_config_kwargs(_args(), cuda=True))
    assert cfg.apply_rope_fusion and rope_utils.fused_apply_rotary_pos_emb is fused_rope
    g = torch.Generator().manual_seed(2)
    s, b, h, d = 4096, 2, 9, 64
    t = torch.randn(s, b, h, d, generator=g).bfloat16()
    grad = torch.randn(s, b, h, d, generator=g).bfloat16()
    freqs = _freqs(s, d, b, base=1e6, offset=700)
    ref, dref = _fwd_bwd(lambda x, f: _reference(x, f, False), t.double(), freqs, grad.double())
    dev = lambda x: x.cuda()  # noqa: E731
    ours, dours = _fwd_bwd(lambda x, f: rope_utils.apply_rotary_pos_emb(x, f, config=cfg, cp_group=object()),
                           dev(t), dev(freqs), dev(grad))
    mc, dmc = _fwd_bwd(lambda x, f: rope_utils._apply_rotary_pos_emb_bshd(x, f), dev(t), dev(freqs), dev(grad))
    eager, deager = _fwd_bwd(rope_bshd, dev(t), dev(freqs), dev(grad))
    ref, dref = ref.cuda(), dref.cuda()
    assert _rel(ours, ref) <= 2 * _rel(mc, ref), (_rel(ours, ref), _rel(mc, ref))
    assert _rel(dours, dref) <= 2 * _rel(dmc, dref), (_rel(dours, dref), _rel(dmc, dref))
    assert _rel(ours, eager) <= 2 ** -7 and _rel(dours, deager) <= 2 ** -7

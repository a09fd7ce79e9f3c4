"""Fused element-wise kernels for the trainer when Transformer Engine is not installed.

megatron-core fuses RoPE only through Transformer Engine (``config.apply_rope_fusion`` asserts that
``fused_apply_rotary_pos_emb`` exists). Without it every attention layer runs the unfused RoPE of
``rope_utils._apply_rotary_pos_emb_bshd``: about six bf16 passes over the queries and keys in the
forward and as many in the backward (cos / sin broadcast products, ``rotate_half``'s negation and
``cat``, the final ``cat`` with the pass-through part). At 64K tokens that is a visible share of a
small model's iteration.

:func:`install_fused_rope` gives megatron-core a fused RoPE of its own in that case:
:func:`rope_bshd` compiled with ``torch.compile`` (megatron-core's own fuser for its element-wise
fusions, ``megatron.core.jit.jit_fuser``), one kernel in the forward and one in the backward. It
computes in fp32 and rounds once, as Transformer Engine's kernel does (the unfused path rounds to
bf16 after every product). With Transformer Engine installed its kernel is kept, except where
the angles differ between the samples of a micro-batch, which it cannot take.

:func:`fusion_config_kwargs` is the one place the trainer turns ``--no-rope-fusion`` /
``--no-bias-swiglu-fusion`` into ``TransformerConfig`` fields: fusions on CUDA (the default, as in
Megatron-LM), none on the CPU.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["rope_bshd", "fused_rope", "install_fused_rope", "fused_rope_name", "fused_rope_takes_per_sample_positions",
           "fusion_config_kwargs"]


def _check_rot(t: Tensor, freqs: Tensor) -> None:
    rot = freqs.shape[-1]
    if rot > t.shape[-1] or rot % 2:
        raise ValueError(f"RoPE: freqs has {rot} channels for heads of {t.shape[-1]}; it needs an even number "
                         "no larger than the head dimension")


def rope_bshd(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """Rotary position embedding of ``t`` (RoFormer, arXiv 2104.09864 §3.4), megatron-core's formula.

    ``out = x * cos(freqs) + rotate_half(x) * sin(freqs)`` on the first ``freqs.shape[-1]`` channels of
    each head (``x``), the remaining channels passed through; computed in fp32, rounded once to ``t``'s
    dtype.

    Args:
        t: ``[s, b, h, d]`` (SBHD) queries or keys, any float dtype.
        freqs: ``[s, 1 or b, 1, rot]`` angles in radians (fp32), ``rot <= d`` and even: megatron-core's
            ``RotaryEmbedding`` output (halves ``[θ, θ]``, or pairs ``θ0 θ0 θ1 θ1 ...`` when interleaved).
        interleaved: rotate channel pairs ``(2i, 2i+1)`` instead of halves (``rotary_interleaved``).

    Returns:
        ``[s, b, h, d]`` in ``t``'s dtype.

    Raises:
        ValueError: ``freqs`` has more channels than ``t`` or an odd number of them.
    """
    _check_rot(t, freqs)
    rot = freqs.shape[-1]
    x, x_pass = t[..., :rot], t[..., rot:]
    xf = x.float()
    ang = freqs.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    out = (xf * torch.cos(ang) + rotated * torch.sin(ang)).to(t.dtype)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


_COMPILED: Optional[Callable[..., Tensor]] = None
_COMPILE_FAILED: Optional[str] = None


def fused_rope(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """:func:`rope_bshd` compiled by ``torch.compile`` (shapes static: one kernel per query / key shape);
    megatron-core's ``fused_apply_rotary_pos_emb`` signature. Differentiable (the backward is compiled
    too). Unlike Transformer Engine's kernel it takes per-sample angles (``freqs`` ``[s, b, 1, rot]``,
    positions that restart at every document with a micro-batch above 1).

    If ``torch.compile`` fails in this process (no working Triton, say), a warning names the error once
    and :func:`rope_bshd` runs uncompiled from then on: the same values, without the fusion's speed.
    The backward is compiled at the first backward call; a failure there is raised.

    Raises:
        ValueError: as :func:`rope_bshd`.
    """
    global _COMPILED, _COMPILE_FAILED
    _check_rot(t, freqs)
    if _COMPILE_FAILED is None:
        if _COMPILED is None:
            _COMPILED = torch.compile(rope_bshd, dynamic=False)
        try:
            return _COMPILED(t, freqs, interleaved)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:                    # torch.compile's backends raise many types
            _COMPILE_FAILED = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            warnings.warn(f"fused RoPE: torch.compile failed ({_COMPILE_FAILED}); RoPE runs uncompiled "
                          "(megatron_mtraining.megatron.fusions.rope_bshd) from now on in this process. "
                          "--no-rope-fusion selects megatron-core's unfused RoPE instead", RuntimeWarning, stacklevel=2)
    return rope_bshd(t, freqs, interleaved)


def _rope_utils():
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils


def fused_rope_name() -> Optional[str]:
    """Which fused RoPE megatron-core calls with ``apply_rope_fusion``: ``"transformer_engine"``,
    ``"torch.compile"`` (:func:`fused_rope`, after :func:`install_fused_rope`) or ``None`` (none: the
    assert in ``apply_rotary_pos_emb`` would fire)."""
    fn = getattr(_rope_utils(), "fused_apply_rotary_pos_emb", None)
    if fn is None:
        return None
    return "torch.compile" if fn is fused_rope else "transformer_engine"


def fused_rope_takes_per_sample_positions() -> bool:
    """Whether megatron-core's fused RoPE in this process takes ``[s, b, 1, d]`` angles: :func:`fused_rope`
    does, Transformer Engine's kernel does not (one row of angles per position)."""
    return getattr(_rope_utils(), "fused_apply_rotary_pos_emb", None) is fused_rope


def install_fused_rope(per_sample_positions: bool = False) -> str:
    """Make ``apply_rope_fusion`` usable in this process: keep Transformer Engine's fused RoPE, else
    install :func:`fused_rope` as megatron-core's ``rope_utils.fused_apply_rotary_pos_emb``.

    Args:
        per_sample_positions: the run's RoPE angles differ between the samples of a micro-batch
            (positions that restart at every document, micro-batch above 1). Transformer Engine's kernel
            takes one row of angles per position, so :func:`fused_rope` replaces it then.

    Idempotent. Returns :func:`fused_rope_name`. Packed sequences in THD format (``cu_seqlens``) still
    need Transformer Engine's THD kernel; the trainer does not use them."""
    ru = _rope_utils()
    if fused_rope_name() is None or (per_sample_positions and not fused_rope_takes_per_sample_positions()):
        ru.fused_apply_rotary_pos_emb = fused_rope
    return fused_rope_name()


def fusion_config_kwargs(args: Any, cuda: bool) -> dict[str, Any]:
    """``TransformerConfig`` fusion fields for the trainer's ``args``.

    On CUDA, as Megatron-LM: RoPE fused unless ``--no-rope-fusion`` (installs :func:`fused_rope` when
    Transformer Engine is absent, or when ``--reset-position-ids`` with a micro-batch above 1 needs
    per-sample angles) and SwiGLU fused unless ``--no-bias-swiglu-fusion`` (megatron-core's
    ``bias_swiglu_impl``, ``torch.compile``). On the CPU both stay unfused (nothing to gain, and
    ``torch.compile`` there needs a C++ toolchain).

    Args:
        args: the trainer's parsed arguments (``rope_fusion``, ``bias_swiglu_fusion``, ``swiglu``,
            ``position_embedding_type``).
        cuda: the model runs on a CUDA device.
    """
    kw: dict[str, Any] = {}
    if not cuda:
        return kw
    if getattr(args, "rope_fusion", True) and getattr(args, "position_embedding_type", None) == "rope":
        from megatron_mtraining.plan import per_sample_position_flags

        install_fused_rope(per_sample_positions=bool(per_sample_position_flags(args)))
        kw["apply_rope_fusion"] = True
    if getattr(args, "bias_swiglu_fusion", True) and getattr(args, "swiglu", False):
        kw["bias_activation_fusion"] = True
    return kw

"""Synthetic attention inputs with vertical-slash structure, the exact kept fraction of a pattern
(MTraining §3.2: the estimator looks for vertical lines and slash lines; these inputs have both), and
the model shape the end-to-end benchmarks train.
"""

from __future__ import annotations

import torch

__all__ = ["structured_qkv", "kept_fraction", "QWEN25_3B_LAYER_FLAGS"]

#: ``pretrain_gpt.py`` flags of Qwen2.5-3B-shaped layers (hidden 2048, 16 query / 2 KV heads of 128, SwiGLU
#: ffn 11008, RMSNorm, RoPE base 1e6, untied embeddings, no biases); the number of layers is the caller's.
QWEN25_3B_LAYER_FLAGS = (
    "--hidden-size", "2048", "--ffn-hidden-size", "11008", "--swiglu",
    "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "2",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
)


def structured_qkv(s: int, hq: int, hkv: int, d: int, device, seed: int = 0, n_vertical: int = 256):
    """bf16 ``q [1, s, hq, d]``, ``k, v [1, s, hkv, d]`` on ``device`` (GQA: ``hkv`` divides ``hq``;
    ``d`` even), seeded by ``seed``, with vertical-slash structure: the first d/2 dims carry a
    shared vector under RoPE (base 1e4) -> attention concentrated near the diagonal; the last d/2
    carry a content direction that a few keys (the first 64 tokens and ``n_vertical`` random
    positions per KV head) match strongly -> vertical columns."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    half = d // 2
    pos = torch.arange(s, dtype=torch.float64)
    inv = 1.0 / (1e4 ** (torch.arange(0, half, 2, dtype=torch.float64) / half))
    ang = pos[:, None] * inv[None]                              # [s, half/2]
    cos, sin = ang.cos().float(), ang.sin().float()

    def rope(x):                                                # x [s, h, half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, sn = cos[:, None], sin[:, None]
        return torch.stack((x1 * c - x2 * sn, x1 * sn + x2 * c), -1).flatten(-2)

    c = torch.randn(hkv, half, generator=g) * 1.2
    u = torch.randn(hkv, half, generator=g)
    rep = hq // hkv
    qa = rope(c.repeat_interleave(rep, 0)[None] + 0.5 * torch.randn(s, hq, half, generator=g))
    ka = rope(c[None] + 0.5 * torch.randn(s, hkv, half, generator=g))
    qb = u.repeat_interleave(rep, 0)[None] + 0.3 * torch.randn(s, hq, half, generator=g)
    kb = 0.3 * torch.randn(s, hkv, half, generator=g)
    for h in range(hkv):
        cols = torch.cat((torch.arange(64), torch.randint(64, s, (n_vertical,), generator=g)))
        kb[cols, h] += 1.8 * u[h]
    q = torch.cat((qa, qb), -1)[None].to(device=device, dtype=torch.bfloat16)
    k = torch.cat((ka, kb), -1)[None].to(device=device, dtype=torch.bfloat16)
    v = torch.randn(1, s, hkv, d, generator=g).to(device=device, dtype=torch.bfloat16)
    return q, k, v


def kept_fraction(pattern) -> float:
    """Fraction of the causal (query, key) pairs inside the pattern's mask (exact, averaged over
    samples x heads): :meth:`~megatron_mtraining.patterns.estimator.VerticalSlashPattern.kept_fraction`."""
    return float(pattern.kept_fraction().mean())

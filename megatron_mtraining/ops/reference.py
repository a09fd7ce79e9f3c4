"""Torch reference attention with LSE: the oracle and the CPU path of every ring.

Both functions work on one (query shard, key shard) pair given the *global* positions of
their tokens, so the same code serves every layout and every ring step. Causality is decided
by positions (key visible iff ``k_pos <= q_pos``), never by local indices.

Shapes (flash-attn's bshd convention):
    q: ``[b, sq, hq, d]``; k, v: ``[b, sk, hkv, d]`` with ``hq % hkv == 0`` (GQA: query head
    ``h`` reads key/value head ``h // (hq // hkv)``; K/V are never expanded).
    q_pos: ``[sq]`` int64; k_pos: ``[sk]`` int64, **ascending** (true for every layout here).
    out: ``[b, sq, hq, d]``; lse: ``[b, hq, sq]`` (natural log).

Accumulation dtype: fp64 for fp64 inputs, fp32 otherwise (bf16/fp16/fp32). Outputs are in
that dtype so that the ring can merge steps without rounding to the input dtype.

Rows with no visible key give ``out = 0`` and ``lse = -inf``; their gradients are exactly 0.

Work skipping: queries are processed in row chunks; for each chunk only the key prefix
``k_pos <= max(q_pos of chunk)`` is computed, so key blocks wholly in the future of a chunk
are skipped, not computed-and-masked (only the triangle inside a chunk is masked).

Algorithm: standard softmax attention with the log-sum-exp form of FlashAttention
(Dao et al. 2022, Alg. 1 forward / Alg. 2 backward, ``dS = P ∘ (dP − rowsum(dO ∘ O))``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common import acc_dtype, default_softmax_scale

__all__ = ["acc_dtype", "attention_forward", "attention_backward", "default_softmax_scale", "DenseStepKernel",
           "attention_delta_torch"]

# Upper bound on elements of one [b, hq, chunk, keys] score block (fp32: 4 bytes each).
_SCORE_BUDGET = 1 << 24


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [b, s, h, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if hq % k.shape[2] != 0:
        raise ValueError(f"GQA needs num query heads ({hq}) divisible by num kv heads ({k.shape[2]})")
    if q_pos.shape != (sq,) or k_pos.shape != (k.shape[1],):
        raise ValueError(f"q_pos {tuple(q_pos.shape)} / k_pos {tuple(k_pos.shape)} must be [sq]={sq} / [sk]={k.shape[1]}")


def _chunks(b: int, sq: int, hq: int, sk: int):
    rows = max(1, _SCORE_BUDGET // max(1, b * hq * sk))
    rows = min(sq, max(64, rows))
    for start in range(0, sq, rows):
        yield start, min(sq, start + rows)


def _visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, start: int, end: int, causal: bool) -> int:
    if not causal:
        return k_pos.numel()
    last = q_pos[start:end].max()
    return int(torch.searchsorted(k_pos, last, right=True))


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      softmax_scale: Optional[float] = None, causal: bool = True):
    """Partial attention of ``q`` over ``k, v`` with its LSE.

    Returns:
        ``(out, lse)``: ``out [b, sq, hq, d]`` and ``lse [b, hq, sq]`` in :func:`acc_dtype`.

    Raises:
        ValueError: inconsistent shapes (see module docstring).
    """
    _check(q, k, v, q_pos, k_pos)
    acc = acc_dtype(q.dtype)
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    rep = hq // hkv
    scale = default_softmax_scale(d) if softmax_scale is None else softmax_scale
    out = torch.zeros((b, sq, hkv, rep, d), dtype=acc, device=q.device)
    lse = torch.full((b, hkv, rep, sq), float("-inf"), dtype=acc, device=q.device)
    qg = q.view(b, sq, hkv, rep, d)
    for start, end in _chunks(b, sq, hq, k.shape[1]):
        kend = _visible_keys(q_pos, k_pos, start, end, causal)
        if kend == 0:
            continue
        s = torch.einsum("bqgrd,bkgd->bgrqk", qg[:, start:end].to(acc), k[:, :kend].to(acc)) * scale
        if causal:
            s.masked_fill_(k_pos[None, :kend] > q_pos[start:end, None], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True)
        lse[..., start:end] = (m + torch.log(l)).squeeze(-1)
        p = p / torch.where(l == 0, torch.ones_like(l), l)
        out[:, start:end] = torch.einsum("bgrqk,bkgd->bqgrd", p, v[:, :kend].to(acc))
    return out.view(b, sq, hq, d), lse.view(b, hq, sq)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       lse: torch.Tensor, delta: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                       softmax_scale: Optional[float] = None, causal: bool = True):
    """Gradients of the *global* attention output through this (q, k) pair.

    ``lse`` and ``delta`` are global (merged over every key shard), so the probabilities
    ``P = exp(S - lse)`` are the final ones and the per-pair gradients add up exactly.

    Args:
        dout: ``[b, sq, hq, d]`` gradient of the final output.
        lse: ``[b, hq, sq]`` final LSE; ``-inf`` rows (no key anywhere) give zero gradients.
        delta: ``[b, hq, sq]`` = ``rowsum(dout * out)`` of the final output, in :func:`acc_dtype`.

    Returns:
        ``(dq, dk, dv)`` shaped like ``q, k, v``, in :func:`acc_dtype`.
    """
    _check(q, k, v, q_pos, k_pos)
    acc = acc_dtype(q.dtype)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    rep = hq // hkv
    scale = default_softmax_scale(d) if softmax_scale is None else softmax_scale
    qg = q.view(b, sq, hkv, rep, d)
    dog = dout.view(b, sq, hkv, rep, d)
    lse_g = lse.view(b, hkv, rep, sq).to(acc)
    lse_g = torch.where(torch.isneginf(lse_g), torch.full_like(lse_g, float("inf")), lse_g)
    delta_g = delta.view(b, hkv, rep, sq).to(acc)
    dq = torch.zeros((b, sq, hkv, rep, d), dtype=acc, device=q.device)
    dk = torch.zeros((b, sk, hkv, d), dtype=acc, device=q.device)
    dv = torch.zeros((b, sk, hkv, d), dtype=acc, device=q.device)
    for start, end in _chunks(b, sq, hq, sk):
        kend = _visible_keys(q_pos, k_pos, start, end, causal)
        if kend == 0:
            continue
        qc = qg[:, start:end].to(acc)
        kc, vc = k[:, :kend].to(acc), v[:, :kend].to(acc)
        doc = dog[:, start:end].to(acc)
        s = torch.einsum("bqgrd,bkgd->bgrqk", qc, kc) * scale
        if causal:
            s.masked_fill_(k_pos[None, :kend] > q_pos[start:end, None], float("-inf"))
        p = torch.exp(s - lse_g[..., start:end, None])
        dp = torch.einsum("bqgrd,bkgd->bgrqk", doc, vc)
        ds = p * (dp - delta_g[..., start:end, None])
        dq[:, start:end] = torch.einsum("bgrqk,bkgd->bqgrd", ds, kc) * scale
        dk[:, :kend] += torch.einsum("bgrqk,bqgrd->bkgd", ds, qc) * scale
        dv[:, :kend] += torch.einsum("bgrqk,bqgrd->bkgd", p, doc)
    return dq.view(b, sq, hq, d), dk, dv


class DenseStepKernel:
    """Ring step kernel (:class:`~megatron_mtraining.ops.base.StepKernel`) of the dense ring on the
    torch reference: causal (or full) attention decided by global positions.

    The ring schedule calls ``forward(q, k, v, owner)`` / ``backward(...)`` once per step with the
    K/V of CP rank ``owner``; a step whose keys all lie in the future of every local query returns
    ``None`` and costs nothing.

    Args:
        layout: the CP :class:`~megatron_mtraining.layout.Layout` (``positions(rank, seq_len)``).
        rank: this rank's index in the CP group (its shard of ``layout``).
        seq_len: global sequence length.
        softmax_scale: attention logit scale.
        causal: causal mask on global positions (else full attention).
        device: where the position tensors live.
    """

    def __init__(self, layout, rank: int, seq_len: int, softmax_scale: float, causal: bool = True, device=None):
        self.layout, self.rank, self.seq_len = layout, rank, seq_len
        self.softmax_scale, self.causal = softmax_scale, causal
        self.q_pos = layout.positions(rank, seq_len, device=device)
        self._k_pos = {}

    def k_pos(self, owner: int) -> torch.Tensor:
        if owner not in self._k_pos:
            self._k_pos[owner] = self.layout.positions(owner, self.seq_len, device=self.q_pos.device)
        return self._k_pos[owner]

    def visible(self, owner: int) -> bool:
        return (not self.causal) or bool(self.k_pos(owner)[0] <= self.q_pos[-1])

    def forward(self, q, k, v, owner: int):
        if not self.visible(owner):
            return None
        return attention_forward(q, k, v, self.q_pos, self.k_pos(owner), self.softmax_scale, self.causal)

    def backward(self, dout, q, k, v, lse, delta, owner: int):
        if not self.visible(owner):
            return None
        return attention_backward(dout, q, k, v, lse, delta, self.q_pos, self.k_pos(owner),
                                  self.softmax_scale, self.causal)


def attention_delta_torch(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)`` of the attention backward in torch: ``[b, hq, s]`` contiguous in
    :func:`acc_dtype` of ``out.dtype`` from ``[b, s, hq, d]`` inputs."""
    acc = acc_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()

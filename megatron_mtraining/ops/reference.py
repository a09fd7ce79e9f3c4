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

Packed documents (:class:`~megatron_mtraining.layout.PackedDocuments`): with per-query key bounds
``q_lo, q_hi`` (``[b, sq]`` int64) key ``t`` is visible to query ``p`` iff ``q_lo[p] <= k_pos[t] <= q_hi[p]``
(the causal-and-same-document rule; padding queries have an empty interval). Queries then run in
64-row tiles and each tile computes only the keys between its smallest ``q_lo`` and largest
``q_hi``: key blocks of other documents are skipped, a tile with no visible key (all padding, or
only other documents' keys) costs nothing, and a tile with a boundary inside is masked exactly.

Algorithm: standard softmax attention with the log-sum-exp form of FlashAttention
(Dao et al. 2022, Alg. 1 forward / Alg. 2 backward, ``dS = P ∘ (dP − rowsum(dO ∘ O))``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common import acc_dtype, default_softmax_scale

__all__ = ["acc_dtype", "attention_forward", "attention_backward", "default_softmax_scale", "DenseStepKernel",
           "attention_delta_torch", "document_tiles", "DOCUMENT_TILE"]

#: Query rows per tile of the packed-document path (the GPU kernels' block size).
DOCUMENT_TILE = 64

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


def document_tiles(q_lo: torch.Tensor, q_hi: torch.Tensor, k_pos: torch.Tensor, rows: int = DOCUMENT_TILE):
    """The work of one (query shard, key shard) pair under per-query key bounds.

    Args:
        q_lo, q_hi: ``[b, sq]`` int64, the visible key positions of each query (inclusive; empty when
            ``q_lo > q_hi``).
        k_pos: ``[sk]`` int64 ascending key positions.
        rows: query rows per tile.

    Returns:
        ``[(start, end, kstart, kend), ...]``: query rows ``start:end`` see keys only within
        ``kstart:kend`` (a non-empty range); tiles with no visible key are left out.
    """
    b, sq = q_lo.shape
    n = -(-sq // rows)
    pad = n * rows - sq
    big = torch.iinfo(torch.int64).max
    real = q_lo <= q_hi
    lo = torch.where(real, q_lo, torch.full_like(q_lo, big))
    hi = torch.where(real, q_hi, torch.full_like(q_hi, -1))
    if pad:
        lo = torch.cat([lo, lo.new_full((b, pad), big)], 1)
        hi = torch.cat([hi, hi.new_full((b, pad), -1)], 1)
    kmin = lo.view(b, n, rows).amin(dim=(0, 2))
    kmax = hi.view(b, n, rows).amax(dim=(0, 2))
    kstart = torch.searchsorted(k_pos, kmin.clamp(max=big - 1))
    kend = torch.searchsorted(k_pos, kmax, right=True)
    tiles = []
    for i, (a, e) in enumerate(zip(kstart.tolist(), kend.tolist())):
        if e > a:
            tiles.append((i * rows, min(sq, (i + 1) * rows), a, e))
    return tiles


def _bounds_mask(q_lo, q_hi, k_pos, start, end, kstart, kend):
    """``[b, 1, 1, rows, keys]`` True where the key is *not* visible."""
    kp = k_pos[None, None, kstart:kend]
    vis = (kp >= q_lo[:, start:end, None]) & (kp <= q_hi[:, start:end, None])
    return ~vis[:, None, None]


def _check_bounds(q_lo, q_hi, b: int, sq: int):
    if (q_lo is None) != (q_hi is None):
        raise ValueError("q_lo and q_hi are given together (per-query key bounds of packed documents)")
    if q_lo is not None and (q_lo.shape != (b, sq) or q_hi.shape != (b, sq)):
        raise ValueError(f"q_lo {tuple(q_lo.shape)} / q_hi {tuple(q_hi.shape)} must be [b, sq] = [{b}, {sq}]")


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                      softmax_scale: Optional[float] = None, causal: bool = True,
                      q_lo: Optional[torch.Tensor] = None, q_hi: Optional[torch.Tensor] = None, tiles=None):
    """Partial attention of ``q`` over ``k, v`` with its LSE.

    ``q_lo``, ``q_hi`` (``[b, sq]`` int64, together): per-query key bounds of packed documents (module
    docstring); they replace ``causal``. ``tiles``: :func:`document_tiles` of these bounds (computed
    when ``None``).

    Returns:
        ``(out, lse)``: ``out [b, sq, hq, d]`` and ``lse [b, hq, sq]`` in :func:`acc_dtype`.

    Raises:
        ValueError: inconsistent shapes (see module docstring).
    """
    _check(q, k, v, q_pos, k_pos)
    acc = acc_dtype(q.dtype)
    b, sq, hq, d = q.shape
    _check_bounds(q_lo, q_hi, b, sq)
    hkv = k.shape[2]
    rep = hq // hkv
    scale = default_softmax_scale(d) if softmax_scale is None else softmax_scale
    out = torch.zeros((b, sq, hkv, rep, d), dtype=acc, device=q.device)
    lse = torch.full((b, hkv, rep, sq), float("-inf"), dtype=acc, device=q.device)
    qg = q.view(b, sq, hkv, rep, d)
    if q_lo is not None:
        work = document_tiles(q_lo, q_hi, k_pos) if tiles is None else tiles
    else:
        work = [(start, end, 0, _visible_keys(q_pos, k_pos, start, end, causal))
                for start, end in _chunks(b, sq, hq, k.shape[1])]
    for start, end, kstart, kend in work:
        if kend == 0:
            continue
        s = torch.einsum("bqgrd,bkgd->bgrqk", qg[:, start:end].to(acc), k[:, kstart:kend].to(acc)) * scale
        if q_lo is not None:
            s.masked_fill_(_bounds_mask(q_lo, q_hi, k_pos, start, end, kstart, kend), float("-inf"))
        elif causal:
            s.masked_fill_(k_pos[None, :kend] > q_pos[start:end, None], float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True)
        lse[..., start:end] = (m + torch.log(l)).squeeze(-1)
        p = p / torch.where(l == 0, torch.ones_like(l), l)
        out[:, start:end] = torch.einsum("bgrqk,bkgd->bqgrd", p, v[:, kstart:kend].to(acc))
    return out.view(b, sq, hq, d), lse.view(b, hq, sq)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       lse: torch.Tensor, delta: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                       softmax_scale: Optional[float] = None, causal: bool = True,
                       q_lo: Optional[torch.Tensor] = None, q_hi: Optional[torch.Tensor] = None, tiles=None):
    """Gradients of the *global* attention output through this (q, k) pair.

    ``q_lo``, ``q_hi``, ``tiles``: per-query key bounds of packed documents, as in
    :func:`attention_forward`; keys no query sees (padding, other documents) get exact zeros.

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
    _check_bounds(q_lo, q_hi, b, sq)
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
    if q_lo is not None:
        work = document_tiles(q_lo, q_hi, k_pos) if tiles is None else tiles
    else:
        work = [(start, end, 0, _visible_keys(q_pos, k_pos, start, end, causal))
                for start, end in _chunks(b, sq, hq, sk)]
    for start, end, kstart, kend in work:
        if kend == 0:
            continue
        qc = qg[:, start:end].to(acc)
        kc, vc = k[:, kstart:kend].to(acc), v[:, kstart:kend].to(acc)
        doc = dog[:, start:end].to(acc)
        s = torch.einsum("bqgrd,bkgd->bgrqk", qc, kc) * scale
        if q_lo is not None:
            s.masked_fill_(_bounds_mask(q_lo, q_hi, k_pos, start, end, kstart, kend), float("-inf"))
        elif causal:
            s.masked_fill_(k_pos[None, :kend] > q_pos[start:end, None], float("-inf"))
        p = torch.exp(s - lse_g[..., start:end, None])
        dp = torch.einsum("bqgrd,bkgd->bgrqk", doc, vc)
        ds = p * (dp - delta_g[..., start:end, None])
        dq[:, start:end] = torch.einsum("bgrqk,bkgd->bqgrd", ds, kc) * scale
        dk[:, kstart:kend] += torch.einsum("bgrqk,bqgrd->bkgd", ds, qc) * scale
        dv[:, kstart:kend] += torch.einsum("bgrqk,bqgrd->bkgd", p, doc)
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
        documents: :class:`~megatron_mtraining.layout.PackedDocuments` of packed streams (``causal``
            must be True): a key is visible iff it is causal *and* in the query's document; a step
            whose keys all belong to other documents (or are padding) returns ``None``.
    """

    def __init__(self, layout, rank: int, seq_len: int, softmax_scale: float, causal: bool = True, device=None,
                 documents=None):
        self.layout, self.rank, self.seq_len = layout, rank, seq_len
        self.softmax_scale, self.causal = softmax_scale, causal
        self.q_pos = layout.positions(rank, seq_len, device=device)
        self._k_pos = {}
        self.documents = documents
        self.q_lo = self.q_hi = None
        self._tiles = {}
        if documents is not None:
            if not causal:
                raise ValueError("packed documents need causal attention (causal=True)")
            if documents.seq_len != seq_len:
                raise ValueError(f"packed documents describe {documents.seq_len}-token streams but the sequence "
                                 f"has {seq_len} tokens")
            lo, hi = documents.key_bounds(layout, rank)
            self.q_lo, self.q_hi = lo.to(self.q_pos.device), hi.to(self.q_pos.device)

    def tiles(self, owner: int):
        """Packed documents: the :func:`document_tiles` of the step with ``owner``'s keys (cached)."""
        if owner not in self._tiles:
            self._tiles[owner] = document_tiles(self.q_lo, self.q_hi, self.k_pos(owner))
        return self._tiles[owner]

    def _check_batch(self, q):
        if self.q_lo is not None and q.shape[0] != self.q_lo.shape[0]:
            raise ValueError(f"packed documents describe {self.q_lo.shape[0]} streams but q has batch {q.shape[0]}")

    def k_pos(self, owner: int) -> torch.Tensor:
        if owner not in self._k_pos:
            self._k_pos[owner] = self.layout.positions(owner, self.seq_len, device=self.q_pos.device)
        return self._k_pos[owner]

    def visible(self, owner: int) -> bool:
        if self.q_lo is not None:
            return bool(self.tiles(owner))
        return (not self.causal) or bool(self.k_pos(owner)[0] <= self.q_pos[-1])

    def forward(self, q, k, v, owner: int):
        if not self.visible(owner):
            return None
        self._check_batch(q)
        if self.q_lo is not None:
            return attention_forward(q, k, v, self.q_pos, self.k_pos(owner), self.softmax_scale,
                                     q_lo=self.q_lo, q_hi=self.q_hi, tiles=self.tiles(owner))
        return attention_forward(q, k, v, self.q_pos, self.k_pos(owner), self.softmax_scale, self.causal)

    def backward(self, dout, q, k, v, lse, delta, owner: int):
        if not self.visible(owner):
            return None
        if self.q_lo is not None:
            return attention_backward(dout, q, k, v, lse, delta, self.q_pos, self.k_pos(owner), self.softmax_scale,
                                      q_lo=self.q_lo, q_hi=self.q_hi, tiles=self.tiles(owner))
        return attention_backward(dout, q, k, v, lse, delta, self.q_pos, self.k_pos(owner),
                                  self.softmax_scale, self.causal)


def attention_delta_torch(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)`` of the attention backward in torch: ``[b, hq, s]`` contiguous in
    :func:`acc_dtype` of ``out.dtype`` from ``[b, s, hq, d]`` inputs."""
    acc = acc_dtype(out.dtype)
    return (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()

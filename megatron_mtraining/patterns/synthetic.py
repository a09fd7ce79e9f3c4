"""Synthetic vertical-slash patterns (single sequence, causal) for tests and benchmarks (MTraining §3.2).

Two seeded recipes, one module; both give the lines a vertical-slash pattern is made of (per query
head: block-diagonal *slash* offsets at 64-token block level and *vertical* key columns at token
level) and are deterministic functions of their arguments (the benchmarks' numbers depend on the
exact patterns, so neither recipe may change).

**Calibrated recipe** (:func:`vertical_slash_indices`, the kernel benchmarks and kernel tests):
per batch entry and query head, seeded,

* **slash** diagonals at block level (64 tokens): offset 0 (the diagonal block), a local window
  of ``window`` offsets ``1..window-1``, and further offsets drawn from a heavy-tailed
  (log-uniform) distribution over ``[window, nqb)`` — many near the diagonal, a few far away;
* **vertical** columns at token level: ``sinks`` attention-sink tokens ``0..sinks-1`` and further
  positions drawn log-uniformly over ``[sinks, s)`` (dense near the start, sparse later).

Query tile ``qb`` lists key blocks ``qb - d`` for every offset ``d <= qb`` (ascending) and the
vertical columns ``t < (qb + 1) * 64`` whose block is not already listed (ascending). The indices
are those of a :class:`~megatron_mtraining.patterns.indices.StepIndices` with ``causal=True``.

Sparsity is measured against causal work (``s * (s + 1) / 2`` visible pairs): ``keep`` = useful
pairs (listed and causally visible) / causal pairs; :func:`vertical_slash_indices` scales the
numbers of offsets and columns (ratio ``block_share`` of the kept work in slash blocks) until
``keep`` is within 2 % of ``1 - sparsity``.

**RoPE-like recipe** (:func:`synthetic_pattern` with a :class:`SyntheticConfig`, the load-imbalance
model): per-head local windows, power-law slash streams and bursts of consecutive vertical tokens,
under a per-head tile budget; returned as a
:class:`~megatron_mtraining.patterns.estimator.VerticalSlashPattern` (the estimator's output type),
like :func:`dense_pattern` (full causal attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import numpy as np
import torch

from .estimator import VerticalSlashPattern
from .indices import DiagonalBlocks, StepIndices
from .io import pattern_from_arrays

__all__ = ["BLOCK", "PatternStats", "vertical_slash_indices", "SyntheticConfig", "synthetic_pattern",
           "dense_pattern"]


BLOCK = 64


@dataclass
class PatternStats:
    """Work of a :func:`vertical_slash_indices` pattern (pairs are (query, key) score entries)."""

    keep: float                 # useful pairs / causal pairs
    block_tiles: int            # 64x64 block tiles computed (all heads, batch)
    column_pairs: int           # useful (row, column) pairs of vertical columns
    column_tiles: int           # 64x64 column tiles computed (columns padded to 64 per query tile)
    mean_offsets: float
    mean_columns: float

    @property
    def computed_pairs(self) -> int:
        return (self.block_tiles + self.column_tiles) * BLOCK * BLOCK


def _log_uniform(n: int, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    if n <= 0 or hi <= lo:
        return torch.empty(0, dtype=torch.long)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))).long().clamp(lo, hi - 1)


def _head_pattern(nqb: int, s: int, n_off: int, n_col: int, window: int, sinks: int, gen: torch.Generator):
    offs = torch.arange(min(window, nqb))
    if n_off > offs.numel():
        extra = _log_uniform(4 * (n_off - offs.numel()) + 8, max(window, 1), nqb, gen).unique()
        extra = extra[torch.randperm(extra.numel(), generator=gen)][: n_off - offs.numel()]
        offs = torch.cat([offs, extra])
    cols = torch.arange(min(sinks, s))
    if n_col > cols.numel():
        extra = _log_uniform(4 * (n_col - cols.numel()) + 8, max(sinks, 1), s, gen).unique()
        extra = extra[torch.randperm(extra.numel(), generator=gen)][: n_col - cols.numel()]
        cols = torch.cat([cols, extra])
    return offs.unique(), cols.unique()          # ascending


def _indices_from(offsets, columns, nqb: int, s: int, device):
    """Block/column lists of every query tile for per-head offset/column sets (lists of tensors)."""
    nh = len(offsets)
    max_nb = max(1, max(int(o.numel()) for o in offsets))
    qb = torch.arange(nqb, device=device)
    bc = torch.zeros(nh, nqb, dtype=torch.int32, device=device)
    bi = torch.zeros(nh, nqb, max_nb, dtype=torch.int32, device=device)
    col_lists = []
    for h in range(nh):
        d_desc = offsets[h].to(device).flip(0)                          # descending offsets
        n = d_desc.numel()
        cnt = (offsets[h].to(device)[None, :] <= qb[:, None]).sum(1)    # offsets <= qb
        j = torch.arange(max_nb, device=device)
        src = (n - cnt)[:, None] + j[None, :]
        ok = j[None, :] < cnt[:, None]
        kb = qb[:, None] - d_desc[src.clamp(max=max(n - 1, 0))]
        bi[h] = torch.where(ok, kb, torch.zeros_like(kb)).to(torch.int32)
        bc[h] = cnt.to(torch.int32)
        # columns
        is_off = torch.zeros(nqb, dtype=torch.bool, device=device)
        is_off[offsets[h].to(device)] = True
        col_lists.append((columns[h].to(device), is_off))
    max_nc = 0
    keeps = []
    for cols, is_off in col_lists:
        if cols.numel() == 0:
            keeps.append(None)
            continue
        keep = (cols[None, :] < (qb[:, None] + 1) * BLOCK) & ~is_off[(qb[:, None] - cols[None, :] // BLOCK).clamp(min=0)]
        keep &= (qb[:, None] - cols[None, :] // BLOCK) >= 0
        keeps.append(keep)
        max_nc = max(max_nc, int(keep.sum(1).max()))
    cc = torch.zeros(nh, nqb, dtype=torch.int32, device=device)
    ci = torch.zeros(nh, nqb, max(1, max_nc), dtype=torch.int32, device=device)
    for h, ((cols, _), keep) in enumerate(zip(col_lists, keeps)):
        if keep is None:
            continue
        pos = torch.cumsum(keep.to(torch.int32), 1) - 1
        cc[h] = keep.sum(1).to(torch.int32)
        rows = qb[:, None].expand_as(keep)[keep]
        ci[h, rows, pos[keep].long()] = cols[None, :].expand_as(keep)[keep].to(torch.int32)
    return bc, bi, cc, ci


def _keep_pairs(offsets: torch.Tensor, columns: torch.Tensor, nqb: int) -> float:
    """Useful pairs of one head (as counted by :func:`_stats`), without building the lists."""
    d = offsets[offsets > 0].double()
    pairs = float(((nqb - d) * BLOCK * BLOCK).sum()) + nqb * BLOCK * (BLOCK + 1) / 2 * float((offsets == 0).sum())
    if columns.numel():
        cb = columns // BLOCK                                         # block of each column
        later = (cb[:, None] + offsets[None, :] < nqb).sum(1)        # tiles where the block is listed
        pairs += float(((nqb - cb) - later).sum()) * BLOCK
    return pairs


def _stats(bc, bi, cc, nqb: int, s: int) -> PatternStats:
    # useful pairs: full tiles below the diagonal, the diagonal tile is a triangle of 64*65/2 pairs
    qb = torch.arange(nqb, device=bi.device)
    slot = torch.arange(bi.shape[-1], device=bi.device)
    valid = slot < bc[..., None].long()
    diag = valid & (bi == qb[:, None])
    n_tiles = int(valid.sum())
    n_diag = int(diag.sum())
    block_pairs = (n_tiles - n_diag) * BLOCK * BLOCK + n_diag * BLOCK * (BLOCK + 1) // 2
    # columns listed by tile qb all lie before its last row; those inside the tile are partly masked:
    # count each column as 64 pairs (upper bound off by < 64 per tile and column near the diagonal)
    col_pairs = int(cc.long().sum()) * BLOCK
    col_tiles = int(((cc.long() + BLOCK - 1) // BLOCK).sum())
    heads = bc.shape[0]
    causal = heads * s * (s + 1) // 2
    return PatternStats(keep=(block_pairs + col_pairs) / causal, block_tiles=n_tiles, column_pairs=col_pairs,
                        column_tiles=col_tiles, mean_offsets=float(bc.float().mean()),
                        mean_columns=float(cc.float().mean()))


def vertical_slash_indices(seq_len: int, num_heads: int, sparsity: float, batch: int = 1, block_share: float = 0.8,
                           window: int = 4, sinks: int = 4, seed: int = 0, device=None, tol: float = 0.02,
                           return_sets: bool = False):
    """A causal :class:`StepIndices` of a synthetic vertical-slash pattern with ``sparsity`` (e.g.
    0.95: 5 % of causal work kept). Returns ``(indices, PatternStats)`` and, with ``return_sets``,
    also the per-head ``(offsets, columns)`` tensors (block offsets, token columns). Batch entries
    share the pattern (expanded, not copied)."""
    if seq_len % BLOCK:
        raise ValueError(f"seq_len must be a multiple of {BLOCK}")
    nqb = seq_len // BLOCK
    target = 1.0 - sparsity
    # first guess: a diagonal at offset d costs ~(nqb - d) tiles, a column at t ~(s - t) pairs
    n_off = max(window, int(round(block_share * target * nqb / 2 * 1.15)))
    n_col = max(sinks, int(round((1 - block_share) * target * seq_len / 2 * 1.6)))
    dev = torch.device(device) if device is not None else torch.device("cpu")
    causal = num_heads * seq_len * (seq_len + 1) / 2
    for _ in range(12):
        gen = torch.Generator().manual_seed(seed)
        pats = [_head_pattern(nqb, seq_len, n_off, n_col, window, sinks, gen) for _ in range(num_heads)]
        keep = sum(_keep_pairs(o, c, nqb) for o, c in pats) / causal
        if abs(keep - target) <= tol * target:
            break
        f = target / max(keep, 1e-12)
        n_off = max(window, int(round(n_off * f ** 0.9)))
        n_col = max(sinks, int(round(n_col * f ** 0.9)))
    bc, bi, cc, ci = _indices_from([p[0] for p in pats], [p[1] for p in pats], nqb, seq_len, dev)
    result = (bc, bi, cc, ci, _stats(bc, bi, cc, nqb, seq_len))
    bc, bi, cc, ci, st = result
    expand = lambda t: t[None].expand(batch, *t.shape)
    idx = StepIndices(expand(bc), expand(bi), expand(cc), expand(ci), True)
    idx.diagonal = DiagonalBlocks.of(idx.block_count, idx.block_index)     # key blocks qb - d: block diagonals
    if batch > 1:
        st = PatternStats(st.keep, st.block_tiles * batch, st.column_pairs * batch, st.column_tiles * batch,
                          st.mean_offsets, st.mean_columns)
    if return_sets:
        return idx, st, pats
    return idx, st


# ----------------------------------------------------------------------------- RoPE-like recipe
@dataclass(frozen=True)
class SyntheticConfig:
    """Generator of a RoPE-like vertical-slash pattern (see :func:`synthetic_pattern`).

    Args:
        heads: number of query heads (one pattern each).
        sparsity: target fraction of causal work skipped per head, in kernel tiles (64x64 tiles
            of the causal block triangle; a vertical column costs 1/64 tile per query block).
        sinks: attention-sink columns ``0 .. sinks-1`` (tokens).
        window: minimum local window in 64-token blocks; head ``h`` keeps block diagonals
            ``0 .. w_h-1`` with ``w_h`` uniform in ``[window, 2*window]``.
        max_vertical: cap on columns per head (the estimator's default cap).
        seed: base seed; head ``h`` uses ``numpy.random.default_rng([seed, h])``.
    """

    heads: int = 16
    sparsity: float = 0.95
    sinks: int = 64
    window: int = 16
    max_vertical: int = 4096
    seed: int = 0


def _power_law(rng: np.random.Generator, n: int, lo: int, hi: int, gamma: float) -> np.ndarray:
    """``n`` integers in ``[lo, hi)`` with ``x = lo * (hi/lo) ** (u ** gamma)``, u ~ U(0, 1).

    ``gamma = 1`` is log-uniform (density ~ 1/x: heavy-tailed, scale-free); ``gamma > 1`` moves
    mass toward ``lo`` while keeping the tail up to ``hi``."""
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    u = rng.random(n)
    x = lo * np.exp(np.log(hi / lo) * u ** gamma)
    return np.clip(np.floor(x).astype(np.int64), lo, hi - 1)


def _first_unique(x: np.ndarray) -> np.ndarray:
    """Unique values of ``x`` in order of first occurrence."""
    _, idx = np.unique(x, return_index=True)
    return x[np.sort(idx)]


def _take_budget(cost: np.ndarray, budget: float) -> int:
    """Length of the shortest prefix of ``cost`` whose sum reaches ``budget`` (all if never)."""
    if budget <= 0 or cost.size == 0:
        return 0
    return int(min(cost.size, np.searchsorted(np.cumsum(cost), budget) + 1))


def _synthetic_head(seq_len: int, cfg: SyntheticConfig, h: int) -> Tuple[np.ndarray, np.ndarray]:
    nb = seq_len // BLOCK
    rng = np.random.default_rng([cfg.seed, h])
    w = int(min(nb, rng.integers(cfg.window, 2 * cfg.window + 1)))
    rho = rng.uniform(0.1, 0.4)                # share of the head's work on vertical columns
    gamma_s = rng.uniform(1.0, 3.0)
    gamma_v = rng.uniform(1.0, 2.0)
    budget = (1.0 - cfg.sparsity) * nb * (nb + 1) / 2           # tiles
    # slash: local window, then a power-law stream of farther offsets
    window = np.arange(w, dtype=np.int64)
    stream = _first_unique(_power_law(rng, 8 * nb, w, nb, gamma_s)) if w < nb else np.zeros(0, np.int64)
    s_cost = (nb - stream).astype(np.float64)
    n_s = _take_budget(s_cost, (1.0 - rho) * budget - float((nb - window).sum()))
    offsets = np.concatenate([window, stream[:n_s]])

    def column_cost(t: np.ndarray, offs: np.ndarray) -> np.ndarray:
        # query blocks at or after the column's block whose tile is not already a slash tile, / 64
        dmask = np.zeros(nb + 1, dtype=np.int64)
        dmask[offs] = 1
        before = np.concatenate([[0], np.cumsum(dmask)])          # before[L] = #offsets < L
        tb = t // BLOCK
        return ((nb - tb) - before[nb - tb]) / BLOCK

    # vertical: sinks, then bursts (mean 4 consecutive tokens) at power-law anchors
    sinks = np.arange(min(cfg.sinks, seq_len), dtype=np.int64)
    anchors = _power_law(rng, 4 * cfg.max_vertical, max(cfg.sinks, 1), seq_len, gamma_v)
    lengths = rng.geometric(0.25, anchors.size)                  # >= 1, mean 4
    starts = np.repeat(anchors, lengths)
    within = np.arange(starts.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    burst = _first_unique(np.clip(starts + within, 0, seq_len - 1))
    burst = burst[burst >= sinks.size][: max(0, cfg.max_vertical - sinks.size)]
    used = float((nb - offsets).sum()) + float(column_cost(sinks, offsets).sum())
    n_v = _take_budget(column_cost(burst, offsets), budget - used)
    columns = np.concatenate([sinks, burst[:n_v]])
    used += float(column_cost(burst[:n_v], offsets).sum())
    if used < budget and n_s < stream.size:      # column cap reached: the rest goes to slashes
        extra = _take_budget(s_cost[n_s:], budget - used)
        offsets = np.concatenate([offsets, stream[n_s:n_s + extra]])
    return np.unique(offsets), np.unique(columns)



def synthetic_pattern(seq_len: int, cfg: SyntheticConfig = SyntheticConfig()) -> VerticalSlashPattern:
    """A RoPE-like vertical-slash pattern, one per head, seeded per head.

    Per head ``h`` (``rng = default_rng([seed, h])``), with ``nb = seq_len / 64`` blocks and a
    budget of ``(1 - sparsity) * nb (nb + 1) / 2`` tiles (a column costs one tile per 64 query
    blocks it is gathered for):

    * slash offsets: the local window ``0 .. w_h - 1`` (``w_h ~ U[window, 2 window]`` blocks),
      then offsets from a power law over ``[w_h, nb)`` (log-uniform warped by ``gamma_s ~
      U[1, 3]``: most near the window, a heavy tail up to the whole sequence) until the head's
      slash share ``1 - rho_h`` of the budget is used (``rho_h ~ U[0.1, 0.4]``);
    * vertical columns: the ``sinks`` attention sinks, then bursts of consecutive tokens (length
      1 + Geometric(0.25), mean 4: a salient phrase) at anchors from a power law over
      ``[sinks, seq_len)`` (``gamma_v ~ U[1, 2]``: dense early, heavy tail to the end) until the
      budget or ``max_vertical`` is reached; a budget left by the cap goes to more slashes.

    At short sequences the floors (window, sinks) alone exceed the budget and the pattern is
    denser than asked; the achieved sparsity is what the tool reports.
    """
    if seq_len % BLOCK:
        raise ValueError(f"seq_len must be a multiple of {BLOCK}")
    heads = [_synthetic_head(seq_len, cfg, h) for h in range(cfg.heads)]
    return pattern_from_arrays(seq_len, [s for s, _ in heads], [v for _, v in heads])


def dense_pattern(seq_len: int, heads: int) -> VerticalSlashPattern:
    """Full causal attention as a vertical-slash pattern (every block diagonal, no columns)."""
    nb = seq_len // BLOCK
    return pattern_from_arrays(seq_len, [np.arange(nb)] * heads, [np.zeros(0, np.int64)] * heads)


#!/usr/bin/env python
"""Load imbalance of ring attention per (worker, ring step) for a CP layout and a sparse pattern.

MTraining §3.3/§4.1 (Fig. 1, 5a, 7, 13, Table 3). Worker ``r`` holds the queries the layout gives
it; at ring step ``s`` it holds the K/V of owner ``o = (r - s) mod cp`` and computes the part of
the attention mask between its queries and those keys. ``W[r, s]`` is that work.

Metrics (``W`` has ``cp`` ring-step columns, plus one "columns" phase for the out-of-ring and
deferred vertical modes; the ring moves in lock step, so every phase lasts as long as its slowest
worker):

    worker_imbalance     = sum_s max_r W[r,s] / sum_s mean_r W[r,s]          (all phases)
    step_imbalance       = mean_r ( max_s W[r,s] / mean_s W[r,s] )           (ring steps only)
    ring_time_over_ideal = sum_s max_r W[r,s] / (sum_{r,s} W[r,s] / cp)      (all phases)
    total_imbalance      = max_r sum_s W[r,s] / mean_r sum_s W[r,s]          (per-worker totals)

``ring_time_over_ideal`` equals ``worker_imbalance`` algebraically (sum_s mean_r W = total / cp);
both are printed because both names are in use. ``total_imbalance`` is the floor that any
re-ordering of a worker's own steps could reach: a gap between it and ``worker_imbalance`` is
imbalance caused by the lock-step synchronisation, not by the amount of work per worker.

Work units (``--unit``), summed over heads:

* ``tiles`` (default): score entries a tile-sparse kernel evaluates. A 64x64 tile of local
  query rows x local keys counts 64*64 when it holds at least one (query, key) pair on a selected
  slash (block diagonal) — in full, masked entries included (the diagonal tile costs 4096, not
  2080). Each vertical column that is not inside such a tile counts 64 per 64-row query tile
  that can see it (some query of the tile at or after the column); padding of the gathered
  columns to multiples of 64 is not counted. For layouts that keep 64-token blocks whole
  (striped with granularity % 64 == 0, zigzag/contiguous with 64-aligned chunks) a local tile is
  one global 64x64 block and this is exactly ``64*64*sum(block_count) + 64*sum(column_count)``
  of the project's converter (``patterns.convert``). For striped with granularity g < 64
  (64 % g == 0; the converter refuses it, token striping is a dense-ring layout) a local tile's
  64 rows are 64/g chunks of g tokens, one every cp*g tokens: it spans cp consecutive global
  blocks, so a tile is computed when *any* of its cp x cp block pairs is on a selected slash —
  the block sparsity is coarsened by the layout, and that cost is what this unit reports.
* ``pairs``: (query, key) pairs inside the mask ``causal & (slash or vertical)`` — useful work,
  independent of the kernel and of tiling.

Vertical (column) work placement (``--vertical``):

* ``in-ring``: what the converter and ``ring.sparse`` do — owner ``o``'s columns are computed at
  the step that holds ``o``'s K/V. Ranks holding sink/early heavy columns get extra work at the
  steps where those owners arrive, and every step has one such worker.
* ``out-of-ring``: the ring computes only slash tiles; each worker computes all columns its
  queries see in one extra phase after the ring, on column K/V collected once (an all-gather of
  the selected columns, or rows extracted while K/V pass by, as MTraining's ``extract_kv``);
  the backward reduces the columns' dK/dV once (the reference's CUDA backward does the column
  gradients locally in one call as well).
* ``deferred``: like ``out-of-ring``, but a worker may compute owner ``o``'s columns at any step
  from the one at which ``o``'s K/V passed (rows kept as they pass) onwards; they fill the
  worker's idle time below that step's slowest worker (never lengthening a step), earliest
  first, and what is left runs in the extra phase.

Patterns (``--pattern``): ``dense`` (full causal), ``synthetic`` (seeded per head, see
:func:`megatron_mtraining.patterns.synthetic.synthetic_pattern`), ``file`` (``--pattern-file``, format in
:mod:`megatron_mtraining.patterns.io`).

``--pattern packed``: dense causal attention *within packed documents* (no sparse pattern): a
stream of ``--seq-len`` tokens filled with documents (``--doc-lengths corpus`` takes the document
lengths of ``--data-path PREFIX.idx``, split at ``--max-doc-len``; ``fixed:N`` / ``list:A,B,...``),
and the work of a worker at a ring step is the part of ``causal & same document`` between its
queries and the owner's keys (:mod:`megatron_mtraining.bench.packing`: 64x64 tiles that hold such
a pair, or pairs). Each row also gives the same layout's metrics for the unpacked causal
sequence (``unpacked_worker_imbalance``) and ``work_fraction_of_causal``. FLOP model only::

    python tools/imbalance.py --pattern packed --seq-len 131072 --max-doc-len 4096 --cp 8 --json packed.json
    python tools/imbalance.py --pattern packed --seq-len 131072 --max-doc-len 8192 --sweep --cps 2,4,8,16 \
        --layouts zigzag,striped-64,striped-128

``--model gpu`` runs the same schedule as real kernels on one device (virtual CP): for each
(worker, step) it builds the worker's query shard, the owner's K/V shard and the converter's
StepIndices, and times the sparse forward and backward (Triton kernels of
``megatron_mtraining.ops.triton`` where usable, else the torch sparse reference), median of
``--repeats`` after ``--warmup`` (:func:`megatron_mtraining.bench.measure`: CUDA events on GPU). ``W`` is then milliseconds (fwd + bwd);
the JSON adds ``W_fwd_ms``, ``W_bwd_ms``, ``step_ms_fwd_max``, ``step_ms_bwd_max`` (max over
workers per ring step, read by tools/simulate_hierarchy.py) and the FLOP model of the same run.

Examples::

    python tools/imbalance.py --model flops --cp 32 --seq-len 524288 --layout striped --granularity 64 \\
        --pattern synthetic --json out.json --png out.png
    python tools/imbalance.py --sweep --seq-len 524288 --pattern synthetic --png sweep.png
    python tools/imbalance.py --model gpu --cp 8 --seq-len 524288 --layout striped --granularity 64 \\
        --pattern synthetic --json gpu_cp8.json          # on one H200

``--cps``, ``--layouts`` and ``--verticals`` choose the rows of ``--sweep`` and are refused without it
(a single configuration is ``--cp``, ``--layout``/``--granularity``, ``--vertical``). Bad values and
combinations end with ``error: ...`` naming the flag (exit 2) before any work; the corpus file of
``--doc-lengths corpus`` is checked after the other flags.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron_mtraining.bench import measure, pyplot, result_record, save_figure, write_json
from megatron_mtraining.layout import Layout
from megatron_mtraining.patterns.convert import without_columns
from megatron_mtraining.patterns.estimator import VerticalSlashPattern
from megatron_mtraining.patterns.io import head_lines, load_pattern, pattern_from_arrays, save_pattern  # noqa: F401
from megatron_mtraining.patterns.synthetic import SyntheticConfig, dense_pattern, synthetic_pattern

BLOCK = 64
TILE = BLOCK * BLOCK
UNITS = ("tiles", "pairs")
VERTICAL_MODES = ("in-ring", "out-of-ring", "deferred")
SWEEP_DEFAULTS = {"cps": "8,16,32", "layouts": "zigzag,striped-1,striped-64,striped-128",
                  "verticals": "in-ring,out-of-ring,deferred"}


# ============================================================================ FLOP model
class Geometry:
    """Who owns what under ``layout`` at ``seq_len``: token owners, block contents, tile structure.

    Attributes (numpy): ``tok_owner [S]``, ``tok_local [S]`` (local index on the owner),
    ``n [cp, nb]`` tokens of rank r in block x, ``whole`` (every block on one rank),
    ``blk_owner [nb]`` (when whole).
    """

    def __init__(self, layout: Layout, seq_len: int):
        layout.check_seq_len(seq_len)
        if seq_len % BLOCK:
            raise ValueError(f"sequence length {seq_len} must be a multiple of {BLOCK}")
        self.layout, self.seq_len, self.cp = layout, seq_len, layout.cp_size
        self.nb = nb = seq_len // BLOCK
        rank, local = layout.global_to_local(torch.arange(seq_len), seq_len)
        self.tok_owner = rank.numpy().astype(np.int64)
        self.tok_local = local.numpy().astype(np.int64)
        ob = self.tok_owner.reshape(nb, BLOCK)
        self.whole = bool((ob == ob[:, :1]).all())
        cp = self.cp
        self.n = np.bincount((np.arange(nb)[:, None] * cp + ob).ravel(), minlength=nb * cp).reshape(nb, cp).T
        self.n = self.n.astype(np.float64)
        self.fft_len = 1 << int(math.ceil(math.log2(2 * nb)))
        self._fft: Dict[str, np.ndarray] = {}
        if self.whole:
            self.blk_owner = ob[:, 0].copy()
            self._order = np.argsort(self.blk_owner, kind="stable")
        self._diag = None
        self._tiles = None

    # --------------------------------------------------------------- helpers
    def weights_fft(self, kind: str) -> np.ndarray:
        """rfft of ``w [cp, nb]``: ``kind='n'`` token counts, ``'i'`` block indicators (whole)."""
        if kind not in self._fft:
            w = self.n if kind == "n" else self.n / BLOCK
            self._fft[kind] = np.fft.rfft(w, self.fft_len, axis=-1)
        return self._fft[kind]

    def correlate(self, dmask: np.ndarray, kind: str) -> np.ndarray:
        """``C[r, x] = sum_d dmask[d] * w[r, x + d]`` for ``x in [0, nb)`` (0 beyond the end)."""
        a = np.fft.rfft(dmask, self.fft_len)
        c = np.fft.irfft(np.conj(a)[None, :] * self.weights_fft(kind), self.fft_len, axis=-1)[:, :self.nb]
        return np.rint(c)

    def by_owner(self, c: np.ndarray) -> np.ndarray:
        """``out[r, o] = sum over blocks x owned by o of c[r, x]`` (blocks whole)."""
        return c[:, self._order].reshape(self.cp, self.cp, -1).sum(-1)

    def diag_pairs(self) -> np.ndarray:
        """``[cp, cp]`` causal (q >= k) pairs inside the same block, by (query rank, key rank)."""
        if self._diag is None:
            cp = self.cp
            rows, counts = np.unique(self.tok_owner.reshape(self.nb, BLOCK), axis=0, return_counts=True)
            u, v = np.tril_indices(BLOCK)                      # u >= v: query u, key v
            out = np.zeros(cp * cp)
            for row, c in zip(rows, counts):
                out += c * np.bincount(row[u] * cp + row[v], minlength=cp * cp)
            self._diag = out.reshape(cp, cp)
        return self._diag

    def tile_structure(self) -> dict:
        """Periodic local-tile structure of striped layouts with granularity g < 64 (64 % g == 0).

        A local 64-row tile of any rank spans ``cp`` consecutive global blocks; its tokens sit at
        the same relative positions ``rel[r]`` (in ``[0, 64 cp)``) in every tile.
        """
        if self._tiles is None:
            lay, cp = self.layout, self.cp
            g = lay.granularity
            if lay.kind != "striped" or BLOCK % g or self.seq_len % (BLOCK * cp):
                raise ValueError(f"unit 'tiles' needs 64-token blocks whole on one rank, or striped with "
                                 f"granularity dividing 64 and seq_len % (64*cp) == 0; got {lay} at {self.seq_len}")
            m = BLOCK // g
            k, e = np.meshgrid(np.arange(m), np.arange(g), indexing="ij")
            rel = np.stack([((k * cp + r) * g + e).ravel() for r in range(cp)])          # [cp, 64]
            blk = rel // BLOCK
            pres = np.zeros((cp, cp), dtype=bool)
            np.put_along_axis(pres, blk, True, axis=1)
            qmax = np.full((cp, cp), -1)
            kmin = np.full((cp, cp), 1 << 40)
            for r in range(cp):
                np.maximum.at(qmax[r], blk[r], rel[r])
                np.minimum.at(kmin[r], blk[r], rel[r])
            # E[r, o, e + cp - 1]: some block u of r and u - e of o (e in (-cp, cp))
            E = np.zeros((cp, cp, 2 * cp - 1), dtype=bool)
            for ee in range(-(cp - 1), cp):
                lo, hi = max(ee, 0), cp + min(ee, 0)
                E[:, :, ee + cp - 1] = (pres[:, None, lo:hi] & pres[None, :, lo - ee:hi - ee]).any(-1)
            # E0[r, o, d], d in [0, cp): same-tile block pairs with a causal (q >= k) token pair
            E0 = E[:, :, cp - 1:].copy()
            E0[:, :, 0] = (pres[:, None, :] & pres[None, :, :] & (qmax[:, None, :] >= kmin[None, :, :])).any(-1)
            uniq, inv = np.unique(E.reshape(cp * cp, -1), axis=0, return_inverse=True)
            self._tiles = {"nt": self.seq_len // (BLOCK * cp), "E_uniq": uniq.astype(np.float64),
                           "E_inv": inv.ravel(), "E0": E0.reshape(cp * cp, cp).astype(np.float64),
                           "maxrel": rel.max(1)}
        return self._tiles


def _sum_by_owner(cnt: np.ndarray, owner: np.ndarray, cp: int) -> np.ndarray:
    """``out[r, o] = sum_j cnt[r, j] * [owner[j] == o]`` for ``cnt [cp, n]``."""
    key = (np.arange(cp)[:, None] * cp + owner[None, :]).ravel()
    return np.bincount(key, weights=cnt.ravel(), minlength=cp * cp).reshape(cp, cp)


def _dmask(offsets: np.ndarray, nb: int, drop_zero: bool = False) -> np.ndarray:
    m = np.zeros(nb)
    m[offsets] = 1.0
    if drop_zero:
        m[0] = 0.0
    return m


def head_work(geo: Geometry, offsets: np.ndarray, columns: np.ndarray, unit: str) -> Tuple[np.ndarray, np.ndarray]:
    """``(slash [cp, cp], vertical [cp, cp])`` work of one head by (query rank, key owner), in score
    entries (see the module docstring for ``unit``)."""
    cp, nb = geo.cp, geo.nb
    if unit == "pairs":
        return _head_pairs(geo, offsets, columns)
    if unit != "tiles":
        raise ValueError(f"unit must be one of {UNITS}")
    if not geo.whole:
        return _head_tiles_strided(geo, offsets, columns)
    c = geo.correlate(_dmask(offsets, nb), "i")                  # [cp, nb]: tiles of key block x at rank r
    slash = geo.by_owner(c) * TILE
    vert = np.zeros((cp, cp))
    if columns.size:
        tb = columns // BLOCK
        ind = geo.n / BLOCK
        after = np.cumsum(ind[:, ::-1], axis=1)[:, ::-1]         # [cp, nb]: blocks >= x owned by r
        cnt = after[:, tb] - c[:, tb]                              # query blocks gathering the column
        vert = _sum_by_owner(cnt, geo.blk_owner[tb], cp) * BLOCK
    return slash, vert


def _head_pairs(geo: Geometry, offsets: np.ndarray, columns: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    cp, nb = geo.cp, geo.nb
    has0 = bool((offsets == 0).any())
    c = geo.correlate(_dmask(offsets, nb, drop_zero=True), "n")   # [cp, nb]: queries of r in blocks x+d, d>0
    if geo.whole:
        slash = geo.by_owner(c) * BLOCK
    else:
        slash = c @ geo.n.T
    if has0:
        slash = slash + geo.diag_pairs()
    vert = np.zeros((cp, cp))
    if columns.size:
        tb = columns // BLOCK
        after = np.cumsum(geo.n[:, ::-1], axis=1)[:, ::-1]
        later = np.concatenate([after[:, 1:], np.zeros((cp, 1))], axis=1)      # blocks > x
        cnt = later[:, tb] - c[:, tb]
        if not has0:                                                # same block, queries at or after t
            u = np.arange(BLOCK)
            own = geo.tok_owner[tb[:, None] * BLOCK + u[None, :]]         # [nv, 64]
            ok = u[None, :] >= (columns % BLOCK)[:, None]
            same = np.bincount((np.arange(columns.size)[:, None] * cp + own)[ok],
                               minlength=columns.size * cp).reshape(columns.size, cp).T
            cnt = cnt + same
        vert = _sum_by_owner(cnt, geo.tok_owner[columns], cp)
    return slash, vert


def _head_tiles_strided(geo: Geometry, offsets: np.ndarray, columns: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    cp, nb = geo.cp, geo.nb
    ts = geo.tile_structure()
    nt = ts["nt"]
    dm = _dmask(offsets, nb)
    # act1[delta-1, r*cp+o]: query tile i, key tile i-delta (delta >= 1) hold a slash pair
    delta = np.arange(1, nt)
    idx = cp * delta[:, None] + np.arange(-(cp - 1), cp)[None, :]    # always in [1, nb)
    act1 = ((dm[idx] @ ts["E_uniq"].T) > 0)[:, ts["E_inv"]]            # [nt-1, cp*cp]
    act0 = (ts["E0"] @ dm[:cp]) > 0                                    # [cp*cp]
    tiles = nt * act0 + ((nt - delta)[:, None] * act1).sum(0)
    slash = tiles.reshape(cp, cp) * TILE
    vert = np.zeros((cp, cp))
    if columns.size:
        o = geo.tok_owner[columns]
        j = geo.tok_local[columns] // BLOCK                          # key tile of the column
        miss = np.concatenate([np.zeros((1, cp * cp)), np.cumsum(~act1, axis=0)], axis=0)   # [nt, cp*cp]
        r = np.arange(cp)
        pair = r[:, None] * cp + o[None, :]                          # [cp, nv]
        sees = (BLOCK * cp * j[None, :] + ts["maxrel"][:, None]) >= columns[None, :]
        cnt = miss[(nt - 1 - j)[None, :], pair] + (~act0[pair]) * sees
        vert = _sum_by_owner(cnt, o, cp) * BLOCK
    return slash, vert


def pair_work(geo: Geometry, pattern: VerticalSlashPattern, unit: str) -> Tuple[np.ndarray, np.ndarray]:
    """Summed over heads: ``(slash [cp, cp], vertical [cp, cp])`` by (query rank, key owner).
    Identical heads (e.g. dense) are computed once."""
    if pattern.seq_len != geo.seq_len:
        raise ValueError(f"pattern is for seq_len {pattern.seq_len}, the layout geometry for {geo.seq_len}")
    cache: Dict[bytes, Tuple[np.ndarray, np.ndarray]] = {}
    slash = np.zeros((geo.cp, geo.cp))
    vert = np.zeros((geo.cp, geo.cp))
    for offs, cols in head_lines(pattern):
        key = hashlib.sha1(offs.tobytes() + b"|" + cols.tobytes()).digest()
        if key not in cache:
            cache[key] = head_work(geo, offs, cols, unit)
        slash += cache[key][0]
        vert += cache[key][1]
    return slash, vert


def by_step(pair: np.ndarray) -> np.ndarray:
    """``W[r, s] = pair[r, (r - s) mod cp]``: the owner whose K/V rank r holds at ring step s."""
    cp = pair.shape[0]
    r = np.arange(cp)[:, None]
    s = np.arange(cp)[None, :]
    return pair[r, (r - s) % cp]


def schedule(slash_pair: np.ndarray, vert_pair: np.ndarray, mode: str) -> np.ndarray:
    """Per (worker, phase) work for a vertical placement ``mode`` (see the module docstring).

    Returns ``[cp, cp]`` for ``in-ring``; ``[cp, cp + 1]`` (last column: the columns phase after
    the ring) for ``out-of-ring`` and ``deferred``."""
    ws, wv = by_step(slash_pair), by_step(vert_pair)
    if mode == "in-ring":
        return ws + wv
    if mode == "out-of-ring":
        return np.concatenate([ws, wv.sum(1, keepdims=True)], axis=1)
    if mode == "deferred":
        level = ws.max(0)
        filled = np.zeros_like(ws)
        pending = np.zeros(ws.shape[0])
        for s in range(ws.shape[1]):
            pending += wv[:, s]                      # owner (r - s)'s columns become available now
            take = np.minimum(pending, level[s] - ws[:, s])
            filled[:, s] = take
            pending -= take
        return np.concatenate([ws + filled, pending[:, None]], axis=1)
    raise ValueError(f"vertical mode must be one of {VERTICAL_MODES}")


def metrics(W: np.ndarray, ring_steps: int) -> dict:
    """The imbalance metrics of the module docstring for ``W [cp, phases]``."""
    colmax, colmean = W.max(0), W.mean(0)
    ring = W[:, :ring_steps]
    rmean = ring.mean(1)
    ok = rmean > 0
    per_worker = W.sum(1)
    total = float(W.sum())
    return {
        "worker_imbalance": float(colmax.sum() / colmean.sum()) if colmean.sum() > 0 else 1.0,
        "step_imbalance": float((ring.max(1)[ok] / rmean[ok]).mean()) if ok.any() else 1.0,
        "ring_time_over_ideal": float(colmax.sum() / (total / W.shape[0])) if total > 0 else 1.0,
        "total_imbalance": float(per_worker.max() / per_worker.mean()) if total > 0 else 1.0,
        "ring_time": float(colmax.sum()),
        "balanced_ideal": total / W.shape[0],
        "total_work": total,
    }


def layout_from_spec(spec: str, cp: int) -> Layout:
    """``zigzag``, ``contiguous`` or ``striped-G`` (``striped`` alone: G = 64)."""
    if spec.startswith("striped"):
        g = int(spec.split("-", 1)[1]) if "-" in spec else 64
        return Layout("striped", cp, g)
    return Layout(spec, cp, 64)


def layout_name(layout: Layout) -> str:
    return f"striped-{layout.granularity}" if layout.kind == "striped" else layout.kind


def result_from_pairs(slash_pair: np.ndarray, vert_pair: np.ndarray, layout: Layout, vertical: str, unit: str,
                      pattern: VerticalSlashPattern) -> dict:
    """Schedule + metrics + diagnostics of one configuration from its per-(rank, owner) work."""
    W = schedule(slash_pair, vert_pair, vertical)
    cp, S, H = layout.cp_size, pattern.seq_len, len(head_lines(pattern))
    total = slash_pair.sum() + vert_pair.sum()
    res = {"layout": layout_name(layout), "cp": cp, "vertical": vertical, "unit": unit, **metrics(W, cp),
           "W": W.tolist(), "phases": [f"step {s}" for s in range(cp)] + (["columns"] if W.shape[1] > cp else []),
           "work_fraction_of_causal": float(total / (H * S * (S + 1) / 2)),
           "vertical_share": float(vert_pair.sum() / total) if total > 0 else 0.0}
    if vertical != "in-ring":
        res["columns_phase_imbalance"] = float(W[:, -1].max() / W[:, -1].mean()) if W[:, -1].sum() > 0 else 1.0
    return res


def flop_model(pattern: VerticalSlashPattern, layout: Layout, unit: str, vertical: str) -> dict:
    """The FLOP-model result of one configuration (work per cell, metrics, diagnostics)."""
    slash_pair, vert_pair = pair_work(Geometry(layout, pattern.seq_len), pattern, unit)
    return result_from_pairs(slash_pair, vert_pair, layout, vertical, unit, pattern)


# ============================================================================ GPU model
def _timer(device: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    """``run(fn, repeats, warmup)``: median milliseconds of ``fn`` on ``device`` (:func:`megatron_mtraining.bench.measure`)."""
    def run(fn, repeats: int, warmup: int) -> float:
        return measure(fn, device=device, warmup=warmup, repeats=max(1, repeats)).median_ms
    return run


def pick_kernels(choice: str, q: torch.Tensor):
    """``(name, forward_fn, backward_fn)`` with the signatures of ``ops.sparse_reference``."""
    if choice in ("auto", "triton"):
        try:
            from megatron_mtraining.ops import triton as tk
            if tk.triton_usable(q):
                return "triton", tk.sparse_attention_forward, tk.sparse_attention_backward
            if choice == "triton":
                raise SystemExit(f"error: Triton kernels cannot run on {q.device} / {q.dtype}")
        except Exception as e:          # kernels under development: fall back, say so
            if choice == "triton":
                raise SystemExit(f"error: megatron_mtraining.ops.triton not importable: {e!r}")
            print(f"note: Triton kernels unavailable ({e!r}); timing the torch sparse reference", flush=True)
    from megatron_mtraining.ops.sparse_reference import sparse_attention_backward, sparse_attention_forward
    return "torch-reference", sparse_attention_forward, sparse_attention_backward


def column_phase(steps, layout: Layout, rank: int, seq_len: int, k: torch.Tensor, v: torch.Tensor):
    """The out-of-ring column work of ``rank``: ``(StepIndices, k_cols, v_cols)``.

    ``k_cols``/``v_cols`` ``[b, n, hkv, d]`` hold the K/V rows of every column of this rank's steps
    (union over heads, ascending positions, zero-padded to a multiple of 64); each query tile lists,
    as indices into them, exactly the columns the converter put into its per-owner ring steps
    (:func:`~megatron_mtraining.patterns.convert.column_phase_indices`, as the ring's ``ColumnPhase``)."""
    from megatron_mtraining.patterns.convert import column_phase_indices, step_column_positions
    glob, valid = step_column_positions(steps, layout, seq_len)
    union = torch.unique(glob[valid])
    n = max(BLOCK, BLOCK * math.ceil(union.numel() / BLOCK))
    idx = column_phase_indices(steps, layout, seq_len, union)

    def gather(x):
        out = torch.zeros((x.shape[0], n, *x.shape[2:]), dtype=x.dtype, device=x.device)
        out[:, :union.numel()] = x[:, union]
        return out
    return idx, gather(k), gather(v)


def gpu_model(pattern: VerticalSlashPattern, layout: Layout, args) -> dict:
    """Time every (worker, ring step) kernel on one device; see the module docstring."""
    from megatron_mtraining.patterns.convert import convert_pattern

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available (use --device cpu for a tiny check)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    S, cp = pattern.seq_len, layout.cp_size
    H = pattern.num_heads                               # patterns here have batch 1 (files: B*H heads)
    if H % args.kv_heads:
        raise SystemExit(f"error: {H} query heads not divisible by --kv-heads {args.kv_heads}")
    if args.vertical == "deferred":
        raise SystemExit("error: --model gpu times in-ring and out-of-ring; 'deferred' is a FLOP-model schedule")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    q = torch.randn((1, S, H, args.head_dim), generator=gen, device=dev, dtype=dtype)
    k = torch.randn((1, S, args.kv_heads, args.head_dim), generator=gen, device=dev, dtype=dtype)
    v = torch.randn((1, S, args.kv_heads, args.head_dim), generator=gen, device=dev, dtype=dtype)
    pat = pattern.to(dev)
    if args.vertical == "out-of-ring" and not bool((pat.slash_mask()[..., 0]).all()):
        raise SystemExit("error: out-of-ring columns run unmasked; every head must select block diagonal 0")
    name, fwd, bwd = pick_kernels(args.kernel, q)
    scale = args.head_dim ** -0.5
    timeit = _timer(dev)
    kv = [(layout.shard(k, o, 1), layout.shard(v, o, 1)) for o in range(cp)]
    phases = cp + (1 if args.vertical == "out-of-ring" else 0)
    ms_f = np.zeros((cp, phases))
    ms_b = np.zeros((cp, phases))
    t0 = time.perf_counter()
    for r in range(cp):
        q_r = layout.shard(q, r, 1)
        dout = torch.randn(q_r.shape, generator=gen, device=dev, dtype=dtype)
        steps = convert_pattern(pat, layout, r)
        work = [(s, (r - s) % cp, steps[(r - s) % cp]) for s in range(cp)]
        if args.vertical == "out-of-ring":
            cidx, kc, vc = column_phase(steps, layout, r, S, k, v)
            work = [(s, o, without_columns(st)) for s, o, st in work] + [(cp, None, cidx)]
        for s, o, idx in work:
            if idx.is_empty():
                continue                                   # the ring skips it: 0 ms
            k_o, v_o = kv[o] if o is not None else (kc, vc)
            out, lse = fwd(q_r, k_o, v_o, idx, scale)
            delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
            lse = lse.float()
            ms_f[r, s] = timeit(lambda: fwd(q_r, k_o, v_o, idx, scale), args.repeats, args.warmup)
            ms_b[r, s] = timeit(lambda: bwd(dout, q_r, k_o, v_o, lse, delta, idx, scale), args.repeats, args.warmup)
        print(f"  worker {r}: fwd {ms_f[r].sum():.3f} ms, bwd {ms_b[r].sum():.3f} ms "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    W = ms_f + ms_b
    res = {"layout": layout_name(layout), "cp": cp, "vertical": args.vertical, "unit": "ms (fwd + bwd)",
           "kernel": name, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dtype": args.dtype, **metrics(W, cp), "W": W.tolist(), "W_fwd_ms": ms_f.tolist(), "W_bwd_ms": ms_b.tolist(),
           "phases": [f"step {s}" for s in range(cp)] + (["columns"] if phases > cp else []),
           "fwd": metrics(ms_f, cp), "bwd": metrics(ms_b, cp),
           "step_ms_fwd_max": ms_f[:, :cp].max(0).tolist(), "step_ms_bwd_max": ms_b[:, :cp].max(0).tolist()}
    if phases > cp:
        res.update(columns_ms_fwd_max=float(ms_f[:, cp].max()), columns_ms_bwd_max=float(ms_b[:, cp].max()))
    return res


# ============================================================================ output
def kv_bytes(pattern: VerticalSlashPattern, cp: int, kv_heads: int, head_dim: int, bytes_per_el: int = 2) -> dict:
    """Bytes of one ring step's K/V shard vs a one-time gather of the selected columns' K/V
    (per KV head the union of its query heads' columns)."""
    lines = head_lines(pattern)
    rep = max(1, len(lines) // kv_heads)
    union = sum(np.unique(np.concatenate([c for _, c in lines[g * rep:(g + 1) * rep]] + [np.zeros(0, np.int64)])).size
                for g in range(kv_heads))
    return {"kv_step_bytes": 2 * pattern.seq_len // cp * kv_heads * head_dim * bytes_per_el,
            "column_gather_bytes": 2 * union * head_dim * bytes_per_el}


def pattern_stats(pattern: VerticalSlashPattern) -> dict:
    lines = head_lines(pattern)
    return {"heads": len(lines), "seq_len": pattern.seq_len,
            "slash_per_head": [int(s.size) for s, _ in lines], "vertical_per_head": [int(c.size) for _, c in lines]}


def plot(results: List[dict], path: str, title: str, ncols: Optional[int] = None) -> None:
    """Heatmaps (workers x ring steps) of ``W / mean ring cell``, one panel per result, like
    MTraining Fig. 13. A columns phase (out-of-ring / deferred) is summarised in the title."""
    plt = pyplot()
    n = len(results)
    ncols = ncols or min(n, 4)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.4 * ncols, 3.2 * nrows), squeeze=False)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    for ax, res in zip(axes.ravel(), results):
        W = np.asarray(res["W"])
        cp = res["cp"]
        mean = W[:, :cp].mean()
        im = ax.imshow(W[:, :cp] / mean if mean > 0 else W[:, :cp], aspect="auto", cmap="viridis",
                       interpolation="nearest")
        head = f"{res['layout']} cp{cp} {res['vertical']}"
        if W.shape[1] > cp:
            head += f" (+cols {W[:, cp].max() / mean:.1f} cells)" if mean > 0 else ""
        ax.set_title(f"{head}\nworker {res['worker_imbalance']:.3f}  step {res['step_imbalance']:.2f}", fontsize=8)
        ax.set_xlabel("ring step", fontsize=7)
        ax.set_ylabel("worker", fontsize=7)
        ax.tick_params(labelsize=6)
        cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
        cb.formatter.set_useOffset(False)
        cb.update_ticks()
        cb.ax.tick_params(labelsize=6)
    fig.suptitle(title + " — work per cell / mean ring cell", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def row_text(r: dict) -> str:
    extra = f"  cols-phase {r['columns_phase_imbalance']:.3f}" if "columns_phase_imbalance" in r else ""
    return (f"{r['cp']:>4} | {r['layout']:<11} | {r['vertical']:<11} | {r['worker_imbalance']:>7.3f} | "
            f"{r['step_imbalance']:>7.3f} | {r['ring_time_over_ideal']:>7.3f} | {r['total_imbalance']:>7.3f} | "
            f"{r['work_fraction_of_causal']:>7.4f}{extra}")


HEADER = (f"{'cp':>4} | {'layout':<11} | {'vertical':<11} | {'worker':>7} | {'step':>7} | {'ring/id':>7} | "
          f"{'total':>7} | {'work/causal':>7}")


# ============================================================================ packed documents
def packed_lengths(args) -> Tuple[List[int], dict]:
    """The document lengths of the packed stream of ``args`` and a description of their source."""
    from megatron_mtraining.bench.packing import pack_lengths, parse_length_spec

    try:
        kind, vals = parse_length_spec(args.doc_lengths)
        source = {"doc_lengths": args.doc_lengths, "max_doc_len": args.max_doc_len}
        if kind == "corpus":
            from megatron_mtraining.data.corpus import default_data_dir
            from megatron_mtraining.training.data import document_lengths

            prefix = args.data_path or str(default_data_dir() / "megatron" / "books_text_document")
            vals = document_lengths(prefix).tolist()
            if not vals:
                raise ValueError(f"--data-path {prefix}: no documents")
            off = args.doc_offset % len(vals)
            vals = vals[off:] + vals[:off]
            source.update(data_path=prefix, corpus_documents=len(vals), doc_offset=args.doc_offset)
        docs = pack_lengths(vals, args.seq_len, args.max_doc_len)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    source.update(documents=len(docs), doc_len_min=min(docs), doc_len_max=max(docs))
    return docs, source


def packed_result(doc_lengths: List[int], seq_len: int, layout: Layout, unit: str) -> dict:
    """Metrics of the dense ring over packed documents on ``layout`` (one configuration)."""
    from megatron_mtraining.bench.packing import packed_pair_work, packed_tile_work

    work = packed_tile_work if unit == "tiles" else packed_pair_work
    pair = work(doc_lengths, seq_len, layout)
    unpacked = work([seq_len], seq_len, layout)
    W = by_step(pair)
    cp = layout.cp_size
    res = {"layout": layout_name(layout), "cp": cp, "vertical": "packed", "unit": unit, **metrics(W, cp),
           "W": W.tolist(), "phases": [f"step {s}" for s in range(cp)],
           "work_fraction_of_causal": float(pair.sum() / unpacked.sum()),
           "documents": len(doc_lengths)}
    um = metrics(by_step(unpacked), cp)
    res.update(unpacked_worker_imbalance=um["worker_imbalance"], unpacked_step_imbalance=um["step_imbalance"])
    return res


def packed_main(args, argv) -> int:
    t0 = time.perf_counter()
    args.seq_len = 131072 if args.seq_len is None else args.seq_len
    docs, source = packed_lengths(args)
    print(f"packed: {len(docs)} documents ({min(docs)}..{max(docs)} tokens) in {args.seq_len} tokens", flush=True)
    config = {k: v for k, v in vars(args).items() if k not in ("json", "png")}
    if args.sweep:
        layouts = [(cp, layout_from_spec(spec, cp)) for cp in (int(x) for x in args.cps.split(","))
                   for spec in args.layouts.split(",")]
    else:
        layouts = [(args.cp, Layout(args.layout, args.cp, args.granularity))]
    rows = []
    print(HEADER + " | unpacked worker")
    for cp, layout in layouts:
        try:
            r = packed_result(docs, args.seq_len, layout, args.unit)
        except ValueError as e:
            if not args.sweep:
                raise SystemExit(f"error: {e}") from None
            print(f"{cp:>4} | {layout_name(layout):<11} | skipped: {e}")
            continue
        rows.append(r)
        print(row_text(r) + f" | {r['unpacked_worker_imbalance']:>7.3f}", flush=True)
    result = {"config": config, "pattern_source": source, "rows": rows} if args.sweep else \
        {**rows[0], "config": config, "pattern_source": source}
    if args.png and rows:
        plot(rows, args.png, f"packed documents, seq {args.seq_len}, {args.unit}", ncols=len(rows))
    result["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        write_json(args.json, result_record(result, device="cpu", argv=argv))
        print(f"wrote {args.json}")
    return 0


# ============================================================================ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["flops", "gpu"], default="flops",
                    help="flops: CPU accounting of work per cell; gpu: time each cell's kernels on one device")
    ap.add_argument("--cp", type=int, default=32, help="CP size (number of workers / ring steps)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="global sequence length in tokens (default 524288; --pattern file: the file's)")
    ap.add_argument("--layout", choices=["striped", "zigzag", "contiguous"], default="striped")
    ap.add_argument("--granularity", type=int, default=64, help="striped chunk size in tokens (1, 64, 128, ...)")
    ap.add_argument("--unit", choices=UNITS, default="tiles", help="work unit of the FLOP model (see above)")
    ap.add_argument("--vertical", choices=VERTICAL_MODES, default="in-ring", help="where column work runs")
    pat = ap.add_argument_group("pattern")
    pat.add_argument("--pattern", choices=["dense", "synthetic", "file", "packed"], default="synthetic")
    pat.add_argument("--pattern-file", default=None, help="--pattern file: .npz/.pt pattern file (megatron_mtraining.patterns.io format)")
    pat.add_argument("--save-pattern", default=None, help="write the pattern used (.npz or .pt) and continue")
    pat.add_argument("--heads", type=int, default=16, help="query heads of dense/synthetic patterns")
    pat.add_argument("--seed", type=int, default=0)
    pat.add_argument("--sparsity", type=float, default=0.95, help="synthetic: target sparsity vs causal tiles")
    pat.add_argument("--sinks", type=int, default=64, help="synthetic: attention-sink tokens")
    pat.add_argument("--window-blocks", type=int, default=16, help="synthetic: minimum local window (64-token blocks)")
    pat.add_argument("--max-vertical", type=int, default=4096, help="synthetic: column cap per head")
    pk = ap.add_argument_group("packed documents (--pattern packed)")
    pk.add_argument("--doc-lengths", default="corpus", help="corpus | fixed:N | list:A,B,... (cycled)")
    pk.add_argument("--data-path", default=None,
                    help="--doc-lengths corpus: tokenized corpus prefix (default DATA/megatron/books_text_document)")
    pk.add_argument("--doc-offset", type=int, default=0, help="first corpus document used")
    pk.add_argument("--max-doc-len", type=int, default=None, help="split documents into pieces of at most N tokens")
    sw = ap.add_argument_group("sweep (FLOP model; --cps/--layouts/--verticals are refused without --sweep)")
    sw.add_argument("--sweep", action="store_true", help="table over --cps x --layouts x --verticals")
    sw.add_argument("--cps", default=None,
                    help=f"--sweep: comma list of CP sizes >= 1 (default {SWEEP_DEFAULTS['cps']})")
    sw.add_argument("--layouts", default=None,
                    help="--sweep: comma list of zigzag, contiguous, striped (= striped-64), striped-G with G >= 1 "
                         f"(default {SWEEP_DEFAULTS['layouts']})")
    sw.add_argument("--verticals", default=None,
                    help=f"--sweep: comma list of {', '.join(VERTICAL_MODES)} (default {SWEEP_DEFAULTS['verticals']}; "
                         "not with --pattern packed)")
    gpu = ap.add_argument_group("gpu model")
    gpu.add_argument("--device", default="cuda", help="cuda (H200 run) or cpu (tiny code-path check)")
    gpu.add_argument("--kernel", choices=["auto", "triton", "reference"], default="auto",
                     help="auto: Triton where usable, else the torch sparse reference")
    gpu.add_argument("--kv-heads", type=int, default=2, help="KV heads (GQA); also used for byte estimates")
    gpu.add_argument("--head-dim", type=int, default=128)
    gpu.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    gpu.add_argument("--repeats", type=int, default=5, help="timed runs per kernel (median)")
    gpu.add_argument("--warmup", type=int, default=2)
    out = ap.add_argument_group("output")
    out.add_argument("--json", default=None, help="write results (metrics, W per cell, config) to this file")
    out.add_argument("--png", default=None, help="draw workers x steps heatmaps to this file")
    return ap


def make_pattern(args) -> Tuple[VerticalSlashPattern, dict]:
    """The pattern the flags ask for and a description of its source."""
    if args.pattern == "file":
        try:
            pattern, meta = load_pattern(args.pattern_file)
        except ValueError as e:
            raise SystemExit(f"error: --pattern-file {e}") from None
        if args.seq_len is not None and pattern.seq_len != args.seq_len:
            raise SystemExit(f"error: {args.pattern_file} holds a pattern for seq_len {pattern.seq_len}, "
                             f"--seq-len is {args.seq_len}")
        return pattern, {"file": args.pattern_file, "meta": meta}
    args.seq_len = 524288 if args.seq_len is None else args.seq_len
    if args.pattern == "dense":
        return dense_pattern(args.seq_len, args.heads), {}
    cfg = SyntheticConfig(heads=args.heads, sparsity=args.sparsity, sinks=args.sinks, window=args.window_blocks,
                          max_vertical=args.max_vertical, seed=args.seed)
    return synthetic_pattern(args.seq_len, cfg), {"synthetic": asdict(cfg)}


def _int_list(ap: argparse.ArgumentParser, flag: str, text: str) -> List[int]:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        ap.error(f"{flag} {text!r}: expected a comma list of integers >= 1")
    return vals


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse bad values and combinations before any work (``ap.error``: one line naming the flag,
    exit 2) and fill in the sweep defaults. Cheap checks first; the corpus file last."""
    for flag, val, lo in (("--cp", args.cp, 1), ("--granularity", args.granularity, 1), ("--heads", args.heads, 1),
                          ("--sinks", args.sinks, 0), ("--window-blocks", args.window_blocks, 1),
                          ("--max-vertical", args.max_vertical, 0), ("--doc-offset", args.doc_offset, 0),
                          ("--kv-heads", args.kv_heads, 1), ("--head-dim", args.head_dim, 1),
                          ("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0)):
        if val < lo:
            ap.error(f"{flag} must be >= {lo}, got {val}")
    if not 0.0 <= args.sparsity <= 1.0:                 # NaN fails too
        ap.error(f"--sparsity must be in [0, 1], got {args.sparsity}")
    if args.max_doc_len is not None and args.max_doc_len < 1:
        ap.error(f"--max-doc-len must be >= 1, got {args.max_doc_len}")
    if args.seq_len is not None and (args.seq_len < BLOCK or args.seq_len % BLOCK):
        ap.error(f"--seq-len must be a positive multiple of {BLOCK}, got {args.seq_len}")
    if args.model != "flops" and (args.sweep or args.pattern == "packed"):
        ap.error(f"{'--sweep' if args.sweep else '--pattern packed'} uses the FLOP model (--model flops)")
    if args.save_pattern is not None and not args.save_pattern.endswith((".npz", ".pt")):
        ap.error(f"--save-pattern {args.save_pattern}: the name must end in .npz or .pt (numpy appends .npz to "
                 "any other name, so --pattern-file could not read it back under it)")
    if args.model == "gpu":
        from megatron_mtraining.bench.cli import checked_device
        from megatron_mtraining.ops.backends import TRITON_HEAD_DIMS

        checked_device(ap, args.device)
        if args.kernel != "reference" and args.head_dim not in TRITON_HEAD_DIMS:
            ap.error(f"--head-dim {args.head_dim}: --kernel {args.kernel} runs the Triton kernels, which take "
                     f"head_dim {', '.join(map(str, TRITON_HEAD_DIMS))} (--kernel reference takes any)")
    if args.model == "gpu" and args.vertical == "deferred":
        ap.error("--vertical deferred: --model gpu times in-ring and out-of-ring; 'deferred' is a FLOP-model schedule")
    if args.pattern == "file":
        if not args.pattern_file:
            ap.error("--pattern file needs --pattern-file PATH")
        if not os.path.isfile(args.pattern_file):
            ap.error(f"--pattern-file: file not found: {args.pattern_file}")
    elif args.pattern_file is not None:
        ap.error(f"--pattern-file applies to --pattern file only (got --pattern {args.pattern})")
    given = [f"--{k}" for k in SWEEP_DEFAULTS if getattr(args, k) is not None]
    if given and not args.sweep:
        ap.error(f"{'/'.join(given)} {'apply' if len(given) > 1 else 'applies'} to --sweep only (one configuration: "
                 "--cp, --layout/--granularity, --vertical)")
    if args.pattern == "packed" and args.verticals is not None:
        ap.error("--verticals does not apply to --pattern packed (dense attention within documents, no columns)")
    for k, default in SWEEP_DEFAULTS.items():
        setattr(args, k, default if getattr(args, k) is None else getattr(args, k))
    if args.sweep:
        _int_list(ap, "--cps", args.cps)
        for spec in args.layouts.split(","):
            try:
                layout_from_spec(spec, 1)
            except (ValueError, TypeError):
                ap.error(f"--layouts: {spec!r} is not zigzag, contiguous, striped or striped-G with an integer G >= 1")
        for mode in args.verticals.split(","):
            if mode not in VERTICAL_MODES:
                ap.error(f"--verticals: {mode!r} is not one of {', '.join(VERTICAL_MODES)}")
    else:
        seq_len = args.seq_len                          # the defaults of packed_main / make_pattern
        if seq_len is None and args.pattern != "file":
            seq_len = 131072 if args.pattern == "packed" else 524288
        if seq_len is not None:
            try:
                Layout(args.layout, args.cp, args.granularity).check_seq_len(seq_len)
            except ValueError as e:
                ap.error(f"--seq-len {seq_len} with --cp {args.cp}, --layout {args.layout}, --granularity "
                         f"{args.granularity}: {e}")
    if args.pattern == "packed":
        from megatron_mtraining.bench.packing import parse_length_spec

        try:
            kind, _ = parse_length_spec(args.doc_lengths)
        except ValueError as e:
            ap.error(str(e))
        if kind == "corpus":                            # the file system, after the flags
            from megatron_mtraining.data.corpus import default_data_dir

            prefix = args.data_path or str(default_data_dir() / "megatron" / "books_text_document")
            for ext in (".idx", ".bin"):
                if not os.path.isfile(prefix + ext):
                    ap.error(f"--data-path: {prefix}{ext} not found (a tokenized corpus prefix, e.g. "
                             "data/megatron/books_text_document; or --doc-lengths fixed:N / list:A,B,...)")


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    if args.pattern == "packed":
        return packed_main(args, argv)
    t0 = time.perf_counter()
    pattern, source = make_pattern(args)
    if args.save_pattern:
        save_pattern(args.save_pattern, pattern, {"source": args.pattern, **source})
    t_pat = time.perf_counter() - t0
    pstats = pattern_stats(pattern)
    config = {k: v for k, v in vars(args).items() if k not in ("json", "png")}
    config["seq_len"] = pattern.seq_len
    print(f"pattern {args.pattern}: {pstats['heads']} heads, seq {pattern.seq_len}, mean slash "
          f"{np.mean(pstats['slash_per_head']):.0f} / vertical {np.mean(pstats['vertical_per_head']):.0f} per head "
          f"({t_pat:.2f} s)", flush=True)

    if args.sweep:
        cps = [int(x) for x in args.cps.split(",")]
        specs = args.layouts.split(",")
        modes = args.verticals.split(",")
        rows = []
        print(HEADER)
        for cp in cps:
            for spec in specs:
                layout = layout_from_spec(spec, cp)
                t1 = time.perf_counter()
                try:
                    geo = Geometry(layout, pattern.seq_len)
                    slash_pair, vert_pair = pair_work(geo, pattern, args.unit)
                except ValueError as e:
                    print(f"{cp:>4} | {spec:<11} | skipped: {e}")
                    continue
                for mode in modes:
                    r = result_from_pairs(slash_pair, vert_pair, layout, mode, args.unit, pattern)
                    rows.append(r)
                    print(row_text(r) + f"  ({time.perf_counter() - t1:.2f} s)", flush=True)
        for cp in cps:
            z = [r for r in rows if r["cp"] == cp and r["layout"] == "zigzag" and r["vertical"] == "in-ring"]
            for r in rows:
                if z and r["cp"] == cp:
                    r["step_imbalance_vs_zigzag"] = z[0]["step_imbalance"] / r["step_imbalance"]
        result = {"config": config, "pattern": pstats, "pattern_source": source,
                  "bytes": {str(cp): kv_bytes(pattern, cp, args.kv_heads, args.head_dim) for cp in cps}, "rows": rows}
        if args.png:
            plot(rows, args.png, f"{args.pattern} pattern, seq {pattern.seq_len}, unit {args.unit}",
                 ncols=len(specs) * len(modes))
    else:
        layout = Layout(args.layout, args.cp, args.granularity)
        if args.pattern == "file":                      # its length is known only now (others: check_args)
            try:
                layout.check_seq_len(pattern.seq_len)
            except ValueError as e:
                ap.error(f"--pattern-file {args.pattern_file} (seq_len {pattern.seq_len}) with --cp {args.cp}, "
                         f"--layout {args.layout}, --granularity {args.granularity}: {e}")
        flops = flop_model(pattern, layout, args.unit, args.vertical)
        if args.model == "flops":
            result = flops
        else:
            result = gpu_model(pattern, layout, args)
            result["flop_model"] = {k: flops[k] for k in ("W", "worker_imbalance", "step_imbalance",
                                                         "ring_time_over_ideal", "total_imbalance", "unit")}
        result.update(config=config, pattern=pstats, pattern_source=source,
                      bytes=kv_bytes(pattern, args.cp, args.kv_heads, args.head_dim))
        result.setdefault("work_fraction_of_causal", flops["work_fraction_of_causal"])
        print(HEADER)
        print(row_text(result))
        if args.model == "gpu":
            print(f"kernel {result['kernel']}: fwd worker {result['fwd']['worker_imbalance']:.3f} step "
                  f"{result['fwd']['step_imbalance']:.3f}; bwd worker {result['bwd']['worker_imbalance']:.3f} step "
                  f"{result['bwd']['step_imbalance']:.3f}; ring fwd+bwd {result['ring_time']:.2f} ms")
        if args.png:
            plot([result], args.png, f"{args.pattern} pattern, seq {pattern.seq_len}, {result['unit']}")
    result["elapsed_s"] = time.perf_counter() - t0
    print(f"done in {result['elapsed_s']:.2f} s", flush=True)
    if args.json:
        write_json(args.json, result_record(result, device=args.device if args.model == "gpu" else "cpu", argv=argv))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

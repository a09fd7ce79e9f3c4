"""Vertical-slash pattern files: save and load estimated or synthetic patterns (MTraining §3.2).

A pattern file holds one :class:`~megatron_mtraining.patterns.estimator.VerticalSlashPattern` with
its rows flattened (``[B, H, n]`` is stored as ``B * H`` rows). Format (``.npz``, compressed; or
``.pt``, ``torch.save`` of the same dict with tensors):

* ``seq_len``: int, global sequence length in tokens;
* ``block_size``: int, the slash block size in tokens (64: the kernels' tile size);
* ``slash``: int64 ``[rows, ns]``, block-diagonal offsets ``d = query block - key block >= 0``,
  ``-1`` padded;
* ``vertical``: int64 ``[rows, nv]``, global key positions (tokens), ``-1`` padded;
* ``meta``: JSON string (optional): provenance (model, layers, rows per layer, command).

``tools/pattern_recall.py --save-pattern`` writes estimator patterns on real text in this format
(rows in layer, sample, head order); ``tools/imbalance.py --pattern file`` and
``tools/bench_attention.py --pattern-file`` read them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .estimator import VerticalSlashPattern

__all__ = ["BLOCK", "pattern_from_arrays", "head_lines", "save_pattern", "load_pattern"]

BLOCK = 64


def _pad(rows: Sequence[np.ndarray]) -> Tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(r.size for r in rows))
    out = torch.full((1, len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[0, i, :r.size] = torch.from_numpy(r)
    return out, torch.tensor([[r.size for r in rows]], dtype=torch.long)


def pattern_from_arrays(seq_len: int, slash: Sequence[np.ndarray],
                        vertical: Sequence[np.ndarray]) -> VerticalSlashPattern:
    """A batch-1 :class:`VerticalSlashPattern` from per-head line arrays.

    Args:
        seq_len: global sequence length in tokens (a multiple of 64).
        slash: per query head, block-diagonal offsets in ``[0, seq_len / 64)`` (any integer dtype;
            duplicates are removed, the result is ascending).
        vertical: per query head, key positions in ``[0, seq_len)`` (tokens).

    Returns:
        A pattern with ``slash``/``vertical`` ``[1, H, n]`` int64 (``-1`` padded) and their counts.

    Raises:
        ValueError: an entry is out of range.
    """
    s, sc = _pad([np.unique(np.asarray(x, dtype=np.int64)) for x in slash])
    v, vc = _pad([np.unique(np.asarray(x, dtype=np.int64)) for x in vertical])
    nb = seq_len // BLOCK
    if bool((s >= nb).any() or (v >= seq_len).any() or (s < -1).any() or (v < -1).any()):
        raise ValueError("pattern entries out of range (slash offsets in [0, S/64), vertical in [0, S))")
    return VerticalSlashPattern(seq_len, BLOCK, s, sc, v, vc)


def head_lines(pattern: VerticalSlashPattern) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per (batch, head) row of ``pattern``: ``(slash offsets, vertical positions)`` as int64 numpy arrays."""
    s = pattern.slash.reshape(-1, pattern.slash.shape[-1]).cpu().numpy()
    v = pattern.vertical.reshape(-1, pattern.vertical.shape[-1]).cpu().numpy()
    return [(a[a >= 0], b[b >= 0]) for a, b in zip(s, v)]


def save_pattern(path: str, pattern: VerticalSlashPattern, meta: Optional[dict] = None) -> None:
    """Write ``pattern`` (and ``meta``, any JSON-serialisable dict) to ``path`` in the format of this
    module: ``.pt`` names get ``torch.save``, any other name ``numpy.savez_compressed`` (which appends
    ``.npz`` to a name without it)."""
    s = pattern.slash.reshape(-1, pattern.slash.shape[-1]).cpu()
    v = pattern.vertical.reshape(-1, pattern.vertical.shape[-1]).cpu()
    m = json.dumps(meta or {})
    if str(path).endswith(".pt"):
        torch.save({"seq_len": pattern.seq_len, "block_size": pattern.block_size, "slash": s, "vertical": v,
                    "meta": m}, path)
    else:
        np.savez_compressed(path, seq_len=pattern.seq_len, block_size=pattern.block_size, slash=s.numpy(),
                            vertical=v.numpy(), meta=m)


def load_pattern(path: str) -> Tuple[VerticalSlashPattern, dict]:
    """Read a file written by :func:`save_pattern`.

    Returns:
        ``(pattern, meta)``: the pattern with batch 1 and one head per stored row (on the CPU), and
        the provenance dict (``{}`` when the file has none).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a pattern file (unreadable, or without the ``seq_len`` / ``block_size`` / ``slash`` /
            ``vertical`` entries), ``block_size`` is not 64, or an entry is out of range.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"pattern file not found: {path}")
    try:
        if str(path).endswith(".pt"):
            d = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(d, dict):
                raise TypeError(f"holds a {type(d).__name__}, not a dict of arrays")
            get = lambda k: d[k].numpy() if isinstance(d[k], torch.Tensor) else np.asarray(d[k])  # noqa: E731
            meta = json.loads(d.get("meta", "{}"))
        else:
            z = np.load(path)
            if not hasattr(z, "files"):
                raise TypeError("holds one array, not the arrays of a pattern (.npz)")
            get = lambda k: z[k]  # noqa: E731
            meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
        bs = int(get("block_size"))
        seq_len = int(get("seq_len"))
        s, v = get("slash"), get("vertical")
    except Exception as e:                  # torch / numpy / pickle / zip errors of a file that is not one
        raise ValueError(f"{path}: not a pattern file written by save_pattern (tools/pattern_recall.py "
                         f"--save-pattern): {type(e).__name__}: {e}") from None
    if bs != BLOCK:
        raise ValueError(f"{path}: block_size {bs}; pattern files use the kernels' {BLOCK}-token blocks")
    s = s.reshape(-1, s.shape[-1])
    v = v.reshape(-1, v.shape[-1])
    return pattern_from_arrays(seq_len, [r[r >= 0] for r in s], [r[r >= 0] for r in v]), meta

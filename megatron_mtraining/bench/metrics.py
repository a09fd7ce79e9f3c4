"""Reading the trainer's metrics file (``--metrics-file``: one JSON object per logged iteration, with at
least ``iteration`` and ``lm_loss``; see the training guide for the other keys)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

__all__ = ["read_metrics_rows", "read_metrics"]


def read_metrics_rows(path: Union[str, Path], flag: str = "--loss-curves") -> dict[int, dict]:
    """``{iteration: row}`` of a metrics file (blank lines ignored); the last row of a repeated
    iteration wins (a run killed after logging it, before its checkpoint).

    Args:
        path: the metrics file.
        flag: the command-line flag that named the file, for the error message.

    Raises:
        ValueError: a line that is not JSON with an integer ``iteration`` and a numeric ``lm_loss``
            (naming the flag, the file and the line).
    """
    rows: dict[int, dict] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if isinstance(rec["lm_loss"], bool) or not isinstance(rec["lm_loss"], (int, float)):
                raise TypeError(f"lm_loss {rec['lm_loss']!r} is not a number")
            rows[int(rec["iteration"])] = rec
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{flag} {path}, line {n}: not a pretrain_gpt.py metrics line ({e})") from None
    return rows


def read_metrics(path: Union[str, Path], flag: str = "--loss-curves") -> tuple[list[int], list[float]]:
    """``(iterations ascending, lm_loss)`` of a metrics file (:func:`read_metrics_rows`)."""
    rows = read_metrics_rows(path, flag)
    its = sorted(rows)
    return its, [float(rows[i]["lm_loss"]) for i in its]

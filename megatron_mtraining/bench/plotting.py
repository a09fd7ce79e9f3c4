"""Plotting for the tools: one matplotlib set-up (non-interactive Agg backend), imported on first use.

matplotlib is an optional dependency (``pip install .[test]`` has it); nothing here imports it
until a figure is drawn, so the tools run without it when no plot is asked for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence, Union

__all__ = ["pyplot", "save_figure", "draw_niah_grid"]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display).

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Union[str, os.PathLike], dpi: int = 120) -> None:
    """Save ``fig`` to ``path`` (format from the suffix; parent directories created) and close it."""
    plt = pyplot()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def draw_niah_grid(ax: Any, cells: Sequence[dict], lengths: Sequence[int], depths: Sequence[int], key: str):
    """Needle-in-a-haystack heat map of ``cell[key]`` (a score 0-100) on the matplotlib axes ``ax``:
    rows = context lengths (tokens), columns = needle depths (%), each cell labelled; a (length,
    depth) without a cell is blank and labelled "not run". Returns the image (for a colour bar)."""
    import numpy as np

    by = {(c["length"], c["depth"]): c[key] for c in cells}
    grid = np.array([[by.get((n, dd), np.nan) for dd in depths] for n in lengths], dtype=float)
    im = ax.imshow(np.ma.masked_invalid(grid), vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        ax.text(j, i, "not run" if np.isnan(v) else (f"{v:.0f}" if v >= 10 else f"{v:.1f}"),
                ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), [f"{x}%" for x in depths])
    ax.set_yticks(range(len(lengths)), [str(x) for x in lengths])
    return im

"""Plotting for the tools: one matplotlib set-up (non-interactive Agg backend), imported on first use.

matplotlib is an optional dependency (``pip install .[test]`` has it); nothing here imports it
until a figure is drawn, so the tools run without it when no plot is asked for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

__all__ = ["pyplot", "save_figure"]


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

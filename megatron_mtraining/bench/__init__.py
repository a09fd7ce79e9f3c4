"""Shared base of the benchmark and evaluation tools (``tools/``).

* :mod:`.timer` — :func:`measure`, the one timer (CUDA events / wall clock, warm-up, median);
* :mod:`.speed` — :func:`time_forward_backward` (one training step of an attention function: forward and
  backward), :func:`compare_speed` (sparse against dense: :class:`SpeedComparison`, ``speedup``);
* :mod:`.record` — :func:`environment` (GPU, clocks, versions, git commit, date, command line),
  :func:`result_record` and :func:`write_json` (strict JSON, atomic);
* :mod:`.plotting` — :func:`pyplot` (matplotlib on Agg, imported lazily), :func:`save_figure`,
  :func:`draw_niah_grid`;
* :mod:`.metrics` — :func:`read_metrics_rows`, :func:`read_metrics` (the trainer's metrics file);
* :mod:`.inputs` — :func:`structured_qkv` (synthetic vertical-slash inputs), :func:`kept_fraction`;
* :mod:`.packing` — packed-document streams (:func:`pack_lengths`) and their work per (worker, ring step).

Imports only torch, the standard library and the package's layers up to the kernels (``layout``,
``patterns``, ``ops``); never ``ring``, ``megatron`` or ``training``.
"""

from .inputs import QWEN25_3B_LAYER_FLAGS, kept_fraction, structured_qkv
from .metrics import read_metrics, read_metrics_rows
from .plotting import draw_niah_grid, pyplot, save_figure
from .record import environment, result_record, to_jsonable, write_json
from .speed import SpeedComparison, compare_speed, time_forward_backward
from .timer import Timing, measure

__all__ = ["Timing", "measure", "SpeedComparison", "compare_speed", "time_forward_backward", "environment",
           "result_record", "to_jsonable", "write_json", "pyplot", "save_figure", "draw_niah_grid",
           "read_metrics_rows", "read_metrics", "structured_qkv", "kept_fraction", "QWEN25_3B_LAYER_FLAGS"]

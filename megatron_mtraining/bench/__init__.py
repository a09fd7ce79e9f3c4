"""Shared base of the benchmark and evaluation tools (``tools/``).

* :mod:`.timer` — :func:`measure`, the one timer (CUDA events / wall clock, warm-up, median);
* :mod:`.record` — :func:`environment` (GPU, clocks, versions, git commit, date, command line),
  :func:`result_record` and :func:`write_json` (strict JSON, atomic);
* :mod:`.plotting` — :func:`pyplot` (matplotlib on Agg, imported lazily) and :func:`save_figure`;
* :mod:`.inputs` — :func:`structured_qkv` (synthetic vertical-slash inputs), :func:`kept_fraction`.

Imports only torch, the standard library and the package's layers up to the kernels (``layout``,
``patterns``, ``ops``); never ``ring``, ``megatron`` or ``training``.
"""

from .inputs import kept_fraction, structured_qkv
from .plotting import pyplot, save_figure
from .record import environment, result_record, to_jsonable, write_json
from .timer import Timing, measure

__all__ = ["Timing", "measure", "environment", "result_record", "to_jsonable", "write_json", "pyplot", "save_figure",
           "structured_qkv", "kept_fraction"]

"""Result files of the benchmark and evaluation tools: one record layout, one strict JSON writer.

A result file is a JSON object: the tool's own keys (``rows``, ``runs``, ``config``, ...) and a
``meta`` object (:func:`environment`) saying where, when and how the numbers were made::

    {"meta": {"tool": "bench_attention", "date": "2026-01-31", "timestamp_utc": "2026-01-31T12:00:00Z",
              "command": "python tools/bench_attention.py --json out.json", "argv": ["--json", "out.json"],
              "git_commit": "c8b2299...", "git_dirty": false, "host": "...", "python": "3.11.9",
              "torch": "2.13.0", "triton": "3.5.0", "megatron_core": "0.16.1", "cuda": "12.8",
              "device": "NVIDIA H200", "gpu": {"name": ..., "sm_clock_mhz": ..., "max_sm_clock_mhz": ...,
              "mem_clock_mhz": ..., "power_limit_w": ..., "driver": ...}},
     ...the tool's keys...}

``git_commit`` is ``git rev-parse HEAD`` of the checkout, or, in a copy of the tree without its
``.git`` folder, the value of the environment variable ``MTRAINING_GIT_COMMIT`` (else ``null``).

:func:`write_json` writes strict JSON (RFC 8259): NaN and infinities become ``null``; numpy and
torch scalars and arrays, tuples, paths, dataclasses and ``argparse.Namespace`` are converted;
anything else is a ``TypeError`` naming its key. Files are replaced atomically.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Sequence, Union

__all__ = ["environment", "result_record", "to_jsonable", "write_json"]

_REPO = Path(__file__).resolve().parents[2]


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _run(cmd: Sequence[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        p = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def _git() -> dict:
    commit = _run(["git", "rev-parse", "HEAD"], cwd=_REPO)
    if commit is None:
        # a copy of the tree without its .git folder: the commit it was taken from, if the caller says
        given = os.environ.get("MTRAINING_GIT_COMMIT") or None
        return {"git_commit": given, "git_dirty": None}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO)
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


@functools.lru_cache(maxsize=None)
def _gpu(index: int) -> dict:
    """GPU name, current and maximum clocks, power limit and driver (``nvidia-smi``, when present)."""
    fields = ("name", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.limit", "driver_version")
    keys = ("name", "sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz", "power_limit_w", "driver")
    out = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", str(index)])
    if not out:
        return {}
    vals = [v.strip() for v in out.splitlines()[0].split(",")]
    res = {}
    for k, v in zip(keys, vals):
        try:
            res[k] = v if k in ("name", "driver") else float(v)
        except ValueError:
            res[k] = None
    return res


def environment(device: Any = None, argv: Optional[Sequence[str]] = None, tool: Optional[str] = None) -> dict:
    """Metadata of this run for a result file (see the module docstring for the keys).

    Args:
        device: the device the numbers were measured on (``torch.device`` or string); default:
            the current CUDA device when CUDA is available, else ``cpu``.
        argv: the tool's arguments (default ``sys.argv[1:]``); ``command`` is the full command line.
        tool: the tool's name (default: the script's file name without ``.py``).
    """
    import torch

    from ..common import cuda_index

    args = list(sys.argv[1:] if argv is None else argv)
    script = sys.argv[0] if sys.argv and sys.argv[0] else "python"
    now = _dt.datetime.now(_dt.timezone.utc)
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    meta = {"tool": tool or Path(script).stem, "date": now.strftime("%Y-%m-%d"),
            "timestamp_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": shlex.join([Path(sys.executable).name, script, *args]), "argv": args, **_git(),
            "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "triton": _version("triton"), "megatron_core": _version("megatron-core"), "cuda": torch.version.cuda}
    if dev.type == "cuda" and torch.cuda.is_available():
        index = cuda_index(dev)
        meta["device"] = torch.cuda.get_device_name(index)
        meta["gpu"] = {"name": meta["device"], **_gpu(index)}
    else:
        meta["device"] = dev.type
    return meta


def result_record(payload: dict, *, device: Any = None, argv: Optional[Sequence[str]] = None,
                  tool: Optional[str] = None) -> dict:
    """``payload`` with a ``meta`` key (:func:`environment`) first; keys of ``payload["meta"]``, if
    any, override the environment's."""
    rest = {k: v for k, v in payload.items() if k != "meta"}
    return {"meta": {**environment(device, argv, tool), **payload.get("meta", {})}, **rest}


def to_jsonable(obj: Any, where: str = "$") -> Any:
    """``obj`` as plain JSON values (see the module docstring); ``where`` names the position in errors."""
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj) if isinstance(obj, (set, frozenset)) else obj
        return [to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(items)]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj), where)
    if type(obj).__name__ == "Namespace":                  # argparse.Namespace
        return to_jsonable(vars(obj), where)
    mod = type(obj).__module__.split(".")[0]
    if mod == "numpy":
        if hasattr(obj, "tolist"):
            return to_jsonable(obj.tolist(), where)
    if mod == "torch":
        import torch

        if isinstance(obj, torch.Tensor):
            return to_jsonable(obj.detach().cpu().tolist(), where)
        if isinstance(obj, (torch.dtype, torch.device)):
            return str(obj)
    raise TypeError(f"{where}: {type(obj).__name__} is not JSON-serialisable")


def write_json(path: Union[str, os.PathLike], obj: Any, indent: Optional[int] = 1) -> None:
    """Write ``obj`` to ``path`` as strict JSON (:func:`to_jsonable`), atomically (a temporary file in
    the same directory, then ``os.replace``); creates missing parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_jsonable(obj), indent=indent, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

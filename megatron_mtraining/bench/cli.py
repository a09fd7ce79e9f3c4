"""Argument types shared by the tools' command lines (``argparse`` ``type=`` callables): a bad value is an
argparse error naming the flag (``error: argument --heads: must be an integer >= 1, got '0'``), not a
traceback later or a silent default."""

from __future__ import annotations

import argparse
import math
import os

__all__ = ["positive_int", "nonnegative_int", "positive_float", "int_list", "checked_device", "check_seq_len",
           "check_output_dir", "check_heads", "number_list"]


def _int_at_least(low: int):
    """A type for an int ``>= low``."""
    def parse(text: str) -> int:
        try:
            val = int(text)
        except ValueError:
            val = low - 1
        if val < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return val

    return parse


#: an int ``>= 1``
positive_int = _int_at_least(1)
#: an int ``>= 0``
nonnegative_int = _int_at_least(0)


def positive_float(text: str) -> float:
    """A finite float ``> 0``."""
    try:
        val = float(text)
    except ValueError:
        val = float("nan")
    if not (math.isfinite(val) and val > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return val


def int_list(multiple_of: int = 1):
    """A type for a comma-separated list of positive ints, each a multiple of ``multiple_of``."""
    def parse(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            vals = []
        if not vals or any(v < 1 or v % multiple_of for v in vals):
            what = "positive integers" + (f", multiples of {multiple_of}" if multiple_of > 1 else "")
            raise argparse.ArgumentTypeError(f"must be comma-separated {what}, got {text!r}")
        return vals

    return parse


def checked_device(ap: argparse.ArgumentParser, text: str, flag: str = "--device"):
    """``torch.device(text)`` for a benchmark, or ``ap.error`` (exit 2) naming ``flag``: the device must
    parse, be a CPU or CUDA device, and CUDA must be available for a CUDA device."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError) as e:
        ap.error(f"{flag} {text}: {e}")
    if dev.type not in ("cpu", "cuda"):
        ap.error(f"{flag} {text}: cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"{flag} {text}: no CUDA device here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        ap.error(f"{flag} {text}: there are {torch.cuda.device_count()} CUDA devices here")
    return dev


def check_seq_len(ap: argparse.ArgumentParser, flag: str, layout, seq_len: int) -> None:
    """``ap.error`` (exit 2) naming ``flag`` when ``layout`` (a :class:`~megatron_mtraining.layout.Layout`)
    cannot split ``seq_len`` tokens (its :meth:`check_seq_len` message follows the flag)."""
    try:
        layout.check_seq_len(seq_len)
    except ValueError as e:
        ap.error(f"{flag}: {e}")


def check_output_dir(ap: argparse.ArgumentParser, flag: str, path) -> None:
    """``ap.error`` (exit 2) naming ``flag`` when the directory an output file ``path`` goes to does not exist
    (``None``: no output, nothing to check)."""
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        ap.error(f"{flag} {path}: directory not found")


def check_heads(ap: argparse.ArgumentParser, heads: int, kv_heads: int) -> None:
    """``ap.error`` (exit 2) unless ``--heads`` and ``--kv-heads`` are >= 1 and ``heads`` is a multiple of
    ``kv_heads`` (GQA)."""
    for flag, val in (("--heads", heads), ("--kv-heads", kv_heads)):
        if val < 1:
            ap.error(f"{flag} must be >= 1, got {val}")
    if heads % kv_heads:
        ap.error(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")


def number_list(ap: argparse.ArgumentParser, flag: str, text: str, kind=int) -> list:
    """The comma-separated values of ``flag`` as ``kind`` (``int`` or ``float``), or ``ap.error`` (exit 2)
    naming the flag (for a string flag checked after parsing; :func:`int_list` is the ``type=`` form)."""
    try:
        vals = [kind(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if not vals:
        ap.error(f"{flag} {text!r}: a comma-separated list of {'integers' if kind is int else 'numbers'} expected")
    return vals

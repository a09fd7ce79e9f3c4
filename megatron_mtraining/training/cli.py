"""Command line of the trainer: :mod:`megatron_mtraining.megatron.args` (Megatron-LM flag names) with
the trainer's own ``--help`` texts. Imports no megatron.core (fast ``--help`` and argument errors)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from megatron_mtraining.megatron.args import ArgumentValidationError
from megatron_mtraining.megatron.args import build_parser as _build_args_parser
from megatron_mtraining.megatron.args import validate_args

from .metrics import METRICS_FILE_HELP

__all__ = ["build_parser", "parse_args"]

_HELP = {"--metrics-file": METRICS_FILE_HELP}


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser (``megatron_mtraining.megatron.args.build_parser`` with the help
    texts of the trainer-owned flags, e.g. ``--metrics-file``'s file policy)."""
    p = _build_args_parser()
    for action in p._actions:
        for flag in action.option_strings:
            if flag in _HELP:
                action.help = _HELP[flag]
    return p


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate; on a bad command line print ``pretrain_gpt.py: error: ...`` and exit(2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args, world_size=world_size)
    except ArgumentValidationError as e:
        parser.error(str(e))
    return args

"""Glue for Megatron-LM's ``pretrain_gpt.py`` / ``gpt_builders.py`` (``patches/megatron-lm-core_v0.16.1.patch``).

The patch adds two flags through an ``extra_args_provider`` and calls four functions of this
package; everything else stays Megatron-LM's:

* ``--cp-attention {te,mtraining}`` (default ``te``: Megatron-LM unchanged) and
  ``--mtraining-config FILE`` (a YAML file, see :mod:`megatron_mtraining.config`; loaded and
  checked while the command line is parsed, so a bad file is an argparse error naming the key).
* ``gpt_builder``: ``replace_core_attention(spec, mtraining_plan(args))`` and, after
  ``GPTModel(...)``, ``install_layout_rope(model, mtraining_plan(args))``.
* ``get_batch``: ``get_batch_on_this_cp_rank_striped(batch, mtraining_plan(args))`` instead of
  Megatron's zigzag ``get_batch_on_this_cp_rank``; with ``--reset-attention-mask`` its
  ``packed_seq_params`` (the documents, from the EOD tokens) go to the model's forward.

``--reset-attention-mask`` (attention inside documents), ``--reset-position-ids`` (RoPE positions
restart per document, from the dataset's ``position_ids``) and ``--eod-mask-loss`` (the dataset's
loss mask) pass through with the dense pattern; the EOD token is Megatron-LM's tokenizer's.

:func:`mtraining_config_from_args` applies the front-door rules shared with
``examples/pretrain_gpt.py`` (:func:`megatron_mtraining.plan.config_from_args`): the Megatron-LM
arguments the backend cannot serve (attention dropout, ``--reset-attention-mask`` with the sparse
pattern, a dataloader attention mask, MTP, MLA, yarn/mrope, hybrid CP, SFT packing) and the config against the run (sequence length, CP size,
hierarchical sizes); each error names the flag or config key. :func:`mtraining_plan` resolves the
run's :class:`~megatron_mtraining.plan.CPPlan` once.

Only ``argparse`` and :mod:`megatron_mtraining.config` are imported at module level.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from megatron_mtraining.config import MTrainingConfig, load_mtraining_config
from megatron_mtraining.layout import Layout

__all__ = [
    "add_mtraining_args",
    "mtraining_args_provider",
    "mtraining_enabled",
    "mtraining_config_from_args",
    "mtraining_layout",
    "mtraining_plan",
]

CP_ATTENTION_CHOICES = ("te", "mtraining")


def _config_file(value: str) -> str:
    """argparse ``type=`` for ``--mtraining-config``: load now, so errors surface at parse time."""
    try:
        load_mtraining_config(value)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_mtraining_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--cp-attention`` and ``--mtraining-config`` to a Megatron-LM parser; returns it."""
    group = parser.add_argument_group(title="MTraining context-parallel attention")
    group.add_argument("--cp-attention", choices=CP_ATTENTION_CHOICES, default="te",
                       help="core attention under context parallelism: te (Megatron-LM default: "
                            "TEDotProductAttention, zigzag split) or mtraining (MTraining ring attention, "
                            "striped split; needs --no-create-attention-mask-in-dataloader and "
                            "--attention-dropout 0)")
    group.add_argument("--mtraining-config", type=_config_file, default=None, metavar="FILE",
                       help="MTraining YAML config (configs/*.yaml); default: dense striped ring, "
                            "granularity 64. Used with --cp-attention mtraining.")
    return parser


def mtraining_args_provider(
    extra_args_provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An ``extra_args_provider`` that runs ``extra_args_provider`` (e.g. ModelOpt's, may be
    ``None``) and then :func:`add_mtraining_args`."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_mtraining_args(parser)

    return provider


def mtraining_enabled(args: Any) -> bool:
    """``--cp-attention mtraining`` (False for parsers without the flag)."""
    return getattr(args, "cp_attention", "te") == "mtraining"


_CONFIGS: dict[tuple, MTrainingConfig] = {}
_PLANS: dict[tuple, Any] = {}


def mtraining_config_from_args(args: Any) -> MTrainingConfig:
    """The validated config of this run (the file is read once per config path and layout).

    The rules are :func:`megatron_mtraining.plan.config_from_args`, the same as for
    ``examples/pretrain_gpt.py``: unsupported Megatron-LM flags (attention dropout,
    ``--reset-attention-mask`` with the sparse pattern, a dataloader mask, MTP, MLA, ...), the config
    against the run (sequence length, CP size), and the hierarchical rule (no config plus
    ``--hierarchical-context-parallel-sizes`` selects the dense hierarchical ring; a flat config
    with them is an error). Megatron-LM builds its hierarchical CP groups from the flag only, so a
    hierarchical config also needs the flag.

    Raises:
        ValueError: naming the flag or the config key.
    """
    from megatron_mtraining.plan import config_from_args, front_door_problems

    problems = front_door_problems(args)
    if problems:
        raise ValueError("--cp-attention mtraining: " + "; ".join(problems))
    path = getattr(args, "mtraining_config", None)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    hcp = getattr(args, "hierarchical_context_parallel_sizes", None)
    key = (path, cp, tuple(hcp) if hcp else None, int(args.seq_length), bool(getattr(args, "reset_attention_mask", False)))
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = config_from_args(args)
        if cfg.implementation == "hierarchical" and not hcp:
            inner, outer = cfg.hierarchical.sizes
            raise ValueError(f"mtraining config {path}: implementation 'hierarchical' needs Megatron's inner/outer "
                             f"CP groups: pass --hierarchical-context-parallel-sizes {inner} {outer}")
        _CONFIGS[key] = cfg
    return cfg


def mtraining_plan(args: Any) -> Any:
    """The run's :class:`~megatron_mtraining.plan.CPPlan` over Megatron's CP group (and hierarchical CP
    groups); one plan per config and CP group, shared by the layer spec, RoPE and the batch split.
    Call after ``initialize_model_parallel``.

    Raises:
        ValueError: as :func:`mtraining_config_from_args` and :func:`~megatron_mtraining.plan.resolve`.
    """
    from megatron_mtraining.megatron.attention import get_cp_group, plan_for_model
    from megatron_mtraining.plan import packing_from_args

    cfg = mtraining_config_from_args(args)
    group = get_cp_group()
    packing = packing_from_args(args, _megatron_lm_eod() if getattr(args, "reset_attention_mask", False) else None)
    key = (cfg, packing)
    plan = _PLANS.get(key)
    if plan is None or plan.cp_group is not group:
        plan = plan_for_model(cfg, packing=packing)
        _PLANS[key] = plan
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if plan.cp_size != cp:
        raise ValueError(f"--context-parallel-size {cp} but the CP group has {plan.cp_size} ranks (call "
                         "mtraining_plan after initialize_model_parallel)")
    return plan


def _megatron_lm_eod() -> int:
    """The EOD token of Megatron-LM's global tokenizer (``--reset-attention-mask``: document ends)."""
    try:
        from megatron.training import get_tokenizer
    except ImportError as e:
        raise ValueError(f"--reset-attention-mask needs Megatron-LM's tokenizer for the EOD token ({e})") from None
    return int(get_tokenizer().eod)


def mtraining_layout(args: Any) -> Layout:
    """The CP sequence layout (striped or zigzag) over ``--context-parallel-size`` ranks."""
    return mtraining_config_from_args(args).make_layout(int(getattr(args, "context_parallel_size", 1) or 1))

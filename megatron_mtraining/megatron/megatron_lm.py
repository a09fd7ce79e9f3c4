"""Glue for Megatron-LM's ``pretrain_gpt.py`` / ``gpt_builders.py`` (``patches/megatron-lm-core_v0.16.1.patch``).

The patch adds two flags through an ``extra_args_provider`` and calls four functions of this
package; everything else stays Megatron-LM's:

* ``--cp-attention {te,mtraining}`` (default ``te``: Megatron-LM unchanged) and
  ``--mtraining-config FILE`` (a YAML file, see :mod:`megatron_mtraining.config`; loaded and
  checked while the command line is parsed, so a bad file is an argparse error naming the key).
* ``gpt_builder``: ``replace_core_attention(spec, mtraining_attention_config(args))`` and, after
  ``GPTModel(...)``, ``install_layout_rope(model, mtraining_layout(args))``.
* ``get_batch``: ``get_batch_on_this_cp_rank_striped(batch, mtraining_layout(args), cp_rank)``
  instead of Megatron's zigzag ``get_batch_on_this_cp_rank``.

:func:`mtraining_config_from_args` checks the Megatron-LM arguments the backend cannot serve
(attention dropout, a dataloader attention mask, MTP, MLA, yarn/mrope, hybrid CP, SFT packing) and
the config against the run (sequence length, CP size, hierarchical sizes); each error names the
flag or config key.

Only ``argparse`` and :mod:`megatron_mtraining.config` are imported at module level.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Optional

from megatron_mtraining.config import MTrainingConfig, load_mtraining_config
from megatron_mtraining.layout import Layout

__all__ = [
    "add_mtraining_args",
    "mtraining_args_provider",
    "mtraining_enabled",
    "mtraining_config_from_args",
    "mtraining_layout",
    "mtraining_attention_config",
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


_CACHE: dict[tuple, MTrainingConfig] = {}


def _check_megatron_args(args: Any) -> None:
    def get(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    problems = []
    if get("attention_dropout", 0.0):
        problems.append(f"--attention-dropout {get('attention_dropout')}: the ring kernels have no attention "
                        "dropout; pass --attention-dropout 0.0")
    if get("create_attention_mask_in_dataloader", False):
        problems.append("pass --no-create-attention-mask-in-dataloader (causality comes from the layout's global "
                        "positions; a dense mask is built for zigzag rows and costs s^2 memory)")
    if get("position_embedding_type", "learned_absolute") not in ("learned_absolute", "rope", "none"):
        problems.append(f"--position-embedding-type {get('position_embedding_type')}: only rope, "
                        "learned_absolute and none are supported (other CP slicers are zigzag-only)")
    if get("multi_latent_attention", False):
        problems.append("--multi-latent-attention is not supported")
    if get("mtp_num_layers"):
        problems.append("--mtp-num-layers is not supported (MTP's roll_tensor assumes the zigzag split)")
    if get("hybrid_context_parallel", False):
        problems.append("--hybrid-context-parallel is not supported")
    if get("sft", False):
        problems.append("--sft is not supported (packed THD sequences)")
    if get("use_legacy_models", False):
        problems.append("--use-legacy-models is not supported")
    if problems:
        raise ValueError("--cp-attention mtraining: " + "; ".join(problems))


def mtraining_config_from_args(args: Any) -> MTrainingConfig:
    """The validated config of this run (the file is read once per config path and layout).

    Raises:
        ValueError: an unsupported Megatron-LM flag (named), or a config that does not fit the run
            (sequence length, CP size, hierarchical sizes; the config key is named).
    """
    path = getattr(args, "mtraining_config", None)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    hcp = getattr(args, "hierarchical_context_parallel_sizes", None)
    seq = int(args.seq_length)
    _check_megatron_args(args)
    key = (path, cp, tuple(hcp) if hcp else None, seq)
    cfg = _CACHE.get(key)
    if cfg is None:
        cfg = load_mtraining_config(path)
        cfg.check_run(cp_size=cp, seq_len=seq, megatron_hierarchical_sizes=hcp)
        if cfg.implementation == "hierarchical" and not hcp:
            inner, outer = cfg.hierarchical.sizes
            raise ValueError(f"mtraining config {path}: implementation 'hierarchical' needs Megatron's inner/outer "
                             f"CP groups: pass --hierarchical-context-parallel-sizes {inner} {outer}")
        _CACHE[key] = cfg
    return cfg


def mtraining_layout(args: Any) -> Layout:
    """The CP sequence layout (striped or zigzag) over ``--context-parallel-size`` ranks."""
    return mtraining_config_from_args(args).make_layout(int(getattr(args, "context_parallel_size", 1) or 1))


def mtraining_attention_config(args: Any) -> Any:
    """The ``MTrainingAttentionConfig`` for ``replace_core_attention``.

    Passes every option of :meth:`MTrainingConfig.attention_kwargs` that ``MTrainingAttentionConfig``
    has a field for; an option that it cannot take yet but that the config sets to a non-default
    value (``pattern: vertical_slash``, ``implementation: hierarchical``, ``deterministic: true``)
    is an error rather than being dropped.

    Raises:
        NotImplementedError: the attention module lacks a feature the config asks for.
    """
    from megatron_mtraining.megatron.attention import MTrainingAttentionConfig

    cfg = mtraining_config_from_args(args)
    supported = {f.name for f in dataclasses.fields(MTrainingAttentionConfig)}
    kwargs = cfg.attention_kwargs()
    if cfg.implementation == "hierarchical":
        kwargs["hierarchical"] = cfg.hierarchical_sizes(
            int(args.context_parallel_size), getattr(args, "hierarchical_context_parallel_sizes", None))
    wanted = {"pattern": cfg.pattern != "dense", "vertical_slash": cfg.sparse,
              "hierarchical": cfg.implementation == "hierarchical", "deterministic": cfg.deterministic}
    missing = [k for k, needed in wanted.items() if needed and k not in supported]
    if missing:
        raise NotImplementedError(
            f"mtraining config {getattr(args, 'mtraining_config', None)}: MTrainingAttention in this version has no "
            f"option {', '.join(repr(k) for k in missing)} (its options: {', '.join(sorted(supported))}); "
            "use a dense striped or zigzag config")
    return MTrainingAttentionConfig(**{k: v for k, v in kwargs.items() if k in supported})

"""GPT layer specs whose core attention is :class:`MTrainingAttention`.

Only ``submodules.self_attention.submodules.core_attention`` is swapped; everything else (QKV
projection, RoPE application, norms, MLP, bias-dropout-add) stays megatron-core's, from the
Transformer Engine spec when TE imports and from the local (pure megatron-core) spec otherwise.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional, Union

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mtraining.config import MTrainingConfig
from megatron_mtraining.megatron.attention import MTrainingAttention
from megatron_mtraining.megatron.compat import check_megatron_core_version
from megatron_mtraining.plan import CPPlan

ConfigOrPlan = Union[MTrainingConfig, CPPlan, None]

logger = logging.getLogger(__name__)
_TE_NOTE_GIVEN = False

__all__ = [
    "te_available",
    "get_gpt_layer_spec_with_mtraining",
    "replace_core_attention",
    "TorchNorm",
    "local_block_spec",
]


def te_available() -> bool:
    """True when Transformer Engine's PyTorch extension imports.

    Catches every exception, not only ``ImportError``: a partial TE install raises
    ``RuntimeError``/``OSError`` at import.
    """
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


class TorchNorm:
    """The local spec's norm (``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``), usable with Megatron's
    sequence parallelism.

    Same constructor and module as megatron-core's ``WrappedTorchNorm``, which refuses
    ``config.sequence_parallel`` only because it does not mark its parameters: with sequence
    parallelism each TP rank normalizes its own slice of the sequence, so the norm's weight
    (and bias) gradients are partial sums that ``finalize_model_grads`` must all-reduce over the TP
    group. Here the parameters carry ``sequence_parallel = config.sequence_parallel``, the attribute
    apex' ``FusedLayerNorm`` and Transformer Engine's norms set for the same purpose.

    Raises:
        ValueError: ``config.normalization`` is not LayerNorm or RMSNorm, or a norm option that
            torch's norms lack (``layernorm_zero_centered_gamma``, ``persist_layer_norm``,
            ``memory_efficient_layer_norm``) is set.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        import torch

        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"TransformerConfig.{flag} is not supported by torch's LayerNorm/RMSNorm "
                                 "(the local layer spec without apex or Transformer Engine)")
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization {config.normalization!r}: the local layer spec supports "
                             "LayerNorm and RMSNorm")
        norm = norms[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def _with_torch_norms(spec: Any) -> Any:
    """A copy of ``spec`` with every megatron-core ``WrappedTorchNorm`` replaced by :class:`TorchNorm`.

    ``ModuleSpec`` objects and their ``submodules`` are copied (shallow) along the way; ``params``
    are shared, not deep-copied (a plan in them holds process groups).
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not isinstance(spec, ModuleSpec):
        return TorchNorm if spec is WrappedTorchNorm else spec
    spec = copy.copy(spec)
    if spec.module is WrappedTorchNorm:
        spec.module = TorchNorm
    if spec.submodules is not None and hasattr(spec.submodules, "__dict__"):
        spec.submodules = copy.copy(spec.submodules)
        for name, val in vars(spec.submodules).items():
            setattr(spec.submodules, name, _with_torch_norms(val))
    return spec


def local_block_spec(layer_spec: ModuleSpec, num_layers: int):
    """``TransformerBlockSubmodules`` of ``num_layers`` copies of ``layer_spec`` for sequence
    parallelism without apex or Transformer Engine.

    megatron-core's local spec and, given a layer spec, ``GPTModel``'s final norm use
    ``WrappedTorchNorm``, which refuses ``config.sequence_parallel``. Here a copy of ``layer_spec``
    has every ``WrappedTorchNorm`` replaced by :class:`TorchNorm` (the same torch module, its
    parameters marked for the TP gradient all-reduce) and the block's final norm is
    :class:`TorchNorm` too; a spec without ``WrappedTorchNorm`` (TE, apex) keeps its norms and
    megatron-core's default final norm. Pass the result to ``GPTModel`` as ``transformer_layer_spec``.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    layer_spec = _with_torch_norms(layer_spec)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers,
                                      layer_norm=TorchNorm if LayerNormImpl is WrappedTorchNorm else LayerNormImpl)


def _mtraining_core_attention(mtraining_config: ConfigOrPlan) -> ModuleSpec:
    return ModuleSpec(
        module=MTrainingAttention,
        params={"mtraining_config": MTrainingConfig() if mtraining_config is None else mtraining_config},
    )


def replace_core_attention(
    spec: Any, mtraining_config: ConfigOrPlan = None
) -> Any:
    """Return a copy of ``spec`` with every self-attention ``core_attention`` set to
    :class:`MTrainingAttention`.

    Args:
        spec: a transformer-layer ``ModuleSpec`` or a ``TransformerBlockSubmodules`` (its
            ``layer_specs`` are all rewritten).
        mtraining_config: the run's :class:`~megatron_mtraining.plan.CPPlan` (shared by every
            layer: one cross-rank check per shape for the whole model) or an
            :class:`~megatron_mtraining.config.MTrainingConfig` (each layer resolves it over the CP
            group); forwarded through ``ModuleSpec.params``. Default: dense striped ring.

    Raises:
        ValueError: ``spec`` has no ``submodules.self_attention.submodules.core_attention``.
        RuntimeError: the installed megatron-core is outside ``>=0.16.1,<0.20``.
    """
    check_megatron_core_version()
    spec = copy.deepcopy(spec)
    layer_specs = getattr(spec, "layer_specs", None)
    for layer_spec in layer_specs if layer_specs is not None else [spec]:
        attn = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
        attn_sub = getattr(attn, "submodules", None)
        if attn_sub is None or not hasattr(attn_sub, "core_attention"):
            raise ValueError(
                "spec has no submodules.self_attention.submodules.core_attention to replace "
                f"(got {type(layer_spec).__name__})"
            )
        attn_sub.core_attention = _mtraining_core_attention(mtraining_config)
    return spec


def get_gpt_layer_spec_with_mtraining(
    use_te: Optional[bool] = None,
    mtraining_config: ConfigOrPlan = None,
    normalization: str = "LayerNorm",
    **kwargs: Any,
) -> ModuleSpec:
    """GPT transformer-layer spec with :class:`MTrainingAttention` as core attention.

    Args:
        use_te: ``True``: Transformer Engine spec (``get_gpt_layer_with_transformer_engine_spec``;
            untested with ``MTrainingAttention``); ``False``: local spec (``get_gpt_layer_local_spec``);
            ``None``: TE if it imports, with one warning per process saying which spec was chosen.
        mtraining_config: the run's :class:`~megatron_mtraining.plan.CPPlan` or an
            :class:`~megatron_mtraining.config.MTrainingConfig` (default: dense striped ring,
            granularity 64); see :func:`replace_core_attention`.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``; passed to the local spec (the TE spec
            reads ``TransformerConfig.normalization`` itself). For sequence parallelism with the
            local spec, build the model from :func:`local_block_spec` of this spec.
        **kwargs: forwarded to the megatron-core spec function (e.g. ``qk_layernorm``).

    Raises:
        ImportError: ``use_te=True`` but Transformer Engine does not import.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    global _TE_NOTE_GIVEN
    if use_te is None:
        use_te = te_available()
        if not _TE_NOTE_GIVEN:  # once per process, not once per model or layer
            _TE_NOTE_GIVEN = True
            if use_te:
                logger.warning("MTrainingAttention in the Transformer Engine layer spec: this combination is "
                               "untested (the local spec is tested); pass use_te=False for the local spec")
            else:
                logger.warning("Transformer Engine does not import: using megatron-core's local layer spec with "
                               "MTrainingAttention (install transformer-engine[pytorch] for the TE spec)")
    if use_te:
        if not te_available():
            raise ImportError("use_te=True needs Transformer Engine (transformer_engine.pytorch), which does not import")
        base = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    else:
        base = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization, **kwargs)
    return replace_core_attention(base, mtraining_config)

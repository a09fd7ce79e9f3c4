"""megatron-core integration of the MTraining CP attention (the only package that imports
``megatron.core``). Supported: megatron-core ``>=0.16.1,<0.20``; what differs between versions and
Megatron-LM release lines is in :mod:`.compat`.

Public API (imported lazily, so ``megatron_mtraining.megatron.args`` stays cheap to import):

* :class:`MTrainingAttention`, :func:`plan_for_model` (``attention``)
* :func:`get_gpt_layer_spec_with_mtraining`, :func:`replace_core_attention`, :func:`te_available` (``spec``)
* :func:`get_batch_on_this_cp_rank_striped` (``batch``)
* :class:`LayoutRotaryEmbedding` (alias ``StripedRotaryEmbedding``), :func:`install_layout_rope` (``rope``)
* :func:`apply_cpu_patches`, :func:`cpu_seed`, :func:`cpu_transformer_config_kwargs` (``cpu_compat``)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MTrainingAttention": "attention",
    "plan_for_model": "attention",
    "get_gpt_layer_spec_with_mtraining": "spec",
    "replace_core_attention": "spec",
    "te_available": "spec",
    "get_batch_on_this_cp_rank_striped": "batch",
    "LayoutRotaryEmbedding": "rope",
    "StripedRotaryEmbedding": "rope",
    "install_layout_rope": "rope",
    "apply_cpu_patches": "cpu_compat",
    "cpu_seed": "cpu_compat",
    "cpu_transformer_config_kwargs": "cpu_compat",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Everything that depends on the megatron-core version or the Megatron-LM release line.

* megatron-core: :data:`MEGATRON_CORE_MIN` <= version < :data:`MEGATRON_CORE_BELOW` (the range of
  ``pyproject.toml``); :func:`check_megatron_core_version` refuses other versions with an error
  naming the range. The ``core_attention`` contract (``CoreAttentionBuilder`` keywords, the forward
  signature), ``RotaryEmbedding`` and the GPT layer specs used here are the same across the range.
* megatron-core 0.20 of Megatron-LM main (:data:`MEGATRON_CORE_MAIN`): there is no 0.20 release on
  the package index yet, so the installed range stops below it; ``megatron.core`` imported from a
  Megatron-LM checkout (its ``pretrain_gpt.py`` next to the ``megatron`` package) may be 0.20.
* Megatron-LM: one patch per release line (:data:`MEGATRON_LM_LINES`,
  ``patches/megatron-lm-core_v<line>.patch``); line ``0.20`` is Megatron-LM main, found by the
  checkout's ``megatron/core/package_info.py`` (:func:`megatron_lm_tree_line`), since main carries no
  0.20 tag. Lines 0.16 to 0.18 build the model in
  ``gpt_builders.gpt_builder``; from 0.19 on ``pretrain_gpt.py`` builds it from a
  ``GPTModelConfig`` (``megatron.training.models.gpt``), which
  :func:`gpt_model_config_with_mtraining` adapts.

Only the standard library is imported at module level.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = [
    "MEGATRON_CORE_MIN",
    "MEGATRON_CORE_BELOW",
    "MEGATRON_CORE_MAIN",
    "MEGATRON_LM_LINES",
    "check_megatron_core_version",
    "gpt_model_config_with_mtraining",
    "megatron_core_version",
    "megatron_lm_line",
    "megatron_lm_patch_name",
    "megatron_lm_tree_line",
    "parse_version",
]

#: Oldest supported megatron-core release (inclusive).
MEGATRON_CORE_MIN = (0, 16, 1)
#: First unsupported megatron-core release (exclusive upper bound).
MEGATRON_CORE_BELOW = (0, 20, 0)

#: megatron-core of Megatron-LM main (MAJOR, MINOR): accepted only from a Megatron-LM checkout.
MEGATRON_CORE_MAIN = (0, 20)

#: Megatron-LM release line -> the tags its patch was checked against (``git apply --check``);
#: ``"main"``: Megatron-LM's main branch (megatron-core 0.20.0 in its tree, no tag yet).
MEGATRON_LM_LINES: dict[str, tuple[str, ...]] = {
    "0.16": ("core_v0.16.0", "core_v0.16.1"),
    "0.17": ("core_v0.17.0", "core_v0.17.1"),
    "0.18": ("core_v0.18.0", "core_v0.18.2"),
    "0.19": ("core_v0.19.0",),
    "0.20": ("main",),
}


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.16.1"``, ``"0.17.0rc0"``, ``"0.19.2+abc"`` -> ``(major, minor, patch)``.

    Raises:
        ValueError: ``text`` does not start with ``MAJOR.MINOR``.
    """
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _fmt(v: tuple[int, int, int]) -> str:
    return ".".join(map(str, v))


def megatron_core_version() -> tuple[int, int, int]:
    """The installed (imported) megatron-core version, from ``megatron.core.package_info``."""
    from megatron.core import package_info

    return parse_version(package_info.__version__)


def _imported_from_megatron_lm_checkout() -> bool:
    """``megatron.core`` is imported from a Megatron-LM checkout (``pretrain_gpt.py`` beside ``megatron/``)."""
    import megatron.core

    return (Path(megatron.core.__file__).resolve().parents[2] / "pretrain_gpt.py").is_file()


def check_megatron_core_version(version: Optional[str] = None) -> tuple[int, int, int]:
    """Return the megatron-core version (``version``, default the imported one) if supported:
    ``>=0.16.1,<0.20``, or the imported 0.20 of a Megatron-LM main checkout (:data:`MEGATRON_CORE_MAIN`).

    Raises:
        RuntimeError: outside that range (the message names the range).
    """
    v = parse_version(version) if version is not None else megatron_core_version()
    if MEGATRON_CORE_MIN <= v < MEGATRON_CORE_BELOW:
        return v
    if version is None and v[:2] == MEGATRON_CORE_MAIN and _imported_from_megatron_lm_checkout():
        return v
    raise RuntimeError(
        f"megatron-core {_fmt(v)} is not supported by megatron_mtraining: it needs "
        f"megatron-core>={_fmt(MEGATRON_CORE_MIN)},<{_fmt(MEGATRON_CORE_BELOW)} (or the "
        f"{_fmt(MEGATRON_CORE_MAIN + (0,))} of a Megatron-LM main checkout, imported from that checkout)")


def megatron_lm_patch_name(line: str) -> str:
    """File name of the patch for a Megatron-LM line: ``"0.16"`` -> ``megatron-lm-core_v0.16.patch``."""
    if line not in MEGATRON_LM_LINES:
        raise ValueError(f"no patch for Megatron-LM line {line}; supported lines: {', '.join(MEGATRON_LM_LINES)}")
    return f"megatron-lm-core_v{line}.patch"


def megatron_lm_line(tag: str) -> str:
    """The supported release line of a Megatron-LM tag or ``git describe`` output
    (``core_v0.17.1`` and ``core_v0.17.1-3-gabc`` -> ``"0.17"``).

    Raises:
        ValueError: not a ``core_vMAJOR.MINOR...`` tag, or a line without a patch (the message lists
            the supported tags).
    """
    m = re.match(r"core_v(\d+)\.(\d+)", tag or "")
    supported = ", ".join(t for tags in MEGATRON_LM_LINES.values() for t in tags)
    if not m or f"{m.group(1)}.{m.group(2)}" not in MEGATRON_LM_LINES:
        raise ValueError(f"Megatron-LM {tag or '(no tag)'} is not supported; supported tags: {supported}")
    return f"{m.group(1)}.{m.group(2)}"


def megatron_lm_tree_line(checkout: Any) -> Optional[str]:
    """The line of a Megatron-LM checkout from its ``megatron/core/package_info.py`` (``MAJOR.MINOR``),
    when it has a patch (``"0.20"`` for main), else ``None`` (no such file, or no patch)."""
    info = Path(checkout) / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    text = info.read_text()
    major = re.search(r"^MAJOR\s*=\s*(\d+)", text, flags=re.M)
    minor = re.search(r"^MINOR\s*=\s*(\d+)", text, flags=re.M)
    line = f"{major.group(1)}.{minor.group(1)}" if major and minor else None
    return line if line in MEGATRON_LM_LINES else None


def gpt_model_config_with_mtraining(
    model_cfg: Any, spec_transform: Callable[[Any], Any], model_hook: Callable[[Any], None]
) -> Any:
    """Megatron-LM >= 0.19: route a ``GPTModelConfig`` through MTraining.

    ``pretrain_gpt.py`` builds the model with ``GPTModelBuilder(model_cfg)``, which takes the layer
    spec from ``model_cfg.transformer_layer_spec`` (``None``: ``default_layer_spec``; a callable:
    called with the config and ``vp_stage``) and runs ``model_cfg.pre_wrap_hooks`` on the list of
    model chunks before DDP wrapping.

    Args:
        model_cfg: the ``GPTModelConfig`` of ``gpt_config_from_args``.
        spec_transform: ``spec -> spec`` applied to the layer spec the builder would use.
        model_hook: called with each unwrapped model chunk (before DDP / ``Float16Module``).

    Returns:
        ``model_cfg``, changed in place.

    Raises:
        ValueError: ``--attention-backend local`` (the builder would put megatron's
            ``DotProductAttention`` back into ``core_attention`` after the spec).
    """
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.spec_utils import ModuleSpec

    if getattr(model_cfg, "attention_backend", None) == AttnBackend.local:
        raise ValueError("--cp-attention mtraining: --attention-backend local is not supported (Megatron-LM's "
                         "GPTModelBuilder replaces core_attention with DotProductAttention); use the default "
                         "--attention-backend auto")
    base = model_cfg.transformer_layer_spec

    def layer_spec(config: Any, vp_stage: Optional[int] = None) -> Any:
        if base is None:
            from megatron.training.models.gpt import default_layer_spec

            spec = default_layer_spec(config, vp_stage)
        elif callable(base) and not isinstance(base, ModuleSpec):  # as GPTModelBuilder.build_model does
            takes_vp = "vp_stage" in inspect.signature(base).parameters
            spec = base(config, vp_stage=vp_stage) if takes_vp else base(config)
        else:
            spec = base
        return spec_transform(spec)

    def pre_wrap_hook(models: list) -> list:
        for m in models:
            model_hook(m)
        return models

    model_cfg.transformer_layer_spec = layer_spec
    model_cfg.pre_wrap_hooks = list(model_cfg.pre_wrap_hooks or []) + [pre_wrap_hook]
    return model_cfg

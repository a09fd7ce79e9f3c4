"""Typed YAML configuration of the MTraining CP attention (``--mtraining-config FILE``).

A config file selects the ring implementation, the striped granularity, the attention pattern
(dense or MTraining's online vertical-slash sparsity) and, for the hierarchical ring, its
inner/outer sizes. Every key is checked: an unknown key or a bad value is a ``ValueError``
that names the key (``mtraining config: unknown key 'patern' (allowed: ...)``,
``mtraining config: 'vertical_slash.recall' must be a number in (0, 1], got 1.5``). The shipped
files are in ``configs/``. Example (``configs/qwen2.5-3b-512k.yaml``)::

    implementation: hierarchical   # striped | zigzag | hierarchical (striped layout, two-level ring)
    granularity: 64                # striped block size in tokens
    pattern: vertical_slash        # dense | vertical_slash
    vertical_slash:                # fields of patterns.estimator.VerticalSlashConfig (all optional)
      recall: 0.9
      max_vertical: 4096
      share_pattern: head          # head | kv_group (one pattern per GQA group)
    hierarchical:                  # optional; default: Megatron's --hierarchical-context-parallel-sizes
      inner: 8
      outer: 4
    columns: out_of_ring           # in_ring | out_of_ring (sparse only; where vertical columns are computed)
    dense_layers: [1]              # sparse only: these layers (1-based, global) run the exact dense ring;
                                   # auto: each layer runs whichever of sparse/dense its first call measures faster
    layer_overrides:               # sparse only: per-layer vertical_slash fields (a layer "3" or a range "2-4")
      "2-4": {recall: 0.98}
    deterministic: false
    kernel_backend: auto           # auto | torch | triton | fa4 | sdpa (per-step attention kernels; sdpa: dense, CP=1)
    cuda_graphs: false             # true: CUDA graphs of each sparse layer's attention (CP=1, no document mask)

Sections must match the choices: ``vertical_slash:`` only with ``pattern: vertical_slash`` and
``hierarchical:`` only with ``implementation: hierarchical`` (a section that would be ignored is an
error, not a silent no-op). The ``vertical_slash`` keys are exactly the fields of
:class:`~megatron_mtraining.patterns.estimator.VerticalSlashConfig` and are validated by it.

Run-time checks that need the parallel layout (CP size, sequence length, Megatron's hierarchical
sizes) are in :func:`config_for_run` (the one rule every front door applies), built on
:meth:`MTrainingConfig.check_run` / :meth:`MTrainingConfig.hierarchical_sizes`; the process groups,
layout and kernels of a run are fixed by :func:`megatron_mtraining.plan.resolve`.

This module does not import megatron (cheap to import from argument parsing).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from megatron_mtraining.common import plain_numbers
from megatron_mtraining.layout import Layout
from megatron_mtraining.patterns.estimator import VerticalSlashConfig
from megatron_mtraining.ring.sparse import COLUMN_SCHEDULES

__all__ = [
    "IMPLEMENTATIONS",
    "PATTERNS",
    "COLUMN_SCHEDULES",
    "KERNEL_BACKENDS",
    "HierarchicalConfig",
    "MTrainingConfig",
    "LAYER_OVERRIDE_KEYS",
    "VerticalSlashConfig",
    "load_mtraining_config",
    "dump_mtraining_config",
    "config_for_run",
]

IMPLEMENTATIONS = ("striped", "zigzag", "hierarchical")
PATTERNS = ("dense", "vertical_slash")
from megatron_mtraining.ops.backends import KERNEL_BACKENDS, TRITON_BLOCK  # noqa: E402  (the one list of backend names)

_PREFIX = "mtraining config"
_DEFAULT_GRANULARITY = 64
_ZIGZAG_GRANULARITY_RULE = ("'granularity: {g}' applies to the striped layout only; implementation: zigzag splits "
                            "each sequence into 2 x CP chunks and has no granularity: remove the key")


class _ConfigError(ValueError):
    """Internal: a message without the ``mtraining config`` prefix (added by the loader)."""


# ------------------------------------------------------------------------ per-layer policy
#: The ``vertical_slash`` fields a ``layer_overrides`` entry may change (``block_size`` is one per
#: run: the layout check, the kernels and the backend choice are fixed for the whole model).
LAYER_OVERRIDE_KEYS = tuple(f.name for f in dataclasses.fields(VerticalSlashConfig) if f.name != "block_size")

LayerRange = tuple  # (first, last): 1-based, inclusive
#: the largest layer number a layer policy may name (a model's layers are checked at run time)
MAX_LAYER_NUMBER = 100_000


def _layer_range(item: Any, where: str) -> LayerRange:
    """``3`` / ``"3"`` -> (3, 3); ``"2-5"`` -> (2, 5); anything else is a ``_ConfigError`` naming ``where``."""
    if isinstance(item, bool):
        raise _ConfigError(f"{where}: a layer must be a 1-based layer number or a range 'first-last', got {item!r}")
    if isinstance(item, int):
        first = last = item
    elif isinstance(item, str) and re.fullmatch(r"\s*\d+\s*(-\s*\d+\s*)?", item):
        parts = [int(x) for x in item.split("-")]
        first, last = parts[0], parts[-1]
    else:
        raise _ConfigError(f"{where}: a layer must be a 1-based layer number or a range 'first-last', got {item!r}")
    if first < 1:
        raise _ConfigError(f"{where}: layer numbers are 1-based (Megatron's layer_number), got {item!r}")
    if last > MAX_LAYER_NUMBER:
        raise _ConfigError(f"{where}: layer numbers go up to {MAX_LAYER_NUMBER}, got {item!r}")
    if last < first:
        raise _ConfigError(f"{where}: range {item!r} is empty (first > last)")
    return (first, last)


def _range_text(r: LayerRange) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


#: the value of ``dense_layers`` that chooses each layer's attention by measurement
AUTO = "auto"


def _normalize_dense_layers(value: Any) -> Optional[tuple[int, ...]]:
    """``None`` / ``[]`` -> ``None``; a list of layer numbers and ranges -> sorted tuple of ints
    (``"auto"`` is handled by the caller)."""
    if value is None:
        return None
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        one = (f"; write [{value!r}] for one layer" if isinstance(value, int) or re.fullmatch(r"\d+(-\d+)?", value)
               else "")
        raise _ConfigError(f"'dense_layers' must be {AUTO!r} or a list of 1-based layer numbers or ranges (e.g. "
                           f"[1, 2] or ['1-4']), got {value!r}{one}")
    if not isinstance(value, (list, tuple)):
        raise _ConfigError(f"'dense_layers' must be {AUTO!r} or a list of 1-based layer numbers or ranges, got "
                           f"{type(value).__name__} {value!r}")
    if AUTO in value:
        raise _ConfigError(f"'dense_layers': write dense_layers: {AUTO} (no brackets) for the measured layer policy; "
                           f"it does not combine with layer numbers, got {list(value)!r}")
    seen: set[int] = set()
    for item in value:
        first, last = _layer_range(item, "'dense_layers'")
        for n in range(first, last + 1):
            if n in seen:
                raise _ConfigError(f"'dense_layers': layer {n} is listed twice")
            seen.add(n)
    return tuple(sorted(seen)) or None


def _normalize_overrides(value: Any) -> Optional[tuple]:
    """``None`` / ``{}`` -> ``None``; ``{"2-4": {"recall": 0.98}}`` -> ``(((2, 4), (("recall", 0.98),)),)``,
    sorted by first layer; the normalized form is accepted as is."""
    if value is None:
        return None
    if isinstance(value, tuple):            # already normalized (dataclasses.replace, copies)
        value = {_range_text(r): dict(items) for r, items in value}
    if not isinstance(value, Mapping):
        raise _ConfigError(f"'layer_overrides' must be a mapping of layer (\"3\") or range (\"2-4\") to "
                           f"vertical_slash fields, got {type(value).__name__} {value!r}")
    entries = []
    for key, fields_ in value.items():
        where = f"'layer_overrides.{key}'"
        rng = _layer_range(key, f"'layer_overrides' key {key!r}")
        if not isinstance(fields_, Mapping) or not fields_:
            raise _ConfigError(f"{where} must be a non-empty mapping of vertical_slash fields "
                               f"({', '.join(LAYER_OVERRIDE_KEYS)}), got {fields_!r}")
        for name in fields_:
            if name == "block_size":
                raise _ConfigError(f"{where}: 'block_size' cannot be set per layer (one slash block size per run: "
                                   "the layout, the kernels and the backend are fixed for the whole model)")
            if name not in LAYER_OVERRIDE_KEYS:
                raise _ConfigError(f"unknown key 'layer_overrides.{key}.{name}' (allowed: "
                                   f"{', '.join(LAYER_OVERRIDE_KEYS)})")
        entries.append((rng, tuple(sorted(fields_.items()))))
    entries.sort()
    for (a, _), (b, _) in zip(entries, entries[1:]):
        if b[0] <= a[1]:
            raise _ConfigError(f"'layer_overrides': ranges '{_range_text(a)}' and '{_range_text(b)}' overlap "
                               f"(layer {b[0]} would have two overrides); each layer may appear in one entry only")
    return tuple(entries) or None


@dataclass(frozen=True)
class HierarchicalConfig:
    """Sizes of the two-level ring (MTraining Alg. 2): ``cp = inner * outer``.

    Args:
        inner: ranks per inner (intra-node) ring, Megatron's hierarchical-CP level 0.
        outer: ranks per outer (inter-node) ring, level 1.

    Both ``None`` (the default) means: take them from Megatron's
    ``--hierarchical-context-parallel-sizes INNER OUTER`` at run time.
    """

    inner: Optional[int] = None
    outer: Optional[int] = None

    def __post_init__(self) -> None:
        if (self.inner is None) != (self.outer is None):
            raise ValueError(f"{_PREFIX}: 'hierarchical.inner' and 'hierarchical.outer' must be given "
                             f"together (got inner={self.inner!r}, outer={self.outer!r})")
        for name in ("inner", "outer"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 2):
                raise ValueError(f"{_PREFIX}: 'hierarchical.{name}' must be an int >= 2 (a ring of one rank "
                                 f"is a flat ring: use implementation: striped), got {val!r}")

    @property
    def sizes(self) -> Optional[tuple[int, int]]:
        return None if self.inner is None else (self.inner, self.outer)


@dataclass(frozen=True)
class MTrainingConfig:
    """Options of the MTraining CP attention.

    Args:
        implementation: ``"striped"`` (flat ring, striped layout; MTraining's default),
            ``"zigzag"`` (flat ring, Megatron/TE DualChunkSwap layout; baseline) or
            ``"hierarchical"`` (striped layout, inner intra-node ring inside an outer inter-node
            ring).
        granularity: striped block size in tokens (>= 1, default 64). The ``zigzag`` layout has
            none: another value with it is an error, and so is the key in a zigzag config file.
        pattern: ``"dense"`` (exact causal attention) or ``"vertical_slash"`` (online
            vertical-slash sparse attention, MTraining §3.2).
        vertical_slash: budgets of the estimator (used with ``pattern: vertical_slash``).
        hierarchical: inner/outer ring sizes (used with ``implementation: hierarchical``).
        columns: where the sparse pattern's vertical columns are computed: ``"in_ring"`` (each
            ring step, with the owner's K/V) or ``"out_of_ring"`` (gathered once and computed
            outside the ring, which balances the ring steps; docs/design.md). Only with
            ``pattern: vertical_slash`` (``out_of_ring`` relies on ``local_blocks >= 1``, which the
            estimator config enforces).
        dense_layers: layers that run the exact dense ring instead of the sparse pattern: a list of
            1-based *global* layer numbers (Megatron's ``layer_number``; with pipeline parallelism the
            number counts from the model's first layer, not the stage's) and ``"first-last"``
            ranges, e.g. ``[1, "30-32"]``; stored as a sorted tuple of ints. ``None``: every layer is
            sparse. ``"auto"``: the measured layer policy (:mod:`megatron_mtraining.layer_policy`): each
            layer's first call times its sparse attention (with its budgets) against the dense attention,
            forward and backward, summed over the ranks that hold the layer, and the layer runs the faster
            one for the rest of the run (a decision per run sequence length and CP size; stored as
            ``dense_layers=None, auto_dense_layers=True``). Only with ``pattern: vertical_slash``.
        layer_overrides: per-layer ``vertical_slash`` fields, a mapping of a layer (``"3"``) or a
            range (``"2-4"``) to fields of :data:`LAYER_OVERRIDE_KEYS` (``block_size`` is one per
            run), e.g. ``{"2-4": {"recall": 0.98}}``; the other fields come from
            ``vertical_slash``. Stored as a sorted tuple of ``((first, last), ((field, value), ...))``.
            Ranges may not overlap each other or ``dense_layers``. Only with ``pattern: vertical_slash``.
            Layer numbers are checked against the model's number of layers by :meth:`check_layers`
            (run by :func:`config_for_run` with ``num_layers`` and by the core attention).
        deterministic: request deterministic kernels (no atomics in the backward pass); the CPU
            reference kernels are always deterministic.
        kernel_backend: the per-step attention kernels: ``"auto"`` (the fastest one that supports
            the device, dtype and head_dim), ``"torch"`` (the reference kernels; any device),
            ``"triton"`` or ``"sdpa"`` (CUDA).
        cuda_graphs: run each sparse layer's attention (estimation, index conversion, plans,
            forward and backward kernels) through CUDA graphs captured per layer and input shape
            (:class:`~megatron_mtraining.ring.graphs.CUDAGraphedAttention`): one launch instead of
            hundreds. Needs CUDA, ``cp_size == 1`` and no document mask, and one forward in flight
            per layer (no pipeline schedule that runs several forwards before their backwards).
            Dense layers run as without it.
        auto_dense_layers: ``True`` for ``dense_layers: auto`` (set by it; not a file key).

    Raises:
        ValueError: naming the offending key (``mtraining config: ...``).
    """

    implementation: str = "striped"
    granularity: int = _DEFAULT_GRANULARITY
    pattern: str = "dense"
    vertical_slash: VerticalSlashConfig = field(default_factory=VerticalSlashConfig)
    hierarchical: HierarchicalConfig = field(default_factory=HierarchicalConfig)
    columns: str = "in_ring"
    dense_layers: Optional[tuple[int, ...]] = None
    layer_overrides: Optional[tuple] = None
    deterministic: bool = False
    kernel_backend: str = "auto"
    cuda_graphs: bool = False
    auto_dense_layers: bool = field(default=False, metadata={"file_key": False})   # set by dense_layers: auto

    def __post_init__(self) -> None:
        try:
            if isinstance(self.dense_layers, str) and self.dense_layers == AUTO:
                object.__setattr__(self, "dense_layers", None)
                object.__setattr__(self, "auto_dense_layers", True)
            if not isinstance(self.auto_dense_layers, bool):
                raise _ConfigError(f"'auto_dense_layers' must be true or false, got {self.auto_dense_layers!r}")
            object.__setattr__(self, "dense_layers", _normalize_dense_layers(self.dense_layers))
            if self.auto_dense_layers and self.dense_layers is not None:
                raise _ConfigError(f"'dense_layers' is either {AUTO!r} or a list of layers, not both "
                                   f"(auto_dense_layers=True with dense_layers={list(self.dense_layers)})")
            object.__setattr__(self, "layer_overrides", _normalize_overrides(self.layer_overrides))
            self._validate()
        except _ConfigError as e:
            raise ValueError(f"{_PREFIX}: {e}") from None

    def _validate(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise _ConfigError(f"'implementation' must be one of {', '.join(IMPLEMENTATIONS)}, "
                               f"got {self.implementation!r}")
        g = self.granularity
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise _ConfigError(f"'granularity' must be an int >= 1, got {g!r}")
        if self.layout_kind == "zigzag" and g != _DEFAULT_GRANULARITY:
            raise _ConfigError(_ZIGZAG_GRANULARITY_RULE.format(g=g))
        if self.pattern not in PATTERNS:
            raise _ConfigError(f"'pattern' must be one of {', '.join(PATTERNS)}, got {self.pattern!r}")
        if not isinstance(self.vertical_slash, VerticalSlashConfig):
            raise _ConfigError(f"'vertical_slash' must be a VerticalSlashConfig, got {type(self.vertical_slash).__name__}")
        if not isinstance(self.hierarchical, HierarchicalConfig):
            raise _ConfigError(f"'hierarchical' must be a HierarchicalConfig, got {type(self.hierarchical).__name__}")
        if not isinstance(self.deterministic, bool):
            raise _ConfigError(f"'deterministic' must be true or false, got {self.deterministic!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise _ConfigError(f"'cuda_graphs' must be true or false, got {self.cuda_graphs!r}")
        if self.cuda_graphs and self.pattern != "vertical_slash":
            raise _ConfigError(f"'cuda_graphs: true' applies to the sparse pattern only, but 'pattern' is "
                               f"{self.pattern!r} (set pattern: vertical_slash or remove 'cuda_graphs')")
        if self.cuda_graphs and self.kernel_backend == "torch":
            raise _ConfigError("'cuda_graphs: true' needs the Triton sparse kernels, but 'kernel_backend' is 'torch' "
                               "(the torch reference reads values back to the host, which a CUDA graph cannot capture)")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise _ConfigError(f"'kernel_backend' must be one of {', '.join(KERNEL_BACKENDS)}, "
                               f"got {self.kernel_backend!r}")
        if self.kernel_backend == "sdpa" and self.pattern == "vertical_slash":
            raise _ConfigError("'kernel_backend: sdpa' has no sparse kernels (SDPA runs dense causal attention at "
                               "context-parallel size 1), but 'pattern' is 'vertical_slash'; use kernel_backend "
                               "auto, triton, fa4 or torch")
        bs = self.vertical_slash.block_size
        triton = self.kernel_backend in ("triton", "fa4")
        if self.pattern == "vertical_slash" and bs % TRITON_BLOCK and (triton or self.cuda_graphs):
            what = f"'kernel_backend: {self.kernel_backend}'" if triton else "'cuda_graphs: true'"
            other = ("cuda_graphs: false and kernel_backend: auto or torch" if self.cuda_graphs
                     else "kernel_backend: torch")
            raise _ConfigError(f"{what} runs the sparse pattern on the Triton kernels, whose tiles are {TRITON_BLOCK} "
                               f"tokens: 'vertical_slash.block_size' must be a multiple of {TRITON_BLOCK}, got {bs} "
                               f"(or use {other})")
        if self.columns not in COLUMN_SCHEDULES:
            raise _ConfigError(f"'columns' must be one of {', '.join(COLUMN_SCHEDULES)}, got {self.columns!r}")
        if self.columns != "in_ring" and self.pattern != "vertical_slash":
            raise _ConfigError(f"'columns: {self.columns}' applies to the sparse pattern only, but 'pattern' is "
                               f"{self.pattern!r} (set pattern: vertical_slash or remove 'columns')")
        if self.hierarchical.sizes is not None and self.implementation != "hierarchical":
            raise _ConfigError(f"'hierarchical' sizes are set but 'implementation' is {self.implementation!r} "
                               "(they are used only with implementation: hierarchical)")
        if self.pattern == "vertical_slash" and self.layout_kind == "striped":
            bs = self.vertical_slash.block_size
            if self.granularity % bs != 0:
                raise _ConfigError(f"'granularity' ({self.granularity}) must be a multiple of "
                                   f"'vertical_slash.block_size' ({bs}): the sparse ring keeps whole blocks "
                                   "on one rank")
        self._validate_layer_policy()

    def _validate_layer_policy(self) -> None:
        if self.auto_dense_layers and self.pattern != "vertical_slash":
            raise _ConfigError(f"'dense_layers: {AUTO}' applies to the sparse pattern only, but 'pattern' is "
                               f"{self.pattern!r} (every layer is dense already; set pattern: vertical_slash or "
                               "remove 'dense_layers')")
        for key in ("dense_layers", "layer_overrides"):
            if getattr(self, key) is not None and self.pattern != "vertical_slash":
                raise _ConfigError(f"'{key}' applies to the sparse pattern only, but 'pattern' is {self.pattern!r} "
                                   f"(every layer is dense already; set pattern: vertical_slash or remove '{key}')")
        dense = set(self.dense_layers or ())
        for rng, items in self.layer_overrides or ():
            both = sorted(n for n in dense if rng[0] <= n <= rng[1])
            if both:
                raise _ConfigError(f"layer {both[0]} is in 'dense_layers' and in 'layer_overrides' "
                                   f"'{_range_text(rng)}' (a dense layer has no sparse budgets to override)")
            try:
                dataclasses.replace(self.vertical_slash, **dict(items))
            except ValueError as e:
                msg = re.sub(r"VerticalSlashConfig\.(\w+)", rf"'layer_overrides.{_range_text(rng)}.\1'", str(e))
                raise _ConfigError(msg) from None

    # ------------------------------------------------------------------ per-layer policy
    def layer_pattern(self, layer_number: int) -> Optional[VerticalSlashConfig]:
        """The estimator budgets of layer ``layer_number`` (1-based, global), or ``None`` when the
        layer runs the exact dense ring (``pattern: dense``, or the layer is in ``dense_layers``). With
        ``dense_layers: auto`` every layer has its budgets here: which layers run dense is measured
        while the run trains (:mod:`megatron_mtraining.layer_policy`).

        Raises:
            ValueError: ``layer_number`` is not an int >= 1.
        """
        if isinstance(layer_number, bool) or not isinstance(layer_number, int) or layer_number < 1:
            raise ValueError(f"{_PREFIX}: layer numbers are 1-based ints (Megatron's layer_number), got "
                             f"{layer_number!r}")
        if not self.sparse or layer_number in (self.dense_layers or ()):
            return None
        for (first, last), items in self.layer_overrides or ():
            if first <= layer_number <= last:
                return dataclasses.replace(self.vertical_slash, **dict(items))
        return self.vertical_slash

    @property
    def has_layer_policy(self) -> bool:
        """True when some layers may differ from the others (``dense_layers``, ``auto`` included, or
        ``layer_overrides``)."""
        return self.dense_layers is not None or self.auto_dense_layers or self.layer_overrides is not None

    def layer_policy_text(self) -> str:
        """A canonical one-line description of ``dense_layers`` and ``layer_overrides`` (``""``: none);
        the CP ranks compare it, and logs print it."""
        parts = []
        if self.auto_dense_layers:
            parts.append(f"dense {AUTO} (measured)")
        if self.dense_layers:
            parts.append("dense " + ",".join(map(str, self.dense_layers)))
        for rng, items in self.layer_overrides or ():
            parts.append(f"layers {_range_text(rng)}: " + ",".join(f"{k}={v!r}" for k, v in items))
        return "; ".join(parts)

    def with_dense_layers(self, layers) -> "MTrainingConfig":
        """This config with ``layers`` (1-based global layer numbers) added to ``dense_layers``: a
        per-layer policy chosen by measurement (``tools/pattern_recall.py --write-policy``). A
        ``layer_overrides`` range that holds one of them keeps its other layers (it is split around it).
        On a ``dense_layers: auto`` config the fixed list replaces ``auto``.

        Raises:
            ValueError: a config with ``pattern: dense``, or a layer number that is not an int >= 1.
        """
        add = []
        for n in layers:           # ints, numpy integers included; not bools, floats or strings
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or int(n) < 1:
                raise ValueError(f"{_PREFIX}: a dense layer must be a 1-based layer number (int >= 1), got {n!r}")
            add.append(int(n))
        add = sorted(set(add))
        if not add:
            return dataclasses.replace(self, auto_dense_layers=False) if self.auto_dense_layers else self
        if not self.sparse:
            raise ValueError(f"{_PREFIX}: dense_layers needs pattern: vertical_slash (every layer is dense already)")
        data = self.to_dict()
        data["dense_layers"] = sorted(set(self.dense_layers or ()) | set(add))
        overrides = {}
        for (first, last), items in self.layer_overrides or ():
            run = []                          # the range's layers that stay sparse, cut into contiguous pieces
            for n in list(range(first, last + 1)) + [None]:
                if n is not None and n not in add:
                    run.append(n)
                    continue
                if run:
                    overrides[_range_text((run[0], run[-1]))] = dict(items)
                run = []
        data["layer_overrides"] = overrides or None
        return load_mtraining_config(data)

    def check_layers(self, num_layers: int, flag: str = "num_layers") -> None:
        """Check that ``dense_layers`` and ``layer_overrides`` name layers of a model with
        ``num_layers`` layers (Megatron's ``--num-layers``: the whole model, every pipeline stage).

        Raises:
            ValueError: ``--num-layers N: mtraining config 'dense_layers' names layer M > N ...``.
        """
        n = int(num_layers)
        where = f"{flag} {n}" if flag.startswith("--") else f"{flag}={n}"
        if self.dense_layers and self.dense_layers[-1] > n:
            raise ValueError(f"{where}: {_PREFIX} 'dense_layers' names layer {self.dense_layers[-1]}, but the model "
                             f"has layers 1..{n} (layer numbers are 1-based and global)")
        for rng, _ in self.layer_overrides or ():
            if rng[1] > n:
                raise ValueError(f"{where}: {_PREFIX} 'layer_overrides' range '{_range_text(rng)}' names layer "
                                 f"{rng[1]}, but the model has layers 1..{n} (layer numbers are 1-based and global)")

    def layer_vertical_slash_configs(self) -> tuple[VerticalSlashConfig, ...]:
        """Every distinct estimator config of the run (``vertical_slash`` and each override)."""
        if not self.sparse:
            return ()
        out = [self.vertical_slash]
        for _, items in self.layer_overrides or ():
            out.append(dataclasses.replace(self.vertical_slash, **dict(items)))
        return tuple(out)

    # ------------------------------------------------------------------ derived values
    @property
    def layout_kind(self) -> str:
        """The :class:`~megatron_mtraining.layout.Layout` kind: ``zigzag`` for the zigzag
        implementation, ``striped`` otherwise."""
        return "zigzag" if self.implementation == "zigzag" else "striped"

    @property
    def sparse(self) -> bool:
        return self.pattern == "vertical_slash"

    def make_layout(self, cp_size: int) -> Layout:
        """The sequence layout over a CP group of ``cp_size`` ranks."""
        return Layout(self.layout_kind, cp_size=cp_size, granularity=self.granularity)

    def hierarchical_sizes(self, cp_size: int,
                           megatron_sizes: Optional[Sequence[int]] = None) -> Optional[tuple[int, int]]:
        """``(inner, outer)`` for the hierarchical ring, ``None`` for the flat implementations.

        Args:
            cp_size: the context-parallel size.
            megatron_sizes: Megatron's ``--hierarchical-context-parallel-sizes`` (``None`` if not
                given). Used when the config has no ``hierarchical:`` sizes; when both are given
                they must agree.

        Raises:
            ValueError: no sizes anywhere, sizes that disagree, ``inner * outer != cp_size``, or
                Megatron sizes that are not exactly two numbers.
        """
        if self.implementation != "hierarchical":
            return None
        mg = None if megatron_sizes is None else tuple(int(x) for x in megatron_sizes)
        if mg is not None and len(mg) != 2:
            raise ValueError(f"{_PREFIX}: implementation 'hierarchical' needs exactly two "
                             f"--hierarchical-context-parallel-sizes (inner outer), got {list(mg)}")
        own = self.hierarchical.sizes
        if own is not None and mg is not None and own != mg:
            raise ValueError(f"{_PREFIX}: 'hierarchical' sizes inner={own[0]}, outer={own[1]} disagree with "
                             f"--hierarchical-context-parallel-sizes {mg[0]} {mg[1]}")
        sizes = own or mg
        if sizes is None:
            raise ValueError(f"{_PREFIX}: implementation 'hierarchical' needs 'hierarchical.inner'/'outer' or "
                             "--hierarchical-context-parallel-sizes INNER OUTER")
        if sizes[0] < 2 or sizes[1] < 2:
            raise ValueError(f"{_PREFIX}: hierarchical ring needs inner and outer >= 2, got {sizes}")
        if sizes[0] * sizes[1] != cp_size:
            raise ValueError(f"{_PREFIX}: hierarchical inner*outer = {sizes[0]}*{sizes[1]} != context-parallel "
                             f"size {cp_size}")
        return sizes

    def check_run(self, cp_size: int, seq_len: int,
                  megatron_hierarchical_sizes: Optional[Sequence[int]] = None) -> None:
        """Check the config against a run: the layout can split ``seq_len`` over ``cp_size`` ranks,
        sparse blocks stay whole, there are enough tokens for the probe queries, and the
        hierarchical sizes resolve.

        Raises:
            ValueError: naming the config key and the rule.
        """
        for name, val in (("context-parallel size", cp_size), ("sequence length", seq_len)):
            if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
                raise ValueError(f"{_PREFIX}: {name} must be an int >= 1, got {val!r}")
        cp_size, seq_len = int(cp_size), int(seq_len)
        layout = self.make_layout(cp_size)
        try:
            layout.check_seq_len(seq_len)
        except ValueError as e:
            key = "'granularity'" if self.layout_kind == "striped" else "'implementation' (zigzag)"
            raise ValueError(f"{_PREFIX}: {key}: {e}") from None
        self.hierarchical_sizes(cp_size, megatron_hierarchical_sizes)
        if self.sparse:
            vs = self.vertical_slash
            if layout.chunk_len(seq_len) % vs.block_size != 0:
                raise ValueError(f"{_PREFIX}: 'vertical_slash.block_size' ({vs.block_size}) must divide the "
                                 f"{layout.kind} chunk length {layout.chunk_len(seq_len)} (sequence {seq_len}, "
                                 f"cp {cp_size})")
            if vs.last_q > seq_len:
                raise ValueError(f"{_PREFIX}: 'vertical_slash.last_q' ({vs.last_q}) exceeds the sequence "
                                 f"length {seq_len}")
            for rng, items in self.layer_overrides or ():
                last_q = dict(items).get("last_q")
                if last_q is not None and last_q > seq_len:
                    raise ValueError(f"{_PREFIX}: 'layer_overrides.{_range_text(rng)}.last_q' ({last_q}) exceeds "
                                     f"the sequence length {seq_len}")

    @staticmethod
    def cuda_graphs_cp_rule(cp_size: int) -> str:
        """The error text of ``cuda_graphs: true`` at ``cp_size > 1``."""
        return (f"{_PREFIX}: 'cuda_graphs: true' needs context-parallel size 1 (the ring's K/V exchanges are not "
                f"captured), got {cp_size}; set cuda_graphs: false")

    def with_hierarchical_sizes(self, sizes: Optional[Sequence[int]]) -> "MTrainingConfig":
        """This config with ``hierarchical.inner``/``outer`` set to ``sizes`` (``None``: unchanged)."""
        if sizes is None:
            return self
        inner, outer = (int(x) for x in sizes)
        return dataclasses.replace(self, hierarchical=HierarchicalConfig(inner=inner, outer=outer))

    def attention_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments: ``layout``, ``granularity``, ``pattern``,
        ``vertical_slash`` (``None`` when dense), ``hierarchical`` (the ``(inner, outer)`` sizes or
        ``None``), ``columns``, ``deterministic`` and ``kernel_backend``. ``vertical_slash`` is the
        base budgets; a per-layer policy (``dense_layers``, ``layer_overrides``) is
        :meth:`layer_pattern` of each layer.

        Raises:
            ValueError: ``implementation: hierarchical`` without sizes (resolve them first with
                :func:`config_for_run`; a flat ring is never substituted).
        """
        if self.implementation == "hierarchical" and self.hierarchical.sizes is None:
            raise ValueError(f"{_PREFIX}: implementation 'hierarchical' needs 'hierarchical.inner'/'outer' or "
                             "--hierarchical-context-parallel-sizes INNER OUTER (resolve the sizes with "
                             "config_for_run)")
        return {
            "layout": self.layout_kind,
            "granularity": self.granularity,
            "pattern": self.pattern,
            "vertical_slash": self.vertical_slash if self.sparse else None,
            "hierarchical": self.hierarchical.sizes,
            "columns": self.columns,
            "deterministic": self.deterministic,
            "kernel_backend": self.kernel_backend,
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the file format (only the sections that apply); round-trips through
        :func:`load_mtraining_config`."""
        out: dict[str, Any] = {"implementation": self.implementation}
        if self.layout_kind == "striped":                        # zigzag has no granularity
            out["granularity"] = self.granularity
        out["pattern"] = self.pattern
        if self.sparse:
            out["vertical_slash"] = dataclasses.asdict(self.vertical_slash)
        if self.hierarchical.sizes is not None:
            out["hierarchical"] = {"inner": self.hierarchical.inner, "outer": self.hierarchical.outer}
        if self.sparse:
            out["columns"] = self.columns
        if self.dense_layers is not None:
            out["dense_layers"] = list(self.dense_layers)
        if self.auto_dense_layers:
            out["dense_layers"] = AUTO
        if self.layer_overrides is not None:
            out["layer_overrides"] = {_range_text(r): dict(items) for r, items in self.layer_overrides}
        out["deterministic"] = self.deterministic
        if self.kernel_backend != "auto":
            out["kernel_backend"] = self.kernel_backend
        if self.cuda_graphs:
            out["cuda_graphs"] = True
        return out


# ---------------------------------------------------------------------------------- loading
_TOP_KEYS = tuple(f.name for f in dataclasses.fields(MTrainingConfig) if f.metadata.get("file_key", True))
_VS_KEYS = tuple(f.name for f in dataclasses.fields(VerticalSlashConfig))
_H_KEYS = tuple(f.name for f in dataclasses.fields(HierarchicalConfig))


def _check_keys(d: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    for k in d:
        if not isinstance(k, str) or k not in allowed:
            raise _ConfigError(f"unknown key '{where}{k}' (allowed: {', '.join(allowed)})")


def _section(d: Mapping[str, Any], name: str) -> Optional[Mapping[str, Any]]:
    """The section ``name`` of ``d``; ``None`` when absent. A key with no value (``vertical_slash:``
    alone) is the empty section, with the same rules."""
    sec = d.get(name)
    if sec is None:
        return {} if name in d else None
    if not isinstance(sec, Mapping):
        raise _ConfigError(f"'{name}' must be a mapping of keys, got {type(sec).__name__} {sec!r}")
    return sec


def _vertical_slash(sec: Mapping[str, Any]) -> VerticalSlashConfig:
    _check_keys(sec, _VS_KEYS, "vertical_slash.")
    try:
        return VerticalSlashConfig(**sec)
    except ValueError as e:
        # "VerticalSlashConfig.recall must be ..." -> "'vertical_slash.recall' must be ..."
        msg = re.sub(r"VerticalSlashConfig\.(\w+)", r"'vertical_slash.\1'", str(e))
        raise _ConfigError(msg) from None


def _from_mapping(d: Mapping[str, Any]) -> MTrainingConfig:
    if isinstance(d, (bytes, bytearray)):
        raise _ConfigError(f"expected a YAML file path (str or os.PathLike), a mapping or an MTrainingConfig, got "
                           f"{type(d).__name__} (decode a bytes path first)")
    if not isinstance(d, Mapping):
        raise _ConfigError(f"top level must be a mapping of keys, got {type(d).__name__}")
    d = plain_numbers(d)
    _check_keys(d, _TOP_KEYS, "")
    kw: dict[str, Any] = {k: d[k] for k in ("implementation", "granularity", "pattern", "columns", "deterministic",
                                            "kernel_backend", "cuda_graphs", "dense_layers", "layer_overrides") if k in d}
    pattern = d.get("pattern", MTrainingConfig.pattern)
    impl = d.get("implementation", MTrainingConfig.implementation)
    if impl == "zigzag" and "granularity" in d:
        g = d["granularity"]
        raise _ConfigError(_ZIGZAG_GRANULARITY_RULE.format(g=g) if g is not None else
                           _ZIGZAG_GRANULARITY_RULE.replace("'granularity: {g}'", "'granularity'"))
    vs = d.get("vertical_slash")
    vs = vs if isinstance(vs, VerticalSlashConfig) else _section(d, "vertical_slash")
    if vs is not None:
        if pattern != "vertical_slash":
            raise _ConfigError(f"'vertical_slash' section given but 'pattern' is {pattern!r} "
                               "(set pattern: vertical_slash or remove the section)")
        kw["vertical_slash"] = vs if isinstance(vs, VerticalSlashConfig) else _vertical_slash(vs)
    h = _section(d, "hierarchical")
    if h is not None:
        if impl != "hierarchical":
            raise _ConfigError(f"'hierarchical' section given but 'implementation' is {impl!r} "
                               "(set implementation: hierarchical or remove the section)")
        _check_keys(h, _H_KEYS, "hierarchical.")
        kw["hierarchical"] = HierarchicalConfig(**h)
    return MTrainingConfig(**kw)


def _yaml_load(text: str) -> Any:
    """``yaml.safe_load`` that rejects duplicate keys (PyYAML keeps the last one silently)."""
    import yaml

    class _StrictLoader(yaml.SafeLoader):
        pass

    def _mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":      # "<<: *anchor": merged by construct_mapping
                continue
            key = loader.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict, set)):
                raise _ConfigError(f"a key must be a name or a number, got {key!r} "
                                   f"(line {key_node.start_mark.line + 1})")
            if key in seen:
                raise _ConfigError(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    _StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
    return yaml.load(text, Loader=_StrictLoader)


def load_mtraining_config(
    path_or_dict: Union[str, os.PathLike, Mapping[str, Any], MTrainingConfig, None],
) -> MTrainingConfig:
    """Load and validate an MTraining config.

    Args:
        path_or_dict: a YAML file path, a mapping with the same structure, an
            :class:`MTrainingConfig` (returned as is) or ``None`` (all defaults: dense striped,
            granularity 64). An empty file also gives the defaults.

    Returns:
        The validated, immutable :class:`MTrainingConfig`.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: YAML syntax errors, unknown keys, duplicate keys, wrong types or values; the
            message starts with ``mtraining config`` (plus the file name) and names the key.
    """
    if path_or_dict is None:
        return MTrainingConfig()
    if isinstance(path_or_dict, MTrainingConfig):
        return path_or_dict
    where = _PREFIX
    if isinstance(path_or_dict, (str, os.PathLike)):
        if not os.fspath(path_or_dict):
            raise ValueError(f"{_PREFIX}: the path is empty (give a YAML config file)")
        path = Path(path_or_dict)
        if path.is_dir():
            raise ValueError(f"{_PREFIX} {path}: is a directory, not a YAML config file")
        if not path.exists():
            raise FileNotFoundError(f"{_PREFIX}: file not found: {path}")
        if not path.is_file():      # a pipe or device: the run reads its config more than once
            raise ValueError(f"{_PREFIX} {path}: not a regular file (a YAML config file is expected; the run reads "
                             "it more than once, so pipes and process substitution do not work)")
        where = f"{_PREFIX} {path}"
        import yaml

        try:
            data = _yaml_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 text (a YAML config file is expected): {e}") from None
        except _ConfigError as e:
            raise ValueError(f"{where}: {e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{where}: invalid YAML: {e}") from None
        if data is None:
            data = {}
    else:
        data = path_or_dict
    try:
        return _from_mapping(data)
    except _ConfigError as e:
        raise ValueError(f"{where}: {e}") from None
    except ValueError as e:  # raised by MTrainingConfig.__post_init__, already prefixed
        msg = str(e)
        if where != _PREFIX and msg.startswith(_PREFIX + ":"):
            msg = where + msg[len(_PREFIX):]
        raise ValueError(msg) from None
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None


def dump_mtraining_config(cfg: MTrainingConfig, path: Union[str, os.PathLike, None] = None) -> str:
    """YAML text of ``cfg`` (written to ``path`` when given); loads back to an equal config."""
    import yaml

    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


# ---------------------------------------------------------------------------- the run rule
def config_for_run(
    config: Union[str, os.PathLike, Mapping[str, Any], MTrainingConfig, None],
    *,
    cp_size: int,
    seq_len: Optional[int] = None,
    megatron_hierarchical_sizes: Optional[Sequence[int]] = None,
    cp_layout: Optional[str] = None,
    granularity: Optional[int] = None,
    num_layers: Optional[int] = None,
) -> MTrainingConfig:
    """The config of a run, checked against it: the one rule of every front door.

    ``examples/pretrain_gpt.py``'s flags, the Megatron-LM patch and direct API users all call this,
    so a command line gets the same verdict everywhere. Without a config the run is the dense ring
    on ``cp_layout`` (default striped) with ``granularity`` (default 64), and Megatron's
    ``--hierarchical-context-parallel-sizes`` select the dense hierarchical ring (MTraining §4.2). A
    config given explicitly fixes the implementation: hierarchical sizes with a flat config are an
    error (the run would silently use a flat ring), as is ``implementation: hierarchical`` with
    no sizes anywhere; it fixes the layout too (``cp_layout`` / ``granularity`` given with a config
    must agree with it). The kernel backend's rules depend on the run's device, dtype and shape:
    the command-line front doors check them with :func:`megatron_mtraining.plan.kernel_backend_problem`,
    the direct API at the first forward (:func:`megatron_mtraining.ops.backends.select_backend`).

    Args:
        config: a YAML path, mapping or :class:`MTrainingConfig`; ``None``: no config given.
        cp_size: the context-parallel size.
        seq_len: the sequence length (checked against the layout and sparse blocks when given).
        megatron_hierarchical_sizes: ``--hierarchical-context-parallel-sizes`` (``None``: not given).
        cp_layout, granularity: the layout flags (``None``: not given). Without a config they choose
            the layout; with one they must agree with it (the config fixes the layout). ``granularity``
            with the zigzag layout is an error (zigzag has none).
        num_layers: the model's number of layers (``--num-layers``, the whole model); when given,
            ``dense_layers`` and ``layer_overrides`` must name layers ``1 .. num_layers``.

    Returns:
        The validated config, with ``hierarchical`` sizes filled in for the hierarchical ring.

    Raises:
        ValueError: naming the config key or flag and the rule.
        FileNotFoundError: a config path that does not exist.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, numbers.Integral) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if cp_layout not in (None, "striped", "zigzag"):
        raise ValueError(f"--cp-layout must be striped or zigzag, got {cp_layout!r}")
    try:
        hcp = None if megatron_hierarchical_sizes is None else [int(x) for x in megatron_hierarchical_sizes]
    except (TypeError, ValueError):
        raise ValueError(f"--hierarchical-context-parallel-sizes must be two ints INNER OUTER, got "
                         f"{megatron_hierarchical_sizes!r}") from None

    def no_zigzag_granularity(what: str) -> None:          # zigzag has none: refused, not ignored
        if granularity is not None:
            raise ValueError(f"--cp-granularity {granularity} applies to the striped layout only; {what} splits each "
                             "sequence into 2 x CP chunks and has no granularity: drop the flag")

    if config is None:
        if hcp and cp_layout == "zigzag":
            raise ValueError("--hierarchical-context-parallel-sizes selects the hierarchical ring, which uses the "
                             "striped layout; --cp-layout zigzag is not supported with it")
        if cp_layout == "zigzag":
            no_zigzag_granularity("--cp-layout zigzag")
        cfg = MTrainingConfig(implementation="hierarchical" if hcp else
                              ("zigzag" if cp_layout == "zigzag" else "striped"),
                              granularity=64 if granularity is None else granularity)
        src = "the default config"
    else:
        cfg = load_mtraining_config(config)
        src = f"{config}" if isinstance(config, (str, os.PathLike)) else "the mtraining config"
        if cp_layout is not None and cp_layout != cfg.layout_kind:
            raise ValueError(f"--cp-layout {cp_layout} disagrees with {src} (implementation '{cfg.implementation}' "
                             f"uses the {cfg.layout_kind} layout); the config fixes the layout: drop the flag")
        if cfg.layout_kind == "zigzag":
            no_zigzag_granularity(f"{src} (zigzag layout)")
        if granularity is not None and (isinstance(granularity, bool) or not isinstance(granularity, numbers.Integral)
                                        or int(granularity) != cfg.granularity):
            raise ValueError(f"--cp-granularity {granularity} disagrees with {src} (granularity {cfg.granularity}); "
                             "the config fixes the layout: drop the flag or change 'granularity' in the config")
    if hcp and cfg.implementation != "hierarchical":
        raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hcp))} is given but {src} has "
                         f"implementation '{cfg.implementation}' (the run would use a flat ring); use a config "
                         "with implementation: hierarchical or drop the flag")
    if cfg.cuda_graphs and cp_size != 1:
        raise ValueError(cfg.cuda_graphs_cp_rule(cp_size))
    if seq_len is not None:
        cfg.check_run(cp_size=cp_size, seq_len=seq_len, megatron_hierarchical_sizes=hcp)
    if num_layers is not None:
        cfg.check_layers(num_layers, flag="--num-layers")
    return cfg.with_hierarchical_sizes(cfg.hierarchical_sizes(cp_size, hcp))


# ------------------------------------------------------------------------------------ CLI
def _pretrain_flags(cfg: MTrainingConfig) -> list[str]:
    """Flags of ``examples/pretrain_gpt.py`` builds without ``--mtraining-config`` that express
    ``cfg``; ``ValueError`` when the config needs more than a layout and a granularity."""
    if cfg.sparse or cfg.implementation == "hierarchical":
        need = "pattern: vertical_slash" if cfg.sparse else "implementation: hierarchical"
        raise ValueError(f"{_PREFIX}: {need} cannot be expressed with --cp-layout/--cp-granularity; this "
                         "pretrain_gpt.py needs --mtraining-config")
    if cfg.layout_kind == "zigzag":                # no granularity: the flag is refused with zigzag
        return ["--cp-layout", "zigzag"]
    return ["--cp-layout", cfg.layout_kind, "--cp-granularity", str(cfg.granularity)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m megatron_mtraining.config [--pretrain-flags] FILE...``: validate config files.

    Prints one summary line per file (exit 0), or the error naming the key (exit 1). With
    ``--pretrain-flags`` (one file) prints the equivalent ``--cp-layout``/``--cp-granularity``
    flags instead (used by examples/slurm/ when pretrain_gpt.py has no ``--mtraining-config``).
    """
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m megatron_mtraining.config",
                                description="Validate MTraining YAML configs.")
    p.add_argument("--pretrain-flags", action="store_true",
                   help="print the equivalent --cp-layout/--cp-granularity flags (one file)")
    p.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    if a.pretrain_flags and len(a.files) != 1:
        p.error("--pretrain-flags takes exactly one file")
    rc = 0
    for f in a.files:
        try:
            cfg = load_mtraining_config(f)
            if a.pretrain_flags:
                print(" ".join(_pretrain_flags(cfg)))
                continue
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 1
            continue
        vs = f", recall {cfg.vertical_slash.recall}" if cfg.sparse else ""
        hs = f", inner x outer {cfg.hierarchical.inner} x {cfg.hierarchical.outer}" if cfg.hierarchical.sizes else ""
        hs += f", {cfg.layer_policy_text()}" if cfg.has_layer_policy else ""
        gs = f", granularity {cfg.granularity}" if cfg.layout_kind == "striped" else ""
        print(f"{f}: ok ({cfg.implementation}{gs}, {cfg.pattern}{vs}{hs}"
              f"{', deterministic' if cfg.deterministic else ''})")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

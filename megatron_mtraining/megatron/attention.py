"""``MTrainingAttention``: a megatron-core 0.16.1 ``core_attention`` that runs ring attention.

It replaces ``TEDotProductAttention`` / ``DotProductAttention`` inside ``SelfAttention`` (see
:func:`megatron_mtraining.megatron.spec.get_gpt_layer_spec_with_mtraining`). ``SelfAttention``
has already projected, split and RoPE-rotated q/k/v; this module only computes
``softmax(q k^T * softmax_scale + causal) v`` over the *whole* sequence, which is split across
the context-parallel (CP) group with a :class:`~megatron_mtraining.layout.Layout` (striped by
default), by calling :func:`megatron_mtraining.ring.ring_attention`.

Consistency requirement: the batch must be split with the same layout
(:func:`megatron_mtraining.megatron.batch.get_batch_on_this_cp_rank_striped`) and RoPE must use
the same positions (:func:`megatron_mtraining.megatron.rope.install_layout_rope`). Megatron's own
``get_batch_on_this_cp_rank`` and ``RotaryEmbedding`` CP slicing assume the zigzag layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mtraining.layout import LAYOUT_KINDS, Layout
from megatron_mtraining.ops.backends import select_backend
from megatron_mtraining.ring import ring_attention
from megatron_mtraining.ring.hierarchical import hierarchical_ring_attention
from megatron_mtraining.ring.sparse import sparse_ring_attention

__all__ = ["MTrainingAttentionConfig", "MTrainingAttention", "get_cp_group"]


@dataclass(frozen=True)
class MTrainingAttentionConfig:
    """Options of the MTraining CP attention backend (passed through ``ModuleSpec.params``).

    Args:
        layout: CP sequence layout kind, ``"striped"`` (default, MTraining) or ``"zigzag"``
            (Megatron/TE DualChunkSwap; useful as a baseline). ``"contiguous"`` is accepted too.
        granularity: striped chunk size in tokens (default 64); ignored by the other layouts.
        pattern: ``"dense"`` (exact causal attention) or ``"vertical_slash"`` (MTraining's dynamic
            sparse pattern, estimated online every forward; paper §3.2).
        vertical_slash: the estimator's budgets (``VerticalSlashConfig``); default budgets when
            ``None`` and the pattern is sparse.
        hierarchical: ``(inner, outer)`` ring sizes for the two-level ring (paper §4.2) over
            Megatron's hierarchical CP groups (``--hierarchical-context-parallel-sizes``), or
            ``None`` for the flat ring.
        columns: ``"in_ring"`` or ``"out_of_ring"``: where the sparse pattern's vertical columns are
            computed (:func:`~megatron_mtraining.ring.sparse.sparse_ring_attention`).
        deterministic: GPU sparse backward without atomics (bitwise repeatable).

    Raises:
        ValueError: unknown layout kind or pattern, ``granularity < 1``, bad hierarchical sizes.
    """

    layout: str = "striped"
    granularity: int = 64
    pattern: str = "dense"
    vertical_slash: Optional[Any] = None
    hierarchical: Optional[tuple] = None
    columns: str = "in_ring"
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.layout not in LAYOUT_KINDS:
            raise ValueError(f"MTrainingAttentionConfig.layout must be one of {LAYOUT_KINDS}, got {self.layout!r}")
        if int(self.granularity) < 1:
            raise ValueError(f"MTrainingAttentionConfig.granularity must be >= 1, got {self.granularity}")
        if self.pattern not in ("dense", "vertical_slash"):
            raise ValueError(f"MTrainingAttentionConfig.pattern must be 'dense' or 'vertical_slash', got {self.pattern!r}")
        if self.columns not in ("in_ring", "out_of_ring"):
            raise ValueError(f"MTrainingAttentionConfig.columns must be 'in_ring' or 'out_of_ring', got {self.columns!r}")
        if self.columns != "in_ring" and self.pattern != "vertical_slash":
            raise ValueError(f"MTrainingAttentionConfig.columns={self.columns!r} applies to pattern='vertical_slash' "
                             f"only, got pattern={self.pattern!r}")
        if self.hierarchical is not None:
            if len(self.hierarchical) != 2 or min(int(x) for x in self.hierarchical) < 2:
                raise ValueError("MTrainingAttentionConfig.hierarchical must be (inner, outer) with both >= 2, "
                                 f"got {self.hierarchical!r}")
            object.__setattr__(self, "hierarchical", tuple(int(x) for x in self.hierarchical))
        if self.pattern == "vertical_slash" and self.vertical_slash is None:
            from megatron_mtraining.patterns.estimator import VerticalSlashConfig

            object.__setattr__(self, "vertical_slash", VerticalSlashConfig())

    def make_layout(self, cp_size: int) -> Layout:
        """The :class:`Layout` for a CP group of ``cp_size`` ranks."""
        return Layout(self.layout, cp_size=cp_size, granularity=self.granularity)


def get_cp_group(pg_collection: Any = None) -> Optional[dist.ProcessGroup]:
    """The context-parallel group: ``pg_collection.cp`` if given, else megatron's global
    ``parallel_state`` CP group, else ``None`` (no CP)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None and dist.is_available() and dist.is_initialized():
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group


def get_hierarchical_groups(pg_collection: Any, sizes: tuple, cp_size: int) -> tuple:
    """``(inner, outer)`` process groups: ``pg_collection.hcp`` (Megatron's hierarchical CP groups,
    level 0 = inner, level 1 = outer), else ``parallel_state``'s.

    Raises:
        ValueError: the groups are missing (Megatron was initialised without
            ``hierarchical_context_parallel_sizes``) or their sizes differ from ``sizes`` — a run
            that would silently fall back to a flat ring is an error.
    """
    groups = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    if not groups:
        groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not groups or len(groups) != 2:
        raise ValueError(f"hierarchical ring {sizes[0]}x{sizes[1]} needs Megatron's hierarchical CP groups: "
                         "initialize_model_parallel(..., hierarchical_context_parallel_sizes=[inner, outer]) "
                         "(--hierarchical-context-parallel-sizes INNER OUTER)")
    got = (_group_size(groups[0]), _group_size(groups[1]))
    if got != tuple(sizes) or got[0] * got[1] != cp_size:
        raise ValueError(f"hierarchical ring sizes {tuple(sizes)} but Megatron's hierarchical CP groups have "
                         f"inner={got[0]}, outer={got[1]} (context-parallel size {cp_size})")
    return groups[0], groups[1]


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


class MTrainingAttention(MegatronModule):
    """Causal self-attention over a CP-sharded sequence (megatron-core ``core_attention``).

    Constructor arguments follow megatron-core 0.16.1's ``CoreAttentionBuilder`` contract
    (``Attention.__init__`` passes them as keywords), plus ``mtraining_config`` from the
    ``ModuleSpec.params``.

    Args:
        config: the model's ``TransformerConfig``.
        layer_number: 1-based global layer number (unused; kept for the contract).
        attn_mask_type: must be ``AttnMaskType.causal`` (GPT).
        attention_type: must be ``"self"``.
        attention_dropout: dropout probability; ``None`` means ``config.attention_dropout``.
            Must be 0 (the ring kernels have no dropout).
        softmax_scale: scale of ``q k^T``; ``None`` means ``1/sqrt(head_dim)``.
        cp_comm_type: megatron's TE CP communication type; ignored (ring communication is fixed).
        pg_collection: process groups; the CP group is ``pg_collection.cp`` (falls back to
            ``parallel_state.get_context_parallel_group()``).
        mtraining_config: layout options (default: striped, granularity 64).

    Raises:
        ValueError: attention dropout > 0.
        NotImplementedError: ``attn_mask_type`` other than causal, or cross attention.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        mtraining_config: Optional[MTrainingAttentionConfig] = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.mtraining_config = mtraining_config or MTrainingAttentionConfig()
        self._check_mask_type(attn_mask_type, "attn_mask_type (from the layer spec)")
        if attention_type != "self":
            raise NotImplementedError(
                f"MTrainingAttention supports self-attention only, got attention_type={attention_type!r}"
            )
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        if p and p > 0.0:
            raise ValueError(
                f"MTrainingAttention does not support attention dropout (got attention_dropout={p}); "
                "set TransformerConfig.attention_dropout=0.0 (--attention-dropout 0.0)"
            )
        self.softmax_scale = softmax_scale
        self.cp_comm_type = cp_comm_type
        self.cp_group = get_cp_group(pg_collection)
        self.cp_size = _group_size(self.cp_group)
        if self.cp_size != config.context_parallel_size:
            raise ValueError(
                f"CP group has {self.cp_size} ranks but TransformerConfig.context_parallel_size="
                f"{config.context_parallel_size}"
            )
        self.layout = self.mtraining_config.make_layout(self.cp_size)
        self.hierarchical_groups = None
        if self.mtraining_config.hierarchical is not None:
            self.hierarchical_groups = get_hierarchical_groups(pg_collection, self.mtraining_config.hierarchical,
                                                               self.cp_size)

    @staticmethod
    def _check_mask_type(mask_type: Any, what: str) -> None:
        if mask_type != AttnMaskType.causal:
            raise NotImplementedError(
                f"MTrainingAttention supports causal attention only, got {what}={mask_type}"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Causal attention of this rank's queries against the whole (CP-sharded) sequence.

        Args:
            query: ``[s_local, b, np, hn]`` (np = query heads per TP rank), RoPE applied.
            key, value: ``[s_local, b, ng, hn]`` (ng = query groups per TP rank; GQA, not expanded).
            attention_mask: ignored. For GPT it is either ``None`` (``create_attention_mask=False``)
                or the plain causal mask ``[b, 1, s_local, s]`` built by the dataset for the
                *zigzag* query rows, which is wrong for any other layout; causality is instead
                enforced from the layout's global positions inside ring attention.
            attn_mask_type: if given, must be ``AttnMaskType.causal``.
            attention_bias: must be ``None``.
            packed_seq_params: must be ``None`` (THD / packed sequences are not supported).

        Returns:
            ``[s_local, b, np * hn]``, dtype of ``query``.

        Raises:
            NotImplementedError: ``attention_bias``, ``packed_seq_params`` or a non-causal mask type.
            ValueError: malformed shapes (head counts not GQA-compatible, q/k length mismatch).
        """
        if attention_bias is not None:
            raise NotImplementedError("MTrainingAttention does not support attention_bias")
        if packed_seq_params is not None:
            raise NotImplementedError(
                "MTrainingAttention does not support packed sequences (packed_seq_params / THD format)"
            )
        if attn_mask_type is not None:
            self._check_mask_type(attn_mask_type, "attn_mask_type")
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                "MTrainingAttention expects sbhd tensors: query [s, b, np, hn], key/value [s, b, ng, hn]; "
                f"got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        sq, b, np_, hn = query.shape
        sk, _, ng, _ = key.shape
        if sk != sq or key.shape != value.shape:
            raise ValueError(
                f"MTrainingAttention: key/value {tuple(key.shape)}/{tuple(value.shape)} must match "
                f"query length {sq}"
            )
        if np_ % ng != 0:
            raise ValueError(f"GQA: query heads ({np_}) must be a multiple of key/value groups ({ng})")
        self.layout.check_seq_len(sq * self.cp_size)

        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(hn)
        q = query.transpose(0, 1).contiguous()  # [b, s_local, np, hn]
        k = key.transpose(0, 1).contiguous()  # [b, s_local, ng, hn]
        v = value.transpose(0, 1).contiguous()
        cfg = self.mtraining_config
        sparse = cfg.pattern == "vertical_slash"
        backend = select_backend("auto", device=q.device, dtype=q.dtype, head_dim=hn, seq_len_local=sq,
                                 cp_size=self.cp_size, sparse=sparse, deterministic=cfg.deterministic)
        if sparse:
            out = sparse_ring_attention(q, k, v, layout=self.layout, group=self.cp_group, config=cfg.vertical_slash,
                                        softmax_scale=scale, hierarchical_groups=self.hierarchical_groups,
                                        columns=cfg.columns, backend=backend)
        elif self.hierarchical_groups is not None:
            inner, outer = self.hierarchical_groups
            out = hierarchical_ring_attention(q, k, v, layout=self.layout, inner_group=inner, outer_group=outer,
                                              softmax_scale=scale, causal=True, backend=backend)
        else:
            out = ring_attention(
                q, k, v, layout=self.layout, group=self.cp_group, softmax_scale=scale, causal=True, backend=backend
            )  # [b, s_local, np, hn]
        return out.transpose(0, 1).reshape(sq, b, np_ * hn)

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

__all__ = ["MTrainingAttentionConfig", "MTrainingAttention", "get_cp_group"]


@dataclass(frozen=True)
class MTrainingAttentionConfig:
    """Options of the MTraining CP attention backend (passed through ``ModuleSpec.params``).

    Args:
        layout: CP sequence layout kind, ``"striped"`` (default, MTraining) or ``"zigzag"``
            (Megatron/TE DualChunkSwap; useful as a baseline). ``"contiguous"`` is accepted too.
        granularity: striped chunk size in tokens (default 64); ignored by the other layouts.

    Raises:
        ValueError: unknown layout kind or ``granularity < 1``.
    """

    layout: str = "striped"
    granularity: int = 64

    def __post_init__(self) -> None:
        if self.layout not in LAYOUT_KINDS:
            raise ValueError(f"MTrainingAttentionConfig.layout must be one of {LAYOUT_KINDS}, got {self.layout!r}")
        if int(self.granularity) < 1:
            raise ValueError(f"MTrainingAttentionConfig.granularity must be >= 1, got {self.granularity}")

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

        from megatron_mtraining import ring  # resolved at call time (lets tests substitute it)

        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(hn)
        q = query.transpose(0, 1).contiguous()  # [b, s_local, np, hn]
        k = key.transpose(0, 1).contiguous()  # [b, s_local, ng, hn]
        v = value.transpose(0, 1).contiguous()
        out = ring.ring_attention(
            q, k, v, layout=self.layout, group=self.cp_group, softmax_scale=scale, causal=True
        )  # [b, s_local, np, hn]
        return out.transpose(0, 1).reshape(sq, b, np_ * hn)

"""``MTrainingAttention``: a megatron-core ``core_attention`` (0.16.1 to 0.19) that runs ring attention.

It replaces ``TEDotProductAttention`` / ``DotProductAttention`` inside ``SelfAttention`` (see
:func:`megatron_mtraining.megatron.spec.get_gpt_layer_spec_with_mtraining`). ``SelfAttention``
has already projected, split and RoPE-rotated q/k/v; this module only computes
``softmax(q k^T * softmax_scale + causal) v`` over the *whole* sequence, which is split across
the context-parallel (CP) group with a :class:`~megatron_mtraining.layout.Layout` (striped by
default), by calling :func:`megatron_mtraining.ring.ring_attention` (or the sparse / hierarchical ring of
the layer's policy) through :meth:`~megatron_mtraining.plan.CPPlan.attention`.

Consistency requirement: the batch must be split with the same layout
(:func:`megatron_mtraining.megatron.batch.get_batch_on_this_cp_rank_striped`) and RoPE must use
the same positions (:func:`megatron_mtraining.megatron.rope.install_layout_rope`). Megatron's own
``get_batch_on_this_cp_rank`` and ``RotaryEmbedding`` CP slicing assume the zigzag layout.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mtraining.common import REGION_COPIES, check_softmax_scale, record_function, resolve_softmax_scale
from megatron_mtraining.config import MTrainingConfig, load_mtraining_config
from megatron_mtraining.megatron.packed import documents_from_packed_seq_params
from megatron_mtraining.megatron.rope import rope_layout_error
from megatron_mtraining.plan import CPPlan, DocumentPacking, resolve

__all__ = ["MTrainingAttention", "get_cp_group", "get_hierarchical_groups", "get_layer_policy_groups",
           "plan_for_model"]


def get_cp_group(pg_collection: Any = None) -> Optional[dist.ProcessGroup]:
    """The context-parallel group: ``pg_collection.cp`` if given, else megatron's global
    ``parallel_state`` CP group, else ``None`` (no CP)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None and dist.is_available() and dist.is_initialized():
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group


def get_hierarchical_groups(pg_collection: Any = None) -> Optional[tuple]:
    """``(inner, outer)``: ``pg_collection.hcp`` (Megatron's hierarchical CP groups, level 0 = inner,
    level 1 = outer), else ``parallel_state``'s; ``None`` when Megatron was initialised without
    ``hierarchical_context_parallel_sizes``."""
    groups = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    if not groups and dist.is_available() and dist.is_initialized():
        groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not groups:
        return None
    if len(groups) != 2:
        raise ValueError(f"the hierarchical ring needs two levels of hierarchical CP groups (inner, outer), got "
                         f"{len(groups)} (--hierarchical-context-parallel-sizes INNER OUTER)")
    return groups[0], groups[1]


def get_layer_policy_groups(pg_collection: Any = None) -> tuple:
    """The groups over which ``dense_layers: auto`` agrees on a layer's decision: every rank holding the
    layer. Megatron's data-parallel group with CP (``pg_collection.dp_cp``, else ``parallel_state``'s),
    then the tensor-parallel group (``pg_collection.tp``, else ``parallel_state``'s); pipeline stages hold
    other layers and are not included. ``()`` without ``torch.distributed``."""
    groups = []
    for name, getter in (("dp_cp", lambda: parallel_state.get_data_parallel_group(with_context_parallel=True)),
                         ("tp", lambda: parallel_state.get_tensor_model_parallel_group(check_initialized=False))):
        group = getattr(pg_collection, name, None) if pg_collection is not None else None
        if group is None and dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized():
            group = getter()
        if group is not None:
            groups.append(group)
    return tuple(groups)


def plan_for_model(mtraining_config: Union[MTrainingConfig, CPPlan, None], pg_collection: Any = None,
                   packing: Optional[DocumentPacking] = None) -> CPPlan:
    """The :class:`~megatron_mtraining.plan.CPPlan` of a model: ``mtraining_config`` itself when it
    is a plan, else the config resolved over the CP group (and, for ``implementation: hierarchical``,
    Megatron's hierarchical CP groups) of ``pg_collection`` / ``parallel_state``, with the run's
    document ``packing`` (:class:`~megatron_mtraining.plan.DocumentPacking`).

    Raises:
        ValueError: as :func:`~megatron_mtraining.plan.resolve` (e.g. a hierarchical config without
            Megatron's hierarchical CP groups).
    """
    if isinstance(mtraining_config, CPPlan):
        return mtraining_config
    cfg = load_mtraining_config(mtraining_config)
    hier = get_hierarchical_groups(pg_collection) if cfg.implementation == "hierarchical" else None
    if cfg.implementation == "hierarchical" and hier is None:
        raise ValueError("mtraining config: implementation 'hierarchical' needs Megatron's hierarchical CP groups: "
                         "initialize_model_parallel(..., hierarchical_context_parallel_sizes=[inner, outer]) "
                         "(--hierarchical-context-parallel-sizes INNER OUTER)")
    return resolve(cfg, cp_group=get_cp_group(pg_collection), hierarchical_groups=hier, packing=packing)


def _group_size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _is_plain_causal_mask(mask: torch.Tensor) -> bool:
    """True for Megatron's plain causal mask (``True`` above the diagonal of its last two dims)."""
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    s = mask.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
    return bool((mask.bool() == causal).all())


class MTrainingAttention(MegatronModule):
    """Causal self-attention over a CP-sharded sequence (megatron-core ``core_attention``).

    Constructor arguments follow megatron-core's ``CoreAttentionBuilder`` contract (0.16.1 to 0.19)
    (``Attention.__init__`` passes them as keywords), plus ``mtraining_config`` from the
    ``ModuleSpec.params``.

    Args:
        config: the model's ``TransformerConfig``.
        layer_number: 1-based global layer number (megatron-core adds the pipeline stage's offset);
            selects this layer's view of the plan (:meth:`~megatron_mtraining.plan.CPPlan.for_layer`):
            the exact dense ring for the config's ``dense_layers``, the ``layer_overrides`` budgets,
            or ``vertical_slash``.
        attn_mask_type: must be ``AttnMaskType.causal`` (GPT).
        attention_type: must be ``"self"``.
        attention_dropout: dropout probability; ``None`` means ``config.attention_dropout``.
            Must be 0 (the ring kernels have no dropout).
        softmax_scale: scale of ``q k^T``; ``None`` means ``1/sqrt(head_dim)``.
        cp_comm_type: megatron's TE CP communication type; ignored (ring communication is fixed).
        pg_collection: process groups; the CP group is ``pg_collection.cp`` (falls back to
            ``parallel_state.get_context_parallel_group()``), the hierarchical groups
            ``pg_collection.hcp``.
        mtraining_config: the :class:`~megatron_mtraining.plan.CPPlan` of the run (shared by all
            layers), or an :class:`~megatron_mtraining.config.MTrainingConfig` (resolved here over
            the CP group; default: dense striped ring, granularity 64).

    Raises:
        ValueError: attention dropout > 0, a plan or CP group whose size is not
            ``TransformerConfig.context_parallel_size``, a hierarchical config without Megatron's
            hierarchical CP groups, ``dense_layers`` / ``layer_overrides`` naming a layer past
            ``TransformerConfig.num_layers``.
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
        mtraining_config: Union[MTrainingConfig, CPPlan, None] = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
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
        if softmax_scale is not None:      # a NaN or infinite scale gives NaN outputs: refused when the layer is built
            check_softmax_scale(resolve_softmax_scale(softmax_scale, 1), "MTrainingAttention")
        self.softmax_scale = softmax_scale
        self.cp_comm_type = cp_comm_type
        self.plan = plan_for_model(mtraining_config, pg_collection).for_layer(
            layer_number, num_layers=getattr(config, "num_layers", None))
        self.mtraining_config = self.plan.config
        self.cp_group = self.plan.cp_group
        self.cp_size = self.plan.cp_size
        if self.cp_size != config.context_parallel_size:
            raise ValueError(
                f"CP group has {self.cp_size} ranks but TransformerConfig.context_parallel_size="
                f"{config.context_parallel_size}"
            )
        self.layout = self.plan.layout
        self.hierarchical_groups = self.plan.hierarchical_groups
        # this layer's own runner (CUDA graphs: its own graphs; dense_layers: auto: its own measurement, agreed
        # by every rank that holds the layer)
        policy_groups = get_layer_policy_groups(pg_collection) if self.mtraining_config.auto_dense_layers else ()
        self._attention = self.plan.attention_runner(policy_groups)
        self.rope_installed = False     # set by install_layout_rope on the model holding this layer
        self._rope_checked = False

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
            attention_mask: ``None`` (``create_attention_mask=False``) or the plain causal mask
                ``[b, 1, s, s]`` (ignored: causality is enforced from the layout's global positions
                inside ring attention). Any other dense mask is refused (documents come as
                ``packed_seq_params``).
            attn_mask_type: if given, must be ``AttnMaskType.causal``.
            attention_bias: must be ``None``.
            packed_seq_params: ``None``, or megatron-core's ``PackedSeqParams`` of packed documents
                (:mod:`megatron_mtraining.megatron.packed`): ``qkv_format="sbhd"`` with the shapes above,
                or ``"thd"`` with ``query [t_local, np, hn]``, ``key, value [t_local, ng, hn]`` (one
                stream). Attention is then causal *and* within a document; padding tokens (past
                ``cu_seqlens``, or in a document's padded slot) give zeros. The whole stream is split by
                the run's layout (every rank holds the same offsets). With the vertical-slash pattern the
                mask is (pattern) ∧ causal ∧ same document (torch or Triton sparse kernels, ``columns: in_ring``).

        Returns:
            ``[s_local, b, np * hn]`` (``thd``: ``[t_local, np * hn]``), dtype of ``query``.

        Raises:
            NotImplementedError: ``attention_bias``, a non-causal mask type, a non-causal
                ``attention_mask``, or packed documents with the vertical-slash pattern and
                ``columns: out_of_ring`` or ``kernel_backend`` ``triton``/``fa4``.
            ValueError: malformed shapes (head counts not GQA-compatible, q/k length mismatch, a
                length the layout cannot split), non-float dtypes, or CP ranks that disagree
                (shapes, dtypes, ``softmax_scale``...); checked on every rank once per shape
                (:meth:`~megatron_mtraining.plan.CPPlan.check_inputs`), so all ranks raise alike; packed
                offsets that are malformed, do not describe the batch or differ across ranks; with
                ``cuda_graphs: true``, packed documents or CPU inputs.
            RuntimeError: with ``cuda_graphs: true``, a second forward of this layer before the backward
                of the previous one.
            ValueError: at CP > 1 with a layout other than zigzag, or with positions that restart at
                documents, before :func:`~megatron_mtraining.megatron.rope.install_layout_rope` ran on
                this layer's model (the RoPE rows would be wrong positions).
        """
        if attention_bias is not None:
            raise NotImplementedError("MTrainingAttention does not support attention_bias")
        if not self._rope_checked:          # CP > 1 striped, or reset positions: the RoPE rows must follow them
            error = rope_layout_error(self.plan, self.rope_installed)
            if error is not None:
                raise ValueError(error)
            self._rope_checked = True
        thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        if thd:
            if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
                raise ValueError(f"MTrainingAttention: packed_seq_params.qkv_format 'thd' needs [t, h, d] q/k/v, got "
                                 f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))   # [t, 1, h, d]
        if attn_mask_type is not None:
            self._check_mask_type(attn_mask_type, "attn_mask_type")
        if attention_mask is not None and not _is_plain_causal_mask(attention_mask):
            raise NotImplementedError(
                f"MTrainingAttention: a non-causal attention_mask {tuple(attention_mask.shape)} is not supported: a "
                "dense mask would be ignored by the ring; build the data without it (create_attention_mask=False) "
                "and pass packed documents as packed_seq_params (the batch split builds them with "
                "--reset-attention-mask)")
        sq, b, np_, hn = query.shape if query.dim() == 4 else (query.shape[0], 0, 0, 0)
        sbhd = query.dim() == key.dim() == value.dim() == 4
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(max(hn, 1))
        with record_function(REGION_COPIES):
            q = query.transpose(0, 1).contiguous() if sbhd else query  # [b, s_local, np, hn]
            k = key.transpose(0, 1).contiguous() if sbhd else key  # [b, s_local, ng, hn]
            v = value.transpose(0, 1).contiguous() if sbhd else value
        self.plan.check_inputs(q, k, v, softmax_scale=scale)   # every rank's verdict, once per shape
        documents = None
        if packed_seq_params is not None:
            error = None
            try:
                documents = documents_from_packed_seq_params(packed_seq_params, q.shape[1] * self.cp_size,
                                                             q.shape[0])
            except ValueError as e:
                error = str(e)
            self.plan.check_documents(documents, q, error=error)  # every rank's verdict, once per micro-batch
            if documents.single_document:
                documents = None                                # plain causal attention: the unpacked path
        # this layer's policy (dense_layers: the exact dense ring), the kernels of the plan's select_backend
        out = self._attention(q, k, v, softmax_scale=scale, documents=documents)  # [b, s_local, np, hn]
        if thd:
            return out[0].reshape(sq, np_ * hn)
        with record_function(REGION_COPIES):
            return out.transpose(0, 1).reshape(sq, b, np_ * hn)

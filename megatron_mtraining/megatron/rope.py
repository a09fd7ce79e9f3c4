"""RoPE on each CP rank's true global positions for any :class:`Layout`.

In megatron-core (0.16.1 to 0.19), ``GPTModel._preprocess`` asks ``self.rotary_pos_emb`` for the table of
the *full* sequence (``rotary_seq_len = s_local * context_parallel_size``) and
``RotaryEmbedding.forward`` keeps this rank's rows with ``get_pos_emb_on_this_cp_rank``, which
hard-codes the zigzag split (chunks ``r`` and ``2*cp-1-r``). The batch ``position_ids`` are not
used for RoPE. With the striped split the rows would be wrong, so :func:`install_layout_rope`
replaces ``model.rotary_pos_emb`` by a :class:`LayoutRotaryEmbedding` that returns
``emb[layout.positions(cp_rank, S)]``. It computes the table on ``inv_freq``'s device (no
``.cuda()``, no pinned memory), so it also runs on the CPU.

Packed documents with ``--reset-position-ids``: positions restart at every document, so a local
token's angle is its position inside its document, whatever stripe or rank it lands on. With a
plan whose :class:`~megatron_mtraining.plan.DocumentPacking` resets positions,
:func:`install_layout_rope` registers a forward pre-hook on the model that hands the forward's
``position_ids`` (``[b, s_local]``, this rank's shard of the dataset's reset positions) to the
embedding, which then returns the rows ``emb[position_ids]`` (``[s_local, b, 1, dim]``).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from torch import Tensor

from megatron_mtraining.layout import Layout
from megatron_mtraining.megatron.fusions import fused_rope_takes_per_sample_positions
from megatron_mtraining.plan import ROPE_FUSION_RULE, CPPlan

__all__ = ["LayoutRotaryEmbedding", "StripedRotaryEmbedding", "install_layout_rope", "rope_layout_error"]


def rope_layout_error(plan: CPPlan, installed: bool) -> Optional[str]:
    """Why a layer's attention must not start yet, or ``None``: its model needs
    :func:`install_layout_rope` and it has not run on it (``installed``: the call reached this layer).

    Needed at ``cp_size > 1`` with a layout other than zigzag (megatron-core's ``RotaryEmbedding``
    keeps the zigzag rows of the RoPE table: wrong positions for striped shards), and whenever the
    plan's packing resets positions (``--reset-position-ids``: without the hook RoPE uses positions
    that do not restart at documents). Both would train silently on wrong positions. Every rank
    builds the same model, so every rank reaches the same verdict. A model without RoPE is left
    unchanged by :func:`install_layout_rope`, so calling it is the one fix for every model."""
    if installed:
        return None
    resets = plan.packing is not None and plan.packing.reset_position_ids
    if not resets and (plan.cp_size == 1 or plan.layout.kind == "zigzag"):
        return None
    why = ("positions that restart at every document (--reset-position-ids) need its hook" if resets else
           f"megatron-core's RotaryEmbedding keeps the zigzag rows of the RoPE table, which are wrong positions for "
           f"{plan.layout.kind} shards")
    return (f"MTrainingAttention: context-parallel size {plan.cp_size} with the {plan.layout.kind} layout, but "
            f"install_layout_rope(model, plan) was not called on this layer's model: {why}. Call "
            "megatron_mtraining.megatron.rope.install_layout_rope(model, plan) before the first forward (it leaves a "
            "model without RoPE unchanged)")


class LayoutRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` whose CP slicing follows a :class:`Layout`.

    Build it from an existing megatron ``RotaryEmbedding`` with :meth:`from_rotary` (keeps its
    ``inv_freq``, including llama-3 ``rope_scaling``, interleaving and interpolation factor).

    Args:
        kv_channels, rotary_percent, rotary_interleaved, seq_len_interpolation_factor, rotary_base,
        rope_scaling, rope_scaling_factor: as in megatron's ``RotaryEmbedding``.
        layout: the CP layout of the batch; ``layout.cp_size`` must equal the CP group size.
        cp_group: the CP group (``None`` = no CP).

    Raises:
        ValueError: ``layout.cp_size`` differs from the CP group size.
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        *,
        layout: Layout,
        cp_group: Optional[dist.ProcessGroup] = None,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
    ) -> None:
        super().__init__(
            kv_channels=kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=rotary_interleaved,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            rotary_base=rotary_base,
            rope_scaling=rope_scaling,
            rope_scaling_factor=rope_scaling_factor,
            use_cpu_initialization=True,
            cp_group=cp_group,
        )
        cp_size = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        if layout.cp_size != cp_size:
            raise ValueError(
                f"LayoutRotaryEmbedding: layout.cp_size={layout.cp_size} but the CP group has {cp_size} ranks"
            )
        self.layout = layout
        self.cp_rank = 0 if cp_size == 1 else dist.get_rank(self.cp_group)
        self._emb_cache: dict[tuple, Tensor] = {}
        self._positions: Optional[Tensor] = None

    def set_positions(self, position_ids: Optional[Tensor]) -> None:
        """Use ``position_ids`` (``[b, s_local]`` int, this rank's tokens) for the next forward's rows
        (``None``: the layout's global positions). Set by :func:`install_layout_rope`'s hook."""
        self._positions = position_ids

    def _rows_of_positions(self, max_seq_len: int, offset: int) -> Tensor:
        pos = self._positions
        if pos.dim() != 2 or pos.shape[1] * self.layout.cp_size != max_seq_len:
            raise ValueError(f"LayoutRotaryEmbedding: position_ids {tuple(pos.shape)} do not hold this rank's "
                             f"{max_seq_len} // {self.layout.cp_size} tokens ([b, s_local] expected)")
        key = ("full", int(max_seq_len), int(offset), self.inv_freq.device)
        table = self._emb_cache.get(key)
        if table is None:
            table = self.get_emb(max_seq_len, offset)[:, 0, 0]          # [S, dim]
            if len(self._emb_cache) >= 32:
                self._emb_cache.clear()
            self._emb_cache[key] = table
        return table[pos.to(table.device).t()].unsqueeze(2)             # [s_local, b, 1, dim]

    @classmethod
    def from_rotary(
        cls, rotary: RotaryEmbedding, layout: Layout, cp_group: Optional[dist.ProcessGroup] = None
    ) -> "LayoutRotaryEmbedding":
        """Same frequencies as ``rotary``, sliced with ``layout`` over ``cp_group``
        (default: ``rotary.cp_group``)."""
        inv_freq = rotary.inv_freq
        new = cls(
            kv_channels=2 * inv_freq.numel(),
            rotary_percent=1.0,
            layout=layout,
            cp_group=rotary.cp_group if cp_group is None else cp_group,
            rotary_interleaved=rotary.rotary_interleaved,
            seq_len_interpolation_factor=rotary.seq_len_interpolation_factor,
        )
        new.inv_freq = inv_freq.detach().clone()
        return new

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        """Full table ``[max_seq_len, 1, 1, dim]`` (fp32) for positions ``offset ..``.

        Unlike the parent it does not move ``inv_freq`` to ``torch.cuda.current_device()`` unless
        CUDA is available (then it does, as megatron does, on the first call).
        """
        if torch.cuda.is_available() and self.inv_freq.device.type == "cpu":
            self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    def forward(  # type: ignore[override]
        self,
        max_seq_len: int,
        offset: int = 0,
        packed_seq: bool = False,
        cp_group: Optional[dist.ProcessGroup] = None,
    ) -> Tensor:
        """This rank's RoPE table.

        Args:
            max_seq_len: the *global* sequence length ``S`` (megatron passes
                ``s_local * context_parallel_size``).
            offset: position offset (0 for training).
            packed_seq: must be False.
            cp_group: ignored unless it differs from the construction group (then an error).

        Returns:
            ``[S // cp_size, 1, 1, dim]`` fp32: rows ``layout.positions(cp_rank, S)`` of the table; with
            positions set (:meth:`set_positions`) ``[S // cp_size, b, 1, dim]``, rows ``position_ids``.
            ``packed_seq`` at CP=1: the table of ``S`` positions (megatron-core slices it per document).

        Raises:
            NotImplementedError: ``packed_seq`` (THD) under CP > 1 (megatron-core's THD RoPE splits
                every document in zigzag halves; the MTraining layout splits the stream as a whole: use
                ``qkv_format="sbhd"`` packed params, :mod:`megatron_mtraining.megatron.packed`).
            ValueError: ``S`` cannot be split by the layout, positions of another shape, or a
                different ``cp_group`` is passed.
        """
        if packed_seq:
            if self.layout.cp_size > 1:
                raise NotImplementedError(
                    "LayoutRotaryEmbedding: RoPE of qkv_format 'thd' under context parallelism is not supported "
                    "(megatron-core's THD RoPE assumes a per-document zigzag split); pass packed documents as "
                    "qkv_format='sbhd' PackedSeqParams (megatron_mtraining.megatron.packed)")
            return self.get_emb(max_seq_len, offset)
        if cp_group is not None and cp_group is not self.cp_group:
            raise ValueError("LayoutRotaryEmbedding was built for a different CP group")
        if self._positions is not None:
            return self._rows_of_positions(max_seq_len, offset)
        key = (int(max_seq_len), int(offset), self.inv_freq.device)
        emb = self._emb_cache.get(key)
        if emb is None:
            emb = self.get_emb(max_seq_len, offset)
            if self.layout.cp_size > 1:
                idx = self.layout.positions(self.cp_rank, max_seq_len, device=emb.device)
                emb = emb.index_select(0, idx)
            else:
                self.layout.check_seq_len(max_seq_len)
            if len(self._emb_cache) >= 32:
                self._emb_cache.clear()
            self._emb_cache[key] = emb
        return emb


#: The striped layout is the MTraining default; the class handles every layout kind.
StripedRotaryEmbedding = LayoutRotaryEmbedding


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def install_layout_rope(
    model: torch.nn.Module, layout: Union[Layout, CPPlan], cp_group: Optional[dist.ProcessGroup] = None
) -> int:
    """Replace every ``rotary_pos_emb`` (a megatron ``RotaryEmbedding``) inside ``model`` by a
    :class:`LayoutRotaryEmbedding` for ``layout``. Call before the first forward.

    Works through wrappers (DDP, ``Float16Module``). Models without RoPE (``learned_absolute``:
    positions come from the sharded ``position_ids``; ``none``) are left alone. When the plan's
    packing resets positions (``--reset-position-ids``), a forward pre-hook on the model passes each
    forward's ``position_ids`` to the embedding, so RoPE angles restart at every document.

    Args:
        model: a ``GPTModel`` or a wrapper of one.
        layout: the run's :class:`~megatron_mtraining.plan.CPPlan` (its layout and CP group), or
            the CP layout used to split the batch.
        cp_group: the CP group (default: the plan's; without a plan, the one the model's
            ``RotaryEmbedding`` was built with).

    Returns:
        The number of embeddings replaced.

    Raises:
        NotImplementedError: YaRN or multimodal RoPE (their CP slicing is zigzag-specific).
        ValueError: ``layout.cp_size`` differs from the CP group size.

    Marks the model's ``MTrainingAttention`` layers (``rope_installed``): at CP > 1 with a layout other
    than zigzag, or with positions that restart at documents, a layer refuses its first forward
    until then (:func:`rope_layout_error`).
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    follow_positions = False
    if isinstance(layout, CPPlan):
        if cp_group is None:
            cp_group = layout.cp_group
        follow_positions = layout.packing is not None and layout.packing.reset_position_ids
        layout = layout.layout
    replaced = 0
    for module in list(_unwrap(model).modules()):
        rot = getattr(module, "rotary_pos_emb", None)
        if rot is None or isinstance(rot, LayoutRotaryEmbedding):
            continue
        if isinstance(rot, (YarnRotaryEmbedding, MultimodalRotaryEmbedding)):
            raise NotImplementedError(
                f"install_layout_rope: {type(rot).__name__} is not supported (use position_embedding_type='rope')"
            )
        if isinstance(rot, RotaryEmbedding):
            module.rotary_pos_emb = LayoutRotaryEmbedding.from_rotary(rot, layout, cp_group)
            replaced += 1
            if follow_positions:
                module.register_forward_pre_hook(_positions_hook, with_kwargs=True)
    for module in _unwrap(model).modules():     # the model's attention layers may now start (rope_layout_error)
        if hasattr(module, "rope_installed"):
            module.rope_installed = True
    return replaced


def _positions_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a ``GPTModel``: its ``position_ids`` (second argument) become the RoPE rows."""
    pos = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
    if (pos is not None and pos.shape[0] > 1 and getattr(getattr(module, "config", None), "apply_rope_fusion", False)
            and not fused_rope_takes_per_sample_positions()):
        raise ValueError("RoPE positions that restart at every document (--reset-position-ids or "
                         f"--dataloader-inter-document-masking) with micro-batch size > 1: {ROPE_FUSION_RULE}")
    module.rotary_pos_emb.set_positions(pos)
    return None

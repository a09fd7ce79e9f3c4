"""The context-parallel plan of a run: one object that fixes everything the attention needs.

:func:`resolve` turns an :class:`~megatron_mtraining.config.MTrainingConfig` and the run's process
groups into a frozen :class:`CPPlan`: the sequence :class:`~megatron_mtraining.layout.Layout`
(striped / zigzag, MTraining §3.3), the CP group and this rank's index in it, the inner/outer
groups of the hierarchical ring (§4.2, Alg. 2), the column schedule and estimator budgets of the
vertical-slash pattern (§3.2), and the kernel backend name. Every consumer takes the plan: the
core attention (:class:`~megatron_mtraining.megatron.attention.MTrainingAttention`), RoPE
(:func:`~megatron_mtraining.megatron.rope.install_layout_rope`), the batch split
(:func:`~megatron_mtraining.megatron.batch.get_batch_on_this_cp_rank_striped`), and the two front
doors (``examples/pretrain_gpt.py``'s flags and the Megatron-LM patch), which check a command line
with the same rules (:func:`config_from_args`).

Cross-rank consistency is checked once per shape signature (:meth:`CPPlan.check_inputs`): the first
call with a new ``(q, k, v)`` shape, dtype, device or ``softmax_scale`` runs the agreed input check
of :func:`~megatron_mtraining.ring.check_ring_inputs` (every rank's local verdict and parameters,
one small all_gather) and remembers the signature; later calls with that signature cost nothing.
All ranks of a CP group must see the same sequence of signatures, as they do in training.

Example::

    plan = resolve("configs/demo.yaml", cp_group=cp_group, seq_len=4096)
    plan.layout                    # Layout("striped", cp_size, 64)
    local = get_batch_on_this_cp_rank_striped(batch, plan)

This module does not import megatron.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from megatron_mtraining.config import (
    IMPLEMENTATIONS,
    KERNEL_BACKENDS,
    MTrainingConfig,
    config_for_run,
    load_mtraining_config,
)
from megatron_mtraining.distributed import collective_device, group_rank, group_size
from megatron_mtraining.layout import Layout
from megatron_mtraining.patterns.estimator import VerticalSlashConfig
from megatron_mtraining.ring.graphs import DOCUMENTS_RULE as GRAPHS_DOCUMENTS_RULE

__all__ = ["CPPlan", "DocumentPacking", "resolve", "config_from_args", "front_door_problems", "kernel_backend_problem",
           "packing_from_args", "sparse_packed_problem", "DOCUMENT_MASK_FLAGS", "DOCUMENT_POSITION_FLAGS",
           "per_sample_position_flags",
           "ROPE_FUSION_RULE", "CUDA_GRAPHS_DOCUMENTS_RULE", "CUDA_GRAPHS_PIPELINE_RULE"]

ConfigLike = Union[str, os.PathLike, Mapping[str, Any], MTrainingConfig, None]

#: Megatron-LM flags whose documents mask the attention (EOD resets; the data loader's THD offsets:
#: GPTDataset's with --dataloader-inter-document-masking, SFTDataset's with --sft)
DOCUMENT_MASK_FLAGS = ("reset_attention_mask", "dataloader_inter_document_masking", "sft")
#: Megatron-LM flags whose RoPE positions restart at every document
DOCUMENT_POSITION_FLAGS = ("reset_position_ids", "dataloader_inter_document_masking", "sft")
#: why ``cuda_graphs: true`` refuses document masks and pipeline parallelism
CUDA_GRAPHS_DOCUMENTS_RULE = GRAPHS_DOCUMENTS_RULE
CUDA_GRAPHS_PIPELINE_RULE = ("mtraining config 'cuda_graphs: true' keeps one forward in flight per layer, and pipeline "
                             "schedules run several forwards before their backwards; set cuda_graphs: false")
#: why ``cuda_graphs: true`` refuses Megatron's fine-grained offloading of the attention output
CUDA_GRAPHS_OFFLOAD_RULE = ("mtraining config 'cuda_graphs: true' hands each layer's attention output to the model in "
                            "its graph's memory, which offloading attn_proj's input would free after copying it out; "
                            "remove attn_proj from --offload-modules or set cuda_graphs: false")
#: why per-document RoPE positions with a micro-batch above 1 need unfused RoPE
ROPE_FUSION_RULE = ("needs --no-rope-fusion (the fused RoPE kernel takes one row of angles per token position, "
                    "shared by the batch)")


@dataclass(frozen=True)
class DocumentPacking:
    """How a run treats the documents packed into its sequences (Megatron-LM's flags).

    Attributes:
        reset_attention_mask: attention stays inside a document (``--reset-attention-mask``): the
            batch split derives the documents from the EOD tokens and the attention masks by them.
        reset_position_ids: RoPE positions restart at every document (``--reset-position-ids``):
            the RoPE rows follow the batch's ``position_ids``.
        eod_token: the token that ends a document (needed with ``reset_attention_mask``).
    """

    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_token: Optional[int] = None

    def __post_init__(self):
        if self.reset_attention_mask and self.eod_token is None:
            raise ValueError("--reset-attention-mask needs the tokenizer's EOD token (document boundaries)")

    @property
    def active(self) -> bool:
        return self.reset_attention_mask or self.reset_position_ids


@dataclass(frozen=True, eq=False)
class CPPlan:
    """Everything fixed for the CP attention of a run (built by :func:`resolve`).

    Attributes:
        config: the validated :class:`~megatron_mtraining.config.MTrainingConfig` (hierarchical
            sizes filled in for the hierarchical ring).
        layout: the sequence layout over ``cp_size`` ranks.
        cp_group: the CP process group (``None``: one rank, no communication).
        cp_size, cp_rank: its size and this rank's index (the shard of ``layout``).
        hierarchical_groups: ``(inner_group, outer_group)`` of the two-level ring, or ``None``.
        columns: the column schedule (``"in_ring"`` / ``"out_of_ring"``).
        pattern: the estimator budgets (:class:`VerticalSlashConfig`) of the sparse pattern, or
            ``None`` for dense attention.
        kernel_backend: the configured backend name (``"auto"``, ``"torch"``, ``"triton"``, ``"sdpa"``).
        seq_len, device, dtype: what the plan was resolved for (``None``: not fixed).
        packing: the run's :class:`DocumentPacking` (``None``: sequences are not packed documents).
        num_layers: the model's number of layers the layer policy was checked against (``None``:
            not yet; checked by :meth:`for_layer`).
        layer_number: ``None`` for the run's plan; for the per-layer view of :meth:`for_layer`,
            its 1-based global layer number (``pattern`` is then that layer's budgets, ``None`` for
            a dense layer).
    """

    config: MTrainingConfig
    layout: Layout
    cp_group: Any
    cp_size: int
    cp_rank: int
    hierarchical_groups: Optional[tuple] = None
    columns: str = "in_ring"
    pattern: Optional[VerticalSlashConfig] = None
    kernel_backend: str = "auto"
    seq_len: Optional[int] = None
    device: Optional[torch.device] = None
    dtype: Optional[torch.dtype] = None
    packing: Optional[DocumentPacking] = None
    num_layers: Optional[int] = None
    layer_number: Optional[int] = None
    _checked: set = field(default_factory=set, repr=False, compare=False)
    _backends: dict = field(default_factory=dict, repr=False, compare=False)
    _layers: dict = field(default_factory=dict, repr=False, compare=False)
    _kept: dict = field(default_factory=dict, repr=False, compare=False)
    _policy: dict = field(default_factory=dict, repr=False, compare=False)

    def for_layer(self, layer_number: int, num_layers: Optional[int] = None) -> "CPPlan":
        """The plan of one layer: the same layout, groups, kernels and input checks, with ``pattern``
        set by the config's per-layer policy (:meth:`~megatron_mtraining.config.MTrainingConfig.layer_pattern`):
        ``None`` (the exact dense ring) for ``dense_layers``, the overridden budgets for
        ``layer_overrides``, ``vertical_slash`` otherwise.

        The views share the run plan's caches: one cross-rank input check per shape covers every
        layer (the whole policy is among the agreed fields, :meth:`agreement_fields`). Views are
        cached per layer.

        Args:
            layer_number: Megatron's 1-based *global* layer number (``TransformerLayer.layer_number``,
                which includes the pipeline stage's offset).
            num_layers: the model's number of layers (``TransformerConfig.num_layers``); the layer
                policy and ``layer_number`` are checked against it.

        Raises:
            ValueError: ``layer_number`` not in ``1 .. num_layers``, or a policy naming a layer past
                ``num_layers`` (naming the config key).
        """
        root = self if self.layer_number is None else self._layers["root"]
        n = num_layers if num_layers is not None else root.num_layers
        if n is not None:
            self.config.check_layers(n)
            if isinstance(layer_number, int) and not isinstance(layer_number, bool) and layer_number > n:
                raise ValueError(f"layer_number {layer_number} > num_layers={n} (layer numbers are 1-based and global)")
        view = root._layers.get(layer_number)
        if view is None:
            pattern = self.config.layer_pattern(layer_number)
            view = dataclasses.replace(root, pattern=pattern, layer_number=layer_number,
                                       num_layers=n, _checked=root._checked, _backends=root._backends,
                                       _layers={"root": root}, _kept=root._kept, _policy=root._policy)
            root._layers[layer_number] = view
        return view

    def dense_view(self) -> "CPPlan":
        """This per-layer view with the dense attention in place of the sparse pattern (the same layout,
        groups, kernels and caches): what ``dense_layers`` would make of the layer."""
        if self.layer_number is None:
            raise ValueError("dense_view() is a per-layer view; call for_layer(n) first")
        if not self.sparse:
            return self
        root = self._layers["root"]
        key = (self.layer_number, "dense")
        view = root._layers.get(key)
        if view is None:
            view = root._layers[key] = dataclasses.replace(self, pattern=None)
        return view

    @property
    def sparse(self) -> bool:
        """True for the vertical-slash pattern (a per-layer view: in this layer; the run plan: the
        config's pattern, whatever ``dense_layers`` say)."""
        return self.pattern is not None

    @property
    def hierarchical_sizes(self) -> Optional[tuple[int, int]]:
        """``(inner, outer)`` of the two-level ring, ``None`` for a flat ring."""
        return self.config.hierarchical.sizes if self.hierarchical_groups is not None else None

    @property
    def deterministic(self) -> bool:
        return self.config.deterministic

    @property
    def document_mask(self) -> bool:
        """True when attention is masked by documents (``--reset-attention-mask``)."""
        return self.packing is not None and self.packing.reset_attention_mask

    def select_backend(self, *, device: torch.device, dtype: torch.dtype, head_dim: int,
                       seq_len_local: Optional[int] = None, packed: bool = False):
        """The kernels for inputs on ``device`` with ``dtype``, ``head_dim`` and ``seq_len_local``.

        The single place where the plan's ``kernel_backend`` name becomes kernels
        (:func:`~megatron_mtraining.ops.backends.select_backend`, with the plan's CP size, pattern and
        ``deterministic``); the choice is cached per input signature, so a layer's forward pays for it
        once per run.

        ``packed``: the inputs carry a document mask (the torch and Triton step kernels have one, and FA4's
        varlen interface for dense attention at CP=1; SDPA has none).

        Raises:
            ValueError: an explicit backend that cannot run these inputs (naming the rule).
        """
        key = (device.type, device.index, dtype, int(head_dim), seq_len_local, bool(packed), self.sparse)
        backend = self._backends.get(key)
        if backend is None:
            from megatron_mtraining.ops.backends import select_backend

            backend = select_backend(self.kernel_backend, device=device, dtype=dtype, head_dim=head_dim,
                                     seq_len_local=seq_len_local, cp_size=self.cp_size, sparse=self.sparse,
                                     deterministic=self.deterministic, packed=bool(packed))
            self._backends[key] = backend
        return backend

    def track_kept_fraction(self, on: bool = True) -> None:
        """Record (``on``) or not the kept share of causal attention work of the sparse layers for
        :meth:`take_kept_fraction`; off by default. Applies to the run plan and all its per-layer views.

        While on, the first sparse call of each layer after :meth:`take_kept_fraction` (eager; not inside a
        CUDA-graph capture) adds its estimated pattern's exact kept fraction of the causal (query, key)
        pairs (:meth:`~megatron_mtraining.patterns.estimator.VerticalSlashPattern.kept_fraction`, mean over
        samples and heads) on the device, without a host synchronisation: a training iteration samples
        its first micro-batch, and a recomputed forward is not counted twice."""
        self._kept["on"] = bool(on)
        if not on:
            self._kept.pop("layers", None)

    def take_kept_fraction(self, group=None) -> Optional[dict]:
        """The kept share of causal attention work recorded since the last call
        (:meth:`track_kept_fraction`), and reset. Reads the device values back (one host
        synchronisation).

        Args:
            group: a process group whose ranks hold different layers (the pipeline-parallel group):
                the result covers the sparse layers of all its ranks (two small all-reduces, so every
                rank of ``group`` must call this together). ``None``: this rank's layers.

        Returns:
            ``None`` when nothing was recorded; else ``{"mean", "min", "max"}`` over the sparse layers and
            ``"layers"``, their number.
        """
        layers = self._kept.pop("layers", None)        # shared by the run plan and its per-layer views
        vals = torch.stack(list(layers.values())).double().cpu() if layers else torch.zeros(0, dtype=torch.float64)
        total, n = float(vals.sum()), vals.numel()
        lo, hi = (float(vals.min()), float(vals.max())) if n else (math.inf, -math.inf)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            dev = collective_device(group)
            sums = torch.tensor([total, float(n)], dtype=torch.float64, device=dev)
            ext = torch.tensor([-lo, hi], dtype=torch.float64, device=dev)
            torch.distributed.all_reduce(sums, group=group)
            torch.distributed.all_reduce(ext, op=torch.distributed.ReduceOp.MAX, group=group)
            (total, n), (lo, hi) = sums.tolist(), (-ext[0].item(), ext[1].item())
        if not n:
            return None
        return {"mean": total / n, "min": lo, "max": hi, "layers": int(n)}

    def _record_kept(self, pattern) -> None:
        if not self._kept.get("on"):
            return
        layers = self._kept.setdefault("layers", {})
        if self.layer_number in layers or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return
        layers[self.layer_number] = pattern.kept_fraction().mean()

    @contextlib.contextmanager
    def kept_fraction_paused(self):
        """A context in which sparse calls record no kept work (:meth:`track_kept_fraction`): timing calls."""
        was = self._kept.get("on", False)
        self._kept["on"] = False
        try:
            yield
        finally:
            self._kept["on"] = was

    # ---------------------------------------------------------------- dense_layers: auto
    def layer_decision(self):
        """This layer's :class:`~megatron_mtraining.layer_policy.LayerDecision` (``dense_layers: auto``) for the
        plan's ``seq_len`` and ``cp_size``, or ``None`` before it is measured or restored."""
        return self._policy.get("decisions", {}).get((self.layer_number, self.seq_len, self.cp_size))

    def record_layer_decision(self, decision) -> None:
        """Store a :class:`~megatron_mtraining.layer_policy.LayerDecision` in the run plan (shared by all
        its per-layer views); :meth:`take_new_layer_decisions` reports it once."""
        self._policy.setdefault("decisions", {})[decision.key] = decision
        self._policy.setdefault("new", []).append(decision)

    def layer_decisions(self, group=None) -> list:
        """Every :class:`~megatron_mtraining.layer_policy.LayerDecision` of the run so far (restored ones
        included), sorted by length, CP size and layer.

        Args:
            group: a process group whose ranks hold different layers (the whole world for a checkpoint,
                the pipeline-parallel group for a log): the result covers all its ranks (one
                ``all_gather_object``, so every rank of ``group`` must call this together). ``None``: this
                rank's layers.
        """
        mine = list(self._policy.get("decisions", {}).values())
        return _gather_decisions(mine, group)

    def take_new_layer_decisions(self, group=None) -> list:
        """The decisions made since the last call (measured, not restored), gathered over ``group`` as in
        :meth:`layer_decisions`; for the run's log."""
        new = self._policy.pop("new", [])
        return _gather_decisions(new, group)

    def restore_layer_decisions(self, records) -> list:
        """Take the decisions of a checkpoint (``LayerDecision.to_dict`` records) so that the layers do
        not measure again; returns those that apply to this plan (its ``seq_len`` and ``cp_size``: a run at
        another length or CP size measures again). Decisions already made in this run are kept.

        Raises:
            ValueError: a malformed record.
        """
        from megatron_mtraining.layer_policy import LayerDecision

        decisions = self._policy.setdefault("decisions", {})
        taken = []
        for rec in records or ():
            d = LayerDecision.from_dict(rec)
            if d.key not in decisions:
                decisions[d.key] = d
                if (d.seq_len, d.cp_size) == (self.seq_len, self.cp_size):
                    taken.append(d)
        return sorted(taken, key=lambda d: d.layer_number)

    def kernel_summary(self) -> str:
        """The kernels this plan's layers have chosen so far, for a run's log (``""`` before the first forward).

        One entry per distinct choice, e.g. ``"dense: fa4 (CP=1 fa4_causal)"`` or ``"sparse: triton"``: the
        :class:`~megatron_mtraining.ops.backends.KernelBackend` name, and at CP=1 the dense function that runs
        the whole causal attention (``sdpa_causal``, ``fa4_causal``; packed documents: ``fa4_packed_causal``,
        FA4 varlen) where there is one; then, for a sparse config with ``dense_layers`` or
        ``layer_overrides``, ``"; layer policy: dense 1,4,7"``
        (:meth:`~megatron_mtraining.config.MTrainingConfig.layer_policy_text`).
        """
        seen = []
        for key, b in self._backends.items():
            text = self._kernel_text(b, sparse=key[-1], packed=key[-2])
            if text not in seen:
                seen.append(text)
        policy = self.config.layer_policy_text() if self.config.sparse and seen else ""
        graphs = "; CUDA graphs: sparse layers" if self.config.cuda_graphs and self.config.sparse and seen else ""
        return ", ".join(seen) + (f"; layer policy: {policy}" if policy else "") + graphs

    def _kernel_text(self, backend, *, sparse: bool, packed: bool) -> str:
        kind = "sparse" if sparse else "dense"
        fn = backend.packed_cp1 if packed else backend.dense_cp1
        fn = getattr(fn, "func", fn)                              # a functools.partial
        one = getattr(fn, "__name__", None) if kind == "dense" and self.cp_size == 1 else None
        return f"{kind}: {backend.name}" + (f" (CP=1 {one})" if one else "")

    def kernel_text(self, q: torch.Tensor, packed: bool = False) -> str:
        """The kernels :meth:`attention` runs for inputs like ``q`` (``[b, s_local, hq, d]``), in the words
        of :meth:`kernel_summary` (e.g. ``"sparse: triton"``, ``"dense: fa4 (CP=1 fa4_causal)"``)."""
        return self._kernel_text(self._backend_for(q, packed), sparse=self.sparse, packed=packed)

    def _backend_for(self, q: torch.Tensor, packed: bool):
        """:meth:`select_backend` for inputs like ``q`` (``[b, s_local, hq, d]``)."""
        return self.select_backend(device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                                   seq_len_local=q.shape[1], packed=packed)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                  documents=None) -> torch.Tensor:
        """This plan's causal attention of ``q, k, v`` (``[b, s_local, h, d]``, this rank's shards): the
        dispatch of :class:`~megatron_mtraining.megatron.attention.MTrainingAttention`'s forward, after its
        input checks (:meth:`check_inputs`, :meth:`check_documents`; none here).

        The sparse pattern (:attr:`pattern`, a per-layer view's budgets) runs
        :func:`~megatron_mtraining.ring.sparse.sparse_ring_attention` (estimation, index conversion, plans,
        kernels), otherwise the hierarchical or flat dense ring; the kernels are :meth:`select_backend`'s.
        ``documents``: packed documents (:class:`~megatron_mtraining.layout.PackedDocuments`) or ``None``.

        Returns:
            ``[b, s_local, hq, d]`` in ``q.dtype``.
        """
        backend = self._backend_for(q, packed=documents is not None)
        if self.sparse:
            from megatron_mtraining.ring.sparse import sparse_ring_attention

            out, pattern = sparse_ring_attention(q, k, v, layout=self.layout, group=self.cp_group,
                                                 config=self.pattern, softmax_scale=softmax_scale,
                                                 check_inputs=False, hierarchical_groups=self.hierarchical_groups,
                                                 columns=self.columns, backend=backend, documents=documents,
                                                 return_pattern=True)
            if documents is None:     # packed documents: the pattern is restricted to them afterwards
                self._record_kept(pattern)
            return out
        if self.hierarchical_groups is not None:
            from megatron_mtraining.ring.hierarchical import hierarchical_ring_attention

            inner, outer = self.hierarchical_groups
            return hierarchical_ring_attention(q, k, v, layout=self.layout, inner_group=inner, outer_group=outer,
                                               softmax_scale=softmax_scale, causal=True, check_inputs=False,
                                               backend=backend, documents=documents)
        from megatron_mtraining.ring import ring_attention

        return ring_attention(q, k, v, layout=self.layout, group=self.cp_group, softmax_scale=softmax_scale,
                              causal=True, check_inputs=False, backend=backend, documents=documents)

    def attention_runner(self, policy_groups: Sequence[Any] = ()):
        """The attention of one layer module: ``run(q, k, v, *, softmax_scale, documents=None) -> out``.

        :meth:`attention` itself, or with ``cuda_graphs: true`` in a sparse layer a runner that
        replays CUDA graphs of it (:class:`~megatron_mtraining.ring.graphs.CUDAGraphedAttention`, one
        per ``softmax_scale``). Each layer module takes its own runner: its graphs hold the layer's
        state between forward and backward.

        Calls that need no gradients run :meth:`attention` itself. For a gradient-enabled call the runner
        raises ``ValueError`` where the graphs cannot run it (CPU tensors, packed documents,
        inputs whose kernels are not the Triton ones: the torch reference reads values back to the host)
        and ``RuntimeError`` for a second forward of the layer before the backward of the first, or a
        second backward of one forward (:mod:`megatron_mtraining.ring.graphs`).

        With ``dense_layers: auto``, a sparse layer's runner is an
        :class:`~megatron_mtraining.layer_policy.AutoLayerRunner` that measures, at the layer's first call,
        whether the sparse or the dense attention is faster, agreed over
        ``policy_groups`` (the groups whose ranks hold the layer: data-parallel × context-parallel, then
        tensor-parallel; default: the CP group), and runs that one.
        """
        if self.config.auto_dense_layers and self.sparse and self.layer_number is not None:
            from megatron_mtraining.layer_policy import AutoLayerRunner

            return AutoLayerRunner(self, self.dense_view(), policy_groups)
        return self.fixed_attention_runner()

    def fixed_attention_runner(self):
        """:meth:`attention_runner` without the measured layer policy: this view's own attention (CUDA
        graphs where configured), whatever ``dense_layers: auto`` would choose."""
        if not (self.config.cuda_graphs and self.sparse):
            return self.attention
        from megatron_mtraining.ring.graphs import CUDAGraphedAttention, cuda_graphs_error

        graphs: dict = {}

        def run(q, k, v, *, softmax_scale: float, documents=None):
            if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
                return self.attention(q, k, v, softmax_scale=softmax_scale, documents=documents)
            error = cuda_graphs_error(q, documents)
            if error is None:
                backend = self._backend_for(q, packed=False)
                if not backend.triton_steps:
                    error = (f"cuda_graphs: true needs the Triton sparse kernels, but these inputs run kernel backend "
                             f"{backend.name!r} (dtype {q.dtype}, head_dim {q.shape[-1]}, length {q.shape[1]}), whose "
                             "torch reference reads values back to the host; use kernel_backend auto or triton with "
                             "inputs within the Triton limits, or set cuda_graphs: false")
            if error is not None:
                raise ValueError(error)
            graphed = graphs.get(float(softmax_scale))
            if graphed is None:
                graphed = graphs[float(softmax_scale)] = CUDAGraphedAttention(
                    lambda a, b, c: self.attention(a, b, c, softmax_scale=softmax_scale))
            return graphed(q, k, v)

        run.graphs = graphs
        return run

    def agreement_fields(self, softmax_scale: float, causal: bool = True) -> dict:
        """The numerical parameters every CP rank must agree on (besides shapes, dtypes, layout):
        the same for the run plan and every per-layer view (the whole layer policy is one field)."""
        fields = dict(causal=bool(causal), softmax_scale=float(softmax_scale),
                      implementation=IMPLEMENTATIONS.index(self.config.implementation),
                      kernel_backend=KERNEL_BACKENDS.index(self.kernel_backend),
                      deterministic=bool(self.deterministic),
                      hierarchical=self.hierarchical_sizes or (0, 0))
        if self.config.sparse:
            from megatron_mtraining.ring.sparse import sparse_agreement_fields

            fields.update(sparse_agreement_fields(self.config.vertical_slash, self.columns))
            fields["layer_policy"] = self.config.layer_policy_text()
        return fields

    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
                     causal: bool = True, what: str = "MTrainingAttention") -> None:
        """Validate ``q, k, v`` ([b, s_local, h, d]) on every rank, once per shape signature.

        The first call with a new signature runs :func:`~megatron_mtraining.ring.check_ring_inputs`
        over the CP group with the plan's parameters (:meth:`agreement_fields`, ``softmax_scale``
        included) and the hierarchical group numbering: every rank learns every rank's verdict
        and all raise the same ``ValueError``. A passed signature is remembered; calls with it
        return at once (no communication, no host synchronisation).

        Raises:
            ValueError: invalid input on any rank (heads not GQA-compatible, an unsplittable length,
                a non-float dtype, a layout whose cp differs from the group size, hierarchical
                groups out of Megatron's numbering) or ranks that disagree.
        """
        sig = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype, q.device.type,
               float(softmax_scale), bool(causal))
        if sig in self._checked:
            return
        from megatron_mtraining.common import REGION_INPUT_CHECK, record_function
        from megatron_mtraining.ring import check_ring_inputs

        with record_function(REGION_INPUT_CHECK):
            check_ring_inputs(q, k, v, self.layout, self.cp_group, what, True,
                              hierarchical_groups=self.hierarchical_groups,
                              **self.agreement_fields(softmax_scale, causal))
        self._checked.add(sig)

    def check_documents(self, documents, q: torch.Tensor, what: str = "MTrainingAttention",
                        error: Optional[str] = None) -> None:
        """Validate packed ``documents`` for inputs ``q`` ([b, s_local, h, d]) on every rank, once per
        documents object (a micro-batch's documents are shared by every layer).

        ``error``: this rank's failure to build the documents (malformed offsets), or ``None``. The
        verdicts and the documents' checksums are compared across the CP group first, so every rank
        raises the same error.

        Raises:
            ValueError: documents that could not be built or do not describe ``q`` (length, batch) on
                any rank, or ranks whose documents differ; NotImplementedError: a document mask with
                the sparse pattern and ``columns: out_of_ring`` or ``kernel_backend`` ``fa4``/``sdpa``
                (:func:`sparse_packed_problem`).
        """
        if documents is None and error is None:
            return
        key = (id(self), tuple(q.shape))
        if documents is None or key not in documents._agreed:
            from megatron_mtraining.distributed import check_consistent_across_ranks
            from megatron_mtraining.layout.documents import documents_agreement_key
            from megatron_mtraining.ring import documents_error

            if error is None:
                error = documents_error(documents, q, self.layout, self.cp_size)
            if self.cp_size > 1:
                check_consistent_across_ranks(self.cp_group, what, error=error,
                                              documents=documents_agreement_key(documents))
            elif error is not None:
                raise ValueError(f"{what}: {error}")
            documents._agreed.add(key)
        problem = sparse_packed_problem(self.config) if not documents.single_document else None
        if problem is not None:
            raise NotImplementedError(f"{what}: {problem}")


def _gather_decisions(decisions: list, group) -> list:
    """``decisions`` of every rank of ``group`` (``None``: this rank's), one per (layer, length), sorted."""
    if group is not None and torch.distributed.get_world_size(group) > 1:
        parts: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(parts, [d.to_dict() for d in decisions], group=group)
        from megatron_mtraining.layer_policy import LayerDecision

        decisions = [LayerDecision.from_dict(r) for part in parts for r in part]
    unique = {d.key: d for d in decisions}
    return [unique[key] for key in sorted(unique, key=lambda t: (t[1] or 0, t[2], t[0]))]


def _check_group(group: Any, what: str) -> None:
    """``group`` is a process group or ``None`` (one rank), not e.g. a string or a rank list."""
    if group is not None and not isinstance(group, torch.distributed.ProcessGroup):
        raise ValueError(f"{what} must be a torch.distributed ProcessGroup or None (one rank), got "
                         f"{type(group).__name__} {group!r}")


def resolve(config: ConfigLike, *, cp_group: Any, hierarchical_groups: Optional[tuple] = None,
            seq_len: Optional[int] = None, device: Optional[torch.device] = None,
            dtype: Optional[torch.dtype] = None, packing: Optional[DocumentPacking] = None,
            num_layers: Optional[int] = None) -> CPPlan:
    """Fix the CP plan of a run: layout, groups, column schedule, pattern config, kernel backend.

    Args:
        config: a YAML path, mapping, :class:`~megatron_mtraining.config.MTrainingConfig`, or
            ``None`` (dense striped ring, granularity 64).
        cp_group: the context-parallel process group (``None``: one rank).
        hierarchical_groups: ``(inner_group, outer_group)``, Megatron's hierarchical CP groups
            (level 0, level 1); required by ``implementation: hierarchical`` (whose sizes, when the
            config has none, are the groups' sizes) and refused otherwise.
        seq_len: the global sequence length, checked against the layout and the sparse blocks.
        device, dtype: what the inputs will be (recorded; used for the kernel backend).
        packing: the run's :class:`DocumentPacking` (``None``: no packed documents).
        num_layers: the model's number of layers (``--num-layers``); the config's ``dense_layers``
            and ``layer_overrides`` must lie in ``1 .. num_layers`` (otherwise checked when a layer
            takes its view, :meth:`CPPlan.for_layer`).

    Returns:
        The frozen :class:`CPPlan`. No communication happens here; the group numbering and the
        cross-rank agreement are part of the first :meth:`CPPlan.check_inputs`.

    Raises:
        ValueError: naming the config key / argument: a hierarchical config without groups or
            with sizes that differ from them, groups given to a flat config, a sequence length
            the layout cannot split, a document mask with the sparse pattern, a layer policy naming a
            layer past ``num_layers``, ``cuda_graphs`` with ``cp_size > 1`` or a document mask.
    """
    cfg = load_mtraining_config(config)
    if num_layers is not None:
        cfg.check_layers(num_layers)
    _check_group(cp_group, "cp_group")
    if packing is not None and not isinstance(packing, DocumentPacking):
        raise ValueError(f"packing must be a DocumentPacking or None, got {type(packing).__name__}")
    if hierarchical_groups is not None:
        if not isinstance(hierarchical_groups, (tuple, list)) or len(hierarchical_groups) != 2:
            raise ValueError(f"hierarchical_groups must be (inner_group, outer_group), got {hierarchical_groups!r}")
        for name, g in zip(("inner", "outer"), hierarchical_groups):
            _check_group(g, f"hierarchical_groups {name} group")
    if packing is not None and not packing.active:
        packing = None
    if packing is not None and packing.reset_attention_mask and sparse_packed_problem(cfg):
        raise ValueError("--reset-attention-mask: " + sparse_packed_problem(cfg))
    if packing is not None and packing.reset_attention_mask and cfg.cuda_graphs:
        raise ValueError("--reset-attention-mask: " + CUDA_GRAPHS_DOCUMENTS_RULE)
    cp = group_size(cp_group)
    if cfg.cuda_graphs and cp != 1:
        raise ValueError(cfg.cuda_graphs_cp_rule(cp))
    groups = None
    if cfg.implementation == "hierarchical":
        if hierarchical_groups is None:
            raise ValueError("mtraining config: implementation 'hierarchical' needs the inner/outer CP groups "
                             "(hierarchical_groups=(inner, outer); Megatron: --hierarchical-context-parallel-sizes "
                             "INNER OUTER)")
        inner, outer = hierarchical_groups
        group_sizes = (group_size(inner), group_size(outer))
        cfg = cfg.with_hierarchical_sizes(cfg.hierarchical_sizes(cp, group_sizes))
        groups = (inner, outer)
    elif hierarchical_groups is not None:
        raise ValueError(f"hierarchical_groups given but the mtraining config has implementation "
                         f"'{cfg.implementation}' (the groups would be ignored and a flat ring run); use "
                         "implementation: hierarchical or pass no groups")
    if seq_len is not None:
        cfg = config_for_run(cfg, cp_size=cp, seq_len=seq_len, megatron_hierarchical_sizes=cfg.hierarchical.sizes)
    return CPPlan(config=cfg, layout=cfg.make_layout(cp), cp_group=cp_group, cp_size=cp,
                  cp_rank=group_rank(cp_group), hierarchical_groups=groups, columns=cfg.columns,
                  pattern=cfg.vertical_slash if cfg.sparse else None, kernel_backend=cfg.kernel_backend,
                  seq_len=seq_len, device=None if device is None else torch.device(device), dtype=dtype,
                  packing=packing, num_layers=num_layers)


def sparse_packed_problem(cfg) -> Optional[str]:
    """Why the config cannot run the vertical-slash pattern over packed documents, or ``None``
    (dense configs and sparse ones with ``columns: in_ring`` and ``kernel_backend``
    ``auto``/``triton``/``torch``: the document mask lives in the torch and Triton sparse step kernels
    and the in-ring columns)."""
    if not cfg.sparse:
        return None
    if cfg.columns != "in_ring":
        return ("packed documents (document masks) with pattern: vertical_slash need columns: in_ring "
                f"(got {cfg.columns}: the out-of-ring column phase has no document mask)")
    if cfg.kernel_backend in ("fa4", "sdpa"):
        return ("packed documents (document masks) with pattern: vertical_slash run on the torch or Triton sparse "
                f"kernels: kernel_backend: {cfg.kernel_backend} has no sparse kernel with a document mask (use auto, "
                "triton or torch)")
    return None


def packing_from_args(args: Any, eod_token: Optional[int] = None) -> Optional[DocumentPacking]:
    """The :class:`DocumentPacking` of a Megatron-LM style command line (``--reset-attention-mask``;
    ``--reset-position-ids`` or ``--dataloader-inter-document-masking``, whose data set restarts
    ``position_ids`` at every document: RoPE follows the batch's positions), or ``None`` when none is set.

    Raises:
        ValueError: ``--reset-attention-mask`` without ``eod_token``.
    """
    ram = bool(getattr(args, "reset_attention_mask", False))
    rpi = any(getattr(args, f, False) for f in DOCUMENT_POSITION_FLAGS)
    if not (ram or rpi):
        return None
    return DocumentPacking(reset_attention_mask=ram, reset_position_ids=rpi, eod_token=eod_token)


def per_sample_position_flags(args: Any) -> list[str]:
    """The :data:`DOCUMENT_POSITION_FLAGS` set in ``args`` when its micro-batch holds more than one sample
    (``--micro-batch-size`` > 1): RoPE's angles then differ between the samples of a micro-batch. Empty
    otherwise. ``args``: a Megatron-LM style namespace; a missing attribute counts as the flag's default."""
    if int(getattr(args, "micro_batch_size", 1) or 1) <= 1:
        return []
    return [f for f in DOCUMENT_POSITION_FLAGS if getattr(args, f, False)]


# ------------------------------------------------------------------------- front-door rules
def front_door_problems(args: Any) -> list[str]:
    """Megatron-LM flags the CP attention cannot serve, each naming the flag (empty: none).

    ``args`` is a Megatron-LM style namespace (``examples/pretrain_gpt.py``'s or Megatron-LM's);
    a missing attribute counts as the flag's default.
    """
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
    if get("use_legacy_models", False):
        problems.append("--use-legacy-models is not supported")
    follow = per_sample_position_flags(args)
    if follow and get("apply_rope_fusion", False) and get("position_embedding_type", "learned_absolute") == "rope":
        problems.append(f"--{follow[0].replace('_', '-')} (RoPE positions restart at every document) with "
                        f"--micro-batch-size {get('micro_batch_size')} {ROPE_FUSION_RULE}")
    return problems


def config_from_args(args: Any, cuda: Optional[bool] = None) -> MTrainingConfig:
    """The checked config of a Megatron-LM style command line (both front doors).

    ``cuda``: whether the run is on CUDA (``None``: ``torch.cuda.is_available()``), for the
    ``kernel_backend`` rules (:func:`kernel_backend_problem`). Reads ``mtraining_config`` (path or
    ``None``), ``context_parallel_size``, ``hierarchical_context_parallel_sizes``, ``seq_length``,
    ``num_layers`` and, without a config, ``cp_layout`` / ``cp_granularity``; applies
    :func:`front_door_problems` and :func:`~megatron_mtraining.config.config_for_run`.

    Raises:
        ValueError: ``--cp-attention mtraining: ...`` listing the unsupported flags, or the
            config/flag rule that failed.
    """
    problems = front_door_problems(args)
    if problems:
        raise ValueError("--cp-attention mtraining: " + "; ".join(problems))
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    hcp = getattr(args, "hierarchical_context_parallel_sizes", None)
    if hcp is not None and (len(hcp) != 2 or int(hcp[0]) * int(hcp[1]) != cp):
        raise ValueError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hcp))}: need INNER OUTER with "
                         f"INNER*OUTER = --context-parallel-size {cp}")
    seq = getattr(args, "seq_length", None)
    cfg = config_for_run(getattr(args, "mtraining_config", None), cp_size=cp,
                         seq_len=None if seq is None else int(seq), megatron_hierarchical_sizes=hcp,
                         cp_layout=getattr(args, "cp_layout", None), granularity=getattr(args, "cp_granularity", None),
                         num_layers=getattr(args, "num_layers", None))
    for flag in DOCUMENT_MASK_FLAGS:
        if getattr(args, flag, False) and sparse_packed_problem(cfg):
            raise ValueError(f"--{flag.replace('_', '-')}: " + sparse_packed_problem(cfg))
        if getattr(args, flag, False) and cfg.cuda_graphs:
            raise ValueError(f"--{flag.replace('_', '-')}: " + CUDA_GRAPHS_DOCUMENTS_RULE)
    if cfg.cuda_graphs and int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        raise ValueError(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: "
                         + CUDA_GRAPHS_PIPELINE_RULE)
    if (cfg.cuda_graphs and getattr(args, "fine_grained_activation_offloading", False)
            and "attn_proj" in (getattr(args, "offload_modules", None) or ())):
        raise ValueError("--fine-grained-activation-offloading --offload-modules attn_proj: " + CUDA_GRAPHS_OFFLOAD_RULE)
    problem = kernel_backend_problem(args, cfg, cuda)
    if problem is not None:
        raise ValueError(problem)
    return cfg


def kernel_backend_problem(args: Any, cfg: MTrainingConfig, cuda: Optional[bool] = None) -> Optional[str]:
    """Why the config's ``kernel_backend`` cannot run this command line's attention, or ``None``.

    The run's device is CUDA when ``torch.cuda.is_available()`` (``cuda`` overrides it; ``cuda=True``
    without a GPU here checks a GPU run's rules, taking Triton and FA4 as installed there), else the
    CPU; dtype from ``--bf16`` / ``--fp16`` (else fp32), head_dim from ``--kv-channels`` or
    ``--hidden-size / --num-attention-heads``, the local length ``--seq-length / CP``, the CP size,
    the pattern and ``--reset-attention-mask``:
    :func:`~megatron_mtraining.ops.backends.kernel_backend_error`, the rules the kernels' selection
    applies at the first forward. ``auto`` and ``torch`` run everywhere."""
    if cfg.kernel_backend in ("auto", "torch"):
        return None
    import torch

    from megatron_mtraining.ops.backends import kernel_backend_error

    def get(name: str) -> Any:
        return getattr(args, name, None)

    here = torch.cuda.is_available()
    if cuda is None:
        cuda = here
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    head_dim = get("kv_channels") or (hidden // heads if hidden and heads else None)
    if head_dim is None:
        return None
    cp = int(get("context_parallel_size") or 1)
    seq = get("seq_length")
    dtype = torch.bfloat16 if get("bf16") else torch.float16 if get("fp16") else torch.float32
    device = "cuda" if cuda else "cpu"
    error = kernel_backend_error(cfg.kernel_backend, device=device, dtype=dtype, head_dim=int(head_dim),
                                 seq_len_local=None if seq is None else int(seq) // cp, cp_size=cp,
                                 sparse=cfg.sparse,
                                 packed=any(get(f) for f in DOCUMENT_MASK_FLAGS), device_here=here or not cuda)
    if error is None:
        return None
    src = get("mtraining_config") or "the mtraining config"
    return f"--mtraining-config {src}: 'kernel_backend' {cfg.kernel_backend!r} on this {device} run: {error}"

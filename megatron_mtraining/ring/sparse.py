"""Sparse (vertical-slash) ring attention: MTraining's dynamic sparse attention over a CP group.

Public API::

    out = sparse_ring_attention(q, k, v, layout=Layout("striped", cp, 64), group=cp_group,
                                config=VerticalSlashConfig(recall=0.95))

Per forward: (1) :func:`~megatron_mtraining.patterns.estimator.estimate_vertical_slash` estimates
the global pattern from the current q/k shards (small collectives on ``group``; identical on every
rank); (2) :func:`~megatron_mtraining.patterns.convert.convert_pattern` turns it into this rank's
per-owner :class:`StepIndices`; (3) the ring runs through the *same*
:class:`~megatron_mtraining.ring.RingAttentionFunc` as the dense ring, with a
:class:`SparseStepKernel` doing the per-step work. The indices are kept on the kernel for the
backward pass (not rebuilt). A step whose indices are empty for every query block is skipped in
both passes (no compute; K/V still circulate, as the ring schedule is fixed).

Vertical columns, in the ring or out of it (``columns=``): with ``"in_ring"`` each step also
computes the selected columns that the step's owner holds. The columns are what skews the striped
ring's balance (sink columns all live on rank 0's shard, so they land in one step; MTraining §3.3,
docs/design.md). With ``"out_of_ring"`` (:class:`ColumnPhase`) the K/V rows of every selected
column are gathered once to every rank (one async all-reduce, overlapped with the ring), each rank
computes its queries against them locally and merges the result into (out, LSE) by LSE; in the
backward pass the column dK/dV are all-reduced (overlapped with the backward ring) and each owner
adds its rows. The ring steps then carry block (slash) work only, which the striped layout spreads
evenly. Both schedules compute every (query, key) pair of the pattern exactly once.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable, Mapping, Optional, Sequence

import torch

from ..common import REGION_PLAN, plain_numbers, record_function, resolve_softmax_scale
from ..distributed import comm_context, group_rank, wait_all
from ..layout import Layout
from ..ops.backends import TRITON_BLOCK, KernelBackend
from ..ops.sparse_reference import SparseStepKernel, sparse_attention_backward, sparse_attention_forward
from ..patterns.convert import (check_block_layout, column_phase_indices, convert_pattern, local_block_ids,
                                restrict_to_documents, without_columns)
from ..patterns.estimator import PROBES, SHARE_PATTERNS, VerticalSlashConfig, VerticalSlashPattern, estimate_vertical_slash
from ..patterns.indices import StepIndices
from . import (RingAttentionFunc, backend_for, check_api_arguments, check_ring_inputs, last_dim_contiguous,
               packed_documents)

__all__ = ["SparseStepKernel", "ColumnPhase", "COLUMN_SCHEDULES", "sparse_ring_attention",
           "sparse_agreement_fields"]

COLUMN_SCHEDULES = ("in_ring", "out_of_ring")
_COLUMNS_FORWARD = "sparse ring forward: all_reduce of the out-of-ring column K/V"     # CommError context
_COLUMNS_BACKWARD = "sparse ring backward: all_reduce of the out-of-ring column dK/dV"


def _weak_callable(fn: Callable) -> Callable:
    """``fn``, or for a bound method a callable that holds its object weakly: the column phase is
    owned by the step kernel whose methods it calls, and a strong reference back would make a cycle
    that keeps the kernel's plans and index tensors alive until Python's cycle collector runs."""
    if not inspect.ismethod(fn):
        return fn
    ref = weakref.WeakMethod(fn)

    def call(*args, **kwargs):
        method = ref()
        if method is None:
            raise RuntimeError("the step kernel of this out-of-ring column phase no longer exists")
        return method(*args, **kwargs)

    return call


class ColumnPhase:
    """Out-of-ring vertical columns (see the module docstring): gather once, compute locally, merge by LSE.

    Built from this rank's per-owner :class:`StepIndices` (``steps``, as produced by
    :func:`~megatron_mtraining.patterns.convert.convert_pattern`) and the global pattern.

    * Column set ``U``: every selected vertical position of the pattern (union over samples and
      heads, ascending; identical on all ranks because the pattern is), padded to a multiple of the
      block size. ``k_cols, v_cols [b, n, hkv, d]`` hold K/V at ``U`` (zeros in the padding).
    * Gather: each rank writes the rows of ``U`` it owns into zero buffers and the buffers are
      summed over ``group`` (exact: one non-zero term per row), as one async all-reduce.
    * Work: one :class:`StepIndices` with no blocks and, per query block, exactly the columns the
      converter put into its ring steps, re-indexed into ``U``; ``causal=False``, which is exact
      because every column lies in a block strictly before its query block (the diagonal block is
      always selected, so a column inside it would be covered by a block) — checked, ``ValueError``
      otherwise.
    * Backward: column dK/dV ``[b, n, hkv, d]`` (fp32 for fp32/bf16/fp16 inputs) are summed over
      ``group`` (async) and each owner adds its rows of ``U`` to its dK/dV. ``U`` has no repeated
      positions, so the scatter has no collisions (deterministic).

    Args:
        steps: per-owner :class:`StepIndices` of this rank (with columns).
        pattern: the global :class:`VerticalSlashPattern` (same on every rank).
        layout, rank, group: the CP layout, this rank's index in it, the CP group (``None``: one rank).
        forward_fn, backward_fn: step implementations (signatures of
            :func:`~megatron_mtraining.ops.sparse_reference.sparse_attention_forward` / ``_backward``).
        softmax_scale: attention scale.

    * Static sizes (``static``; default: on CUDA): the set-up reads nothing back from the device.
      ``U`` is then padded to a host bound (``min(seq_len, #vertical slots)``, rounded up to the
      block size) with the sentinel ``seq_len``; the gather and the final add go through index maps
      of that fixed size (rows of other owners and padding add zeros), and the two checks below,
      which need a device read, are skipped: they hold by construction for the estimator's patterns
      (``VerticalSlashConfig`` requires ``local_blocks >= 1``, so block diagonal 0 is always
      selected, and the converter never lists a column inside a selected block). The results are
      those of the data-dependent sizes.

    Raises:
        ValueError: a head whose block diagonal 0 is not selected (``local_blocks=0``), or a column
            the converter placed inside a query's own block (checked when not ``static``).
    """

    def __init__(self, steps: Sequence[StepIndices], pattern: VerticalSlashPattern, layout: Layout, rank: int,
                 group, forward_fn: Callable, backward_fn: Callable, softmax_scale: float,
                 static: Optional[bool] = None):
        self.static = pattern.vertical.is_cuda if static is None else bool(static)
        if not self.static and not bool(pattern.slash_mask()[..., 0].all()):
            raise ValueError("columns='out_of_ring' needs block diagonal 0 selected for every head "
                             "(VerticalSlashConfig.local_blocks >= 1): out-of-ring columns are computed unmasked")
        self.layout, self.rank, self.group = layout, rank, group
        self.forward_fn, self.backward_fn = _weak_callable(forward_fn), _weak_callable(backward_fn)
        self.softmax_scale = softmax_scale
        S, bs = pattern.seq_len, pattern.block_size
        dev = pattern.vertical.device
        vert = pattern.vertical
        if self.static:
            self._static_union(vert, layout, rank, S, bs)
        else:
            self.union = torch.unique(vert[vert >= 0])                               # ascending, int64
            self.n = max(bs, bs * -(-self.union.numel() // bs))
            o_rank, o_loc = layout.global_to_local(self.union, S)
            mine = o_rank == rank
            self.mine_slot = torch.nonzero(mine).flatten()                           # rows of U owned here
            self.mine_local = o_loc[mine]                                            # their local indices
            own = steps[rank]                  # the only causal step: its columns must lie in past blocks
            slot = torch.arange(own.column_index.shape[-1], device=dev)
            ok = slot < own.column_count[..., None].long()
            t = layout.local_to_global(rank, own.column_index.long().clamp(min=0), S)
            if bool((ok & ((t // bs) >= local_block_ids(layout, rank, S, bs, dev)[:, None])).any()):
                raise ValueError("a vertical column inside its query's own block cannot run out of the ring")
        self.indices = column_phase_indices(list(steps), layout, S, self.union, static=self.static)
        self.empty = self.indices.is_empty()
        self._kv = None
        self._pending = None

    def _static_union(self, vert: torch.Tensor, layout: Layout, rank: int, S: int, bs: int) -> None:
        """``U`` and the index maps at host-known sizes (no device read): ``union [n]`` ascending,
        padded with ``S``; ``_gather_loc [n]`` (local row of U's entry on this rank, any valid row
        elsewhere) with ``_gather_mine [n]`` (owned here); ``_inverse [s_local]``: the slot in U of
        each local row, ``n`` (a zero row) for rows not in U."""
        dev = vert.device
        flat = torch.sort(torch.where(vert >= 0, vert, S).reshape(-1).long()).values
        first = torch.ones_like(flat, dtype=torch.bool)
        first[1:] = flat[1:] != flat[:-1]
        packed = torch.sort(torch.where(first & (flat < S), flat, S)).values       # distinct, then S
        self.n = max(bs, bs * -(-min(S, flat.numel()) // bs))
        union = torch.full((self.n,), S, dtype=torch.long, device=dev)
        m = min(self.n, packed.numel())
        union[:m] = packed[:m]
        self.union = union
        real = union < S
        o_rank, o_loc = layout.global_to_local(union.clamp(max=S - 1), S)
        self._gather_mine = real & (o_rank == rank)
        self._gather_loc = o_loc
        s_loc = S // layout.cp_size
        pos = layout.local_to_global(rank, torch.arange(s_loc, device=dev), S)
        slot = torch.searchsorted(union, pos)
        hit = union.gather(0, slot.clamp(max=self.n - 1)) == pos
        self._inverse = torch.where(hit, slot, self.n)

    def _all_reduce(self, t: torch.Tensor, where: str):
        if self.group is None or torch.distributed.get_world_size(self.group) == 1:
            return None
        with comm_context(where, self.group):
            return torch.distributed.all_reduce(t, group=self.group, async_op=True)

    def begin_forward(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Post the gather of the column K/V rows (async; overlaps the ring)."""
        if self.static:
            keep = self._gather_mine[None, :, None, None]
            buf = torch.stack([torch.where(keep, t[:, self._gather_loc], 0) for t in (k, v)])
        else:
            buf = torch.zeros((2, k.shape[0], self.n, *k.shape[2:]), dtype=k.dtype, device=k.device)
            buf[0, :, self.mine_slot] = k[:, self.mine_local]
            buf[1, :, self.mine_slot] = v[:, self.mine_local]
        self._kv, self._pending = buf, self._all_reduce(buf, _COLUMNS_FORWARD)

    def forward(self, q: torch.Tensor):
        """``(out, lse)`` of this rank's queries against the gathered columns, or ``None`` if none."""
        if self._pending is not None:
            wait_all([self._pending], _COLUMNS_FORWARD, self.group)
            self._pending = None
        if self.empty:
            return None
        return self.forward_fn(q, self._kv[0], self._kv[1], self.indices, self.softmax_scale)

    def begin_backward(self, dout, q, lse, delta, dq: torch.Tensor) -> None:
        """Column gradients: adds dQ into ``dq`` and posts the sum of column dK/dV over the group."""
        k_cols, v_cols = self._kv[0], self._kv[1]
        if self.empty:
            acc = dq.dtype
            grads = torch.zeros((2, *k_cols.shape), dtype=acc, device=q.device)
        else:
            dq_c, dk_c, dv_c = self.backward_fn(dout, q, k_cols, v_cols, lse, delta, self.indices, self.softmax_scale)
            dq += dq_c
            grads = torch.stack((dk_c, dv_c))
        self._grads, self._pending = grads, self._all_reduce(grads, _COLUMNS_BACKWARD)

    def finish_backward(self, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add the summed column dK/dV rows this rank owns into its ``dk``/``dv`` (in place)."""
        if self._pending is not None:
            wait_all([self._pending], _COLUMNS_BACKWARD, self.group)
            self._pending = None
        if self.static:       # every local row: its row of U, or the zero row n
            g = torch.cat([self._grads, self._grads.new_zeros((2, self._grads.shape[1], 1, *self._grads.shape[3:]))], 2)
            dk += g[0][:, self._inverse].to(dk.dtype)
            dv += g[1][:, self._inverse].to(dv.dtype)
        else:
            dk[:, self.mine_local] += self._grads[0][:, self.mine_slot].to(dk.dtype)
            dv[:, self.mine_local] += self._grads[1][:, self.mine_slot].to(dv.dtype)
        self._grads = None


def sparse_agreement_fields(config: VerticalSlashConfig, columns: str) -> dict:
    """The sparse parameters every CP rank must agree on (for the cross-rank input check)."""
    return dict(budgets=(config.last_q, config.block_size, config.sink_tokens, config.local_blocks,
                         config.max_vertical, config.max_slash), recall=float(config.recall),
                columns=COLUMN_SCHEDULES.index(columns), share_pattern=SHARE_PATTERNS.index(config.share_pattern),
                probes=PROBES.index(config.probes))


def vertical_slash_config(config, what: str) -> VerticalSlashConfig:
    """``config`` as a :class:`VerticalSlashConfig`: one as is, ``None`` for the defaults, or a mapping of
    its fields (e.g. ``{"recall": 0.9}``).

    Raises:
        TypeError: anything else, or a mapping with a key that is not a field.
        ValueError: a field's value outside its rule (:class:`VerticalSlashConfig`).
    """
    if config is None:
        return VerticalSlashConfig()
    if isinstance(config, VerticalSlashConfig):
        return config
    if isinstance(config, Mapping):
        names = set(VerticalSlashConfig.__dataclass_fields__)
        unknown = sorted(map(str, set(config) - names))
        if unknown:
            raise TypeError(f"{what}: config has unknown key(s) {', '.join(unknown)}; VerticalSlashConfig fields are "
                            f"{', '.join(sorted(names))}")
        return VerticalSlashConfig(**plain_numbers(config))
    raise TypeError(f"{what}: config must be a VerticalSlashConfig, a mapping of its fields or None, got "
                    f"{type(config).__name__}")


def sparse_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout, group=None,
                          config: VerticalSlashConfig = VerticalSlashConfig(),
                          softmax_scale: Optional[float] = None, check_inputs: bool = True,
                          return_pattern: bool = False, hierarchical_groups: Optional[tuple] = None,
                          columns: str = "in_ring", backend: Optional[KernelBackend] = None, documents=None):
    """Causal attention restricted to the online-estimated vertical-slash pattern, over a CP group.

    Args:
        q: ``[b, s_local, hq, d]`` this rank's queries (position-encoded).
        k, v: ``[b, s_local, hkv, d]`` this rank's keys/values (GQA when ``hkv < hq``).
        layout: the CP layout of the shards; must keep ``config.block_size`` blocks whole (striped
            with granularity a multiple of the block size, or zigzag with chunks that are).
        group: the CP process group (``None``: one rank).
        config: estimator budgets (:class:`VerticalSlashConfig`, a mapping of its fields, or ``None``
            for the defaults).
        softmax_scale: defaults to ``1/sqrt(d)``.
        check_inputs: compare shapes/dtypes/layout/config across ranks first (one small all_gather).
        return_pattern: also return the estimated global :class:`VerticalSlashPattern`.
        hierarchical_groups: ``(inner_group, outer_group)`` (Megatron's hierarchical CP groups, whose
            numbering gives this rank's index in ``group``): run the two-level ring of
            :mod:`megatron_mtraining.ring.hierarchical` instead of the flat ring. The pattern is still
            estimated over ``group``.
        config.share_pattern: ``"kv_group"`` estimates one pattern per KV head; the Triton step
            kernels read it per group (``KernelConfig.pack_gqa``: several query heads of a group
            against each K/V tile the forward loads), the other kernels get it repeated per query head.
        columns: ``"in_ring"`` (each ring step computes the columns its owner holds) or
            ``"out_of_ring"`` (:class:`ColumnPhase`: columns gathered once and computed outside the
            ring, which balances the steps; needs ``config.local_blocks >= 1``).
        backend: the kernels (:func:`~megatron_mtraining.ops.backends.select_backend`): its sparse
            step kernel, estimator and index-conversion implementations; ``None``:
            ``select_backend("auto")`` for these inputs (the Triton kernels on CUDA where they support
            the shape, else :class:`SparseStepKernel` with the torch reference).
        documents: packed documents (:class:`~megatron_mtraining.layout.PackedDocuments` of the
            global sequence) or ``None``. The mask is then (pattern) ∧ causal ∧ same document:
            the estimator scores only keys of the probes' own documents and keeps the first
            ``sink_tokens`` of every document as vertical floors (docs/design.md, packed
            sequences); :func:`~megatron_mtraining.patterns.convert.restrict_to_documents` drops the
            key blocks and columns no query of a block may see and the sparse step kernel (torch
            or Triton) masks mixed blocks by document bounds. Padding tokens get exact zeros (out,
            dQ, dK, dV). A single document per stream without padding runs the unpacked path
            (bitwise). The estimator and the index conversion run on the backend's
            implementations (Triton score kernels with the document bounds, or torch); needs
            ``columns="in_ring"`` and a backend other than FA4.

    Returns:
        ``out [b, s_local, hq, d]`` in ``q.dtype`` (and the pattern if ``return_pattern``).

    Raises:
        ValueError: inconsistent shapes/dtypes (locally or across ranks), ``layout.cp_size`` not the
            group size, a layout that splits sparse blocks, an unknown ``columns`` schedule, a
            backend without sparse kernels (``"sdpa"``), or a NaN or infinite ``softmax_scale``.
        NotImplementedError: packed documents with ``columns="out_of_ring"`` or with the FA4 sparse
            step kernels (no document mask).
        TypeError: ``q``/``k``/``v`` that are not tensors, a ``layout`` that is not a ``Layout``, a
            ``backend`` that is not a ``KernelBackend``, or a ``config`` that is none of the above.
    """
    check_api_arguments("sparse_ring_attention", q, k, v, layout, backend)
    config = vertical_slash_config(config, "sparse_ring_attention")
    documents = packed_documents(documents)
    if documents is not None and columns == "out_of_ring":
        raise NotImplementedError("sparse_ring_attention: packed documents need columns='in_ring' (the "
                                  "out-of-ring column phase has no document mask)")
    if columns not in COLUMN_SCHEDULES:
        raise ValueError(f"columns must be one of {COLUMN_SCHEDULES}, got {columns!r}")
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    cp = check_ring_inputs(q, k, v, layout, group, "sparse_ring_attention", check_inputs,
                           hierarchical_groups=hierarchical_groups, softmax_scale=scale, documents=documents,
                           **sparse_agreement_fields(config, columns))
    check_block_layout(layout, q.shape[1] * cp, config.block_size)
    backend = backend_for(q, cp, backend, sparse=True, packed=documents is not None)
    if backend.sparse_step is None:
        raise ValueError(f"kernel_backend={backend.name!r} has no sparse kernels: sparse_ring_attention needs "
                         "'auto', 'fa4', 'triton' or 'torch'")
    if documents is not None and not backend.sparse_documents:
        raise NotImplementedError("sparse_ring_attention: packed documents (document masks) with the vertical-slash "
                                  "pattern run on the torch or Triton sparse step kernels; the FA4 sparse kernels "
                                  "have no document mask (use kernel_backend 'auto', 'triton' or 'torch')")
    if backend.triton_steps and config.block_size % TRITON_BLOCK:
        raise ValueError(f"the sparse kernels chosen for these inputs ({backend.name!r}) are the Triton kernels, "
                         f"whose tiles are {TRITON_BLOCK} tokens: vertical_slash.block_size must be a multiple of "
                         f"{TRITON_BLOCK}, got {config.block_size} (or use kernel_backend 'torch')")
    q, k, v = last_dim_contiguous(q, k, v)
    pattern: VerticalSlashPattern = estimate_vertical_slash(q.detach(), k.detach(), layout=layout, group=group,
                                                            config=config, softmax_scale=scale,
                                                            impl=backend.estimator_impl, documents=documents)
    steps = convert_pattern(pattern, layout, group_rank(group), impl=backend.convert_impl)
    if documents is not None:
        steps = restrict_to_documents(steps, documents, layout, group_rank(group))
    if not backend.group_indices:     # only the Triton kernels read per-group indices (kv_group) directly
        steps = [st.per_query_head(q.shape[2]) for st in steps]
    rank = group_rank(group)
    with record_function(REGION_PLAN):
        if columns == "out_of_ring":
            col_steps = steps
            steps = [without_columns(st) for st in steps]
        kernel = backend.sparse_step(steps, scale)
        try:   # a hint for kernels that prepare their backward during the forward (custom kernels may refuse it)
            kernel.expect_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        except AttributeError:
            pass
        if columns == "out_of_ring":
            kernel.column_phase = ColumnPhase(col_steps, pattern, layout, rank, group,
                                              getattr(kernel, "forward_fn", sparse_attention_forward),
                                              getattr(kernel, "backward_fn", sparse_attention_backward), scale)
    if hierarchical_groups is None:
        out = RingAttentionFunc.apply(q, k, v, kernel, group, backend.delta)
    else:
        from .hierarchical import hierarchical_ring_attention

        inner, outer = hierarchical_groups      # numbering checked with the inputs, on every rank
        out = hierarchical_ring_attention(q, k, v, layout=layout, inner_group=inner, outer_group=outer,
                                          softmax_scale=scale, kernel=kernel, check_inputs=False, backend=backend)
    return (out, pattern) if return_pattern else out

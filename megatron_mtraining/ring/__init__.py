"""Exact causal ring attention over a context-parallel process group.

Public API (flash-attn style names)::

    out = ring_attention(q, k, v, layout=Layout("striped", cp_size, 64), group=cp_group,
                         softmax_scale=None, causal=True)

Each rank holds the tokens that ``layout`` assigns to it (``layout.shard``). K/V circulate
around the ring (rank ``r`` sends to ``r+1``); at step ``s`` rank ``r`` attends to the K/V of
owner ``(r - s) mod cp`` under the causal structure of *global* positions, and merges the
partial (out, LSE) in fp32 (fp64 for fp64 inputs). The backward pass is a second ring: K/V
circulate again while fp32 dK/dV accumulators travel one exchange behind them and arrive,
fully reduced, at their owner after ``cp`` hops; dQ accumulates locally. Every step uses the
final (global) out and LSE, as in FlashAttention's backward (Dao et al. 2022, Alg. 2) and
ring attention (Liu et al. 2023; striped layout: Brandon et al. 2023, MTraining §3.3).

The next K/V exchange is posted before the current step's compute (double buffering: at most
two K/V buffers and two dK/dV buffers are alive, whatever ``cp_size``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..common import REGION_ATTENTION_BWD, REGION_ATTENTION_FWD, acc_dtype, \
    first_order_only, profiled, record_function, resolve_softmax_scale, softmax_scale_error
from ..distributed import (RingComm, check_consistent_across_ranks, group_rank, group_size,
                           hierarchical_numbering_error)
from ..layout import LAYOUT_KINDS, Layout
from ..layout.documents import documents_agreement_key
from ..ops.backends import KernelBackend, select_backend, triton_unsupported
from ..ops.base import DeltaFunction
from ..ops.merge import merge_attention_fast
from ..ops.reference import DenseStepKernel, attention_delta_torch

__all__ = ["ring_attention", "RingAttentionFunc", "DenseStepKernel", "check_ring_inputs", "ring_input_error",
           "FLOAT_DTYPES", "backend_for", "last_dim_contiguous", "begin_backward", "end_backward", "packed_documents",
           "documents_error", "dense_step_kernel", "backend_input_error"]


def ring_pass_forward(kernel, comm: RingComm, q, kv, out, lse, owner_of_step, where: str = ""):
    """One pass of K/V around ``comm``'s ring, merging every step into ``(out, lse)``.

    ``kv`` is this rank's entry K/V (not modified); at step ``j`` the rank holds the K/V that
    entered the ring ``j`` ranks earlier and ``owner_of_step(j)`` names its CP owner. The next
    exchange is posted before the step's compute (double buffering). ``out, lse = None, None``: no
    partial yet (the first computed step's result is taken as it is, not merged into zeros); they
    stay ``None`` if no step computes.

    A failed or timed-out exchange raises :class:`~megatron_mtraining.distributed.CommError` naming
    ``"{ring} ring forward step {j}{where}"`` (steps count from 0), this rank and its neighbours.
    """
    for step in range(comm.size):
        pending = None
        if step + 1 < comm.size:
            pending = comm.exchange(kv, [torch.empty_like(kv[0]), torch.empty_like(kv[1])],
                                    f"forward step {step}{where} (K/V exchange for step {step + 1})")
        partial = kernel.forward(q, kv[0], kv[1], owner_of_step(step))
        if partial is not None:      # a one-step ring's only partial is its result: kept in its own dtype
            out, lse = merge_partial(out, lse, partial, acc_dtype(q.dtype), keep=comm.size == 1)
        if pending is not None:
            kv = tuple(pending.wait())
    return out, lse


def merge_partial(out, lse, partial, acc: torch.dtype, keep: bool = False):
    """``(out, lse)`` merged with a step's ``partial = (out, lse)`` by LSE
    (:func:`~megatron_mtraining.ops.merge.merge_attention_fast`: one fused Triton launch on CUDA, the torch
    merge elsewhere; a later merge computes in fp32 or wider whatever the dtype of ``out``); ``out is None``
    (nothing merged yet): the partial itself in ``acc`` (``lse`` contiguous), which is what merging it into
    zeros and ``-inf`` gives, without the full-size passes over the output. ``keep``: the partial's
    ``out`` in its own dtype instead (the only partial of a one-step ring, e.g. FlashAttention-4's bf16
    output at CP=1: no fp32 copy, and none back to q's dtype in :func:`finish_forward`); ``lse`` still in
    ``acc``."""
    if out is None:
        return (partial[0] if keep else partial[0].to(acc)), partial[1].to(acc).contiguous()
    return merge_attention_fast(out, lse, *partial)


def ring_pass_backward(kernel, comm: RingComm, dout, q, kv, lse, delta, dq, owner_of_step, where: str = ""):
    """Backward of :func:`ring_pass_forward`: returns ``(dq, (dk, dv))``: this rank's dQ added into
    ``dq`` (in place; ``None``: the first computed step's dQ becomes the accumulator, and ``dq`` stays
    ``None`` if no step computes), and the dK/dV of the entry ``kv`` summed over every rank of the ring.

    The fp32 accumulator of each K/V travels one exchange behind it and, after ``comm.size``
    hops, arrives back at the rank that put the K/V into the ring. A one-step ring (``comm.size == 1``)
    takes its step's gradients as they are (a kernel may return them in q's dtype then, e.g.
    FlashAttention-4's bf16 ones: no fp32 copies); a ``dq`` passed in keeps its dtype. Failures raise
    :class:`~megatron_mtraining.distributed.CommError` naming ``"{ring} ring backward step {j}{where}"``.
    """
    acc = acc_dtype(q.dtype)
    dkv_pending = None   # in-flight exchange of accumulators
    dkv = None
    for step in range(comm.size):
        kv_pending = None
        if step + 1 < comm.size:
            kv_pending = comm.exchange(kv, [torch.empty_like(kv[0]), torch.empty_like(kv[1])],
                                       f"backward step {step}{where} (K/V exchange for step {step + 1})")
        grads = kernel.backward(dout, q, kv[0], kv[1], lse, delta, owner_of_step(step))
        if grads is not None:
            dq_s, dk_s, dv_s = grads
            if dq is None:
                dq = dq_s if comm.size == 1 else dq_s.to(acc)
            else:
                dq += dq_s
        else:
            dk_s = torch.zeros(kv[0].shape, dtype=acc, device=q.device)
            dv_s = torch.zeros(kv[1].shape, dtype=acc, device=q.device)
        if dkv_pending is not None:                # accumulator of this K/V, from the previous rank
            dk_in, dv_in = dkv_pending.wait()
            dk_s += dk_in
            dv_s += dv_in
        dkv = (dk_s, dv_s)
        if comm.size > 1:                          # pass it on; the last hop brings it home
            dkv_pending = comm.exchange(dkv, [torch.empty_like(dk_s), torch.empty_like(dv_s)],
                                        f"backward step {step}{where} (dK/dV exchange)")
        if kv_pending is not None:
            kv = tuple(kv_pending.wait())
    if dkv_pending is not None:
        dkv = tuple(dkv_pending.wait())
    return dq, dkv


def _empty_out_lse(q):
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def finish_forward(q, out, lse, cols):
    """A ring Function's ``(out, lse)`` after its steps (``out, lse = None, None`` if no step computed):
    the column phase's partial (``cols``, or ``None``) merged in by LSE (in fp32 or wider, also into a
    one-step ring's partial kept in q's dtype), zeros and ``-inf`` where nothing saw a key, ``out`` in
    ``q``'s dtype and detached (the first partial may be a view of a step kernel's buffer, or at CP=1 the
    kernel's own output: the output stays a plain tensor that callers may edit in place, without a copy)."""
    if cols is not None and (partial := cols.forward(q)) is not None:
        out, lse = merge_partial(out, lse, partial, acc_dtype(q.dtype))
    if out is None:
        out, lse = _empty_out_lse(q)
    return out.to(q.dtype).detach(), lse


def zero_dq(q):
    """A zero dQ accumulator for ``q`` (its accumulation dtype): where the column phase adds first, or
    where no step of the ring computed."""
    return torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)


def column_phase_of(kernel):
    """The kernel's out-of-ring column work (:class:`~megatron_mtraining.ring.sparse.ColumnPhase`) or ``None``.

    Protocol, used by every ring Function: ``begin_forward(k, v)`` before the ring (posts the
    gather), ``forward(q) -> (out, lse) | None`` after it (merged by LSE);
    ``begin_backward(dout, q, lse, delta, dq)`` before the backward ring (adds dQ, posts the dK/dV
    sum), ``finish_backward(dk, dv)`` after it (adds the owned rows)."""
    return getattr(kernel, "column_phase", None)


def begin_backward(kernel, out: torch.Tensor) -> None:
    """Hand the ring's final ``out`` to a step kernel whose backward needs it (FlashAttention-style
    kernels derive ``delta`` from ``out`` themselves); other kernels ignore it."""
    hook = getattr(kernel, "begin_backward", None)
    if hook is not None:
        hook(out)


def end_backward(ctx) -> None:
    """After a ring Function's backward: let the kernel drop what it held for it (``end_backward``),
    so that no reference cycle (output -> autograd node -> kernel -> output) keeps the step plans and
    index tensors alive until Python's cycle collector runs. The kernel stays on ``ctx``: a second
    backward through a retained graph runs it again."""
    hook = getattr(ctx.kernel, "end_backward", None)
    if hook is not None:
        hook()


def backend_for(q: torch.Tensor, cp_size: int, backend: Optional[KernelBackend] = None,
                sparse: bool = False, packed: bool = False) -> KernelBackend:
    """``backend``, or :func:`~megatron_mtraining.ops.backends.select_backend` ``("auto")`` for inputs like ``q``.

    Raises:
        ValueError: a given ``backend`` whose kernels cannot run ``q`` (:func:`backend_input_error`),
            e.g. an explicit ``"triton"`` built without ``seq_len_local`` and a local length that is
            not a multiple of 64.
    """
    if backend is not None:
        error = backend_input_error(backend, q)
        if error is not None:
            raise ValueError(error)
        return backend
    return select_backend("auto", device=q.device, dtype=q.dtype, head_dim=q.shape[-1], seq_len_local=q.shape[1],
                          cp_size=cp_size, sparse=sparse, packed=packed)


def backend_input_error(backend: KernelBackend, q: torch.Tensor) -> Optional[str]:
    """Why ``backend`` (chosen before these inputs were known) cannot run ``q`` ([b, s_local, h, d]), or ``None``.

    A backend whose ring steps run Triton (``"triton"``, ``"fa4"``) needs the Triton limits of
    :func:`~megatron_mtraining.ops.backends.triton_unsupported` for ``q`` itself: its device, dtype,
    head_dim and local length (a multiple of 64). ``select_backend(..., seq_len_local=...)`` checks the
    length at selection; without it, this check names the rule instead of a reshape error inside the
    kernels. The inputs' shapes and dtypes are compared across ranks first, so every rank gives the
    same verdict."""
    if not backend.triton_steps:
        return None
    why = triton_unsupported(device=q.device, dtype=q.dtype, head_dim=q.shape[-1], seq_len_local=q.shape[1])
    if not why:
        return None
    return (f"kernel_backend={backend.name!r} cannot run these inputs: " + "; ".join(why)
            + " (use kernel_backend='auto' or 'torch', or inputs within these limits)")


def packed_documents(documents):
    """``documents`` when they need a document mask; ``None`` for no documents or a single document
    per stream without padding (plain causal attention: the unpacked path runs, bitwise as without
    documents)."""
    if documents is None or documents.single_document:
        return None
    return documents


def documents_error(documents, q: torch.Tensor, layout: Layout, cp: int, causal: bool = True) -> Optional[str]:
    """This rank's verdict on packed documents for inputs ``q`` ([b, s_local, h, d]), or ``None``."""
    if documents is None:
        return None
    if not causal:
        return "packed documents need causal attention (causal=True)"
    if documents.seq_len != q.shape[1] * cp:
        return (f"packed documents describe {documents.seq_len}-token streams but the sequence has "
                f"s_local*cp_size = {q.shape[1]}*{cp} = {q.shape[1] * cp} tokens")
    if documents.batch_size != q.shape[0]:
        return f"packed documents describe {documents.batch_size} streams but q has batch {q.shape[0]}"
    return None


def dense_step_kernel(backend: KernelBackend, layout: Layout, rank: int, seq_len: int, scale: float, causal: bool,
                      device, documents=None):
    """The dense ring's step kernel of ``backend``; with packed ``documents`` its document-masked
    step kernel (the torch reference :class:`DenseStepKernel` or the Triton dense steps; a backend
    that runs packed documents through FA4 varlen at CP=1, ``packed_cp1``, keeps the Triton dense
    steps for them).

    Raises:
        ValueError: packed documents with a backend whose step kernels have no document mask.
    """
    if documents is None:
        return backend.dense_step(layout, rank, seq_len, scale, causal, device=device)
    if not backend.document_steps:
        raise ValueError(f"packed sequences (document masks) run on the torch or Triton step kernels; kernel backend "
                         f"{backend.name!r} has none (use kernel_backend='auto', 'triton' or 'torch')")
    return backend.dense_step(layout, rank, seq_len, scale, causal, device=device, documents=documents)


def last_dim_contiguous(*ts: torch.Tensor):
    """The tensors with a unit stride in the last dimension (copied only where it is not): every
    kernel takes the other strides as they are."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


class RingAttentionFunc(torch.autograd.Function):
    """One autograd.Function for the flat ring; the per-step work comes from ``kernel``.

    ``forward(ctx, q, k, v, kernel, comm, delta=None)``: ``kernel`` is a
    :class:`~megatron_mtraining.ops.base.StepKernel`; ``comm`` is the CP process group (or ``None``),
    or a :class:`~megatron_mtraining.distributed.RingComm` over it (e.g. one that simulates a slow
    link); ``delta`` computes ``rowsum(dout * out)`` for the backward (the backend's
    :attr:`~megatron_mtraining.ops.backends.KernelBackend.delta`; ``None``: torch).
    """

    @staticmethod
    @profiled(REGION_ATTENTION_FWD)
    def forward(ctx, q, k, v, kernel, comm, delta: Optional[DeltaFunction] = None):
        comm = comm if isinstance(comm, RingComm) else RingComm(comm)
        cp, rank = comm.size, comm.rank
        cols = column_phase_of(kernel)
        if cols is not None:
            cols.begin_forward(k, v)
        out, lse = ring_pass_forward(kernel, comm, q, (k.contiguous(), v.contiguous()), None, None,
                                     lambda step: (rank - step) % cp)
        out, lse = finish_forward(q, out, lse, cols)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.comm, ctx.delta = kernel, comm, delta or attention_delta_torch
        return out

    @staticmethod
    @profiled(REGION_ATTENTION_BWD)
    @first_order_only("ring attention")
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm = ctx.comm
        cp, rank = comm.size, comm.rank
        dout = dout.contiguous()
        delta = ctx.delta(dout, out)              # [b, hq, sq] in acc_dtype(out.dtype)
        begin_backward(ctx.kernel, out)
        cols = column_phase_of(ctx.kernel)
        dq = None                                 # the first computed step's dQ, unless the columns add first
        if cols is not None:
            dq = zero_dq(q)
            cols.begin_backward(dout, q, lse, delta, dq)
        dq, (dk, dv) = ring_pass_backward(ctx.kernel, comm, dout, q, (k.contiguous(), v.contiguous()), lse,
                                          delta, dq, lambda step: (rank - step) % cp)
        if dq is None:
            dq = zero_dq(q)
        if cols is not None:
            cols.finish_backward(dk, dv)
        end_backward(ctx)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_api_arguments(what: str, q, k, v, layout, backend) -> None:
    """Types of an entry point's arguments (the same code runs on every rank, so these are local
    errors): tensors for ``q, k, v``, a :class:`~megatron_mtraining.layout.Layout`, and a
    :class:`~megatron_mtraining.ops.backends.KernelBackend` or ``None``.

    Raises:
        TypeError: naming the argument and what it takes.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor [b, s_local, h, d], got {type(t).__name__}")
    if not isinstance(layout, Layout):
        raise TypeError(f"{what}: layout must be a megatron_mtraining.layout.Layout (e.g. Layout('striped', cp_size, "
                        f"64)), got {layout!r}")
    if backend is not None and not isinstance(backend, KernelBackend):
        raise TypeError(f"{what}: backend must be a KernelBackend or None, got {backend!r}; for a backend by name use "
                        f"megatron_mtraining.ops.backends.select_backend({backend!r}, device=..., dtype=..., "
                        "head_dim=...)" if isinstance(backend, str) else
                        f"{what}: backend must be a KernelBackend or None, got {type(backend).__name__}")


def ring_input_error(q, k, v, layout: Layout, cp: int) -> Optional[str]:
    """This rank's verdict on ring inputs (no communication): the error text, or ``None``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"q, k, v must be [b, s_local, h, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        return (f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must match, "
                "and share batch, sequence and head_dim with q")
    if q.shape[3] < 1:
        return f"head_dim must be >= 1, got q {tuple(q.shape)}"
    if k.shape[2] < 1 or q.shape[2] % k.shape[2] != 0:
        return f"GQA needs num query heads ({q.shape[2]}) divisible by num kv heads ({k.shape[2]})"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype not in FLOAT_DTYPES:
        return (f"q, k, v dtype {q.dtype} is not supported: attention needs floating-point inputs "
                "(float64, float32, bfloat16 or float16)")
    if layout.cp_size != cp:
        return f"layout.cp_size={layout.cp_size} but the process group has {cp} ranks"
    try:
        layout.check_seq_len(q.shape[1] * cp)
    except ValueError as e:
        return str(e)
    return None


def check_ring_inputs(q, k, v, layout: Layout, group, what: str, across_ranks: bool = True,
                      hierarchical_groups=None, documents=None, **fields) -> int:
    """Validate ring inputs locally and (when ``across_ranks``) across the CP group; returns cp_size.

    The local rules (:func:`ring_input_error`, and for ``hierarchical_groups`` the group numbering
    of :func:`~megatron_mtraining.distributed.hierarchical_numbering_error`) are part of the
    cross-rank check: every rank gathers every rank's verdict with one small all_gather and all
    raise the same error, so an input that is invalid on one rank only is an error on every rank
    rather than a hang.

    ``fields``: extra values every rank must agree on (``causal``, ``softmax_scale``, sparse budgets...).
    ``documents``: packed documents (:func:`documents_error` locally; every rank must hold the same).

    Raises:
        ValueError: q/k/v not ``[b, s_local, h, d]`` with matching batch, length and head_dim, k/v
            shapes differ, heads not GQA-compatible, dtypes differ or are not floating point,
            ``layout.cp_size`` not the group size, a global length the layout cannot split,
            hierarchical groups out of Megatron's numbering, a NaN or infinite ``softmax_scale``, or ranks
            that disagree.
    """
    cp = group_size(group)
    error = ring_input_error(q, k, v, layout, cp)
    if error is None and hierarchical_groups is not None:
        error = hierarchical_numbering_error(*hierarchical_groups, group=group)
    if error is None:
        error = documents_error(documents, q, layout, cp, fields.get("causal", True))
    if error is None:
        error = softmax_scale_error(fields.get("softmax_scale"))
    fields["documents"] = documents_agreement_key(documents)
    if across_ranks and cp > 1:
        check_consistent_across_ranks(group, what, error=error, q_shape=tuple(q.shape), kv_shape=tuple(k.shape),
                                      dtype=q.dtype, layout=LAYOUT_KINDS.index(layout.kind),
                                      granularity=layout.granularity, cp_size=layout.cp_size, **fields)
    elif error is not None:
        raise ValueError(error)
    return cp


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: Layout,
                   group=None, softmax_scale: Optional[float] = None, causal: bool = True,
                   check_inputs: bool = True, backend: Optional[KernelBackend] = None,
                   documents=None) -> torch.Tensor:
    """Exact (dense) causal attention over a sequence sharded across a CP group.

    Args:
        q: ``[b, s_local, hq, d]`` this rank's queries (already position-encoded), fp64/fp32/bf16/fp16.
        k, v: ``[b, s_local, hkv, d]`` this rank's keys/values; GQA when ``hkv < hq``
            (``hq % hkv == 0``; K/V are not expanded).
        layout: the :class:`~megatron_mtraining.layout.Layout` the sequence was sharded with;
            ``layout.cp_size`` must equal the group size.
        group: the CP process group (``None``: a single rank, no communication).
        softmax_scale: defaults to ``1/sqrt(d)``.
        causal: causal mask on global positions (key visible iff its position <= the query's).
        check_inputs: before the first exchange, all ranks compare their local verdicts, shapes,
            dtypes, layout and ``softmax_scale`` with one small all_gather and raise the same
            error on an invalid input or a mismatch (instead of hanging).
        backend: the kernels (:func:`~megatron_mtraining.ops.backends.select_backend`); ``None``:
            ``select_backend("auto")`` for these inputs: on CUDA FlashAttention-4 or the Triton kernels
            of :mod:`megatron_mtraining.ops.dense_gpu` (position-masked 64x64 tiles) where they support
            the shape, SDPA for causal bf16/fp16 attention at CP=1; otherwise the torch reference
            :class:`DenseStepKernel` (the CPU path and the oracle).
        documents: :class:`~megatron_mtraining.layout.PackedDocuments` of the ``b`` packed streams
            (the same on every rank): attention is causal *and* within a document, key blocks of
            other documents are skipped, padding tokens give exact zeros in the output and every
            gradient. A single document without padding runs the unpacked path. Runs on the torch
            reference or the Triton dense step kernels, or at CP=1 on FA4's varlen interface where
            ``backend`` has it (``packed_cp1``; ``"auto"`` on a Hopper/Blackwell GPU with FA4), never SDPA.

    q/k/v with a strided last dimension are copied to a unit last stride first (every backend).

    Returns:
        ``[b, s_local, hq, d]`` in the dtype of ``q``.

    Raises:
        ValueError: shapes/dtypes inconsistent locally or across ranks, ``layout.cp_size`` not the
            group size, a global length ``s_local * cp_size`` the layout cannot split, documents that
            do not match the inputs or differ across ranks, documents with a backend that has no
            document masks, or a NaN or infinite ``softmax_scale`` (on any rank).
        TypeError: a ``softmax_scale`` that is not a number; ``q``/``k``/``v`` that are not tensors,
            a ``layout`` that is not a :class:`~megatron_mtraining.layout.Layout` or a ``backend``
            that is not a :class:`~megatron_mtraining.ops.backends.KernelBackend` (e.g. a name).
    """
    check_api_arguments("ring_attention", q, k, v, layout, backend)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    documents = packed_documents(documents)
    cp = check_ring_inputs(q, k, v, layout, group, "ring_attention", check_inputs, causal=bool(causal),
                           softmax_scale=scale, documents=documents)
    backend = backend_for(q, cp, backend, packed=documents is not None)
    q, k, v = last_dim_contiguous(q, k, v)
    if cp == 1 and causal and backend.dense_cp1 is not None and documents is None:
        # the layout is the identity at cp=1, so this is plain causal attention (FA4 or SDPA: cuDNN/flash)
        with record_function(REGION_ATTENTION_FWD):
            return backend.dense_cp1(q, k, v, scale)
    if cp == 1 and causal and backend.packed_cp1 is not None and documents is not None:
        # causal attention within each document of the (identity-laid-out) streams: FA4 varlen
        with record_function(REGION_ATTENTION_FWD):
            return backend.packed_cp1(q, k, v, scale, documents)
    kernel = dense_step_kernel(backend, layout, group_rank(group), q.shape[1] * cp, scale, bool(causal), q.device,
                               documents)
    return RingAttentionFunc.apply(q, k, v, kernel, RingComm(group), backend.delta)

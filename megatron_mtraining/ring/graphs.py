"""CUDA graphs of one layer's whole sparse attention (``cuda_graphs: true`` in the config).

A sparse layer launches a few hundred small kernels per call (pattern estimation, index conversion,
kernel plans, the sparse forward and backward kernels; MTraining §3.2-3.3), about 5 ms of host work
per call. :class:`CUDAGraphedAttention` captures
the layer's attention, forward and backward, once per input signature with
:class:`torch.cuda.CUDAGraph` and then replays the two graphs: one launch each, whatever the
number of kernels inside. The pattern is still estimated online from each call's q/k: a replay
runs the same kernels on the new inputs (copied into the graph's input buffers). This pays only where
the host, not the GPU, bounds training: on one H200 with the SmolLM2-135M shape it pays at 32K
(docs/results.md, sparse plans without sorts); at 64K, where the GPU bounds training, it measured 1-2 %
slower (docs/results.md, CUDA graphs of the sparse layers).

Rules (each refused with an error naming it, never a silent wrong answer):

* CUDA inputs only, at ``cp_size == 1`` (the ring's K/V exchanges are not captured), without
  packed documents (their boundaries change with every micro-batch);
* one backward per forward: a second backward through a retained graph raises ``RuntimeError``
  (:data:`SECOND_BACKWARD_RULE`); non-reentrant activation checkpointing around the attention
  (``torch.utils.checkpoint(..., use_reentrant=False)``) recomputes while the first forward is alive and
  is refused as a second forward (Megatron's own recomputation is reentrant and runs);
* one forward in flight per layer: a layer's graph holds the state of its last forward until that
  forward's backward has run. A second forward of the same layer with gradients enabled while the
  first one's autograd graph is still alive raises ``RuntimeError`` (pipeline schedules that run
  several forwards before their backwards need ``cuda_graphs: false``); a forward whose autograd graph
  was dropped without a backward frees the layer. Activation recomputation (a no-grad forward,
  then the recomputed forward and its backward) is fine.

Calls without gradients (``torch.no_grad``, inputs that do not require grad) run eagerly. Replays
compute what the eager call computes: the same kernels on the same inputs (bitwise with
``deterministic: true``). The gradients handed out are copies. The output handed out is the graph's
output buffer itself (as the eager call hands out the tensor it saves for its backward), guarded as
the eager output is:

* modified in place before the backward (it or a view of it), the backward raises autograd's
  ``RuntimeError`` for a saved tensor modified by an inplace operation;
* still referenced past its backward (the model keeps it, a view of it or its storage, or a retained
  autograd graph holds it), it keeps its values: the layer's next forward runs eagerly, and a replay of a
  layer captured before it (in training order, the next layers down in the backward and the first layers
  of the next forward) may reuse its memory, so its values are copied aside before that replay and back
  after it; the pool keeps that memory allocated while the output is referenced, even if the layer is
  dropped. The layer warns once; from then on it hands out copies of its graph's output (one output's
  memory more per layer), and runs eagerly for as long as a tensor handed out before is referenced;
* under saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``,
  activation offloading), which skip that version check, the call hands out a copy.

Memory: the graphs of all layers on a device share one memory pool. Each layer keeps its forward's saved
tensors (as the eager call keeps them until its backward), its output buffer among them; the transients of the
estimation and the kernels are shared by all layers (one eager call's peak), and so are the backward's
static buffers, the incoming output gradient and the gradients handed out (one set per input signature:
a replay reads and writes them only while it runs, and its gradients are copied out before the next
replay). The backward graph copies its gradients into those shared buffers, so that no layer keeps its
own (dO, dQ, dK and dV of a 128K SmolLM2-135M layer: 0.4 GB). A block that one
layer's capture freed may hold the saved tensors of a layer captured later, so the graphs must replay in
an order that keeps those intact: while a layer's forward awaits its backward, only layers captured after
it may run in between (training's order: forwards 1..N, backwards N..1, with or without recomputing the
core attention in the backward). A replay out of that order raises ``RuntimeError``
(:data:`REPLAY_ORDER_RULE`) before it runs. For the same reason, what a forward writes and its backward reads
must stay referenced until the layer's autograd node is released (its saved tensors, and whatever the step
kernels keep from the forward, such as plans and block lists): memory freed during the backward's capture
goes back to the shared pool, a later layer's capture may take it, and that layer's replays would then
overwrite it between this layer's forward and backward.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, Optional

import torch

from ..common import REGION_ATTENTION_BWD, REGION_ATTENTION_FWD, cuda_index, record_function

__all__ = ["CUDAGraphedAttention", "DOCUMENTS_RULE", "SECOND_FORWARD_RULE", "SECOND_BACKWARD_RULE",
           "REPLAY_ORDER_RULE", "OUTPUT_KEPT_WARNING", "cuda_graphs_error"]

DOCUMENTS_RULE = ("mtraining config 'cuda_graphs: true' cannot capture packed documents (their boundaries change with "
                  "every micro-batch); set cuda_graphs: false")

SECOND_FORWARD_RULE = (
    "cuda_graphs: a second forward of this layer before the backward of the previous one (the layer's CUDA graph "
    "holds one forward's state); run forward and backward in turn, drop the earlier output, or set "
    "cuda_graphs: false (e.g. for pipeline schedules that run several forwards before their backwards)")


SECOND_BACKWARD_RULE = (
    "cuda_graphs: a second backward through one forward of this layer (retain_graph=True): the layer's graph keeps "
    "its saved tensors only until the first backward; run the forward again, or set cuda_graphs: false")
REPLAY_ORDER_RULE = (
    "cuda_graphs: this layer's graph would run while a layer captured after it awaits its backward (the layers' graphs "
    "share one memory pool, laid out for the order of the first training step: forwards 1..N, then backwards "
    "N..1); keep that order from step to step (the same recomputation settings), or set cuda_graphs: false")


OUTPUT_KEPT_WARNING = (
    "cuda_graphs: the output of this layer's previous call is still referenced past its backward (the model keeps "
    "the attention output or a view of it, or a retained autograd graph holds it); it is kept intact (the layer's "
    "next forward runs eagerly, and the replays of the layers captured before it save and restore it), and the "
    "layer hands out copies of its graph's output from now on (one output's memory more)")


def _alias(t: torch.Tensor):
    """``(tensor, weak reference)``: a tensor over ``t``'s memory on a storage of its own that does not own it,
    and a weak reference to that storage, alive while the tensor, a view of it or its storage is referenced
    anywhere. ``None`` where this version of torch cannot build them."""
    build = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if build is None:
        return None
    from torch.multiprocessing.reductions import StorageWeakRef

    st = t.untyped_storage()
    out = t.new_empty(0).set_(build(st.data_ptr(), t.device, st.nbytes()), t.storage_offset(), t.shape, t.stride())
    return out, StorageWeakRef(out.untyped_storage())


def _saved_tensor_hooks_active() -> bool:
    """Whether default saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``,
    activation offloading) are active: they pack a saved tensor without autograd's version check, and the
    graph's backward reads its own buffer, not what they unpack. ``True`` where torch cannot tell."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class _Pool:
    """The memory pool shared by the graphs of one device, the capture order and the forwards in flight."""

    def __init__(self):
        self.handle = torch.cuda.graph_pool_handle()
        self.captured = 0
        self.in_flight: list = []            # entries whose forward awaits its backward
        self.shared: dict = {}               # the backward's static buffers, one set per signature
        self.holding: dict = {}              # capture order -> entry whose handed-out output may be referenced

    def add(self, entry: "_Entry") -> None:
        """Register a captured entry: its capture order."""
        entry.order = self.captured
        self.captured += 1

    def hold(self, entry: "_Entry") -> None:
        """``entry`` handed out its output buffer: the pool keeps the entry (and so that memory) alive while the
        output may be referenced, even if its layer is dropped, and :meth:`replay` keeps its values."""
        self.holding[entry.order] = entry

    def replay(self, entry: "_Entry", graph) -> None:
        """Replay ``graph`` (``entry``'s forward or backward) without losing an output that a layer captured
        after ``entry`` handed out and the model still references: that layer's capture may have placed its
        output in memory that ``entry``'s capture had freed (``entry``'s transients), which this replay writes.
        Such outputs are copied aside before the replay and back after it (stream order, no host
        synchronisation), and their layers hand out copies from then on (:data:`OUTPUT_KEPT_WARNING`). In
        training nothing keeps an attention output past its backward: the outputs handed out by the layers
        captured after ``entry`` are checked (and released once no longer referenced), nothing is copied."""
        kept = []
        for order, other in list(self.holding.items()):
            if order > entry.order:
                if other.output_kept():
                    kept.append(other)
                else:
                    del self.holding[order]
        saved = [e.out_data.clone() for e in kept]
        graph.replay()
        for e, data in zip(kept, saved):
            e.out_data.copy_(data)
            e.keep_copies()

    def shared_like(self, role: str, *like: torch.Tensor) -> tuple:
        """Buffers shaped (and strided) like ``like``, one set per ``role`` and signature of ``like``, shared by
        every entry of the pool that asks for them. Allocate them outside a capture (they are not in the
        graphs' pool)."""
        key = (role, *((tuple(t.shape), t.stride(), t.dtype, t.device) for t in like))
        if key not in self.shared:
            self.shared[key] = tuple(torch.empty_like(t) for t in like)
        return self.shared[key]

    def check(self, entry: "_Entry") -> None:
        self.in_flight = [e for e in self.in_flight if e.live()]
        for other in self.in_flight:
            if other is not entry and other.order > entry.order:
                raise RuntimeError(REPLAY_ORDER_RULE)


_POOLS: dict = {}


def _pool(device: torch.device) -> _Pool:
    idx = cuda_index(device)
    if idx not in _POOLS:
        _POOLS[idx] = _Pool()
    return _POOLS[idx]


def cuda_graphs_error(q: torch.Tensor, documents=None) -> Optional[str]:
    """Why CUDA graphs cannot run this attention call, or ``None`` (``cp_size == 1`` is a rule of the plan,
    :func:`~megatron_mtraining.plan.resolve`).

    Args:
        q: the call's queries (``[b, s_local, hq, d]``).
        documents: the call's packed documents (``None``: none).
    """
    if documents is not None:
        return DOCUMENTS_RULE
    if q.device.type != "cuda":
        return f"cuda_graphs: true needs CUDA tensors, got q on {q.device}; set cuda_graphs: false"
    return None


class _Entry:
    """The captured graphs of one input signature, their buffers and the forward in flight."""

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.order = -1                 # capture order in the pool
        self.fwd = self.bwd = None      # the captured graphs (``replay()``)
        self.inputs = ()
        self.out = None                 # the captured output (its autograd graph holds the saved tensors)
        self.out_data = None
        self.grad_out = None
        self.grads = ()
        self.generation = 0
        self.pending = None             # weakref to the ctx of the forward whose backward has not run
        self.handed = None              # weak reference to the storage of the last output buffer handed out
        self.copy_out = False           # hand out copies of the output (an output was kept past a forward)

    def live(self) -> bool:
        return self.pending is not None and self.pending() is not None

    def output_kept(self) -> bool:
        """Whether a tensor handed out by an earlier replay (or a view of it) is still referenced, so that a
        replay would overwrite it (copies never are)."""
        return self.handed is not None and not self.handed.expired()

    def keep_copies(self) -> None:
        """Hand out copies of the output buffer from now on (an output handed out was kept); warns once, naming
        the layer by its capture order and input shape (so that Python's default filter, which shows a message
        once per text and place, shows one per layer)."""
        if not self.copy_out:
            shape = tuple(self.inputs[0].shape) if self.inputs else ()
            warnings.warn(f"{OUTPUT_KEPT_WARNING} [layer {self.order + 1} in this GPU's capture order, q {shape}]",
                          RuntimeWarning, stacklevel=3)
            self.copy_out = True

    def check_free(self) -> None:
        if self.live():
            raise RuntimeError(SECOND_FORWARD_RULE)
        self.pool.check(self)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entry: _Entry, q, k, v):
        entry.check_free()
        with record_function(REGION_ATTENTION_FWD):
            for dst, src in zip(entry.inputs, (q, k, v)):
                dst.copy_(src)
            entry.pool.replay(entry, entry.fwd)
            alias = None if entry.copy_out or _saved_tensor_hooks_active() else _alias(entry.out_data)
            if alias is None:
                out = entry.out_data.clone()
            else:   # the output buffer itself, as a tensor of its own (not an autograd view of out_data), saved:
                out, entry.handed = alias   # autograd refuses the backward if it (or a view) was modified in place
                entry.pool.hold(entry)
                ctx.save_for_backward(out)
        entry.generation += 1
        ctx.entry, ctx.generation = entry, entry.generation
        entry.pending = weakref.ref(ctx)
        entry.pool.in_flight.append(entry)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        entry = ctx.entry
        if getattr(ctx, "done", False):
            raise RuntimeError(SECOND_BACKWARD_RULE)
        if ctx.generation != entry.generation:
            raise RuntimeError(SECOND_FORWARD_RULE)
        entry.pool.check(entry)
        ctx.saved_tensors       # the version check of a handed-out output buffer
        with record_function(REGION_ATTENTION_BWD):
            entry.grad_out.copy_(dout)
            entry.pool.replay(entry, entry.bwd)
            grads = tuple(g.clone() for g in entry.grads)
        entry.pending = None
        ctx.done = True
        return (None, *grads)


class CUDAGraphedAttention:
    """One layer's attention ``fn(q, k, v) -> out`` through CUDA graphs, captured per input signature.

    Give every layer its own instance (its graphs hold that layer's state between forward and
    backward). The first gradient-enabled call with a new signature (shapes, strides, dtype, device)
    runs ``fn`` eagerly ``warmup`` times on a side stream (kernel compilation, cached plans), then
    captures the forward and, through :func:`torch.autograd.grad` (the forward's autograd graph kept),
    the backward into two graphs in the device's shared pool; every call replays them (:class:`_Replay`). A capture that fails
    warns once, naming the error, and that signature runs eagerly from then on.

    Args:
        fn: ``fn(q, k, v) -> out``: ``q [b, s, hq, d]``, ``k, v [b, s, hkv, d]`` (CUDA, float), ``out
            [b, s, hq, d]``; no host synchronisation, no communication.
        warmup: eager forward+backward runs before the capture (>= 1).

    Call: ``graphed(q, k, v)`` with the same contract as ``fn``. Raises ``RuntimeError`` for a second
    forward in flight (:data:`SECOND_FORWARD_RULE`).
    """

    def __init__(self, fn: Callable, warmup: int = 2):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (kernels compile before the capture), got {warmup}")
        self.fn = fn
        self.warmup = int(warmup)
        self._entries: dict = {}

    @staticmethod
    def _signature(*ts: torch.Tensor) -> tuple:
        return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in ts)

    @property
    def captured(self) -> int:
        """Number of signatures with captured graphs."""
        return sum(1 for e in self._entries.values() if e is not None)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and q.requires_grad and k.requires_grad and v.requires_grad):
            return self.fn(q, k, v)
        sig = self._signature(q, k, v)
        if sig not in self._entries:
            self._entries[sig] = self._capture(q, k, v)
        entry = self._entries[sig]
        if entry is None:                       # the capture failed (warned): eager
            return self.fn(q, k, v)
        if not entry.live() and entry.output_kept():    # a replay would overwrite a kept output: eager
            entry.keep_copies()
            return self.fn(q, k, v)
        return _Replay.apply(entry, q, k, v)

    def _capture(self, q, k, v) -> Optional[_Entry]:
        entry = _Entry(_pool(q.device))
        entry.fwd, entry.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        entry.inputs = tuple(t.detach().clone().requires_grad_(True) for t in (q, k, v))
        cur = torch.cuda.current_stream(q.device)
        side = torch.cuda.Stream(device=q.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                out = self.fn(*entry.inputs)
                torch.autograd.grad(out, entry.inputs, torch.zeros_like(out))
                del out
        cur.wait_stream(side)
        pool = entry.pool.handle
        caller = torch.cuda.current_stream(q.device)
        had = set(entry.pool.shared)
        try:
            with torch.cuda.graph(entry.fwd, pool=pool):
                entry.out = self.fn(*entry.inputs)
            (entry.grad_out,) = entry.pool.shared_like("grad_out", entry.out)
            entry.grads = entry.pool.shared_like("grads", *entry.inputs)
            with torch.cuda.graph(entry.bwd, pool=pool):
                # retain_graph: the saved tensors stay allocated, so no later capture reuses their blocks
                grads = torch.autograd.grad(entry.out, entry.inputs, entry.grad_out, retain_graph=True)
                for dst, g in zip(entry.grads, grads):     # the shared buffers; the graph's own return to the pool
                    dst.copy_(g)
                del grads, g, dst
        except Exception as e:   # an operation CUDA graphs cannot capture: this signature runs eagerly
            torch.cuda.set_stream(caller)     # a failed capture_end leaves the capture stream current
            torch.cuda.synchronize(q.device)
            for key in set(entry.pool.shared) - had:      # buffer sets this failed capture created
                del entry.pool.shared[key]
            cause = e.__context__ if e.__context__ is not None else e    # the op that broke the capture, if any
            text = f"{type(cause).__name__}: {cause}"
            del cause     # its traceback holds this frame: kept, the failed capture's tensors wait for the collector
            warnings.warn(f"cuda_graphs: capturing the attention of inputs {tuple(q.shape)} failed ({text}); this layer "
                          f"runs without CUDA graphs", RuntimeWarning, stacklevel=3)
            return None
        entry.out_data = entry.out.detach()
        entry.pool.add(entry)
        return entry

"""The one place that chooses attention kernels: :func:`select_backend` -> :class:`KernelBackend`.

Backends (``kernel_backend`` in the configuration):

* ``"torch"``: the torch reference kernels (:mod:`~megatron_mtraining.ops.reference`,
  :mod:`~megatron_mtraining.ops.sparse_reference`; the oracle and the CPU path). Any device, any
  float dtype, any shape.
* ``"triton"``: the Triton kernels of :mod:`~megatron_mtraining.ops.triton` for the ring steps
  (dense steps with position masks, :mod:`~megatron_mtraining.ops.dense_gpu`; vertical-slash sparse
  steps, MTraining §3.3), the fused estimator scores (§3.2) and, at CP=1, the fused index conversion.
  Limits: bf16/fp16/fp32; ``head_dim`` in :data:`TRITON_HEAD_DIMS`; a local sequence length that is a
  multiple of 64; CUDA, or the CPU under the Triton interpreter (``TRITON_INTERPRET=1``). Inputs with
  a strided last dimension are accepted: the ring entry points make q/k/v contiguous first.
* ``"sdpa"``: PyTorch SDPA (cuDNN / FlashAttention) for dense causal attention at CP=1; it has no
  ring-step or sparse kernels, so it accepts ``cp_size == 1`` and dense attention only.
* ``"fa4"``: FlashAttention-4 (:mod:`~megatron_mtraining.ops.fa4`; optional ``flash-attn-4``
  package, Hopper/Blackwell GPUs, bf16/fp16, ``head_dim`` 64/96/128) for dense causal attention at
  CP=1 and for the dense ring steps it can express exactly (striped granularity a multiple of 128,
  zigzag chunks a multiple of 128, and every rank's own causal step) and for the slash blocks of
  vertical-slash patterns estimated at 128-token blocks (``vertical_slash.block_size: 128``), and for
  packed documents with dense attention at CP=1 (its varlen interface, below); the
  other dense steps, the vertical columns and patterns at 64-token blocks run the Triton kernels. FA4 is used only after a one-time self-check for the shape
  (:func:`~megatron_mtraining.ops.fa4.fa4_self_check`) passes; a shape it fails falls back to
  ``"triton"`` with a warning naming why.
* ``"auto"`` (default): the fastest supported choice for the device. CPU: ``"torch"``. CUDA: FA4
  where it can run and passes its self-check (dense attention at CP=1 and the dense ring steps;
  packed documents: dense attention at CP=1 through FA4 varlen),
  else SDPA for causal bf16/fp16 attention at CP=1; the Triton kernels elsewhere, each checked
  against every limit above; where a limit fails (e.g. ``head_dim`` 80, fp64) the ring steps use
  the torch reference while the Triton estimator and ``delta`` kernels still run where they can.

Packed documents (``packed=True``: a document mask from
:class:`~megatron_mtraining.layout.PackedDocuments`) run on the step kernels whose masks take
per-query key bounds: the torch reference, the Triton dense steps (mode 3 of
:mod:`~megatron_mtraining.ops.triton.kernels`) and the Triton sparse steps (their document mask),
and, for dense attention at ``cp_size == 1``, FA4's varlen interface
(:func:`~megatron_mtraining.ops.fa4.fa4_varlen_attention`: every document its own causal sequence
of one THD batch; the backend's ``packed_cp1``). ``"auto"`` picks FA4 varlen for packed dense
attention at CP=1 where FA4 can run and passes its one-time varlen self-check
(:func:`~megatron_mtraining.ops.fa4.fa4_varlen_self_check`), and otherwise chooses as for unpacked
inputs but never FA4 or SDPA: at ``cp_size > 1`` the dense ring steps with documents run Triton
(a step's document mask on striped/zigzag shards is token-level on global positions; FA4's varlen
causal mask is on local indices and its varlen backward takes no block sparsity). An explicit
``"fa4"`` with ``packed=True`` is accepted for dense attention at ``cp_size == 1`` (a shape that
fails the varlen self-check runs the Triton steps, with a warning) and raises ``ValueError`` at
``cp_size > 1`` or with ``sparse``; ``"sdpa"`` with ``packed=True`` raises. The vertical-slash pattern over packed documents
(``packed=True, sparse=True``) runs the sparse step kernels of ``"triton"`` (``"auto"`` on CUDA where
the Triton limits hold) or ``"torch"``; its estimator and index conversion run in torch (the Triton
score kernels have no document mask).

An explicit ``"triton"``, ``"sdpa"`` or ``"fa4"`` that cannot run the requested shape raises ``ValueError``
naming the rule and the supported values; ``"auto"`` never raises for a supported float dtype.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ..common import TRITON_DTYPES, triton_runs_on
from .base import DeltaFunction, DenseSingleFunction, StepKernel
from .reference import DenseStepKernel, attention_delta_torch
from .sparse_reference import SparseStepKernel

__all__ = ["KERNEL_BACKENDS", "TRITON_HEAD_DIMS", "TRITON_BLOCK", "KernelBackend", "select_backend",
           "triton_unsupported", "kernel_backend_error"]

KERNEL_BACKENDS = ("auto", "torch", "triton", "sdpa", "fa4")
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256)
TRITON_BLOCK = 64        # query tile rows = key block width of the Triton kernels (slash block sizes: multiples)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class KernelBackend:
    """The kernels one attention call runs (built by :func:`select_backend`; immutable).

    Attributes:
        name: the ring step kernels: ``"torch"``, ``"triton"``, ``"fa4"`` (FA4 dense steps, Triton
            elsewhere) or ``"sdpa"`` (SDPA at CP=1, torch reference steps for the non-causal case).
        dense_step: ``(layout, rank, seq_len, softmax_scale, causal, device=...) ->`` a
            :class:`~megatron_mtraining.ops.base.StepKernel` of the dense ring.
        sparse_step: ``(steps, softmax_scale) ->`` a sparse ring step kernel
            (:class:`~megatron_mtraining.ops.sparse_reference.SparseStepKernel` protocol, ``steps`` the
            per-owner :class:`~megatron_mtraining.patterns.indices.StepIndices`), or ``None`` (no
            sparse kernels: ``"sdpa"``).
        delta: ``(dout, out) -> delta [b, hq, s]`` of the backward.
        dense_cp1: causal attention at CP=1 without the ring, ``(q, k, v, softmax_scale) -> out``, or
            ``None`` (the ring with one rank).
        packed_cp1: causal attention within packed documents at CP=1 without the ring,
            ``(q, k, v, softmax_scale, documents) -> out`` (FA4 varlen), or ``None`` (the ring with one
            rank and the document-masked step kernels). When set, ``dense_step`` is a step kernel
            with a document mask (the Triton dense steps).
        estimator_impl: ``impl`` of :func:`~megatron_mtraining.patterns.estimator.estimate_vertical_slash`
            (``"torch"`` or ``"triton"``).
        convert_impl: ``impl`` of :func:`~megatron_mtraining.patterns.convert.convert_pattern`.
        deterministic: backward without floating-point atomics (bitwise repeatable).
    """

    name: str
    dense_step: Callable[..., StepKernel]
    sparse_step: Optional[Callable[..., StepKernel]]
    delta: DeltaFunction
    dense_cp1: Optional[DenseSingleFunction] = None
    estimator_impl: str = "torch"
    convert_impl: str = "torch"
    deterministic: bool = True
    packed_cp1: Optional[Callable[..., torch.Tensor]] = None

    # what the kernels can do, so that no caller decides by the backend's name
    @property
    def triton_steps(self) -> bool:
        """The ring's step kernels run Triton (``"triton"``; ``"fa4"``, whose fallbacks are Triton) and need
        the Triton limits (:func:`triton_unsupported`) of the inputs themselves."""
        return self.name in ("triton", "fa4")

    @property
    def document_steps(self) -> bool:
        """Packed documents can run: the dense step kernels have a document mask (torch, Triton), or
        ``packed_cp1`` runs them at CP=1."""
        return self.name in ("torch", "triton") or self.packed_cp1 is not None

    @property
    def sparse_documents(self) -> bool:
        """The sparse step kernels have a document mask (torch, Triton; not FA4's block-sparse kernels)."""
        return self.sparse_step is not None and self.name != "fa4"

    @property
    def group_indices(self) -> bool:
        """The sparse step kernels read per-KV-group indices (``share_pattern: kv_group``) directly; the
        others take them expanded per query head."""
        return self.name == "triton"


def triton_unsupported(*, device, dtype: torch.dtype, head_dim: int, seq_len_local: Optional[int] = None,
                       triton_available: Optional[bool] = None) -> List[str]:
    """Every limit of the Triton attention kernels these inputs break (empty: they can run).

    Args:
        device, dtype, head_dim, seq_len_local: as for :func:`select_backend`.
        triton_available: whether Triton runs on ``device`` (``None``: check it,
            :func:`~megatron_mtraining.common.triton_runs_on`).
    """
    device = torch.device(device)
    runs = triton_runs_on(device) if triton_available is None else bool(triton_available)
    why = []
    if not runs:
        why.append(f"Triton does not run on {device} (it needs Triton and CUDA, or the CPU with "
                   "TRITON_INTERPRET=1 set before triton is imported)")
    if dtype not in TRITON_DTYPES:
        why.append(f"dtype {dtype} is not supported (supported: bfloat16, float16, float32)")
    if head_dim not in TRITON_HEAD_DIMS:
        why.append(f"head_dim {head_dim} is not supported (supported: {', '.join(map(str, TRITON_HEAD_DIMS))})")
    if seq_len_local is not None and seq_len_local % TRITON_BLOCK:
        why.append(f"local sequence length {seq_len_local} is not supported (supported: multiples of {TRITON_BLOCK})")
    return why


def _fa4_problem(device: torch.device, dtype: torch.dtype, head_dim: int,
                 fa4_available: Optional[bool]) -> Optional[str]:
    """Why FA4 cannot run here (``None``: it can), without running it."""
    if fa4_available is not None:
        return None if fa4_available else "FlashAttention-4 is not available"
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"FlashAttention-4 needs a CUDA device, got {device}"
    from .fa4 import fa4_unavailable_reason

    return fa4_unavailable_reason(device, dtype, head_dim)


def _fa4_passes_self_check(device: torch.device, dtype: torch.dtype, head_dim: int,
                           fa4_available: Optional[bool], packed: bool = False,
                           deterministic: bool = False) -> bool:
    """FA4's one-time self-check for this shape (cached); a failure warns once with the reason.
    ``packed``: the varlen self-check (packed documents at CP=1) instead of the ring-step one."""
    if fa4_available is not None:
        return bool(fa4_available)
    if packed:
        from .fa4 import fa4_varlen_self_check

        why = fa4_varlen_self_check(device, dtype, head_dim, hq=4, hkv=2, deterministic=deterministic)
    else:
        from .fa4 import fa4_self_check

        why = fa4_self_check(device, dtype, head_dim, hq=4, hkv=2)
    if why is not None:
        warnings.warn(f"{why}; using the Triton kernels instead", RuntimeWarning, stacklevel=3)
    return why is None


def select_backend(name: str = "auto", *, device, dtype: torch.dtype, head_dim: int,
                   seq_len_local: Optional[int] = None, cp_size: int = 1, sparse: bool = False,
                   deterministic: bool = True, kernel_config=None, prebuild_backward_plans: bool = True,
                   stats: Optional[dict] = None, triton_available: Optional[bool] = None,
                   fa4_available: Optional[bool] = None, packed: bool = False) -> KernelBackend:
    """Choose the attention kernels for one shape (see the module docstring for the rules).

    Args:
        name: one of :data:`KERNEL_BACKENDS` (the ``kernel_backend`` setting).
        device: the device of q/k/v (``torch.device`` or string).
        dtype: the dtype of q/k/v (a float dtype).
        head_dim: ``d``, the last dimension of q/k/v.
        seq_len_local: tokens per CP rank (``None``: not checked here; the kernels check it).
        cp_size: size of the CP group (``"sdpa"`` needs 1; the Triton index conversion runs at 1 only).
        sparse: the vertical-slash sparse ring will run (``"sdpa"`` has no sparse kernels).
        deterministic: Triton backward without floating-point atomics (bitwise repeatable).
        kernel_config: Triton launch parameters
            (:class:`~megatron_mtraining.ops.triton.launch.KernelConfig`; ``None``: the defaults).
        prebuild_backward_plans: the Triton sparse step builds each step's backward index plans during
            the forward (overlapped with it on CUDA); results are bitwise the same either way.
        stats: a dict receiving the registers / spills of each launched Triton kernel (benchmarks).
        triton_available: whether Triton runs on ``device`` (``None``: checked,
            :func:`~megatron_mtraining.common.triton_runs_on`); lets a caller decide for a device it
            does not hold.
        fa4_available: whether FlashAttention-4 runs and computes these shapes correctly (``None``:
            checked, :func:`~megatron_mtraining.ops.fa4.fa4_unavailable_reason` and the cached
            :func:`~megatron_mtraining.ops.fa4.fa4_self_check`); lets a caller decide for a device it
            does not hold.
        packed: the attention has a packed-document mask (the torch and Triton step kernels, dense
            and sparse, implement it; FA4 for dense attention at ``cp_size == 1`` through its varlen
            interface; SDPA does not).

    Returns:
        a :class:`KernelBackend`.

    Raises:
        ValueError: an unknown ``name`` (naming :data:`KERNEL_BACKENDS`), a non-float ``dtype``, a
            ``head_dim`` or ``cp_size`` below 1, ``"triton"`` where a limit fails (each failing limit
            named with the supported values), ``"sdpa"`` with ``cp_size > 1`` or ``sparse``,
            ``"sdpa"`` with ``packed``, or ``"fa4"`` with ``packed`` and ``cp_size > 1`` or ``sparse``.
    """
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {', '.join(map(repr, KERNEL_BACKENDS))}, got {name!r}")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"attention inputs must be bfloat16, float16, float32 or float64, got dtype {dtype}")
    if head_dim < 1 or cp_size < 1:
        raise ValueError(f"head_dim and cp_size must be >= 1, got head_dim={head_dim}, cp_size={cp_size}")
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    # packed documents on FA4: its varlen interface, for dense attention at CP=1 (no ring steps)
    packed_fa4 = packed and not sparse and cp_size == 1
    if packed and name == "sdpa":
        raise ValueError("kernel_backend='sdpa' cannot run packed sequences (document masks): its kernels mask "
                         "by causal positions only; use kernel_backend='auto', 'triton' or 'torch'")
    if packed and name == "fa4" and not packed_fa4:
        where = "with the vertical-slash pattern" if sparse else f"at cp_size {cp_size}"
        raise ValueError(f"kernel_backend='fa4' cannot run packed sequences (document masks) {where}: FA4 runs "
                         "packed documents through its varlen interface for dense attention at cp_size 1 only (its "
                         "ring-step and sparse kernels mask by positions only); use kernel_backend='auto', 'triton' "
                         "or 'torch'")
    why = triton_unsupported(device=device, dtype=dtype, head_dim=head_dim, seq_len_local=seq_len_local,
                             triton_available=triton_available)
    if name == "triton" and why:
        raise ValueError("kernel_backend='triton' cannot run these inputs: " + "; ".join(why)
                         + " (use kernel_backend='auto' or 'torch')")
    if name == "sdpa" and (cp_size != 1 or sparse):
        raise ValueError(f"kernel_backend='sdpa' runs dense attention at cp_size 1 only (SDPA has no ring-step or "
                         f"sparse kernels), got cp_size={cp_size}, sparse={sparse} (use 'auto', 'triton' or 'torch')")
    use_fa4 = False
    if name == "fa4":
        problem = _fa4_problem(device, dtype, head_dim, fa4_available)
        if problem is None and why:
            problem = "the rest of its work runs the Triton kernels, and " + "; ".join(why)
        if problem is not None:
            raise ValueError(f"kernel_backend='fa4' cannot run these inputs: {problem} "
                             "(use kernel_backend='auto', 'triton' or 'torch')")
        use_fa4 = _fa4_passes_self_check(device, dtype, head_dim, fa4_available, packed, deterministic)
        name = "triton"
    if name == "auto":
        triton_runs = on_cuda and (triton_runs_on(device) if triton_available is None else bool(triton_available))
        steps = "triton" if on_cuda and not why else "torch"
        sdpa = on_cuda and dtype in (torch.bfloat16, torch.float16) and not packed
        pattern_kernels = triton_runs and dtype in TRITON_DTYPES
        fast_delta = triton_runs
        use_fa4 = (steps == "triton" and (packed_fa4 or not packed)
                   and _fa4_problem(device, dtype, head_dim, fa4_available) is None
                   and _fa4_passes_self_check(device, dtype, head_dim, fa4_available, packed, deterministic))
    else:
        steps = "triton" if name == "triton" else "torch"
        sdpa = name == "sdpa"
        pattern_kernels = fast_delta = name == "triton"

    dense_step: Callable[..., StepKernel] = DenseStepKernel
    sparse_step: Optional[Callable[..., StepKernel]] = SparseStepKernel
    delta: DeltaFunction = attention_delta_torch
    if steps == "triton":
        from .dense_gpu import DenseGpuStepKernel
        from .triton import make_sparse_step_kernel

        dense_step = functools.partial(DenseGpuStepKernel, deterministic=deterministic, config=kernel_config,
                                       stats=stats)
        sparse_step = functools.partial(make_sparse_step_kernel, deterministic=deterministic,
                                        prebuild=prebuild_backward_plans, config=kernel_config, stats=stats)
    if fast_delta:
        from .triton import attention_delta   # Triton where its own limits allow, torch otherwise

        delta = attention_delta
    dense_cp1 = None
    if sdpa:
        from .sdpa import sdpa_causal

        dense_cp1 = sdpa_causal
    packed_cp1 = None
    if use_fa4 and packed:
        # packed dense attention at CP=1: FA4 varlen; the ring steps (dense_step) keep the Triton
        # kernels, which have the document mask
        from .fa4 import fa4_causal, fa4_packed_causal

        packed_cp1 = functools.partial(fa4_packed_causal, deterministic=deterministic)
        dense_cp1 = fa4_causal
        steps = "fa4"
    elif use_fa4:
        from .fa4 import fa4_causal, make_fa4_dense_step, make_fa4_sparse_step

        dense_step = functools.partial(make_fa4_dense_step, fallback=dense_step, deterministic=deterministic)
        if sparse_step is not None:
            sparse_step = functools.partial(make_fa4_sparse_step, fallback=sparse_step, deterministic=deterministic)
        dense_cp1 = fa4_causal
        steps = "fa4"
    if name == "sdpa":
        sparse_step = None
    return KernelBackend(
        name=steps if name != "sdpa" else "sdpa", dense_step=dense_step, sparse_step=sparse_step, delta=delta,
        dense_cp1=dense_cp1, estimator_impl="triton" if pattern_kernels else "torch",
        convert_impl="triton" if pattern_kernels and cp_size == 1 else "torch", deterministic=bool(deterministic),
        packed_cp1=packed_cp1)


def kernel_backend_error(name: str, *, device, dtype: torch.dtype, head_dim: int, seq_len_local: Optional[int],
                         cp_size: int, sparse: bool, packed: bool = False, device_here: bool = True) -> Optional[str]:
    """What :func:`select_backend` would refuse for a run's shape, before the run starts, or ``None``.

    The same rules (device, dtype, head_dim, local length, CP size, sparse pattern, packed
    documents) without running anything: FA4 is checked for availability only (its one-time
    self-check runs at the first forward and falls back to Triton with a warning, never an error).
    The command-line front doors call it with the run's device (CUDA when available, else the CPU),
    so that e.g. ``kernel_backend: triton`` on a CPU run is an argument error, not a traceback at
    the first forward. ``device_here=False``: the run's device is not on this machine (a dry run of a
    GPU launch on a login node): Triton and FA4 are taken as installed there (their dtype, head_dim and
    length rules still checked; not FA4's compute capability)."""
    device = torch.device(device)
    if name == "fa4":
        if device_here:
            problem = _fa4_problem(device, dtype, head_dim, None)
        else:
            from .fa4 import fa4_shape_problem

            problem = fa4_shape_problem(dtype, head_dim)
        if problem is not None:
            return (f"kernel_backend='fa4' cannot run these inputs: {problem} "
                    "(use kernel_backend='auto', 'triton' or 'torch')")
    try:
        select_backend(name, device=device, dtype=dtype, head_dim=head_dim, seq_len_local=seq_len_local,
                       cp_size=cp_size, sparse=sparse, packed=packed,
                       fa4_available=True if name in ("fa4", "auto") or not device_here else None,
                       triton_available=None if device_here else True)
    except ValueError as e:
        return str(e)
    return None

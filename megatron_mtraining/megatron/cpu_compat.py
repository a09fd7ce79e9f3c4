"""CPU shims for megatron-core 0.16.1 (torch CPU build, gloo backend).

megatron-core hard-codes CUDA in a handful of places that the training path of
``examples/pretrain_gpt.py`` (GPTModel + DistributedDataParallel + get_megatron_optimizer +
clip-grad + OptimizerParamScheduler + dist_checkpointing save/load) runs through. Everything that a ``TransformerConfig`` flag
can switch off is switched off by the caller instead (``use_cpu_initialization=True``, all
fusions False; see :func:`cpu_transformer_config_kwargs`). What remains is patched here, one
function per CUDA assumption, and only when ``torch.cuda.is_available()`` is False.

Mechanism: every patch wraps the *original* megatron function with :func:`cuda_requests_on_cpu`,
a context in which

* factory calls asking for a CUDA device (``device="cuda"``, ``"cuda:N"``, an int, or
  ``torch.cuda.current_device()``) allocate on the CPU instead,
* ``Tensor.cuda()`` returns the tensor unchanged and ``pin_memory=True`` is dropped,
* ``Tensor.type()`` (no argument) reports CPU tensors as ``torch.cuda.*Tensor`` (megatron checks
  dtypes through these type strings, e.g. ``'torch.cuda.FloatTensor'``),
* ``torch.cuda.synchronize()`` is a no-op.

So the wrapped function keeps its exact upstream logic; only its device requests change. The
context is entered only around the wrapped functions, never globally.

The patches (see :data:`_PATCHES`): ``RotaryEmbedding.get_emb``, ``rope_utils.get_pos_emb_on_this_cp_rank``
(reached only without :func:`~megatron_mtraining.megatron.rope.install_layout_rope`, whose absence
``MTrainingAttention`` then reports), ``GlobalMemoryBuffer.get_tensor``,
``_ParamAndGradBuffer.__init__``, the optimizers' ``__init__`` (FP32 / mixed precision / float16,
``ChainedOptimizer.get_loss_scale``), the grad scalers' ``__init__``, ``get_grad_norm_fp32`` /
``clip_grad_by_total_norm_fp32`` / ``count_zeros_fp32``, ``dist_checkpointing.save`` / ``load``,
the tensor-parallel / sequence-parallel communication buffers, the pipeline send/receive buffers
and schedule, the tied-embedding set-up across pipeline stages, ``DistributedOptimizer.__init__``
and the RNG-state save/restore of activation recomputation.
:func:`patch_missing_psutil` is separate (not CUDA-related).

Not patched (not on our path; avoid on CPU): CUDA graphs, overlapped grad reduce and param
gather (CUDA streams), ``distribute_saved_activations``, inference KV caches and yarn/mrope embeddings.

Usage::

    from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_seed
    apply_cpu_patches()           # no-op on a CUDA machine; idempotent
    ...initialize_model_parallel(...)
    cpu_seed(1234)                # instead of model_parallel_cuda_manual_seed(1234) on CPU
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "apply_cpu_patches",
    "applied_patches",
    "patch_missing_psutil",
    "cpu_seed",
    "cuda_requests_on_cpu",
    "cpu_transformer_config_kwargs",
]

_APPLIED: list[str] = []


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, int) and not isinstance(dev, bool):
        return True  # a bare int means a CUDA ordinal to torch
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """TorchFunctionMode that serves CUDA device requests on the CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            if out.startswith("torch.") and not out.startswith("torch.cuda."):
                out = "torch.cuda." + out[len("torch."):]
        return out


@contextlib.contextmanager
def cuda_requests_on_cpu() -> Iterator[None]:
    """Context: CUDA allocations inside megatron code go to the CPU (see module docstring).

    While the context is active ``torch.cuda.current_device()`` returns ``torch.device("cpu")`` and
    ``torch.cuda.synchronize()`` is a no-op (CPU work is synchronous).
    """
    orig = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        with _CudaToCpuMode():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = orig  # type: ignore[assignment]


def _on_cpu(fn: Callable) -> Callable:
    if getattr(fn, "_mtraining_on_cpu", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_requests_on_cpu():
            return fn(*args, **kwargs)

    wrapper._mtraining_on_cpu = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_attr(owner: Any, name: str) -> None:
    setattr(owner, name, _on_cpu(getattr(owner, name)))


# ---------------------------------------------------------------------------------- the patches
def _patch_rotary_get_emb() -> None:
    """``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on the
    first call (fails even at CP=1). Only hit by a stock ``RotaryEmbedding``; ours (rope.py) does
    not move anything."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rpe

    _wrap_attr(rpe.RotaryEmbedding, "get_emb")


def _patch_rope_cp_slice() -> None:
    """``rope_utils.get_pos_emb_on_this_cp_rank`` (megatron-core's zigzag slicing of the RoPE table at
    CP > 1) builds its row index with ``pin_memory=True`` and ``.cuda()``. A model without
    :func:`~megatron_mtraining.megatron.rope.install_layout_rope` reaches it before attention runs; on
    CPU it then fails inside megatron-core, and with the patch ``MTrainingAttention`` names the missing
    call instead. ``RotaryEmbedding`` imports the function by name, so the wrapper is installed in both modules
    (yarn embeddings stay unpatched, see the module docstring)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rpe

    wrapped = _on_cpu(rope_utils.get_pos_emb_on_this_cp_rank)
    rope_utils.get_pos_emb_on_this_cp_rank = wrapped
    if hasattr(rpe, "get_pos_emb_on_this_cp_rank"):
        rpe.get_pos_emb_on_this_cp_rank = wrapped


def _patch_global_memory_buffer() -> None:
    """``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffer on
    ``torch.cuda.current_device()``. Only the stock ``DotProductAttention`` uses it (our tests use
    that as the CP=1 reference)."""
    from megatron.core import utils as mcore_utils

    _wrap_attr(mcore_utils.GlobalMemoryBuffer, "get_tensor")


def _patch_param_and_grad_buffer() -> None:
    """``_ParamAndGradBuffer.__init__`` (DistributedDataParallel) allocates the contiguous grad
    (and distributed-optimizer param) buffer with ``device=torch.cuda.current_device()``."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    _wrap_attr(pgb._ParamAndGradBuffer, "__init__")


def _patch_optimizer_scalars() -> None:
    """``FP32Optimizer.__init__`` / ``MixedPrecisionOptimizer.__init__`` create their loss-scale
    and overflow scalars with ``device='cuda'``; ``Float16OptimizerWithFloat16Params.__init__``
    accepts parameters only if ``param.type()`` is a ``'torch.cuda.*Tensor'`` (--bf16/--fp16);
    ``ChainedOptimizer.get_loss_scale`` may create a scalar on ``torch.cuda.current_device()``."""
    from megatron.core.optimizer import optimizer as opt

    _wrap_attr(opt.FP32Optimizer, "__init__")
    _wrap_attr(opt.MixedPrecisionOptimizer, "__init__")
    _wrap_attr(opt.Float16OptimizerWithFloat16Params, "__init__")
    _wrap_attr(opt.ChainedOptimizer, "get_loss_scale")


def _patch_grad_scalers() -> None:
    """``ConstantGradScaler`` / ``DynamicGradScaler`` keep their scale on ``device='cuda'``
    (only --fp16, or --bf16 with an explicit loss scale), and ``DynamicGradScaler.load_state_dict``
    moves a checkpoint's scale there (resuming an fp16 run)."""
    from megatron.core.optimizer import grad_scaler as gs

    for cls in (gs.ConstantGradScaler, gs.DynamicGradScaler):
        _wrap_attr(cls, "__init__")
    _wrap_attr(gs.DynamicGradScaler, "load_state_dict")


def _patch_clip_grads() -> None:
    """``get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32`` (and the local
    ``multi_tensor_l2norm`` fallback they call) put the norm and the overflow flag on
    ``device='cuda'`` and assert ``param.grad.type() == 'torch.cuda.FloatTensor'``. Both names are
    imported into ``optimizer.optimizer``, so the wrapper is installed in both modules."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as opt

    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        wrapped = _on_cpu(getattr(clip_grads, name))
        setattr(clip_grads, name, wrapped)
        if hasattr(opt, name):
            setattr(opt, name, wrapped)


def _patch_dist_checkpointing() -> None:
    """``dist_checkpointing.save`` / ``load`` (torch_dist format) call ``torch.cuda.synchronize()``
    after staging tensors to host memory (``FileSystemWriterAsync.preload_tensors``) and all-reduce
    their success flags as ``device=torch.cuda.current_device()`` tensors
    (``state_dict_saver.save_state_dict_async_finalize``). Both entry points are wrapped (they are
    re-exported by name from ``megatron.core.dist_checkpointing``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization

    for name in ("save", "load"):
        wrapped = _on_cpu(getattr(serialization, name))
        setattr(serialization, name, wrapped)
        setattr(dist_checkpointing, name, wrapped)


def _patch_tensor_parallel_comms() -> None:
    """Sequence parallelism and tensor-parallel linears allocate their communication buffers with
    ``device=torch.cuda.current_device()``: ``mappings._gather_along_first_dim`` /
    ``_gather_along_last_dim`` / ``_reduce_scatter_along_first_dim`` (the SP all-gather and
    reduce-scatter), and ``LinearWithGradAccumulationAndAsyncCommunication`` (the all-gathered
    input and the reduce-scattered input gradient of a sequence-parallel linear). The mapping
    functions are looked up by name inside ``mappings``, so wrapping the module attributes reaches
    every caller; the autograd function's ``forward`` / ``backward`` are wrapped in place."""
    from megatron.core.tensor_parallel import layers, mappings

    for name in ("_gather_along_first_dim", "_gather_along_last_dim", "_reduce_scatter_along_first_dim"):
        _wrap_attr(mappings, name)
    fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    for name in ("forward", "backward"):
        setattr(fn, name, staticmethod(_on_cpu(getattr(fn, name))))


def _patch_pipeline_p2p() -> None:
    """Pipeline parallelism: ``P2PCommunicator._communicate`` / ``_communicate_shapes`` allocate the
    receive buffers with ``device=torch.cuda.current_device()`` and call ``torch.cuda.synchronize()``
    after the batched send/receive; ``forward_backward_pipelining_without_interleaving`` (the 1F1B
    schedule, which ``get_forward_backward_func`` looks up by name) counts tokens in a
    ``device="cuda"`` scalar."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules

    for name in ("_communicate", "_communicate_shapes"):
        _wrap_attr(p2p.P2PCommunicator, name)
    _wrap_attr(schedules, "forward_backward_pipelining_without_interleaving")


def _patch_tied_embeddings() -> None:
    """Tied embeddings with pipeline parallelism: ``LanguageModule.setup_embeddings_and_output_layer``
    moves the last stage's copy of the word embedding to CUDA (``weight.data.cuda()``) before
    all-reducing it from the first stage."""
    from megatron.core.models.common.language_module import language_module as lm

    _wrap_attr(lm.LanguageModule, "setup_embeddings_and_output_layer")


def _patch_distributed_optimizer() -> None:
    """``DistributedOptimizer.__init__`` accepts model parameters only if ``param.type()`` is a
    ``'torch.cuda.*Tensor'`` and builds its shard views there; ``_copy_model_params_to_main_params``
    and the parameter all-gather buffers use ``torch.cuda.current_device()``
    (``--use-distributed-optimizer``)."""
    from megatron.core.optimizer import distrib_optimizer as do

    _wrap_attr(do.DistributedOptimizer, "__init__")


def _patch_checkpoint_rng_states() -> None:
    """Activation recomputation (``tensor_parallel.checkpoint``, ``CheckpointWithoutOutput``) saves
    the CPU RNG state, the CUDA RNG state and megatron's RNG-tracker states in the forward pass and
    restores them for the recomputation (``random._get_all_rng_states`` / ``_set_all_rng_states``).
    Without CUDA there is no CUDA state: these two functions are replaced by ones that keep the CPU
    state and the tracker's states (``cpu_seed``'s tracker runs on the CPU generator) and skip the
    CUDA one, so the recomputed forward draws the same random numbers as the first."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_all_rng_states():
        return torch.get_rng_state(), None, mrandom.get_cuda_rng_tracker().get_states()

    def set_all_rng_states(cpu_rng_state, cuda_rng_state, cuda_rng_state_tracker):
        torch.set_rng_state(cpu_rng_state)
        mrandom.get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)

    mrandom._get_all_rng_states = get_all_rng_states
    mrandom._set_all_rng_states = set_all_rng_states


_PATCHES: tuple[Callable[[], None], ...] = (
    _patch_rotary_get_emb,
    _patch_rope_cp_slice,
    _patch_global_memory_buffer,
    _patch_param_and_grad_buffer,
    _patch_optimizer_scalars,
    _patch_grad_scalers,
    _patch_clip_grads,
    _patch_dist_checkpointing,
    _patch_tensor_parallel_comms,
    _patch_pipeline_p2p,
    _patch_tied_embeddings,
    _patch_distributed_optimizer,
    _patch_checkpoint_rng_states,
)


def apply_cpu_patches(force: bool = False) -> list[str]:
    """Install the CPU shims (idempotent). Does nothing when CUDA is available, unless ``force``.

    Returns:
        The names of the patches in effect (empty on a CUDA machine).
    """
    names = [p.__name__.removeprefix("_patch_") for p in _PATCHES]
    if all(n in _APPLIED for n in names) or (torch.cuda.is_available() and not force):
        return [n for n in _APPLIED if n in names]
    for patch, name in zip(_PATCHES, names):
        patch()
        _APPLIED.append(name)
    return names


def patch_missing_psutil() -> bool:
    """Let ``dist_checkpointing`` (torch_dist format) save without ``psutil``. Not CUDA-related;
    applied on every machine by examples/pretrain_gpt.py before saving.

    ``filesystem_async._process_memory`` reads the writer process' RSS with ``psutil`` only for a
    debug log line; megatron-core 0.16.1 does not declare ``psutil`` as a dependency, and without it
    the forked writer raises and the saving rank then blocks forever on the result queue. When
    ``psutil`` is missing the function is replaced by one returning 0.

    Returns:
        True if the patch was installed (``psutil`` missing), False otherwise.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    if getattr(fsa, "HAVE_PSUTIL", True):
        return False
    fsa._process_memory = lambda: 0
    if "process_memory_without_psutil" not in _APPLIED:
        _APPLIED.append("process_memory_without_psutil")
    return True


def applied_patches() -> list[str]:
    """Names of the CPU patches installed in this process."""
    return list(_APPLIED)


def cpu_seed(seed: int) -> None:
    """Seed torch and megatron's RNG tracker without CUDA.

    The stock ``model_parallel_cuda_manual_seed(seed)`` reads ``torch.cuda.get_rng_state()``.
    With ``inference_rng_tracker=True`` the tracker's ``add()``/``fork()`` are no-ops, so code that
    forks the "model-parallel-rng" state (dropout in the stock attention, recompute) runs on the
    CPU generator. Per-TP-rank dropout streams are therefore not distinct (irrelevant at TP=1 or
    with dropout 0). On a CUDA machine this calls the stock seeding.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=True, force_reset_rng=True
        )


def cpu_transformer_config_kwargs() -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments that keep megatron-core off CUDA-only code paths.

    Safe on GPU too, except ``use_cpu_initialization`` (weights are initialized on the CPU and
    moved by the caller), which is only set on a CPU machine.
    """
    kw: dict[str, Any] = dict(
        gradient_accumulation_fusion=False,  # needs apex' fused_weight_gradient_mlp_cuda
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,  # needs Transformer Engine
        persist_layer_norm=False,  # needs apex
        cross_entropy_loss_fusion=False,
    )
    if not torch.cuda.is_available():
        kw["use_cpu_initialization"] = True  # else weights are allocated on torch.cuda.current_device()
    return kw

"""Memory-lean LM-head losses for long sequences: the output layer and the cross entropy fused or in chunks.

A GPTModel computes ``logits = hidden @ W^T`` for every token (``[s, b, V]``, then an fp32 copy and
an fp32 softmax inside the cross entropy) before the per-token loss: at 256K tokens with a 32K
vocabulary that is 31 GiB of fp32 logits on one GPU, more than the attention layers of a small
model. Two replacements compute the same per-token loss ``[b, s]`` (fp32) from the output layer's
input and weight:

* ``megatron`` (:func:`install_chunked_lm_loss`, ``--cross-entropy-chunk-tokens``): the loss
  ``chunk_tokens`` sequence positions at a time in both passes (the backward recomputes each
  chunk's logits), so at most one chunk's logits are alive. The cross entropy
  itself is megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy`` (vocabulary-parallel
  under TP), the output matmul uses the output layer's own (local vocabulary shard of the) weight.
  fp32: equal to the unchunked model up to rounding; the output-weight gradient sums the chunks in
  fp32 in every dtype (a bf16 sum of many chunks' gradients would lose precision with their number).
* ``liger`` (:func:`install_fused_lm_loss`, ``--lm-loss liger``): Liger-Kernel's fused linear cross
  entropy (``liger_kernel.ops.fused_linear_cross_entropy``; optional dependency, the ``[liger]``
  extra): the matmul and one Triton cross-entropy kernel per row chunk of about ``s*b*h/V`` tokens,
  the logits gradient scaled by each token's upstream gradient before the weight gradient is summed
  (accumulated in fp32 on CUDA of compute capability >= 8.0 with torch >= 2.8). No fp32 logits at all;
  tensor-parallel size 1 only (the vocabulary is not split). Needs CUDA (or the CPU under
  ``TRITON_INTERPRET=1``) and Liger-Kernel >= :data:`LIGER_MIN_VERSION`.

Only training/evaluation calls with ``labels`` change; a call without ``labels`` still returns the
full logits. Refused (``ValueError`` naming the setting): multi-token prediction, sequence parallelism
on the output layer, MuP output scaling, a model without its output stage (``post_process=False``);
for ``liger`` also a tensor-parallel output layer and a missing or too old ``liger_kernel``.

Public API::

    install_chunked_lm_loss(model, chunk_tokens)      # GPTModel or a wrapper (DDP, Float16Module)
    install_fused_lm_loss(model)                      # the same, Liger-Kernel's fused loss
    auto_chunk_tokens(seq_local, micro_batch, vocab_local, budget_bytes=2**30)
    chunked_lm_loss(hidden, weight, labels, chunk_tokens, tp_group=None)
    fused_lm_loss(hidden, weight, labels)
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_mtraining.common import first_order_only
from megatron_mtraining.megatron.lm_loss_check import (LIGER_HINT, LIGER_MIN_VERSION, LM_LOSS_IMPLS, liger_device_problem,
                                                       liger_problem)

__all__ = ["install_chunked_lm_loss", "install_fused_lm_loss", "auto_chunk_tokens", "chunked_lm_loss",
           "fused_lm_loss", "liger_problem", "LM_LOSS_IMPLS", "LIGER_MIN_VERSION"]

#: fp32 logits of one micro-batch above which ``auto`` chunks the LM-head loss (bytes).
AUTO_THRESHOLD_BYTES = 1 << 30


def auto_chunk_tokens(seq_local: int, micro_batch: int, vocab_local: int,
                      budget_bytes: int = AUTO_THRESHOLD_BYTES) -> int:
    """Sequence positions per chunk for ``--cross-entropy-chunk-tokens auto``: ``0`` (no chunking)
    when the micro-batch's fp32 logits (``seq_local * micro_batch * vocab_local * 4`` bytes) fit in
    ``budget_bytes``; else the largest multiple of 64 positions whose fp32 logits take at most a
    quarter of it (at least 64)."""
    if seq_local * micro_batch * vocab_local * 4 <= budget_bytes:
        return 0
    per_pos = micro_batch * vocab_local * 4
    return max(64, (budget_bytes // 4 // per_pos) // 64 * 64)


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from megatron.core import tensor_parallel

    logits = torch.matmul(hidden, weight.t())                     # [c, b, V_local]
    return tensor_parallel.vocab_parallel_cross_entropy(logits, labels)


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place, ``acc`` fp32: on CUDA with torch >= 2.8 one matmul in the inputs' dtype
    accumulating into ``acc`` in fp32 (no parameter-sized temporary); elsewhere the product of the inputs
    upcast to fp32 (temporaries the size of ``a`` and ``b``)."""
    if a.dtype != b.dtype:
        b = b.to(a.dtype)
    if a.dtype in (torch.bfloat16, torch.float16) and a.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            pass
    acc.addmm_(a.float(), b.float())


def _no_tokens_loss(hidden: torch.Tensor, weight: torch.Tensor, shape) -> torch.Tensor:
    """The loss of no tokens: an empty fp32 ``shape`` whose graph reaches both inputs (zero gradients, as
    megatron-core's loss gives)."""
    return hidden.new_zeros(shape, dtype=torch.float32) + 0.0 * (hidden.sum() + weight.sum()).float()


class _ChunkedLMLoss(torch.autograd.Function):
    """The per-token cross entropy of ``hidden @ weight^T``, one chunk of sequence positions at a time in
    both passes; the backward recomputes each chunk's logits (under the forward's autocast state) and
    sums the weight gradient in fp32."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, target, chunk_tokens):
        parts = [_chunk_loss(hidden[lo:lo + chunk_tokens], weight, target[lo:lo + chunk_tokens])
                 for lo in range(0, hidden.shape[0], chunk_tokens)]
        ctx.save_for_backward(hidden, weight, target)
        ctx.chunk_tokens = chunk_tokens
        return torch.cat(parts, 0)                                # [s, b] fp32

    @staticmethod
    @first_order_only("chunked LM-head loss (--cross-entropy-chunk-tokens)", rule=(
        "double backward (the gradient of a gradient) is not supported: its backward computes first-order "
        "gradients only"))
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        from megatron.core import tensor_parallel

        hidden, weight, target = ctx.saved_tensors
        c = ctx.chunk_tokens
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for lo in range(0, hidden.shape[0], c):
            h = hidden[lo:lo + c]
            with torch.enable_grad():
                logits = torch.matmul(h, weight.t()).detach().requires_grad_()     # [c, b, V_local]
                loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target[lo:lo + c])
                (d_logits,) = torch.autograd.grad(loss, logits, grad[lo:lo + c])
            if need_h:
                d_hidden[lo:lo + c] = torch.matmul(d_logits, weight)
            if need_w:
                _addmm_fp32_(d_weight, d_logits.flatten(0, 1).t(), h.flatten(0, 1))
        return d_hidden, (d_weight.to(weight.dtype) if need_w else None), None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                    tp_group=None) -> torch.Tensor:
    """Per-token cross entropy of ``hidden @ weight^T`` computed ``chunk_tokens`` positions at a time.

    Only one chunk's logits are alive at a time: the forward keeps the loss alone, and the backward
    recomputes each chunk's logits (one more output matmul). The output-weight gradient is summed over
    the chunks in an fp32 buffer the size of the weight (each chunk's product accumulated into it in
    fp32: on CUDA with torch >= 2.8 by the matmul itself, elsewhere from inputs upcast to fp32) and
    rounded to the weight's dtype once at the end, so in bf16 it is as accurate as the unchunked
    loss's. Not twice differentiable.

    Args:
        hidden: ``[s, b, h]`` final hidden states (the output layer's input).
        weight: ``[V_local, h]`` output weight (this TP rank's vocabulary shard).
        labels: ``[b, s]`` int64 target ids.
        chunk_tokens: sequence positions per chunk (>= 1).
        tp_group: the tensor-parallel group (``None``: megatron-core's default); with TP > 1 the
            input is copied into the TP region as ``ColumnParallelLinear`` does.

    Returns:
        ``[b, s]`` fp32 per-token loss, as ``GPTModel.compute_language_model_loss`` returns.

    Raises:
        ValueError: ``chunk_tokens < 1``.
    """
    from megatron.core import tensor_parallel

    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if tp_group is not None and tp_group.size() > 1:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    target = labels.transpose(0, 1).contiguous()                  # [s, b]
    if hidden.shape[0] == 0:
        return _no_tokens_loss(hidden, weight, labels.shape)
    return _ChunkedLMLoss.apply(hidden, weight, target, chunk_tokens).transpose(0, 1).contiguous()


def _import_liger():
    """Liger-Kernel's fused-linear-cross-entropy function, after :func:`liger_problem`'s package checks."""
    problem = liger_problem()
    if problem:
        raise ValueError(problem)
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError as e:
        raise ValueError(f"--lm-loss liger needs Liger-Kernel, which does not import here ({e}): {LIGER_HINT}") from e
    return LigerFusedLinearCrossEntropyFunction


_LIGER = {}          # the checked function, and the device kinds already checked (per training step: no rescan)


def _liger_function(device):
    if "fn" not in _LIGER:
        _LIGER["fn"] = _import_liger()
    kind = (device.type, os.environ.get("TRITON_INTERPRET", "0"))
    if kind not in _LIGER:
        _LIGER[kind] = liger_device_problem(device)
    if _LIGER[kind]:
        raise ValueError(_LIGER[kind])
    return _LIGER["fn"]


def fused_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy of ``hidden @ weight^T`` by Liger-Kernel's fused linear cross entropy.

    The logits exist only a row chunk at a time (Liger sizes the chunks to about ``s*b*h`` logits) and
    in the input dtype; the softmax and its gradient run in fp32 inside one Triton kernel per chunk.
    The backward recomputes each chunk's logits and scales its gradient by the tokens' upstream
    gradients (``reduction="none"``); the weight gradient accumulates in fp32 (CUDA of compute
    capability >= 8.0 with torch >= 2.8; else each chunk's product is rounded to the weight's dtype
    first) and is returned in the weight's dtype. Deterministic (no atomics).

    Args:
        hidden: ``[s, b, h]`` final hidden states (the output layer's input), fp32/bf16/fp16.
        weight: ``[V, h]`` output weight, the same dtype (tensor-parallel size 1: the whole vocabulary).
        labels: ``[b, s]`` int64 target ids in ``[0, V)``.

    Returns:
        ``[b, s]`` fp32 per-token loss, as ``GPTModel.compute_language_model_loss`` returns.

    Raises:
        ValueError: shapes or dtypes that do not match as above; a label outside ``[0, V)``; Liger-Kernel
            missing or older than :data:`LIGER_MIN_VERSION`.
    """
    fn = _liger_function(hidden.device)
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"fused_lm_loss: hidden [s, b, h] and weight [V, h] expected, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    s, b, h = hidden.shape
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"fused_lm_loss: labels [b, s] = {(b, s)} expected, got {tuple(labels.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"fused_lm_loss: hidden ({hidden.dtype}) and weight ({weight.dtype}) must have one dtype")
    if labels.numel() == 0:
        return _no_tokens_loss(hidden, weight, (b, s))
    lo, hi = labels.aminmax()
    lo, hi = int(lo), int(hi)                                      # one host sync (Liger's forward has another)
    if lo < 0 or hi >= weight.shape[0]:
        raise ValueError(f"fused_lm_loss: labels must be token ids in [0, {weight.shape[0]}) (the output "
                         f"weight's rows), got ids from {lo} to {hi}")
    x = hidden.reshape(s * b, h)                                   # position-major rows, as Megatron lays out
    y = labels.transpose(0, 1).reshape(s * b)
    # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
    #  softcap, return_z_loss, accum_dtype): no label is ignored (ids are >= 0), fp32 weight-gradient sums
    out = fn.apply(x, weight, y, None, None, -100, 0.0, 0.0, "none", None, False, torch.float32)
    loss = out[0] if isinstance(out, tuple) else out
    return loss.float().view(s, b).transpose(0, 1).contiguous()


def _gpt_of(model):
    m = model
    while hasattr(m, "module") and not hasattr(m, "output_layer"):
        m = m.module
    return m


def _check_model(gpt, what: str, tensor_parallel_ok: bool = True) -> None:
    cfg = getattr(gpt, "config", None)
    out_layer = getattr(gpt, "output_layer", None)
    problems = []
    if not getattr(gpt, "post_process", False) or out_layer is None:
        problems.append("the model has no output layer (post_process=False)")
    if cfg is not None and getattr(cfg, "mtp_num_layers", None):
        problems.append("multi-token prediction (mtp_num_layers)")
    if getattr(out_layer, "sequence_parallel", False):
        problems.append("sequence parallelism on the output layer")
    if cfg is not None and getattr(cfg, "use_mup", False):
        problems.append("MuP output scaling (use_mup)")
    tp_group = getattr(out_layer, "tp_group", None)
    if not tensor_parallel_ok and tp_group is not None and tp_group.size() > 1:
        problems.append(f"a tensor-parallel output layer (size {tp_group.size()}; the fused loss needs the "
                        "whole vocabulary on each rank: use --lm-loss megatron)")
    if problems:
        raise ValueError(f"{what} cannot serve " + "; ".join(problems))


def _install(model, loss_of):
    """Route ``model``'s LM loss through ``loss_of(hidden [s,b,h], weight, labels [b,s], tp_group)``;
    replaces an earlier installation on the same model."""
    gpt = _gpt_of(model)
    if getattr(gpt, "_mtraining_lm_loss", None) is not None:
        gpt._mtraining_lm_loss = loss_of
        return gpt
    gpt._mtraining_lm_loss = loss_of
    out_layer = gpt.output_layer
    state = {"active": False, "weight": None}
    out_forward, loss_fn, forward = out_layer.forward, gpt.compute_language_model_loss, gpt.forward

    def output_forward(input_, weight: Optional[torch.Tensor] = None, runtime_gather_output=None, **kw):
        if state["active"]:                     # defer: the loss computes the logits itself
            state["weight"] = weight if weight is not None else out_layer.weight
            return input_, None
        return out_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output, **kw)

    def compute_language_model_loss(labels, logits):
        if state["active"]:
            w, state["weight"] = state["weight"], None
            return gpt._mtraining_lm_loss(logits, w, labels, getattr(out_layer, "tp_group", None))
        return loss_fn(labels, logits)

    def gpt_forward(*args, **kwargs):
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        state["active"] = labels is not None
        try:
            return forward(*args, **kwargs)
        finally:
            state["active"], state["weight"] = False, None

    out_layer.forward = output_forward
    gpt.compute_language_model_loss = compute_language_model_loss
    gpt.forward = gpt_forward
    return gpt


def install_chunked_lm_loss(model, chunk_tokens: int):
    """Make ``model`` (a megatron-core ``GPTModel`` or a wrapper of one) compute its LM loss in chunks
    of ``chunk_tokens`` sequence positions (see the module docstring). Idempotent per model; a later
    install (of either loss) replaces an earlier one.

    Returns:
        the ``GPTModel`` it was installed on.

    Raises:
        ValueError: ``chunk_tokens < 1``; the model has multi-token prediction, a sequence-parallel
            output layer, MuP output scaling, or no output layer.
    """
    if chunk_tokens < 1:
        raise ValueError(f"--cross-entropy-chunk-tokens must be >= 1 to chunk, got {chunk_tokens}")
    gpt = _gpt_of(model)
    _check_model(gpt, "chunked LM-head loss (--cross-entropy-chunk-tokens)")
    n = int(chunk_tokens)
    return _install(model, lambda h, w, y, tp_group: chunked_lm_loss(h, w, y, n, tp_group=tp_group))


def install_fused_lm_loss(model):
    """Make ``model`` (a megatron-core ``GPTModel`` or a wrapper of one) compute its LM loss with
    :func:`fused_lm_loss` (Liger-Kernel's fused linear cross entropy; ``--lm-loss liger``). Idempotent
    per model; a later install (of either loss) replaces an earlier one.

    Returns:
        the ``GPTModel`` it was installed on.

    Raises:
        ValueError: Liger-Kernel missing or older than :data:`LIGER_MIN_VERSION`; the model has a
            tensor-parallel output layer, multi-token prediction, a sequence-parallel output layer,
            MuP output scaling, or no output layer. (A device where Triton cannot run is refused at
            the first call: the model may move to the GPU after this.)
    """
    gpt = _gpt_of(model)
    _check_model(gpt, "fused LM-head loss (--lm-loss liger)", tensor_parallel_ok=False)
    _LIGER["fn"] = _import_liger()   # the device is checked at the first call (the model may move to the GPU)
    return _install(model, lambda h, w, y, tp_group: fused_lm_loss(h, w, y))

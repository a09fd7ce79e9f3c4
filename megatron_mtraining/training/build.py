"""Build the pieces of a run from the validated arguments: tokenizer, CP plan, GPTModel,
DDP + optimizer + LR scheduler, and the model-FLOPs count used for throughput."""

from __future__ import annotations

import math

__all__ = ["build_tokenizer", "padded_vocab_size", "transformer_config", "build_plan", "build_model",
           "build_optimizer", "count_params", "flops_per_iteration"]


def build_tokenizer(args):
    """``--tokenizer-type HuggingFaceTokenizer``: a ``tokenizer.json`` through the ``tokenizers`` library
    (:class:`~megatron_mtraining.megatron.hf_tokenizer.TokenizersTokenizer`); every other type: the
    sentencepiece model through ``megatron.core.tokenizers`` (GPT model type).

    Raises:
        ValueError: naming ``--tokenizer-model`` and ``--tokenizer-type`` when the file does not load.
    """
    hf = args.tokenizer_type == "HuggingFaceTokenizer"
    try:
        if hf:
            from megatron_mtraining.megatron.hf_tokenizer import TokenizersTokenizer

            return TokenizersTokenizer(args.tokenizer_model)
        from megatron.core.tokenizers import MegatronTokenizer

        return MegatronTokenizer.from_pretrained(
            tokenizer_path=args.tokenizer_model,
            metadata_path={"library": "sentencepiece", "model_type": "gpt"},
        )
    except Exception as e:                          # the loaders raise their own types
        kind = "a tokenizer.json (HuggingFace tokenizers)" if hf else "a sentencepiece model"
        raise ValueError(f"--tokenizer-model {args.tokenizer_model}: cannot be loaded as {kind} "
                         f"(--tokenizer-type {args.tokenizer_type}): {type(e).__name__}: {e}") from e


def padded_vocab_size(vocab: int, args) -> int:
    """``vocab`` rounded up to a multiple of ``--make-vocab-size-divisible-by`` x TP size."""
    mult = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(vocab / mult) * mult)


def transformer_config(args):
    """megatron-core ``TransformerConfig`` for ``args`` (per-token loss: DDP sums the gradients).

    With CUDA, RoPE and SwiGLU are fused unless ``--no-rope-fusion`` / ``--no-bias-swiglu-fusion``
    (:func:`megatron_mtraining.megatron.fusions.fusion_config_kwargs`, which gives megatron-core a
    fused RoPE when Transformer Engine is absent); on the CPU nothing is fused."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.megatron.cpu_compat import cpu_transformer_config_kwargs
    from megatron_mtraining.megatron.fusions import fusion_config_kwargs

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    kw = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=not args.disable_bias_linear, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
        sequence_parallel=getattr(args, "sequence_parallel", False),
        context_parallel_size=args.context_parallel_size, cp_comm_type="p2p",
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        calculate_per_token_loss=True,  # DDP sums grads; we divide by the global token count
        **cpu_transformer_config_kwargs(),
    )
    if args.swiglu:
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    kw.update(fusion_config_kwargs(args, cuda=torch.cuda.is_available()))
    if args.recompute_granularity:
        kw.update(recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                  recompute_num_layers=args.recompute_num_layers)
    return TransformerConfig(**kw)


def build_plan(args, eod_token=None):
    """The CP plan of a ``--cp-attention mtraining`` run (``None`` for ``te``).

    The one place the trainer resolves ``args.mtraining`` (the validated config) into a
    :class:`~megatron_mtraining.plan.CPPlan`: the layout, Megatron's CP group and, for
    ``implementation: hierarchical``, its hierarchical CP groups (inner, outer), checked against
    ``--seq-length``. A run builds it once and hands it to the attention of every layer, to RoPE
    (the layout's positions) and to the batch split.

    ``--reset-attention-mask`` / ``--reset-position-ids`` become the plan's
    :class:`~megatron_mtraining.plan.DocumentPacking` (``eod_token``: the tokenizer's EOD token).

    Requires ``parallel_state.initialize_model_parallel`` to have run (the CP groups).
    """
    if args.cp_attention != "mtraining":
        return None
    from megatron.core import parallel_state as ps

    from megatron_mtraining.megatron.attention import get_hierarchical_groups
    from megatron_mtraining.plan import packing_from_args, resolve

    cfg = args.mtraining                     # validated MTrainingConfig (args.validate_args)
    hier = get_hierarchical_groups() if cfg.implementation == "hierarchical" else None
    return resolve(cfg, cp_group=ps.get_context_parallel_group(), hierarchical_groups=hier,
                   seq_len=args.seq_length, packing=packing_from_args(args, eod_token), num_layers=args.num_layers)


def _mtraining_layer_spec(args, plan):
    from megatron_mtraining.megatron.spec import get_gpt_layer_spec_with_mtraining

    return get_gpt_layer_spec_with_mtraining(mtraining_config=plan, normalization=args.normalization)


def build_model(args, config, vocab_size: int, device, layer_spec=None, plan=None):
    """GPTModel for ``args`` (Float16Module-wrapped with --bf16/--fp16); with
    ``--pipeline-model-parallel-size`` > 1 this rank's stage (its share of the layers, the embedding
    on the first stage, the output layer and loss on the last).

    Args:
        args: validated arguments (:func:`megatron_mtraining.megatron.args.parse_args`).
        config: :func:`transformer_config` of ``args``.
        vocab_size: the padded vocabulary (:func:`padded_vocab_size`).
        device: where the model lives (``cuda`` moves it; ``cpu`` keeps it).
        layer_spec: replaces the transformer-layer spec that ``--cp-attention`` selects (and then
            megatron-core's own RoPE is kept); tools/eval_long_context.py passes megatron-core's
            local spec (stock ``DotProductAttention``) for its dense reference.
        plan: the run's CP plan (:func:`build_plan`); built here when ``None``.

    Requires ``parallel_state.initialize_model_parallel`` to have run (the CP group).
    """
    from megatron.core.models.gpt import GPTModel

    mtraining = layer_spec is None and args.cp_attention == "mtraining"
    if mtraining and plan is None:
        plan = build_plan(args)
    if layer_spec is not None:
        spec = layer_spec
    elif mtraining:
        spec = _mtraining_layer_spec(args, plan)
        if config.sequence_parallel:          # the block's final norm must take sequence parallelism too
            from megatron_mtraining.megatron.spec import local_block_spec

            spec = local_block_spec(spec, args.num_layers)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()   # True, True without PP
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=first, post_process=last,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )
    if mtraining:
        from megatron_mtraining.megatron.rope import install_layout_rope

        install_layout_rope(model, plan)
    fused = getattr(args, "lm_loss", "megatron") == "liger"
    if last and fused:      # the device is checked where the run starts (training.loop) and at the first call
        from megatron_mtraining.megatron.lm_loss import install_fused_lm_loss

        install_fused_lm_loss(model)
    chunk = lm_loss_chunk_tokens(args, vocab_size) if last and not fused else 0
    if chunk:
        from megatron_mtraining.megatron.lm_loss import install_chunked_lm_loss

        install_chunked_lm_loss(model, chunk)
    if device.type == "cuda":
        model.cuda(device)
    if args.bf16 or args.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def _init_sgd_state(opt, config=None) -> None:
    """The momentum buffers a checkpoint's SGD state loads into (``init_state_fn`` of megatron-core's
    optimizer wrappers, which build none for SGD, so that ``sharded_state_dict(is_loading=True)``
    fails): zeros for every parameter without state, where the momentum is non-zero."""
    import torch

    for group in opt.param_groups:
        if not group.get("momentum"):
            continue
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


def build_optimizer(args, config, model):
    """Wrap ``model`` in megatron-core DDP and build the optimizer and LR/WD scheduler.

    Returns:
        ``(ddp_model, optimizer, scheduler)``: ``DistributedDataParallel`` (gradients reduced in
        fp32 with --bf16/--fp16; reduce-scattered over DP x CP with --use-distributed-optimizer),
        ``get_megatron_optimizer`` (megatron-core's ``DistributedOptimizer`` with
        --use-distributed-optimizer) (``--optimizer``, clipping, loss
        scale) and ``OptimizerParamScheduler`` whose steps count samples (iterations x
        ``--global-batch-size``).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    dist_opt = bool(getattr(args, "use_distributed_optimizer", False))
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=args.bf16 or args.fp16,
                                               overlap_grad_reduce=False, use_distributed_optimizer=dist_opt)
    model = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis, use_distributed_optimizer=dist_opt,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    if args.optimizer == "sgd":
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            opt.init_state_fn = _init_sgd_state
    gbs = args.global_batch_size
    override = bool(getattr(args, "override_opt_param_scheduler", False))
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        # --load: without either flag the schedules are equal (checkpoint.check_resume_schedule)
        override_opt_param_scheduler=override, use_checkpoint_opt_param_scheduler=not override,
    )
    return model, optimizer, scheduler


def lm_loss_chunk_tokens(args, vocab_size: int) -> int:
    """Sequence positions per chunk of the LM-head loss (``--cross-entropy-chunk-tokens``; 0: unchunked;
    ``auto`` never chunks with ``--sequence-parallel``)."""
    from megatron_mtraining.megatron.lm_loss import auto_chunk_tokens

    n = getattr(args, "cross_entropy_chunk_tokens", 0)
    if n == "auto" and getattr(args, "sequence_parallel", False):
        return 0                          # the chunked loss does not support sequence parallelism
    if n == "auto":
        vocab_local = vocab_size // args.tensor_model_parallel_size
        return auto_chunk_tokens(args.seq_length // args.context_parallel_size, args.micro_batch_size, vocab_local)
    return int(n)


def count_params(model) -> int:
    """Number of parameters of ``model`` (all ranks' copies are identical at TP=1)."""
    return sum(p.numel() for p in model.parameters())


def flops_per_iteration(args, vocab_size: int, attention: bool = True) -> float:
    """Model FLOPs of one training iteration (forward + backward), the standard 6N + attention rule.

    ``6 * N * T`` for the matmul weights (N counts the QKV/out projections, MLP and the output
    (logit) layer, not the embedding lookup; 2 FLOPs per multiply-add, x3 for forward + backward)
    plus, with ``attention`` (default), the dense causal attention matmuls
    ``6 * L * S * (heads * head_dim)`` per token (QK^T and PV: 4 * context * d_attn FLOPs forward,
    average causal context S/2, x3). T = global batch x sequence length.
    """
    h, L, S = args.hidden_size, args.num_layers, args.seq_length
    d_q = args.num_attention_heads * args.kv_channels
    d_kv = args.num_query_groups * args.kv_channels
    mlp = h * args.ffn_hidden_size * (3 if args.swiglu else 2)
    n_matmul = L * (h * d_q + 2 * h * d_kv + d_q * h + mlp) + h * vocab_size
    tokens = args.global_batch_size * S
    return tokens * (6.0 * n_matmul + (6.0 * L * S * d_q if attention else 0.0))

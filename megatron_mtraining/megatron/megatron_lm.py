"""Glue for Megatron-LM's ``pretrain_gpt.py`` / ``gpt_builders.py`` (``patches/megatron-lm-core_v*.patch``).

The patches (one per Megatron-LM line, see :mod:`megatron_mtraining.megatron.compat`) add
``--cp-attention {te,mtraining}`` (default ``te``: Megatron-LM unchanged) and
``--mtraining-config FILE`` to ``pretrain_gpt.py``'s ``extra_args_provider`` and, only when
``--cp-attention mtraining`` is given, import this module and call:

* ``--mtraining-config FILE``: :func:`mtraining_config_file` (the YAML file is loaded while the
  command line is parsed, so a bad file is an argparse error naming the key);
* right after parsing (the patch wraps the parser's ``parse_known_args``): :func:`mtraining_argument_error`,
  so that every rule below is an argparse error naming the flag before Megatron-LM initialises
  (``--mtraining-config`` without ``--cp-attention mtraining`` is one too, checked by the patch
  without importing this package);
* ``get_batch``: :func:`get_batch_on_this_cp_rank_mtraining` instead of Megatron's zigzag
  ``get_batch_on_this_cp_rank``;
* model building: lines 0.16 to 0.18 in ``gpt_builders.gpt_builder``: :func:`mtraining_layer_spec`
  (core_attention of the chosen spec) and, after ``GPTModel(...)``, :func:`install_mtraining_rope`;
  line 0.19 in ``pretrain_gpt.py``: :func:`mtraining_model_config` (the same two through the
  ``GPTModelConfig``).

On the default ``te`` path the patched files do not import this package.

Packed documents (the run's :class:`~megatron_mtraining.plan.DocumentPacking`, :func:`mtraining_packing`):
``--reset-attention-mask`` (documents end at the tokenizer's EOD token), ``--reset-position-ids``
(RoPE follows the batch's ``position_ids``), ``--eod-mask-loss`` (Megatron-LM's data set masks the
loss) and, from line 0.19 on, ``--dataloader-inter-document-masking`` (the data loader's THD offsets
``cu_seqlens``). :func:`get_batch_on_this_cp_rank_mtraining` reads the documents of the whole
micro-batch before the split and hands them on as ``packed_seq_params`` (``qkv_format="sbhd"``):
lines 0.16 and 0.17 return them from ``get_batch``; from 0.18 on ``get_batch`` returns the offsets
(``cu_seqlens``), ``forward_step`` builds its THD ``PackedSeqParams`` from them and
:func:`mtraining_packed_seq_params` turns that into the ``sbhd`` form the layout split needs.

:func:`mtraining_config_from_args` applies the front-door rules shared with
``examples/pretrain_gpt.py`` (:func:`megatron_mtraining.plan.config_from_args`): the Megatron-LM
arguments the backend cannot serve (attention dropout, a dataloader attention mask, MTP, MLA, yarn/mrope, hybrid CP, SFT packing) and the config against the run (sequence length, CP size,
hierarchical sizes); each error names the flag or config key. :func:`mtraining_plan` resolves the
run's :class:`~megatron_mtraining.plan.CPPlan` once. :func:`add_mtraining_args` /
:func:`mtraining_args_provider` define the same two flags for other Megatron-LM style scripts.

Only ``argparse`` and :mod:`megatron_mtraining.config` are imported at module level.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from megatron_mtraining.config import MTrainingConfig, load_mtraining_config
from megatron_mtraining.layout import Layout

__all__ = [
    "add_mtraining_args",
    "get_batch_on_this_cp_rank_mtraining",
    "install_mtraining_rope",
    "mtraining_config_file",
    "mtraining_layer_spec",
    "mtraining_model_config",
    "mtraining_args_provider",
    "mtraining_argument_error",
    "mtraining_enabled",
    "mtraining_config_from_args",
    "mtraining_layout",
    "mtraining_packed_seq_params",
    "mtraining_packing",
    "plan_log_line",
    "mtraining_plan",
]

CP_ATTENTION_CHOICES = ("te", "mtraining")
#: why Megatron-LM's pretrain_gpt.py refuses ``dense_layers: auto``
AUTO_LAYERS_MEGATRON_LM_RULE = (
    "'dense_layers: auto' is not supported through the Megatron-LM patch: Megatron-LM's checkpoints do not keep "
    "the measured decisions, so a resumed run would measure again and could train differently. Fix the dense "
    "layers instead (tools/pattern_recall.py --write-policy POLICY.yaml --policy-min-speedup 1.05 writes them), or "
    "train with examples/pretrain_gpt.py")


def mtraining_config_file(value: str) -> str:
    """argparse ``type=`` for ``--mtraining-config``: loads the file now, so errors surface at parse time.

    Returns:
        ``value`` (the path).

    Raises:
        argparse.ArgumentTypeError: the file cannot be read or breaks a config rule (names the key).
    """
    try:
        load_mtraining_config(value)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_mtraining_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--cp-attention`` and ``--mtraining-config`` to a Megatron-LM parser; returns it."""
    group = parser.add_argument_group(title="MTraining context-parallel attention")
    group.add_argument("--cp-attention", choices=CP_ATTENTION_CHOICES, default="te",
                       help="core attention under context parallelism: te (Megatron-LM default: "
                            "TEDotProductAttention, zigzag split) or mtraining (MTraining ring attention, "
                            "striped split; needs --no-create-attention-mask-in-dataloader and "
                            "--attention-dropout 0)")
    group.add_argument("--mtraining-config", type=mtraining_config_file, default=None, metavar="FILE",
                       help="MTraining YAML config (configs/*.yaml); default: dense striped ring, "
                            "granularity 64. Used with --cp-attention mtraining.")
    return parser


def mtraining_args_provider(
    extra_args_provider: Optional[Callable[[argparse.ArgumentParser], argparse.ArgumentParser]] = None,
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An ``extra_args_provider`` that runs ``extra_args_provider`` (e.g. ModelOpt's, may be
    ``None``) and then :func:`add_mtraining_args`."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_mtraining_args(parser)

    return provider


def mtraining_enabled(args: Any) -> bool:
    """``--cp-attention mtraining`` (False for parsers without the flag)."""
    return getattr(args, "cp_attention", "te") == "mtraining"


_CONFIGS: dict[tuple, MTrainingConfig] = {}
#: the other arguments that the config's checks read (besides the config path, CP sizes and --seq-length)
_CONFIG_ARGS = ("num_layers", "cp_layout", "cp_granularity", "reset_attention_mask",
                "dataloader_inter_document_masking", "sft", "num_attention_heads", "hidden_size", "kv_channels", "bf16",
                "fp16", "pipeline_model_parallel_size")
_PLANS: dict[tuple, Any] = {}


def mtraining_config_from_args(args: Any) -> MTrainingConfig:
    """The validated config of this run (the file is read once per config path and layout).

    The rules are :func:`megatron_mtraining.plan.config_from_args`, the same as for
    ``examples/pretrain_gpt.py``: unsupported Megatron-LM flags (attention dropout,
    a dataloader mask, MTP, MLA, ...), the config
    against the run (sequence length, CP size), and the hierarchical rule (no config plus
    ``--hierarchical-context-parallel-sizes`` selects the dense hierarchical ring; a flat config
    with them is an error). Megatron-LM builds its hierarchical CP groups from the flag only, so a
    hierarchical config also needs the flag.

    Raises:
        ValueError: naming the flag or the config key.
    """
    from megatron_mtraining.plan import DOCUMENT_POSITION_FLAGS, config_from_args, front_door_problems

    problems = front_door_problems(args)
    if problems:
        raise ValueError("--cp-attention mtraining: " + "; ".join(problems))
    if getattr(args, "sft", False):
        from megatron_mtraining.megatron.compat import megatron_core_version

        version = megatron_core_version()
        if version < (0, 18, 0):
            # lines 0.16/0.17 split SFT's THD batches in Megatron-Core's get_batch, before the MTraining split
            raise ValueError("--cp-attention mtraining: --sft (SFTDataset's packed THD sequences) needs Megatron-LM "
                             "0.18 or later; on this line pack documents with --reset-attention-mask "
                             "--reset-position-ids --eod-mask-loss")
        if version < (0, 19, 0) and int(getattr(args, "micro_batch_size", 1) or 1) > 1:
            # 0.18's forward_step keeps the first sample's offsets only (cu_seqlens[0]) for the whole micro-batch
            raise ValueError("--cp-attention mtraining: --sft with --micro-batch-size > 1 needs Megatron-LM 0.19 or "
                             "later (line 0.18's forward_step reads the first sample's cu_seqlens for every sample); "
                             "pass --micro-batch-size 1")
    documents = [f for f in ("reset_attention_mask",) + DOCUMENT_POSITION_FLAGS if getattr(args, f, False)]
    if documents and int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        # the middle pipeline stages' get_batch returns no batch: their layers would not see the documents
        raise ValueError(f"--cp-attention mtraining: --{documents[0].replace('_', '-')} (packed documents) with "
                         "--pipeline-model-parallel-size > 1 is not supported through the Megatron-LM patch (the "
                         "middle stages' get_batch returns no batch, so their attention would not see the documents)")
    path = getattr(args, "mtraining_config", None)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    hcp = getattr(args, "hierarchical_context_parallel_sizes", None)
    # every value config_from_args reads: a call with other flags (documents, --num-layers, dtype) is checked again
    key = (path, cp, tuple(hcp) if hcp else None, int(args.seq_length),
           *(getattr(args, f, None) for f in _CONFIG_ARGS))
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = config_from_args(args)
        if cfg.implementation == "hierarchical" and not hcp:
            inner, outer = cfg.hierarchical.sizes
            raise ValueError(f"mtraining config {path}: implementation 'hierarchical' needs Megatron's inner/outer "
                             f"CP groups: pass --hierarchical-context-parallel-sizes {inner} {outer}")
        if cfg.auto_dense_layers:
            raise ValueError(f"mtraining config {path}: {AUTO_LAYERS_MEGATRON_LM_RULE}")
        _CONFIGS[key] = cfg
    return cfg


def mtraining_argument_error(args: Any) -> Optional[str]:
    """The rules of :func:`mtraining_config_from_args` for a command line just parsed (before
    Megatron-LM's ``validate_args`` fills in derived values), as the error text, or ``None``.

    The patches call it from the parser (lines 0.16 to 0.19 alike), so a flag the backend cannot
    serve (attention dropout, a dataloader attention mask, the reset flags, ...), a config that does
    not fit the run, or a ``kernel_backend`` the device cannot run is an argparse error at start-up
    instead of a traceback at model building. Values Megatron-LM derives later are taken the way
    it derives them: ``--encoder-seq-length`` / ``--encoder-num-layers`` for a missing
    ``--seq-length`` / ``--num-layers``; without any sequence length the check is left to model
    building (it runs again there). So is a command line whose values Megatron-LM replaces after
    parsing (``--yaml-cfg``, ``--use-checkpoint-args``)."""
    if getattr(args, "yaml_cfg", None) or getattr(args, "use_checkpoint_args", False):
        return None
    ns = argparse.Namespace(**vars(args))
    if getattr(ns, "seq_length", None) is None:
        ns.seq_length = getattr(ns, "encoder_seq_length", None)
    if getattr(ns, "num_layers", None) is None:
        ns.num_layers = getattr(ns, "encoder_num_layers", None)
    if ns.seq_length is None:
        return None
    try:
        mtraining_config_from_args(ns)
    except ValueError as e:
        return str(e)
    return None


def mtraining_plan(args: Any) -> Any:
    """The run's :class:`~megatron_mtraining.plan.CPPlan` over Megatron's CP group (and hierarchical CP
    groups); one plan per config and CP group, shared by the layer spec, RoPE and the batch split.
    Call after ``initialize_model_parallel``.

    Raises:
        ValueError: as :func:`mtraining_config_from_args` and :func:`~megatron_mtraining.plan.resolve`.
    """
    from megatron_mtraining.megatron.attention import get_cp_group, plan_for_model

    cfg = mtraining_config_from_args(args)
    packing = mtraining_packing(args)
    key = (cfg, None if packing is None else (packing.reset_attention_mask, packing.reset_position_ids,
                                              packing.eod_token))
    group = get_cp_group()
    plan = _PLANS.get(key)
    if plan is None or plan.cp_group is not group:
        plan = plan_for_model(cfg, packing=packing)
        _PLANS[key] = plan
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"> {plan_log_line(plan)}", flush=True)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if plan.cp_size != cp:
        raise ValueError(f"--context-parallel-size {cp} but the CP group has {plan.cp_size} ranks (call "
                         "mtraining_plan after initialize_model_parallel)")
    return plan


def plan_log_line(plan: Any) -> str:
    """One line for the run's log: layout, pattern, layer policy and packed documents of ``plan``, e.g.
    ``MTraining CP attention: striped over CP=2 (granularity 64), pattern vertical_slash, layer policy:
    dense 1,4,7``."""
    cfg = plan.config
    lay = plan.layout
    text = f"MTraining CP attention: {cfg.implementation} over CP={plan.cp_size}"
    if lay.kind == "striped":
        text += f" (granularity {lay.granularity})"
    text += f", pattern {cfg.pattern}"
    if cfg.sparse:
        text += f", columns {cfg.columns}, layer policy: {cfg.layer_policy_text() or 'every layer sparse'}"
    if plan.packing is not None and plan.packing.active:
        text += ", packed documents" + (" (EOD resets the attention)" if plan.packing.reset_attention_mask else "")
    return text


def mtraining_packing(args: Any) -> Any:
    """The run's :class:`~megatron_mtraining.plan.DocumentPacking` (``None``: no packed documents).

    ``--reset-attention-mask``: documents end at the EOD token of Megatron-LM's tokenizer
    (``megatron.training.get_tokenizer().eod``; Megatron-LM builds the tokenizer before the model).
    ``--reset-position-ids`` and ``--dataloader-inter-document-masking`` (whose data set restarts
    ``position_ids`` at every document): RoPE follows the batch's ``position_ids``.

    Raises:
        ValueError: ``--reset-attention-mask`` before Megatron-LM's tokenizer is built.
    """
    from megatron_mtraining.plan import packing_from_args

    eod = None
    if getattr(args, "reset_attention_mask", False):
        try:
            from megatron.training.global_vars import get_tokenizer

            eod = int(get_tokenizer().eod)
        except (ImportError, AssertionError, AttributeError, NotImplementedError) as e:
            raise ValueError("--reset-attention-mask with --cp-attention mtraining needs Megatron-LM's tokenizer (its "
                             f"EOD token ends each document), built before the model: {type(e).__name__}: {e}") from None
    return packing_from_args(args, eod)


def mtraining_layout(args: Any) -> Layout:
    """The CP sequence layout (striped or zigzag) over ``--context-parallel-size`` ranks."""
    return mtraining_config_from_args(args).make_layout(int(getattr(args, "context_parallel_size", 1) or 1))


def get_batch_on_this_cp_rank_mtraining(batch: Any, args: Any) -> dict:
    """This CP rank's part of a GPT micro-batch with the run's layout (striped by default):
    :func:`~megatron_mtraining.megatron.batch.get_batch_on_this_cp_rank_striped` with
    :func:`mtraining_plan`. ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ``[b, s]`` ->
    ``[b, s // cp]``; other keys pass through.

    Packed documents, read from the whole micro-batch before the split (the same on every CP rank):
    the data loader's THD offsets (``batch["cu_seqlens"]``, ``[1, n]`` over the micro-batch's streams;
    Megatron-LM 0.19 flattens ``b`` streams into ``[1, b * s]``, which become ``[b, s]`` again here),
    else with ``--reset-attention-mask`` the EOD tokens. The result has ``packed_seq_params``
    (``qkv_format="sbhd"``) and, for batches with a ``cu_seqlens`` key (Megatron-LM >= 0.18, whose
    ``forward_step`` builds the ``PackedSeqParams``), ``cu_seqlens`` ``[1, n]``, ``cu_seqlens_padded``
    and ``max_seqlen`` of those documents (``None`` without documents); see
    :func:`mtraining_packed_seq_params`.

    Raises:
        ValueError: as :func:`mtraining_plan`, an ``attention_mask`` in the batch, or offsets that do
            not describe the batch.
    """
    import torch

    from megatron_mtraining.megatron.batch import SEQ_KEYS, get_batch_on_this_cp_rank_striped
    from megatron_mtraining.megatron.packed import packed_seq_params_from_cu_seqlens

    plan = mtraining_plan(args)
    batch = dict(batch)
    cu = batch.get("cu_seqlens")
    if cu is not None:       # the data loader's documents (THD offsets over the whole micro-batch)
        seq = int(args.seq_length)
        tokens = batch.get("tokens")
        total = tokens.numel() if tokens is not None else int(cu.reshape(-1)[-1])
        if total % seq:
            raise ValueError(f"cu_seqlens: the micro-batch holds {total} tokens, not a multiple of --seq-length {seq}")
        streams = total // seq
        for key in SEQ_KEYS:  # Megatron-LM 0.19 flattens [b, s] to [1, b * s] for THD: one stream per sample again
            if batch.get(key) is not None:
                batch[key] = batch[key].reshape(streams, seq)
        _check_offsets_cover(cu, batch.get("cu_seqlens_padded"), total)
        batch["packed_seq_params"] = packed_seq_params_from_cu_seqlens(cu, seq, streams,
                                                                       batch.get("cu_seqlens_padded"))
    out = get_batch_on_this_cp_rank_striped(batch, plan)
    if "cu_seqlens" in batch:  # Megatron-LM >= 0.18: forward_step builds PackedSeqParams from these
        params = out.get("packed_seq_params")
        pad = None if params is None else params.cu_seqlens_q_padded
        out["cu_seqlens"] = None if params is None else params.cu_seqlens_q.unsqueeze(0)
        out["cu_seqlens_padded"] = None if pad is None else pad.unsqueeze(0)
        out["max_seqlen"] = None if params is None else torch.tensor([params.max_seqlen_q], dtype=torch.int32,
                                                                      device=params.cu_seqlens_q.device)
    return out


def mtraining_packed_seq_params(packed_seq_params: Any, tokens: Any, args: Any) -> Any:
    """Megatron-LM >= 0.18's ``forward_step``: the ``PackedSeqParams`` it built (``qkv_format="thd"``)
    from the offsets of :func:`get_batch_on_this_cp_rank_mtraining` as MTraining's ``sbhd`` form:
    the same offsets over the micro-batch's ``tokens.shape[0]`` streams of ``--seq-length`` tokens,
    split by the run's layout (Megatron-Core's THD path would split each document in zigzag halves).
    ``None`` stays ``None``.

    Raises:
        ValueError: the offsets do not describe the micro-batch.
    """
    if packed_seq_params is None:
        return None
    from megatron_mtraining.megatron.packed import packed_seq_params_from_cu_seqlens

    pad = packed_seq_params.cu_seqlens_q_padded
    seq, streams = int(args.seq_length), int(tokens.shape[0]) if tokens is not None else 1
    _check_offsets_cover(packed_seq_params.cu_seqlens_q, pad, streams * seq)
    return packed_seq_params_from_cu_seqlens(packed_seq_params.cu_seqlens_q, seq, streams, pad)


def _check_offsets_cover(cu_seqlens: Any, cu_seqlens_padded: Any, total: int) -> None:
    """Megatron-LM's data set writes offsets over every token of the micro-batch (a sample's padding
    is folded into its last document): offsets that end early would turn the rest of the micro-batch
    into padding that attends to nothing while its loss still counts. Raises ValueError."""
    import torch

    for name, off in (("cu_seqlens", cu_seqlens), ("cu_seqlens_padded", cu_seqlens_padded)):
        if off is None:
            continue
        off = torch.as_tensor(off)
        if off.dtype.is_floating_point or off.dtype == torch.bool or off.is_complex():
            raise ValueError(f"{name} must be an integer tensor, got dtype {off.dtype}")
    last = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    last = torch.as_tensor(last).reshape(-1)
    end = int(last[-1]) if last.numel() else 0
    if end != total:
        name = "cu_seqlens" if cu_seqlens_padded is None else "cu_seqlens_padded"
        raise ValueError(f"{name} ends at token {end} but the micro-batch holds {total} tokens: the offsets must "
                         "cover every token of the micro-batch (Megatron-LM's data set folds a sample's padding "
                         "into its last document)")


def mtraining_layer_spec(spec: Any, args: Any) -> Any:
    """``spec`` (a layer ``ModuleSpec`` or a ``TransformerBlockSubmodules``) with every
    ``core_attention`` replaced by ``MTrainingAttention`` over the run's plan.

    Raises:
        RuntimeError: an unsupported megatron-core version.
        ValueError: as :func:`mtraining_plan`, or a spec without ``core_attention``.
    """
    from megatron_mtraining.megatron.spec import replace_core_attention

    return replace_core_attention(spec, mtraining_plan(args))


def install_mtraining_rope(model: Any, args: Any) -> int:
    """RoPE on this CP rank's layout positions (Megatron's CP RoPE slicing is zigzag-only):
    :func:`~megatron_mtraining.megatron.rope.install_layout_rope` with :func:`mtraining_plan`.
    Returns the number of rotary embeddings replaced."""
    from megatron_mtraining.megatron.rope import install_layout_rope

    return install_layout_rope(model, mtraining_plan(args))


def mtraining_model_config(model_cfg: Any, args: Any) -> Any:
    """Megatron-LM >= 0.19: the ``GPTModelConfig`` of ``pretrain_gpt.py`` with
    :func:`mtraining_layer_spec` applied to its layer spec and :func:`install_mtraining_rope` run on
    every model chunk before wrapping (see
    :func:`~megatron_mtraining.megatron.compat.gpt_model_config_with_mtraining`).

    Raises:
        ValueError: as :func:`mtraining_config_from_args` (checked here, before any model is
            built), or ``--attention-backend local``.
    """
    from megatron_mtraining.megatron.compat import gpt_model_config_with_mtraining

    mtraining_config_from_args(args)
    return gpt_model_config_with_mtraining(model_cfg, lambda spec: mtraining_layer_spec(spec, args),
                                           lambda model: install_mtraining_rope(model, args))

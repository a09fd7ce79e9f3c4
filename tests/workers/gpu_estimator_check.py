"""GPU accuracy and timing check of the fused estimator kernels: the checks, the case list, and a CLI.

    pytest -m gpu tests/kernels/test_gpu_estimator.py                  # one test per case (no timings)
    python3 tests/workers/gpu_estimator_check.py --json OUT.json       # the same cases, with timings
    TRITON_INTERPRET=1 python3 tests/workers/gpu_estimator_check.py --device cpu --seqs 1024 --heads 4 \\
        --kv-heads 2 --head-dim 64                                      # CPU smoke test of this script

Per sequence length, Qwen2.5-3B attention shape by default (q ``[1, S, 16, 128]``, k ``[1, S, 2,
128]``, bf16, structured vertical-slash inputs of ``megatron_mtraining.bench.structured_qkv``), CP=1:

* scores: the Triton probe softmax / column sums / block-diagonal sums against the fp64 torch path
  on the same bf16 values (``estimator._torch_scores``): ``lse`` max abs error, ``col`` and
  ``slash`` errors ``max|a - b| / max|b|``; criterion <= 1e-5 (fp32 accumulation);
* pattern: ``estimate_vertical_slash(impl="triton")`` vs ``impl="torch"`` (same lines, else the
  number of differing slash / vertical lines; a difference is legitimate only for near-ties of
  ~1e-6 relative, so it is reported, not failed);
* time (CUDA events, median of ``--repeats``): the two kernels alone, and
  ``estimate_vertical_slash`` for each impl.

Plus a simulated CP=2 striped case (kernels on each rank's keys, (m, z) merged like the
all-reduce) at the first length, and packed documents (lengths :data:`DOC_LENGTHS`, the probes'
key bounds) at the last length (CP=1) and the first (simulated CP=2), with the stream's probes and
with every document's probes (``probes="document"``: the per-document kernels against the fp64
torch per-document path). Prints one line per case and a final ``RESULT`` line.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron_mtraining.layout import Layout  # noqa: E402
from megatron_mtraining.patterns import estimator as est  # noqa: E402
from megatron_mtraining.bench import structured_qkv  # noqa: E402

TOL = 1e-5


def _err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


#: document lengths of the packed cases, cycled over the stream (the last one cut at its end)
DOC_LENGTHS = (3071, 1199, 4096, 517, 2363, 129, 8000)


def packed_documents(S, dev):
    """A stream of ``S`` tokens packed with documents of :data:`DOC_LENGTHS` (an eighth of them below 8K)."""
    from megatron_mtraining.layout import PackedDocuments

    cu, i, div = [0], 0, 1 if S >= 8192 else 8
    while cu[-1] < S:
        cu.append(min(S, cu[-1] + max(1, DOC_LENGTHS[i % len(DOC_LENGTHS)] // div)))
        i += 1
    return PackedDocuments.from_cu_seqlens(torch.tensor(cu), S, device=dev)


def merge_lse(ms, zs):
    """The probes' lse from every rank's local ``(m, z)``, merged like the estimator's all-reduces (MAX, then
    the rescaled SUM)."""
    gm = torch.stack(list(ms)).amax(0)
    safe = torch.where(torch.isneginf(gm), torch.zeros_like(gm), gm)
    gz = sum(z * torch.exp(m - safe) for m, z in zip(ms, zs))
    return safe + torch.log(torch.where(gz > 0, gz, torch.ones_like(gz)))


def fused_scores(q, k, layout, L, bs, scale, docs=None):
    """Triton (lse, col [global positions], slash) over ``layout``'s ranks, merged like the all-reduce;
    ``docs``: packed documents (the probes' key bounds) or ``None``."""
    from megatron_mtraining.patterns.triton.estimator import probe_block_range, probe_column_sums, probe_softmax_stats

    b, S, hq, _ = q.shape
    probe = q[:, S - L:]
    bounds = None if docs is None else (docs.lo[:, S - L:], docs.hi[:, S - L:])
    parts = []
    for r in range(layout.cp_size):
        k_loc = layout.shard(k, r, dim=1)
        k_pos = layout.positions(r, S, device=q.device)
        m, z = probe_softmax_stats(probe, k_loc, k_pos, S, scale, bounds=bounds)
        parts.append((k_loc, k_pos, m, z))
    lse = merge_lse([p[2] for p in parts], [p[3] for p in parts])
    u0, nu = probe_block_range(S, L, bs)
    col = torch.zeros(b, hq, S, dtype=torch.float64, device=q.device)
    slash = torch.zeros(b, hq, S // bs, dtype=torch.float64, device=q.device)
    for k_loc, k_pos, _, _ in parts:
        colu = probe_column_sums(probe, k_loc, k_pos, S, lse, scale, bs, bounds=bounds).double()
        col[:, :, k_pos] = colu.sum(2)
        for i in range(nu):
            slash.index_add_(-1, (u0 + i - k_pos // bs).clamp(min=0), colu[:, :, i])
    return lse, col, slash


def fused_document_scores(q, k, docs, layout, L, bs, scale):
    """Per-document probes (``probes="document"``) on the Triton kernels over ``layout``'s ranks, merged
    like the all-reduce: ``(lse [list per stream of [hq, P]], col [b, hq, S] global positions, slash)``."""
    from megatron_mtraining.patterns.triton.estimator import document_probe_stats, tile_sizes

    b, S, hq, _ = q.shape
    dev = q.device
    col = torch.zeros(b, hq, S, dtype=torch.float64, device=dev)
    slash = torch.zeros(b, hq, S // bs, dtype=torch.float64, device=dev)
    lses = []
    for i, spans in enumerate(est._document_probe_spans(docs, L)):
        pos = torch.tensor([t for _, _, probes in spans for t in probes], dtype=torch.long, device=dev)
        if pos.numel() == 0:
            lses.append(None)
            continue
        probe, lo, hi = q[i, pos], docs.lo[i, pos], docs.hi[i, pos]
        parts = []
        for r in range(layout.cp_size):
            k_loc = layout.shard(k, r, dim=1)[i]
            host_pos = layout.positions(r, S)
            tables = est._document_probe_tables(spans, host_pos, bs, *tile_sizes(q.dtype))
            k_pos = host_pos.to(dev)
            m, z = document_probe_stats(probe, k_loc, k_pos, lo, hi, tables[0], scale)
            parts.append((k_loc, k_pos, tables, m, z))
        lse = merge_lse([p[3] for p in parts], [p[4] for p in parts])
        lses.append(lse)
        for k_loc, k_pos, tables, _, _ in parts:
            c = torch.zeros(hq, k_loc.shape[0], dtype=torch.float64, device=dev)
            est._fused_document_lines(probe, k_loc, k_pos, lo, hi, lse, tables, scale, bs, c, slash[i])
            col[i][:, k_pos] = c
    return lses, col, slash


def torch_document_scores(q, k, docs, L, bs, scale):
    """fp64 torch (lse per stream, col, slash) of per-document probes, CP=1: the estimator's own
    per-document path for the scores, a logsumexp over each document's keys for the lse."""
    b, S, hq, _ = q.shape
    one = Layout("striped", 1, 64)
    col, slash, _, _ = est._document_probe_scores(q, k, one, None, 0, 1, S, bs, L, S // bs, scale, False, docs)
    rep = hq // k.shape[2]
    lses = []
    for i, spans in enumerate(est._document_probe_spans(docs, L)):
        rows = []
        for s0, s1, probes in spans:
            p = torch.arange(probes.start, probes.stop, device=q.device)
            kk = k[i, s0:s1].double().repeat_interleave(rep, 1)                      # [n, hq, d]
            s = torch.einsum("phd,nhd->hpn", q[i, p].double(), kk) * scale
            s.masked_fill_(torch.arange(s0, s1, device=q.device)[None, None, :] > p[None, :, None], float("-inf"))
            rows.append(torch.logsumexp(s, -1))
        lses.append(torch.cat(rows, -1) if rows else None)
    return lses, col, slash


def torch_scores(q, k, L, bs, scale, docs=None):
    """fp64 torch (lse, col, slash) of the estimator's own oracle path, CP=1."""
    b, S, hq, _ = q.shape
    k_pos = torch.arange(S, device=q.device)
    q_blocks = [(u, max(0, u * bs - (S - L)), min(L, (u + 1) * bs - (S - L))) for u in range((S - L) // bs, S // bs)]
    bounds = None if docs is None else (docs.lo[:, S - L:], docs.hi[:, S - L:])
    col, slash = est._torch_scores(q[:, S - L:], k, k_pos, q_blocks, S, bs, scale, None, 1, bounds=bounds)
    # lse: fp64 logsumexp per head (the torch path keeps its own lse internal)
    rep = hq // k.shape[2]
    lse = torch.empty(b, hq, L, dtype=torch.float64, device=q.device)
    if docs is None:
        hidden = k_pos[None, None, :] > torch.arange(S - L, S, device=q.device)[None, :, None]
    else:
        hidden = (k_pos[None, None, :] < bounds[0][..., None]) | (k_pos[None, None, :] > bounds[1][..., None])
    for h in range(hq):
        s = torch.einsum("bqd,bkd->bqk", q[:, S - L:, h].double(), k[:, :, h // rep].double()) * scale
        s.masked_fill_(hidden, float("-inf"))
        lse[:, h] = torch.logsumexp(s, -1)
    return lse, col, slash


def check_len(S, args, dev, timeit, layout, packed: bool = False) -> dict:
    """Scores (and at CP=1 the selected pattern) of length ``S`` on ``layout``; ``args`` from
    :func:`build_parser`; ``timeit`` ``None`` skips the timings; ``packed``: the stream packed with
    documents (:func:`packed_documents`; the probes score only their own documents), ``"document"``: the
    same with every document's probes (:func:`fused_document_scores`). ``row["scores_ok"]`` is the check."""
    q, k, _ = structured_qkv(S, args.heads, args.kv_heads, args.head_dim, dev, seed=S)
    docs = packed_documents(S, dev) if packed else None
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    q, k = q.to(dt), k.to(dt)
    cfg = est.VerticalSlashConfig(**({} if args.config is None else _config_kwargs(args.config)))
    L, bs = cfg.last_q, cfg.block_size
    scale = 1.0 / math.sqrt(args.head_dim)
    if packed == "document":
        import dataclasses

        cfg = dataclasses.replace(cfg, probes="document")
        lses, col, slash = fused_document_scores(q, k, docs, layout, L, bs, scale)
        lses_r, col_r, slash_r = torch_document_scores(q, k, docs, L, bs, scale)
        lse, lse_r = torch.cat([x.flatten() for x in lses]), torch.cat([x.flatten() for x in lses_r])
    else:
        lse, col, slash = fused_scores(q, k, layout, L, bs, scale, docs)
        lse_r, col_r, slash_r = torch_scores(q, k, L, bs, scale, docs)
    row = {"seq": S, "cp": layout.cp_size, "layout": layout.kind, "dtype": args.dtype, "packed": packed,
           "lse_abs_err": float((lse - lse_r).abs().max()), "col_err": _err(col, col_r),
           "slash_err": _err(slash, slash_r), "nan": bool(torch.isnan(col).any() or torch.isnan(slash).any()),
           "lse_ref_absmax": float(lse_r.abs().max())}
    row["scores_ok"] = (not row["nan"] and row["col_err"] <= TOL and row["slash_err"] <= TOL
                        and row["lse_abs_err"] <= TOL * max(1.0, row["lse_ref_absmax"]))
    if layout.cp_size == 1:
        one = Layout("striped", 1, 64)
        pt = est.estimate_vertical_slash(q, k, layout=one, config=cfg, softmax_scale=scale, impl="triton",
                                         documents=docs)
        pr = est.estimate_vertical_slash(q, k, layout=one, config=cfg, softmax_scale=scale, impl="torch",
                                         documents=docs)
        row["pattern_equal"] = bool(pt.same_selection(pr))
        row["slash_lines_differing"] = int((pt.slash_mask() != pr.slash_mask()).sum())
        row["vertical_lines_differing"] = int((pt.vertical_mask() != pr.vertical_mask()).sum())
        if timeit is None or packed:
            return row
        from megatron_mtraining.patterns.triton.estimator import probe_column_sums, probe_softmax_stats

        probe = q[:, S - L:]
        k_pos = torch.arange(S, device=dev)

        def kernels_only():
            m, z = probe_softmax_stats(probe, k, k_pos, S, scale)
            probe_column_sums(probe, k, k_pos, S, m + torch.log(z), scale, bs)

        row["kernels_only_s"] = timeit(kernels_only, 1, args.repeats)
        for impl in ("triton", "torch"):
            row[f"estimate_{impl}_s"] = timeit(
                lambda: est.estimate_vertical_slash(q, k, layout=one, config=cfg, softmax_scale=scale, impl=impl),
                1, args.repeats)
    return row


def _config_kwargs(path):
    from megatron_mtraining.config import load_mtraining_config
    vs = load_mtraining_config(path).vertical_slash
    return {f: getattr(vs, f) for f in ("recall", "last_q", "block_size", "sink_tokens", "local_blocks",
                                         "max_vertical", "max_slash")}


def cases(seqs):
    """``(S, layout, packed)`` per check: every length at CP=1, a simulated CP=2 striped at the first;
    packed documents (``packed=True``: the stream's probes; ``"document"``: every document's) at the
    last length (CP=1) and at the first (simulated CP=2)."""
    packed = [(seqs[-1], Layout("striped", 1, 64), p) for p in (True, "document")] + \
        [(seqs[0], Layout("striped", 2, 64), p) for p in (True, "document")]
    return [(s, Layout("striped", 1, 64), False) for s in seqs] + [(seqs[0], Layout("striped", 2, 64), False)] + packed


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="8192,65536,131072")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--config", default=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "configs", "e2e_sparse.yaml"))
    ap.add_argument("--json", default=None)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.dtype == "bf16" and torch.device(args.device).type == "cpu":
        args.dtype = "fp32"          # bf16 tl.dot is wrong in the interpreter
    return args


def main(argv=None) -> int:
    from tools.bench_estimator import _timer

    args = parse_args(argv)
    dev = torch.device(args.device)
    timeit = _timer(dev)
    seqs = [int(x) for x in args.seqs.split(",")]
    rows, ok = [], True
    for S, layout, packed in cases(seqs):
        try:
            r = check_len(S, args, dev, timeit, layout, packed)
        except Exception as e:  # noqa: BLE001 - report and go on
            r = {"seq": S, "cp": layout.cp_size, "error": f"{type(e).__name__}: {e}", "scores_ok": False}
        ok &= bool(r.get("scores_ok"))
        rows.append(r)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    print("RESULT", "PASS" if ok else "FAIL", "(scores within 1e-5; see pattern_equal per length)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

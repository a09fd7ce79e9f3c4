#!/usr/bin/env python3
"""Single-GPU end-to-end benchmark: dense (SDPA/cuDNN) vs MTraining sparse attention in
``examples/pretrain_gpt.py``.

For every sequence length: two training runs of a Qwen2.5-3B-shaped model (hidden 2048, 16 heads,
2 query groups, ffn 11008, SwiGLU, RMSNorm, RoPE base 1e6, untied; ``--num-layers`` layers, no
recompute), CP=1, bf16, on the real corpus:

* ``dense``: ``--cp-attention mtraining`` without a config: ``ring_attention``'s CP=1 fast path,
  i.e. ``torch.nn.functional.scaled_dot_product_attention`` (cuDNN/flash);
* ``mtraining``: ``--mtraining-config`` (default ``configs/e2e_sparse.yaml``): online
  vertical-slash estimation + the Triton sparse kernels.

Per run: median of the last ``--median-of`` iteration times (``--metrics-file`` JSON lines) ->
tokens/s, TFLOP/s (model FLOPs of the *dense* model, the same number for both runs, so the ratio is
the speedup), peak ``torch.cuda.max_memory_allocated``.

Then, in this process, the Amdahl bound: one layer's attention fwd+bwd at the same shape,
dense (SDPA) and sparse (``sparse_ring_attention``, group=None, same config), on structured
synthetic q/k (a rotary local half + a content "vertical" half; see
:func:`megatron_mtraining.bench.structured_qkv`):
``f = layers * t_attn_dense / t_step_dense``, ``s = t_attn_dense / t_attn_sparse``,
``bound = 1 / ((1 - f) + f / s)``, and achieved ``t_step_dense / t_step_sparse`` / bound.
Two kept fractions of the causal (query, key) pairs are reported: ``kept (model)``, the sparse layers'
mean over the measured iterations as the trainer logs it (``attention_kept`` in the metrics file: the
model's own patterns), and ``kept (synthetic)``, the pattern's on those synthetic q/k.

    python3 tools/bench_e2e.py --seqs 65536,131072 --num-layers 4 --json e2e.json
    python3 tools/bench_e2e.py --dry-run            # print the commands, run nothing
    python3 tools/bench_e2e.py --seqs 262144,524288 --num-layers 2 --no-microbench -- \\
        --recompute-granularity full --recompute-method uniform --recompute-num-layers 1   # longer sequences
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_mtraining.bench import (QWEN25_3B_LAYER_FLAGS, kept_fraction, measure, result_record,  # noqa: F401
                                      structured_qkv, write_json)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL_FLAGS = [*QWEN25_3B_LAYER_FLAGS, "--attention-dropout", "0", "--hidden-dropout", "0"]


def build_cmd(args, seq: int, layers: int, mode: str, metrics: str) -> list[str]:
    cmd = [sys.executable, os.path.join(REPO, "examples", "pretrain_gpt.py"),
           "--num-layers", str(layers), *MODEL_FLAGS,
           "--seq-length", str(seq), "--max-position-embeddings", str(seq),
           "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
           "--cp-attention", "mtraining",
           "--micro-batch-size", "1", "--global-batch-size", "1",
           "--train-iters", str(args.iters), "--lr", "1e-5", "--optimizer", "adam", "--bf16",
           "--data-path", args.data_path, "--split", "100,0,0",
           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", args.tokenizer_model,
           "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000",
           "--metrics-file", metrics]
    if mode == "mtraining":
        cmd += ["--mtraining-config", args.config]
    return cmd + list(args.extra)


def read_metrics(path: str, median_of: int) -> dict:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    if not rows:
        raise RuntimeError(f"{path}: no iterations")
    last = rows[-median_of:]
    t = statistics.median(r["time_s"] for r in last)
    mem = max((r.get("max_memory_allocated") or 0) for r in rows)
    kept = [r["attention_kept"] for r in last if r.get("attention_kept") is not None]
    return {"iters": len(rows), "step_s": t, "all_step_s": [r["time_s"] for r in rows],
            "tokens": last[-1]["tokens"], "model_flops": last[-1].get("model_flops"),
            "peak_mem_gib": mem / 2 ** 30 if mem else None, "lm_loss": last[-1]["lm_loss"],
            "kept_in_model": statistics.mean(kept) if kept else None}


# ------------------------------------------------------------------ attention microbenchmark
def time_fwd_bwd(fn, q, k, v, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn(q, k, v).backward(ones)`` on fresh leaf copies of ``q, k, v``
    (:func:`megatron_mtraining.bench.measure`)."""
    import torch

    def step():
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        out = fn(qq, kk, vv)
        out.backward(torch.ones_like(out))

    return measure(step, device=q.device, warmup=warmup, repeats=repeats).median_s


def attention_microbench(args, seq: int) -> dict:
    import torch
    from megatron_mtraining.config import load_mtraining_config
    from megatron_mtraining.ring.sparse import sparse_ring_attention

    cfg = load_mtraining_config(args.config)
    layout = cfg.make_layout(1)
    vs = cfg.vertical_slash
    q, k, v = structured_qkv(seq, 16, 2, 128, "cuda", seed=seq)
    scale = 1.0 / math.sqrt(128)

    def dense(qq, kk, vv):
        return torch.nn.functional.scaled_dot_product_attention(
            qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)

    def sparse(qq, kk, vv):
        return sparse_ring_attention(qq, kk, vv, layout=layout, group=None, config=vs, softmax_scale=scale)

    t_dense = time_fwd_bwd(dense, q, k, v, args.warmup, args.repeats)
    t_sparse = time_fwd_bwd(sparse, q, k, v, args.warmup, args.repeats)
    with torch.no_grad():
        _, pat = sparse_ring_attention(q, k, v, layout=layout, group=None, config=vs, softmax_scale=scale,
                                       return_pattern=True)
    res = {"attn_dense_s": t_dense, "attn_sparse_s": t_sparse, "kept_fraction": kept_fraction(pat),
           "mean_slash_blocks": float(pat.slash_count.float().mean()),
           "mean_vertical": float(pat.vertical_count.float().mean())}
    del q, k, v, pat
    torch.cuda.empty_cache()
    return res


def add_speedup_and_bounds(row: dict, layers: int) -> dict:
    """Adds to one length's ``row`` the measured ``speedup`` (dense over MTraining step time) and
    ``amdahl``: ``f`` (the dense attention share of the dense step), ``s`` (the microbenchmark's attention
    speed-up on synthetic q/k), ``bound = 1 / ((1 - f) + f / s)`` and ``achieved_over_bound``; where the
    trainer logged the model's own kept work (``kept_in_model``) also ``s_model``, ``s`` rescaled to that
    work (sparse time taken as proportional to the kept work: ``s * kept_synthetic / kept_in_model``), and
    ``bound_model`` / ``achieved_over_bound_model``. Returns ``row``."""
    d, m, a = row.get("dense", {}), row.get("mtraining", {}), row.get("attn", {})
    if d.get("step_s") and m.get("step_s"):
        row["speedup"] = d["step_s"] / m["step_s"]
    if d.get("step_s") and a.get("attn_dense_s") and a.get("attn_sparse_s"):
        f = min(1.0, layers * a["attn_dense_s"] / d["step_s"])
        s = a["attn_dense_s"] / a["attn_sparse_s"]
        am = row["amdahl"] = {"f": f, "s": s, "bound": 1.0 / ((1 - f) + f / s)}
        if m.get("kept_in_model") and a.get("kept_fraction"):
            am["s_model"] = s * a["kept_fraction"] / m["kept_in_model"]
            am["bound_model"] = 1.0 / ((1 - f) + f / am["s_model"])
        if row.get("speedup"):
            am["achieved_over_bound"] = row["speedup"] / am["bound"]
            if "bound_model" in am:
                am["achieved_over_bound_model"] = row["speedup"] / am["bound_model"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="65536,131072", help="comma list of sequence lengths")
    ap.add_argument("--num-layers", default="4",
                    help="layers: one number, or a comma list matching --seqs")
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--median-of", type=int, default=2, help="median of the last N iterations")
    ap.add_argument("--modes", default="dense,mtraining")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "e2e_sparse.yaml"))
    ap.add_argument("--data-path", default=os.path.join(REPO, "data", "megatron", "books_text_document"))
    ap.add_argument("--tokenizer-model", default=os.path.join(REPO, "data", "tokenizer", "mistral_v1.model"))
    ap.add_argument("--warmup", type=int, default=1, help="microbenchmark warm-up runs")
    ap.add_argument("--repeats", type=int, default=3, help="microbenchmark timed runs (median)")
    ap.add_argument("--no-microbench", action="store_true")
    ap.add_argument("--run-timeout", type=float, default=600.0, help="seconds per training run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags for both modes (after --)")
    args = ap.parse_args(argv)

    try:
        seqs = [int(x) for x in args.seqs.split(",") if x]
        lay = [int(x) for x in args.num_layers.split(",") if x]
    except ValueError:
        ap.error(f"--seqs {args.seqs!r} / --num-layers {args.num_layers!r}: comma lists of ints")
    if not seqs or min(seqs + lay) < 1:
        ap.error("--seqs and --num-layers: positive ints")
    if len(lay) == 1:
        lay = lay * len(seqs)
    if len(lay) != len(seqs):
        ap.error("--num-layers: one value or one per --seqs entry")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("dense", "mtraining"):
            ap.error(f"--modes: unknown mode {m!r}")
    if args.median_of < 1 or args.median_of > args.iters:
        ap.error("--median-of must be in [1, --iters]")

    results = {"config": vars(args), "runs": []}

    def dump():
        if args.json:
            write_json(args.json, result_record(results))

    tmp = tempfile.mkdtemp(prefix="bench_e2e_")
    for seq, L in zip(seqs, lay):
        row = {"seq": seq, "layers": L}
        for mode in modes:
            mpath = os.path.join(tmp, f"metrics_{seq}_{mode}.jsonl")
            cmd = build_cmd(args, seq, L, mode, mpath)
            print("+ " + " ".join(cmd), flush=True)
            if args.dry_run:
                continue
            t0 = time.time()
            try:
                p = subprocess.run(cmd, cwd=REPO, timeout=args.run_timeout, capture_output=True, text=True)
                rc = p.returncode
                out = p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:
                rc, out = "timeout", ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                                      else (e.stdout or ""))
            tail = "\n".join(out.strip().splitlines()[-6:])
            print(tail, flush=True)
            r = {"rc": rc, "wall_s": time.time() - t0}
            if os.path.exists(mpath):
                try:
                    r.update(read_metrics(mpath, args.median_of))
                except Exception as e:                          # noqa: BLE001
                    r["error"] = repr(e)
            if rc != 0:
                r["log_tail"] = tail
            if r.get("step_s"):
                r["tokens_per_s"] = seq / r["step_s"]
                if r.get("model_flops"):
                    r["tflops"] = r["model_flops"] / r["step_s"] / 1e12
            row[mode] = r
            results["runs"] = [x for x in results["runs"] if x["seq"] != seq] + [row]
            dump()
        if args.dry_run:
            continue
        if not args.no_microbench:
            try:
                row["attn"] = attention_microbench(args, seq)
            except Exception as e:                              # noqa: BLE001
                row["attn"] = {"error": repr(e)}
                print(f"microbench {seq}: {e!r}", flush=True)
        add_speedup_and_bounds(row, L)
        dump()
        print(json.dumps({k: v for k, v in row.items()}, default=str), flush=True)
    if args.dry_run:
        return 0

    def g(x, k, fmt):
        v = x.get(k) if isinstance(x, dict) else None
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    print("\n| seq | layers | mode | step s | tokens/s | TFLOP/s | peak mem GiB | kept (model) | kept (synthetic) "
          "| attn fwd+bwd ms | f | s | bound | speedup | speedup/bound | bound (model kept) | speedup/bound (model) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results["runs"]:
        a, am = row.get("attn", {}), row.get("amdahl", {})
        for mode in modes:
            r = row.get(mode, {})
            sparse = mode == "mtraining"
            attn = a.get("attn_sparse_s" if sparse else "attn_dense_s")
            print(f"| {row['seq']} | {row['layers']} | {mode} | {g(r, 'step_s', '.3f')} | {g(r, 'tokens_per_s', '.0f')} "
                  f"| {g(r, 'tflops', '.1f')} | {g(r, 'peak_mem_gib', '.1f')} "
                  f"| {g(r, 'kept_in_model', '.3f') if sparse else '1'} "
                  f"| {g(a, 'kept_fraction', '.3f') if sparse else '1'} "
                  f"| {format(attn * 1e3, '.1f') if attn else '-'} "
                  f"| {g(am, 'f', '.3f') if sparse else ''} | {g(am, 's', '.2f') if sparse else ''} "
                  f"| {g(am, 'bound', '.2f') if sparse else ''} | {g(row, 'speedup', '.2f') if sparse else ''} "
                  f"| {g(am, 'achieved_over_bound', '.2f') if sparse else ''} "
                  f"| {g(am, 'bound_model', '.2f') if sparse else ''} "
                  f"| {g(am, 'achieved_over_bound_model', '.2f') if sparse else ''} |")
    dump()
    failed = [f"{row['seq']} {mode}" for row in results["runs"] for mode in modes
              if not isinstance(row.get(mode), dict) or row[mode].get("rc") != 0 or not row[mode].get("step_s")]
    if failed:
        print(f"error: {len(failed)} of {len(results['runs']) * len(modes)} training runs failed or gave no "
              f"iteration time ({', '.join(failed)}); their log tails are above" + (" and in --json" if args.json
                                                                                     else ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

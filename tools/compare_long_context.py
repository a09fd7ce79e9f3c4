#!/usr/bin/env python3
"""Compare long-context runs side by side: training loss at equal tokens,
held-out perplexity by position bucket and needle-in-a-haystack cells, for several checkpoints
evaluated by ``tools/eval_long_context.py --json``.

    python3 tools/compare_long_context.py \\
        --eval base=runs/long_context/eval_base_32k_dense.json dense=... mtraining=... \\
        --loss-curves dense=checkpoints/long_context/dense_32k/metrics.jsonl mtraining=... \\
        --baseline dense --last 10 --out docs/results/raw/long_context --json compare.json

Inputs:

* ``--eval LABEL=FILE``: eval JSON files in ``eval_long_context.py``'s format. The keys read are
  ``ppl.buckets[].{bucket,tokens,loss,ppl}``, ``ppl.overall``, ``niah.cells[].{length,depth,
  greedy_score,ll_score}`` and ``niah.control_no_needle[].{length,ll_score}``. Any of ``ppl`` and
  ``niah`` may be missing. A cell that was not run is absent, never zero.
* ``--loss-curves LABEL=FILE``: ``pretrain_gpt.py --metrics-file`` JSONL. If an iteration appears more
  than once (a call killed after logging), the last row counts.

Outputs:

* A printed Markdown report:
  * training loss at the iterations that all curves share: iteration 1, the mean of the last
    ``--last`` shared iterations, the mean of all shared iterations;
  * the median seconds per iteration;
  * PPL per bucket with the change relative to ``--baseline``;
  * NIAH greedy / likelihood per (length, depth) cell.
* ``OUT/loss_curves.png``: the curves, with the relative difference to the baseline below them.
* ``OUT/ppl_by_position.png``: grouped bars on a log scale.
* ``OUT/niah.png``: one heat map row per model; cells not run are left blank.
* ``--json``: the numbers behind the report.

Raises ``SystemExit`` (argparse error) if a label is given twice, a file is missing, or the
baseline is not among the labels.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_mtraining.bench import draw_niah_grid, pyplot, result_record, save_figure, write_json
from megatron_mtraining.bench import read_metrics_rows as read_metrics


def _pairs(specs: Sequence[str], flag: str, parser: argparse.ArgumentParser) -> dict[str, str]:
    out: dict[str, str] = {}
    for spec in specs or []:
        if "=" not in spec:
            parser.error(f"{flag} {spec!r}: expected LABEL=FILE")
        label, path = spec.split("=", 1)
        if label in out:
            parser.error(f"{flag}: label {label!r} given twice")
        if not Path(path).is_file():
            parser.error(f"{flag} {label}={path}: file not found")
        out[label] = path
    return out


def _read_eval(label: str, path: str, parser: argparse.ArgumentParser) -> dict:
    """An ``eval_long_context.py --json`` file: a JSON object with ``ppl`` and/or ``niah`` results."""
    try:
        data = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        parser.error(f"--eval {label}={path}: not a JSON file ({e})")
    if not isinstance(data, dict) or not (data.get("ppl") or data.get("niah")):
        parser.error(f"--eval {label}={path}: no 'ppl' or 'niah' results (an eval_long_context.py --json file is "
                     "expected)")
    bad = _eval_schema_error(data)
    if bad:
        parser.error(f"--eval {label}={path}: {bad} (an eval_long_context.py --json file is expected)")
    return data


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _eval_schema_error(data: dict) -> Optional[str]:
    """What the report reads that ``data`` lacks, or None: ``ppl.buckets`` (``bucket``, ``tokens``, ``ppl``)
    and ``ppl.overall``; ``niah.cells`` (``length``, ``depth``, ``greedy_score``, ``ll_score``) and
    ``niah.control_no_needle`` (``length``, ``ll_score``)."""
    ppl, niah = data.get("ppl"), data.get("niah")
    if ppl:
        if not isinstance(ppl, dict) or not isinstance(ppl.get("buckets"), list) or \
                not isinstance(ppl.get("overall"), dict):
            return "'ppl' needs a 'buckets' list and an 'overall' object"
        for row in ppl["buckets"] + [ppl["overall"]]:
            if not isinstance(row, dict) or not _number(row.get("tokens")) or \
                    (row.get("tokens") and not _number(row.get("ppl"))):
                return f"a 'ppl' row without numeric 'tokens' / 'ppl': {row!r}"
        if any("bucket" not in row for row in ppl["buckets"]):
            return "a 'ppl.buckets' row without 'bucket'"
    if niah:
        if not isinstance(niah, dict):
            return "'niah' must be an object"
        for key, need in (("cells", ("length", "depth", "greedy_score", "ll_score")),
                          ("control_no_needle", ("length", "ll_score"))):
            rows = niah.get(key, [])
            if not isinstance(rows, list) or any(not isinstance(c, dict) or not all(_number(c.get(f)) for f in need)
                                                 for c in rows):
                return f"'niah.{key}' rows need numeric {', '.join(need)}"
    return None


def loss_summary(curves: dict[str, dict[int, dict]], last: int) -> dict:
    """Loss statistics over the iterations every curve has (equal tokens when the runs share data order)."""
    shared = sorted(set.intersection(*(set(c) for c in curves.values()))) if curves else []
    out = {"shared_iterations": [shared[0], shared[-1]] if shared else None, "runs": {}}
    tail = shared[-last:] if shared else []
    for label, c in curves.items():
        times = [c[i]["time_s"] for i in shared[1:] if "time_s" in c[i]]  # iteration 1 includes compilation
        mem = [c[i].get("max_memory_allocated") for i in shared if c[i].get("max_memory_allocated")]
        out["runs"][label] = {
            "first": c[shared[0]]["lm_loss"] if shared else None,
            "last_mean": statistics.fmean(c[i]["lm_loss"] for i in tail) if tail else None,
            "all_mean": statistics.fmean(c[i]["lm_loss"] for i in shared) if shared else None,
            "final": c[shared[-1]]["lm_loss"] if shared else None,
            "median_s_per_iter": statistics.median(times) if times else None,
            "peak_memory_gib": max(mem) / 2**30 if mem else None,
            "tokens": sum(c[i].get("tokens", 0) for i in shared),
        }
    out["last"] = len(tail)
    return out


def _bucket_names(with_ppl: dict[str, dict]) -> list[str]:
    """Buckets with tokens in any of the evaluations, in first-seen order."""
    names: list[str] = []
    for p in with_ppl.values():
        for b in p["buckets"]:
            if b["tokens"] and b["bucket"] not in names:
                names.append(b["bucket"])
    return names


def _rel(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return ""
    return f"{(a / b - 1) * 100:+.2f} %"


def _fmt(x: Optional[float], digits: int = 4) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def report(evals: dict[str, dict], losses: Optional[dict], baseline: Optional[str]) -> str:
    lines = []
    if losses and losses["runs"]:
        lo, hi = losses["shared_iterations"]
        lines += [f"Training loss, iterations {lo}-{hi} (shared by all runs)", "",
                  f"| run | iteration {lo} | mean of last {losses['last']} | mean of all | s / iteration | peak GiB |",
                  "|---|---|---|---|---|---|"]
        base = losses["runs"].get(baseline, {}) if baseline else {}
        for label, r in losses["runs"].items():
            cell = lambda k: _fmt(r[k]) + (f" ({_rel(r[k], base.get(k))})" if base and label != baseline else "")  # noqa: E731
            lines.append(f"| {label} | {cell('first')} | {cell('last_mean')} | {cell('all_mean')} | "
                         f"{_fmt(r['median_s_per_iter'], 2)} | {_fmt(r['peak_memory_gib'], 1)} |")
        lines.append("")
    with_ppl = {k: v["ppl"] for k, v in evals.items() if v.get("ppl")}
    if with_ppl:
        buckets = _bucket_names(with_ppl)
        labels = list(with_ppl)
        lines += ["Held-out perplexity by position", "",
                  "| bucket | " + " | ".join(labels) + (f" | change vs {baseline}" if baseline in with_ppl else "") + " |",
                  "|---" * (len(labels) + 1 + (baseline in with_ppl and len(labels) > 1)) + "|"]
        for name in buckets + ["overall"]:
            vals = {}
            for k, p in with_ppl.items():
                row = p["overall"] if name == "overall" else next((b for b in p["buckets"] if b["bucket"] == name), None)
                vals[k] = row["ppl"] if row and row["tokens"] else None
            extra = ""
            if baseline in with_ppl and len(labels) > 1:
                extra = " | " + ", ".join(f"{k} {_rel(vals[k], vals[baseline])}" for k in labels if k != baseline)
            lines.append(f"| {name} | " + " | ".join(_fmt(vals[k], 2) for k in labels) + extra + " |")
        lines.append("")
    with_niah = {k: v["niah"] for k, v in evals.items() if v.get("niah")}
    if with_niah:
        keys = sorted({(c["length"], c["depth"]) for n in with_niah.values() for c in n.get("cells", [])})
        labels = list(with_niah)
        lines += ["Needle in a haystack: greedy retrieval / answer likelihood (0-100; — = not run)", "",
                  "| length | depth | " + " | ".join(labels) + " |", "|---|---" + "|---" * len(labels) + "|"]
        for length, depth in keys:
            row = []
            for k in labels:
                c = next((c for c in with_niah[k].get("cells", []) if (c["length"], c["depth"]) == (length, depth)), None)
                row.append("—" if c is None else f"{c['greedy_score']:.0f} / {c['ll_score']:.1f}")
            lines.append(f"| {length} | {depth} % | " + " | ".join(row) + " |")
        ctl = sorted({c["length"] for n in with_niah.values() for c in n.get("control_no_needle", [])})
        for length in ctl:
            row = []
            for k in labels:
                c = next((c for c in with_niah[k].get("control_no_needle", []) if c["length"] == length), None)
                row.append("—" if c is None else f"— / {c['ll_score']:.1f}")
            lines.append(f"| {length} | no needle | " + " | ".join(row) + " |")
        for k in labels:
            cells = with_niah[k].get("cells", [])
            if cells:
                g = statistics.fmean(c["greedy_score"] for c in cells)
                ll = statistics.fmean(c["ll_score"] for c in cells)
                lines.append(f"\n{k}: {len(cells)} cells, mean greedy {g:.1f}, mean likelihood {ll:.1f}")
        lines.append("")
    return "\n".join(lines)


def plots(out: Path, evals: dict[str, dict], curves: dict[str, dict[int, dict]], baseline: Optional[str]) -> list[str]:
    import numpy as np

    plt = pyplot()

    out.mkdir(parents=True, exist_ok=True)
    written = []
    if curves:
        fig, axes = plt.subplots(2, 1, figsize=(6.4, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
        for label, c in curves.items():
            its = sorted(c)
            axes[0].plot(its, [c[i]["lm_loss"] for i in its], label=label, lw=1.2)
        axes[0].set_ylabel("training lm loss")
        axes[0].legend()
        if baseline in curves:
            b = curves[baseline]
            for label, c in curves.items():
                if label == baseline:
                    continue
                its = sorted(set(c) & set(b))
                axes[1].plot(its, [100 * (c[i]["lm_loss"] / b[i]["lm_loss"] - 1) for i in its], label=f"{label} vs {baseline}")
            axes[1].axhline(0, color="k", lw=0.8)
            axes[1].axhline(2, color="tab:red", ls="--", lw=0.8, label="+2 %")
            axes[1].set_ylabel("loss change (%)")
            axes[1].legend(fontsize=8)
        axes[1].set_xlabel("iteration (same batches in every run)")
        fig.tight_layout()
        save_figure(fig, out / "loss_curves.png", dpi=100)
        written.append(str(out / "loss_curves.png"))
    with_ppl = {k: v["ppl"] for k, v in evals.items() if v.get("ppl")}
    if with_ppl:
        buckets = _bucket_names(with_ppl)
        fig, ax = plt.subplots(figsize=(7, 4))
        w = 0.8 / len(with_ppl)
        for j, (label, p) in enumerate(with_ppl.items()):
            vals = [next((b["ppl"] for b in p["buckets"] if b["bucket"] == n and b["tokens"]), np.nan) for n in buckets]
            ax.bar(np.arange(len(buckets)) + (j - (len(with_ppl) - 1) / 2) * w, vals, w, label=label)
        ax.set_yscale("log")
        ax.set_xticks(range(len(buckets)), buckets)
        ax.set_xlabel("token position in window")
        ax.set_ylabel("held-out perplexity (log scale)")
        ax.legend()
        fig.tight_layout()
        save_figure(fig, out / "ppl_by_position.png", dpi=100)
        written.append(str(out / "ppl_by_position.png"))
    with_niah = {k: v["niah"] for k, v in evals.items() if v.get("niah") and v["niah"].get("cells")}
    if with_niah:
        lengths = sorted({c["length"] for n in with_niah.values() for c in n["cells"]})
        depths = sorted({c["depth"] for n in with_niah.values() for c in n["cells"]})
        fig, axes = plt.subplots(len(with_niah), 2, figsize=(9, 1.2 + 0.45 * len(lengths) * len(with_niah) + 0.4),
                                 squeeze=False)
        for r, (label, n) in enumerate(with_niah.items()):
            for col, (key, name) in enumerate((("greedy_score", "greedy retrieval"), ("ll_score", "answer likelihood"))):
                ax = axes[r][col]
                draw_niah_grid(ax, n["cells"], lengths, depths, key)
                ax.set_title(f"{label}: {name}", fontsize=9)
        fig.tight_layout()
        save_figure(fig, out / "niah.png", dpi=100)
        written.append(str(out / "niah.png"))
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", nargs="*", default=[], metavar="LABEL=FILE", help="eval_long_context.py --json files")
    ap.add_argument("--loss-curves", nargs="*", default=[], metavar="LABEL=FILE", help="pretrain_gpt.py metrics JSONL")
    ap.add_argument("--baseline", default=None, help="label the others are compared with (e.g. dense)")
    ap.add_argument("--last", type=int, default=10, help="mean of the last N shared iterations (default 10)")
    ap.add_argument("--out", default=None, help="directory for the PNG plots")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    eval_paths = _pairs(args.eval, "--eval", ap)
    curve_paths = _pairs(args.loss_curves, "--loss-curves", ap)
    if not eval_paths and not curve_paths:
        ap.error("give --eval and/or --loss-curves")
    if args.baseline is not None and args.baseline not in eval_paths and args.baseline not in curve_paths:
        ap.error(f"--baseline {args.baseline!r} is not one of the labels {sorted(set(eval_paths) | set(curve_paths))}")
    if args.last < 1:
        ap.error("--last must be >= 1")
    evals = {k: _read_eval(k, p, ap) for k, p in eval_paths.items()}
    curves = {}
    for k, p in curve_paths.items():
        try:
            curves[k] = read_metrics(p)
        except ValueError as e:
            ap.error(str(e))
        if not curves[k]:
            ap.error(f"--loss-curves {k}={p}: no iterations in the file (a pretrain_gpt.py --metrics-file is expected)")
    losses = loss_summary(curves, args.last) if curves else None
    if losses is not None and losses["shared_iterations"] is None:
        spans = ", ".join(f"{k}: {min(c)}-{max(c)}" for k, c in curves.items())
        ap.error(f"--loss-curves: the runs share no iteration ({spans}); compare runs of the same schedule")
    print(report(evals, losses, args.baseline))
    written = plots(Path(args.out), evals, curves, args.baseline) if args.out else []
    if written:
        print(" > plots: " + ", ".join(written))
    if args.json:
        write_json(args.json, result_record({"losses": losses, "evals": {k: {"ppl": v.get("ppl"), "niah": v.get("niah")}
                                                                         for k, v in evals.items()}}, device="cpu",
                                            argv=argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

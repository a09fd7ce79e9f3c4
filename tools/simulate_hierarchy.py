"""Predicted attention time of a flat vs a hierarchical (inner × outer) ring, per layer.

Model (one layer, forward and backward separately; every ring step is synchronous because the
ring moves in lock step, and a transfer posted before a step's compute overlaps it):

* **flat ring** over ``nodes × gpus_per_node`` ranks: each of its ``cp`` steps exchanges K/V
  (backward: K/V plus the fp32 dK/dV accumulator) with the neighbour; some neighbour pair of
  every step sits across nodes, so each step lasts ``max(t_step, bytes / inter_bw)``.
* **hierarchical ring** (MTraining §4.2, Algorithm 2): ``outer = nodes`` outer steps; each runs
  an inner ring of ``inner = gpus_per_node`` steps at ``max(t_step, bytes / intra_bw)`` and,
  at the same time, the outer transfer (``bytes / inter_bw``); an outer step lasts
  ``max(inner ring, outer transfer)``. Backward: one more outer hop brings dK/dV home.

``t_step`` = the attention kernel time of one (worker, ring step) cell: from the imbalance
tool's JSON (``--imbalance-json``: the mean over steps of the slowest worker's time) or, by default, the
sparse-attention time of the whole sequence on one GPU divided evenly over ``cp × cp`` cells
(balanced striped layout). Defaults: Qwen2.5-3B attention (2 KV heads, head_dim 128, bf16),
NVLink 300 GB/s intra-node, InfiniBand HDR 25 GB/s inter-node (per GPU), and a one-GPU
fwd / fwd+bwd time at 512K and 95 % sparsity of FlexAttention, 147.3 / 548.4 ms (the "FlexAttention
anchor" rows of docs/results.md#hierarchy-model, record docs/results/70_hierarchy_model.json; pass
``--fwd-ms/--fwdbwd-ms`` with another kernel's numbers, e.g. 190.88 / 714.37 ms for this project's
kernels in the same record).

Bad values (a count below 1, a non-positive or non-finite bandwidth or time, ``--fwdbwd-ms`` below
``--fwd-ms``, a ``--seq-len`` that the ``nodes x gpus_per_node`` ranks cannot split evenly, an
unreadable ``--imbalance-json`` or one measured at another CP size) end with ``error: ...`` naming
the flag (exit 2).

    python tools/simulate_hierarchy.py --nodes 4 --gpus-per-node 8 --seq-len 524288
    python tools/simulate_hierarchy.py --nodes 8 --gpus-per-node 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import List, Optional, Tuple


def simulate(nodes: int, gpus_per_node: int, seq_len: int, kv_heads: int, head_dim: int, bytes_per_el: int,
             intra_gbs: float, inter_gbs: float, fwd_ms: float, fwdbwd_ms: float, step_ms=None) -> dict:
    cp = nodes * gpus_per_node
    s_local = seq_len // cp
    kv_bytes = 2 * s_local * kv_heads * head_dim * bytes_per_el
    dkv_bytes = 2 * s_local * kv_heads * head_dim * 4                        # fp32 accumulators
    bwd_ms = fwdbwd_ms - fwd_ms
    t_fwd = step_ms[0] if step_ms else fwd_ms / (cp * cp)
    t_bwd = step_ms[1] if step_ms else bwd_ms / (cp * cp)
    ms = lambda nbytes, gbs: nbytes / (gbs * 1e9) * 1e3                      # noqa: E731

    def flat(t, nbytes):
        return (cp - 1) * max(t, ms(nbytes, inter_gbs)) + t

    def hier(t, nbytes, extra_outer_hop):
        inner_ring = (gpus_per_node - 1) * max(t, ms(nbytes, intra_gbs)) + t
        outer_xfer = ms(nbytes, inter_gbs)
        total = (nodes - 1) * max(inner_ring, outer_xfer) + inner_ring
        return total + (outer_xfer if extra_outer_hop else 0.0)

    res = {
        "nodes": nodes, "gpus_per_node": gpus_per_node, "cp": cp, "seq_len": seq_len,
        "kv_mib_per_step": kv_bytes / 2**20, "t_step_fwd_ms": t_fwd, "t_step_bwd_ms": t_bwd,
        "inter_ms_per_step_fwd": ms(kv_bytes, inter_gbs), "intra_ms_per_step_fwd": ms(kv_bytes, intra_gbs),
        "flat_fwd_ms": flat(t_fwd, kv_bytes),
        "flat_bwd_ms": flat(t_bwd, kv_bytes + dkv_bytes) + ms(dkv_bytes, inter_gbs),
        "hier_fwd_ms": hier(t_fwd, kv_bytes, False),
        "hier_bwd_ms": hier(t_bwd, kv_bytes + dkv_bytes, True),
        "compute_only_ms": cp * (t_fwd + t_bwd),
    }
    res["flat_ms"] = res["flat_fwd_ms"] + res["flat_bwd_ms"]
    res["hier_ms"] = res["hier_fwd_ms"] + res["hier_bwd_ms"]
    res["speedup_hier_over_flat"] = res["flat_ms"] / res["hier_ms"]
    return res


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse values the model cannot use (``ap.error``: one line naming the flag, exit 2)."""
    for flag, vals in (("--nodes", args.nodes), ("--gpus-per-node", [args.gpus_per_node]),
                       ("--seq-len", [args.seq_len]), ("--kv-heads", [args.kv_heads]), ("--head-dim", [args.head_dim]),
                       ("--bytes-per-element", [args.bytes_per_element])):
        for v in vals:
            if v < 1:
                ap.error(f"{flag} must be >= 1, got {v}")
    for flag, v in (("--intra-gbs", args.intra_gbs), ("--inter-gbs", args.inter_gbs), ("--fwd-ms", args.fwd_ms),
                    ("--fwdbwd-ms", args.fwdbwd_ms)):
        if not (math.isfinite(v) and v > 0):
            ap.error(f"{flag} must be a finite number > 0, got {v}")
    if args.fwdbwd_ms < args.fwd_ms:
        ap.error(f"--fwdbwd-ms ({args.fwdbwd_ms}) must be >= --fwd-ms ({args.fwd_ms}): it is forward + backward")
    for nodes in args.nodes:
        cp = nodes * args.gpus_per_node
        if args.seq_len % cp:
            ap.error(f"--seq-len {args.seq_len} must be divisible by --nodes x --gpus-per-node = {nodes} x "
                     f"{args.gpus_per_node} = {cp} (every rank holds seq_len / cp tokens)")
    if args.imbalance_json and not os.path.isfile(args.imbalance_json):
        ap.error(f"--imbalance-json: file not found: {args.imbalance_json}")


def imbalance_step_ms(ap: argparse.ArgumentParser, path: str, cp: int) -> Tuple[float, float]:
    """``(fwd, bwd)``: the mean over ring steps of the slowest worker's kernel ms in ``path``
    (tools/imbalance.py --model gpu JSON of a virtual CP of size ``cp``)."""
    try:
        with open(path) as f:
            data = json.load(f)
        fwd, bwd = [float(x) for x in data["step_ms_fwd_max"]], [float(x) for x in data["step_ms_bwd_max"]]
    except (OSError, ValueError, TypeError, KeyError) as e:
        ap.error(f"--imbalance-json {path}: not a tools/imbalance.py --model gpu JSON with step_ms_fwd_max / "
                 f"step_ms_bwd_max lists ({type(e).__name__}: {e})")
    if not fwd or len(bwd) != len(fwd) or not all(math.isfinite(x) and x >= 0 for x in fwd + bwd):
        ap.error(f"--imbalance-json {path}: step_ms_fwd_max / step_ms_bwd_max must be equally long, non-empty "
                 "lists of finite times >= 0")
    if len(fwd) != cp:
        ap.error(f"--imbalance-json {path} was measured with cp={len(fwd)}, but --nodes x --gpus-per-node = {cp}")
    return sum(fwd) / len(fwd), sum(bwd) / len(bwd)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 8], help="node counts, one table row each (>= 1)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node (>= 1)")
    ap.add_argument("--seq-len", type=int, default=524288,
                    help="tokens; a multiple of nodes x gpus-per-node")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--bytes-per-element", type=int, default=2, help="K/V dtype size (bf16: 2)")
    ap.add_argument("--intra-gbs", type=float, default=300.0, help="intra-node GB/s per GPU (NVLink)")
    ap.add_argument("--inter-gbs", type=float, default=25.0, help="inter-node GB/s per GPU (IB HDR)")
    ap.add_argument("--fwd-ms", type=float, default=147.3, help="one-GPU sparse attention fwd, whole sequence")
    ap.add_argument("--fwdbwd-ms", type=float, default=548.4, help="one-GPU sparse attention fwd+bwd")
    ap.add_argument("--imbalance-json", default=None,
                    help="tools/imbalance.py --model gpu JSON: per-step kernel ms (max over workers) replace the even split")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    check_args(ap, args)

    rows = []
    for nodes in args.nodes:
        step_ms = None
        if args.imbalance_json:
            # per-step slowest-worker times of a virtual CP of the same size; the model uses their mean
            step_ms = imbalance_step_ms(ap, args.imbalance_json, nodes * args.gpus_per_node)
        rows.append(simulate(nodes, args.gpus_per_node, args.seq_len, args.kv_heads, args.head_dim,
                             args.bytes_per_element, args.intra_gbs, args.inter_gbs, args.fwd_ms, args.fwdbwd_ms,
                             step_ms))
    print(f"{'nodes x gpus':>12} | {'KV MiB/step':>11} | {'step fwd/bwd ms':>15} | {'IB ms/step':>10} | "
          f"{'flat ms':>8} | {'hier ms':>8} | {'compute-only ms':>15} | {'hier speedup':>12}")
    for r in rows:
        print(f"{r['nodes']:>5} x {r['gpus_per_node']:<4} | {r['kv_mib_per_step']:>11.1f} | "
              f"{r['t_step_fwd_ms']:>6.3f} / {r['t_step_bwd_ms']:<6.3f} | {r['inter_ms_per_step_fwd']:>10.3f} | "
              f"{r['flat_ms']:>8.2f} | {r['hier_ms']:>8.2f} | {r['compute_only_ms']:>15.2f} | "
              f"{r['speedup_hier_over_flat']:>11.2f}x")
    if args.json:
        from megatron_mtraining.bench import result_record, write_json

        write_json(args.json, result_record({"args": vars(args), "rows": rows}, device="cpu"))


if __name__ == "__main__":
    main()

"""GPU check of the CUDA-graph estimate (megatron_mtraining.patterns.graphed), run on the H200 through the
device tool:

    python3 tests/workers/gpu_graphed_estimate_check.py [--seqs 8192,65536,131072]

Per sequence length (q ``[1, S, 16, 128]``, k/v ``[1, S, 2, 128]``, bf16, structured inputs of
``tools.bench_e2e.structured_qkv``, ``configs/e2e_sparse.yaml``), CP=1:

* two different inputs through the same captured graph (the second call must see its own data): the
  selected lines and step indices are bitwise those of the eager ``static_widths=True`` estimate +
  conversion (the estimated masses to 1e-12: CUDA's fp64 ``index_add_`` has no fixed order), and equal the default (data-dependent widths) ones up to their width, ``-1`` beyond;
* the sparse ring fwd+bwd with ``cuda_graph_estimate=True`` gives bitwise the out/dQ/dK/dV of the
  default path.

Prints one line per case and a final ``RESULT`` line (``pass``: every check held).
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron_mtraining.config import load_mtraining_config  # noqa: E402
from megatron_mtraining.patterns.convert import convert_pattern  # noqa: E402
from megatron_mtraining.patterns.estimator import estimate_vertical_slash  # noqa: E402
from megatron_mtraining.patterns.graphed import estimate_and_convert_graphed  # noqa: E402
from megatron_mtraining.ring.sparse import sparse_ring_attention  # noqa: E402
from tools.bench_e2e import structured_qkv  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SELECTION_FIELDS = ("slash", "slash_count", "vertical", "vertical_count")
MASS_FIELDS = ("est_slash_mass", "est_vertical_mass")
STEP_FIELDS = ("block_count", "block_index", "column_count", "column_index")


def padded_equal(static: torch.Tensor, dyn: torch.Tensor) -> bool:
    w = dyn.shape[-1]
    return (static.shape[:-1] == dyn.shape[:-1] and static.shape[-1] >= w and torch.equal(static[..., :w], dyn)
            and bool((static[..., w:] == -1).all()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,65536,131072")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "e2e_sparse.yaml"))
    args = ap.parse_args(argv)
    cfg = load_mtraining_config(args.config)
    layout, vs = cfg.make_layout(1), cfg.vertical_slash
    dev = torch.device("cuda")
    ok = True
    for S in (int(x) for x in args.seqs.split(",")):
        scale = 1.0 / math.sqrt(128)
        for trial in range(2):          # the second input goes through the graph captured for the first
            q, k, v = structured_qkv(S, 16, 2, 128, dev, seed=S + trial)
            pat, steps = estimate_and_convert_graphed(q, k, layout=layout, config=vs, softmax_scale=scale)
            ref = estimate_vertical_slash(q, k, layout=layout, config=vs, softmax_scale=scale, static_widths=True)
            ref_steps = convert_pattern(ref, layout, 0, static_widths=True)
            dyn = estimate_vertical_slash(q, k, layout=layout, config=vs, softmax_scale=scale)
            dyn_steps = convert_pattern(dyn, layout, 0)
            # the selection bitwise; the masses to 1e-12: CUDA's fp64 index_add_ (block-diagonal sums)
            # adds in no fixed order, in eager mode as in the graph
            same_eager = (all(torch.equal(getattr(pat, f), getattr(ref, f)) for f in SELECTION_FIELDS)
                          and all(torch.allclose(getattr(pat, f), getattr(ref, f), rtol=1e-12, atol=0)
                                  for f in MASS_FIELDS)
                          and all(torch.equal(getattr(steps[0], f), getattr(ref_steps[0], f)) for f in STEP_FIELDS))
            same_dyn = (torch.equal(pat.slash_count, dyn.slash_count) and torch.equal(pat.vertical_count,
                                                                                        dyn.vertical_count)
                        and padded_equal(pat.slash, dyn.slash) and padded_equal(pat.vertical, dyn.vertical)
                        and torch.equal(steps[0].block_count, dyn_steps[0].block_count)
                        and torch.equal(steps[0].column_count, dyn_steps[0].column_count)
                        and padded_equal(steps[0].block_index, dyn_steps[0].block_index)
                        and padded_equal(steps[0].column_index, dyn_steps[0].column_index))
            good = same_eager and same_dyn
            ok &= good
            print(f"S={S} input {trial}: graph == eager static {same_eager}, == default up to padding {same_dyn} "
                  f"(widths {steps[0].block_index.shape[-1]}/{steps[0].column_index.shape[-1]} vs "
                  f"{dyn_steps[0].block_index.shape[-1]}/{dyn_steps[0].column_index.shape[-1]}) "
                  f"{'ok' if good else 'FAIL'}")
        res = []
        for graph in (True, False):
            qa, ka, va = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            out = sparse_ring_attention(qa, ka, va, layout=layout, group=None, config=vs, softmax_scale=scale,
                                        columns=cfg.columns, cuda_graph_estimate=graph)
            out.backward(torch.ones_like(out))
            res.append([t.detach() for t in (out, qa.grad, ka.grad, va.grad)])
        same = all(torch.equal(a, b) for a, b in zip(*res))
        ok &= same
        print(f"S={S} ring fwd+bwd, graphed estimate vs default: {'bitwise equal' if same else 'DIFFER'}")
    print("RESULT " + json.dumps({"pass": bool(ok)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

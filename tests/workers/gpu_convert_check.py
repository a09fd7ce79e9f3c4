"""GPU check of the Triton index conversion (patterns/triton/convert.py): the check, its lengths, and a CLI.

    pytest -m gpu tests/kernels/test_gpu_convert.py                        # one test per length
    python3 tests/workers/gpu_convert_check.py [--seqs 8192,65536,131072] [--json OUT]   # + timings

Per sequence length (q ``[1, S, 16, 128]``, k ``[1, S, 2, 128]``, bf16, structured inputs of
``megatron_mtraining.bench.structured_qkv``, ``configs/e2e_sparse.yaml``, CP=1), on the estimated pattern:
``convert_pattern(impl="triton")`` must return bitwise the tensors and maxima of ``impl="torch"``
(:func:`convert_case`). The CLI also times both (CUDA events, median of 7 after 2 warm-ups) and
prints one line per length and a final ``RESULT`` line.
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
from megatron_mtraining.bench import structured_qkv  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "e2e_sparse.yaml")
FIELDS = ("block_count", "block_index", "column_count", "column_index")
SEQS = (8192, 65536, 131072)


def same_steps(new, ref) -> bool:
    """Every step's four index tensors equal (dtype, shape, values) and the same recorded maxima."""
    same = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
               for x, y in zip(new, ref) for a, b in ((getattr(x, f), getattr(y, f)) for f in FIELDS))
    return same and len(new) == len(ref) and all(
        (x.known_max.block, x.known_max.column) == (y.known_max.block, y.known_max.column) for x, y in zip(new, ref))


def convert_case(S: int, device="cuda", config=CONFIG, heads=(16, 2), head_dim=128):
    """Estimate the pattern of the structured inputs at length ``S`` and convert it with both
    implementations. Returns ``(row, pattern, layout)``; ``row["bitwise_equal"]`` is the check."""
    cfg = load_mtraining_config(config)
    layout, vs = cfg.make_layout(1), cfg.vertical_slash
    q, k, _ = structured_qkv(S, heads[0], heads[1], head_dim, torch.device(device), seed=S)
    with torch.no_grad():
        pat = estimate_vertical_slash(q, k, layout=layout, config=vs, softmax_scale=1 / math.sqrt(head_dim))
        ref = convert_pattern(pat, layout, 0, impl="torch")
        new = convert_pattern(pat, layout, 0, impl="triton")
    row = {"seq": S, "bitwise_equal": bool(same_steps(new, ref)),
           "widths": [ref[0].block_index.shape[-1], ref[0].column_index.shape[-1]]}
    return row, pat, layout


def main(argv=None) -> int:
    from tools.bench_estimator import _timer

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)))
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    timeit = _timer(dev)
    ok, rows = True, []
    for S in (int(x) for x in args.seqs.split(",")):
        row, pat, layout = convert_case(S, dev, args.config)
        ok &= row["bitwise_equal"]
        row["torch_s"] = timeit(lambda: convert_pattern(pat, layout, 0, impl="torch"), 2, 7)
        row["triton_s"] = timeit(lambda: convert_pattern(pat, layout, 0, impl="triton"), 2, 7)
        rows.append(row)
        print(f"S={S}: triton == torch {'bitwise' if row['bitwise_equal'] else 'DIFFER'} (widths {row['widths']}); "
              f"convert torch {row['torch_s'] * 1e3:.2f} ms, triton {row['triton_s'] * 1e3:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("RESULT " + json.dumps({"pass": bool(ok)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

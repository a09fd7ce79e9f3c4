"""GPU check of the Triton index conversion (patterns/triton/convert.py), run on the H200 through the device tool:

    python3 tests/workers/gpu_convert_check.py [--seqs 8192,65536,131072] [--json OUT]

Per sequence length (q ``[1, S, 16, 128]``, k ``[1, S, 2, 128]``, bf16, structured inputs of
``tools.bench_e2e.structured_qkv``, ``configs/e2e_sparse.yaml``, CP=1), on the estimated pattern:
``convert_pattern(impl="triton")`` must return bitwise the tensors and maxima of ``impl="torch"``;
both are timed (CUDA events, median of 7 after 2 warm-ups). Prints one line per length and a final
``RESULT`` line.
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
from tools.bench_e2e import structured_qkv  # noqa: E402
from tools.bench_estimator import _timer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIELDS = ("block_count", "block_index", "column_count", "column_index")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="8192,65536,131072")
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "e2e_sparse.yaml"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = load_mtraining_config(args.config)
    layout, vs = cfg.make_layout(1), cfg.vertical_slash
    dev = torch.device("cuda")
    timeit = _timer(dev)
    ok, rows = True, []
    for S in (int(x) for x in args.seqs.split(",")):
        q, k, _ = structured_qkv(S, 16, 2, 128, dev, seed=S)
        with torch.no_grad():
            pat = estimate_vertical_slash(q, k, layout=layout, config=vs, softmax_scale=1 / math.sqrt(128))
            ref = convert_pattern(pat, layout, 0, impl="torch")
            new = convert_pattern(pat, layout, 0, impl="triton")
        same = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                   for x, y in zip(new, ref) for a, b in ((getattr(x, f), getattr(y, f)) for f in FIELDS))
        same &= all((x.known_max.block, x.known_max.column) == (y.known_max.block, y.known_max.column)
                    for x, y in zip(new, ref))
        ok &= same
        t_torch = timeit(lambda: convert_pattern(pat, layout, 0, impl="torch"), 2, 7)
        t_triton = timeit(lambda: convert_pattern(pat, layout, 0, impl="triton"), 2, 7)
        rows.append({"seq": S, "bitwise_equal": bool(same), "torch_s": t_torch, "triton_s": t_triton,
                     "widths": [ref[0].block_index.shape[-1], ref[0].column_index.shape[-1]]})
        print(f"S={S}: triton == torch {'bitwise' if same else 'DIFFER'} (widths {rows[-1]['widths']}); "
              f"convert torch {t_torch * 1e3:.2f} ms, triton {t_triton * 1e3:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("RESULT " + json.dumps({"pass": bool(ok)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

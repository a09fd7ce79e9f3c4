#!/usr/bin/env python
"""Long-context extension of a converted checkpoint (SmolLM2-135M, 8K -> 32K) in resumable calls.

One call = one process running ``examples/pretrain_gpt.py``'s ``main`` (CP=1, one GPU) that stops
in time and saves, so a run of ``--train-iters`` iterations is split over several device calls of
at most 10 minutes each; every call continues exactly where the last one saved:

* ``--load``: the run's own ``--save`` directory once it holds a checkpoint, else ``--base`` (a
  ``release`` checkpoint: model weights only; optimizer, LR schedule and iteration start fresh,
  by design). A finished run (checkpoint iteration = ``--train-iters``) exits 0 at once.
* The *schedule* is the whole run's: ``--train-iters`` (the total) is passed unchanged on every
  call, so the data order (GPTDataset sizes: train_iters x global batch), the LR schedule
  (warm-up, cosine decay over ``--train-iters``) and the weight-decay schedule (megatron-core's
  scheduler refuses a checkpoint whose ``wd_incr_steps`` differ) are those of one uninterrupted
  run. On resume pretrain_gpt.py restores model, optimizer (Adam moments, fp32 main weights),
  scheduler and the iteration; the sample position is ``iteration x global batch``.
* ``pretrain_gpt.py``'s ``--exit-interval`` / ``--exit-duration-in-mins`` (Megatron-LM's flags)
  stop *after* the limit has passed; a device call has a hard wall-clock limit, so this driver
  stops *before* it (predicting the next iteration's time) by running pretrain_gpt.py's ``main``
  in-process with two wrappers: ``load_checkpoint``
  (records the start iteration) and ``forward_backward`` (after iteration ``i`` of this call it
  lowers ``args.train_iters`` to ``i`` -- only the loop bound; datasets, scheduler and LR were
  built with the total -- when ``--stop-iter`` is reached or when the time left in
  ``--time-budget-s`` would not cover another iteration plus ``--save-reserve-s``). The loop then
  ends and pretrain_gpt.py saves its normal checkpoint.

Modes (same seed, same data, same flags otherwise):

* ``dense``: ``--cp-attention mtraining`` without a config = ``ring_attention``'s CP=1 path
  (``scaled_dot_product_attention``, cuDNN/flash on GPU; the torch reference on CPU), as
  ``tools/bench_e2e.py`` does;
* ``mtraining``: ``--mtraining-config configs/long_context_r095.yaml`` (striped, CP=1,
  vertical-slash, recall 0.95): online pattern estimation + the Triton sparse kernels.

RoPE: **the base is raised** (ABF, "adjusted base frequency"; Xiong et al. 2023), not YaRN:
pretrain_gpt.py/megatron-core's GPTModel take ``--rotary-base`` but have no YaRN/NTK scaling flag,
and ABF + continued pretraining is what SmolLM2 itself did for its 2K -> 8K stage (base 1e4 ->
1e5: x10 for x4 length; Llama-2-Long, Code Llama, Qwen2.5 likewise). We repeat SmolLM2's own step:
``base(L) = 1e5 * 10 ** log4(L / 8192)`` rounded to 2 significant digits -> 32K: 1.0e6,
64K: 3.2e6 (the NTK-aware minimum ``1e5 * 4 ** (64/62)`` = 4.2e5 for 32K is meant for zero-shot
use; a larger base with training is the usual choice). ``--rotary-base`` overrides.

    python tools/extend_context.py --mode dense --seq 32768 --train-iters 120 --time-budget-s 450
    python tools/extend_context.py --mode mtraining --seq 32768 --train-iters 120 --time-budget-s 450
    python tools/extend_context.py --mode dense --dry-run          # print the command, run nothing

Outputs: ``--save-root/<mode>_<seq/1024>k/`` (checkpoints, ``metrics.jsonl`` appended by every call
-- a call killed before its save leaves rows that the next call repeats; keep the last row per
iteration -- and ``calls.jsonl``, one line per call: start/stop iteration, wall time).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = REPO / "examples" / "pretrain_gpt.py"
DEFAULT_CONFIG = "configs/long_context_r095.yaml"


def abf_rotary_base(seq: int, base: float = 1e5, trained: int = 8192) -> int:
    """SmolLM2's own 2K->8K step (x10 base for x4 length) applied to ``trained -> seq``, 2 significant digits."""
    b = base * 10 ** (math.log(seq / trained, 4))
    e = 10 ** (math.floor(math.log10(b)) - 1)
    return int(round(b / e) * e)


def tracker_iteration(d: Path) -> Optional[str]:
    t = d / "latest_checkpointed_iteration.txt"
    return t.read_text().strip() if t.is_file() else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=["dense", "mtraining"], required=True)
    p.add_argument("--seq", type=int, default=32768, help="training sequence length")
    p.add_argument("--train-iters", type=int, default=120, help="the whole run's iterations (same on every call)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--min-lr", type=float, default=5e-6)
    p.add_argument("--lr-warmup-iters", type=int, default=10)
    p.add_argument("--lr-decay-style", default="cosine")
    p.add_argument("--rotary-base", type=int, default=None, help="default: abf_rotary_base(--seq)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--base", default="checkpoints/smollm2_135m",
                   help="the converted release checkpoint (tools/convert_smollm2.py)")
    p.add_argument("--base-flags", default=None, help="model/tokenizer flags (default: BASE/pretrain_flags.txt)")
    p.add_argument("--data-prefix", default="data/long_context/train_text_document")
    p.add_argument("--mtraining-config", default=DEFAULT_CONFIG)
    p.add_argument("--save-root", default="checkpoints/long_context")
    p.add_argument("--save-interval", type=int, default=None, help="extra periodic saves (default: only at the end)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto", help="auto: bf16 on CUDA")
    p.add_argument("--stop-iter", type=int, default=None, help="stop this call after this iteration")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop in time to have saved within this many seconds of the process start")
    p.add_argument("--save-reserve-s", type=float, default=45.0, help="seconds kept for the final save")
    p.add_argument("--dry-run", action="store_true", help="print the pretrain_gpt.py command and exit")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    return p


def run_dir(a) -> Path:
    return Path(a.save_root) / f"{a.mode}_{a.seq // 1024}k"


def pretrain_argv(a, load: str, bf16: bool) -> list[str]:
    flags_file = Path(a.base_flags or Path(a.base) / "pretrain_flags.txt")
    base = shlex.split(flags_file.read_text())
    # drop the flags file's own --load / --rotary-base: this driver sets them
    out, skip = [], False
    for tok in base:
        if skip:
            skip = False
            continue
        if tok in ("--load", "--rotary-base", "--seq-length", "--max-position-embeddings"):
            skip = True
            continue
        out.append(tok)
    rd = run_dir(a)
    argv = out + [
        "--rotary-base", str(a.rotary_base or abf_rotary_base(a.seq)),
        "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq),
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--cp-attention", "mtraining",
        "--micro-batch-size", str(a.micro_batch_size), "--global-batch-size", str(a.global_batch_size),
        "--train-iters", str(a.train_iters), "--lr", str(a.lr), "--min-lr", str(a.min_lr),
        "--lr-warmup-iters", str(a.lr_warmup_iters), "--lr-decay-style", a.lr_decay_style,
        "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0", "--seed", str(a.seed),
        "--data-path", a.data_prefix, "--split", "100,0,0",
        "--eval-iters", "0", "--eval-interval", str(10 ** 9), "--log-interval", "1",
        "--load", load, "--save", str(rd), "--metrics-file", str(rd / "metrics.jsonl"),
    ]
    if a.save_interval:
        argv += ["--save-interval", str(a.save_interval)]
    if bf16:
        argv.append("--bf16")
    if a.mode == "mtraining":
        argv += ["--mtraining-config", a.mtraining_config]
    return argv + list(a.extra)


def _import_pretrain():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_for_extend", PRETRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_pretrain(argv: list[str], stop_iter: Optional[int], budget_s: Optional[float], reserve_s: float,
                 t_process: float) -> dict:
    """``pretrain_gpt.main(argv)`` stopping after ``stop_iter`` or before ``budget_s`` runs out."""
    mod = _import_pretrain()
    st = {"start": 0, "n": 0, "last_t": None, "last_dt": None, "stopped_at": None, "reason": None}
    orig_load, orig_fb = mod.load_checkpoint, mod.forward_backward

    def load_checkpoint(args, *a, **k):
        st["start"] = orig_load(args, *a, **k)
        return st["start"]

    def forward_backward(args, model, optimizer, micro, device, train):
        if not train:
            return orig_fb(args, model, optimizer, micro, device, train)
        now = time.time()
        if st["last_t"] is not None:
            st["last_dt"] = now - st["last_t"]       # one whole iteration (fwd, bwd, optimizer, logging)
        st["last_t"] = now
        st["n"] += 1
        it = st["start"] + st["n"]
        out = orig_fb(args, model, optimizer, micro, device, train)
        reason = None
        if stop_iter is not None and it >= stop_iter:
            reason = f"--stop-iter {stop_iter}"
        elif budget_s is not None:
            per_iter = st["last_dt"] if st["last_dt"] is not None else 2.0 * (time.time() - now)
            if time.time() - t_process + 1.5 * per_iter + reserve_s > budget_s:
                reason = f"time budget {budget_s:.0f} s (elapsed {time.time() - t_process:.0f} s, {per_iter:.1f} s/it)"
        if reason and it < args.train_iters:
            args.train_iters = it                     # loop bound only: schedules were built with the total
            st["stopped_at"], st["reason"] = it, reason
            print(f" > extend_context: stopping after iteration {it} ({reason}); saving", flush=True)
        return out

    mod.load_checkpoint, mod.forward_backward = load_checkpoint, forward_backward
    rc = mod.main(argv)
    return {"rc": rc, "start_iteration": st["start"], "iterations_run": st["n"],
            "end_iteration": st["start"] + st["n"], "stop_reason": st["reason"]}


def main(argv: Optional[list[str]] = None) -> int:
    t_process = time.time()
    a = build_parser().parse_args(argv)
    rd = run_dir(a)
    done = tracker_iteration(rd)
    if done is not None and done != "release" and int(done) >= a.train_iters:
        print(f" > extend_context: {rd} is finished (iteration {done} of {a.train_iters}); nothing to do")
        return 0
    load = str(rd) if done is not None else a.base
    # before torch is imported: fragmentation at long sequences (docs/benchmarks.md, 256K e2e OOM)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if a.precision == "auto":
        import torch

        bf16 = torch.cuda.is_available()
    else:
        bf16 = a.precision == "bf16"
    pargv = pretrain_argv(a, load, bf16)
    print(" > extend_context: " + ("resuming " + str(rd) + f" at iteration {done}" if done is not None
                                   else f"first call: --load {a.base} (release: fresh optimizer/schedule)"))
    print("python examples/pretrain_gpt.py " + shlex.join(pargv), flush=True)
    if a.dry_run:
        return 0
    rd.mkdir(parents=True, exist_ok=True)
    res = run_pretrain(pargv, a.stop_iter, a.time_budget_s, a.save_reserve_s, t_process)
    res.update(mode=a.mode, seq=a.seq, train_iters=a.train_iters, wall_s=round(time.time() - t_process, 1),
               checkpoint=tracker_iteration(rd))
    with open(rd / "calls.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    print(" > extend_context: " + json.dumps(res), flush=True)
    return int(res["rc"] or 0)


if __name__ == "__main__":
    sys.exit(main())

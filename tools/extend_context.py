#!/usr/bin/env python
"""Long-context extension of a converted checkpoint (SmolLM2-135M, 8K -> 32K) in resumable calls.

One call = one process running the trainer (:func:`megatron_mtraining.training.main`, the code of
``examples/pretrain_gpt.py``; CP=1, one GPU) that stops in time and saves, so a run of
``--train-iters`` iterations is split over several calls of bounded wall time; every call
continues exactly where the last one saved:

* ``--load``: the run's own ``--save`` directory once it holds a checkpoint, else ``--base`` (a
  ``release`` checkpoint: model weights only; optimizer, LR schedule and iteration start fresh,
  by design). A finished run (checkpoint iteration = ``--train-iters``) exits 0 at once.
* The *schedule* is the whole run's: ``--train-iters`` (the total) is passed unchanged on every
  call, so the data order (GPTDataset sizes: train_iters x global batch), the LR schedule
  (warm-up, cosine decay over ``--train-iters``) and the weight-decay schedule (megatron-core's
  scheduler refuses a checkpoint whose ``wd_incr_steps`` differ) are those of one uninterrupted
  run. On resume the trainer restores model, optimizer (Adam moments, fp32 main weights),
  scheduler and the iteration; the sample position is ``iteration x global batch``.
* The trainer's ``--exit-interval`` / ``--exit-duration-in-mins`` (Megatron-LM's flags) stop
  *after* the limit has passed; a call with a hard wall-clock limit must stop *before* it, so this
  driver passes a stop hook (:class:`megatron_mtraining.training.TrainHooks`): after iteration
  ``i`` it ends the call when ``--stop-iter`` is reached or when the time left in
  ``--time-budget-s`` would not cover another iteration plus ``--save-reserve-s`` (predicted from
  the last iteration's wall time). The trainer then saves its normal checkpoint.

Modes (same seed, same data, same flags otherwise):

* ``dense``: ``--cp-attention mtraining`` without a config = ``ring_attention``'s CP=1 path
  (``scaled_dot_product_attention``, cuDNN/flash on GPU; the torch reference on CPU), as
  ``tools/bench_e2e.py`` does;
* ``mtraining``: ``--mtraining-config configs/long_context_r095.yaml`` (striped, CP=1,
  vertical-slash, recall 0.95): online pattern estimation + the Triton sparse kernels.

RoPE: **the base is raised** (ABF, "adjusted base frequency"; Xiong et al. 2023), not YaRN:
the trainer/megatron-core's GPTModel take ``--rotary-base`` but have no YaRN/NTK scaling flag,
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
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
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


def run_pretrain(argv: list[str], stop_iter: Optional[int], budget_s: Optional[float], reserve_s: float,
                 t_process: float) -> dict:
    """The trainer's ``run(argv)`` stopping after ``stop_iter`` or before ``budget_s`` runs out."""
    from megatron_mtraining.training import IterationInfo, TrainHooks, run

    st = {"last_t": None}

    def should_stop(info: IterationInfo) -> Optional[str]:
        now = time.time()
        # one whole iteration as seen from here (data, step, logging, checkpointing); the first
        # iteration's own time, doubled, before a second one has been seen
        per_iter = now - st["last_t"] if st["last_t"] is not None else 2.0 * info.time_s
        st["last_t"] = now
        if stop_iter is not None and info.iteration >= stop_iter:
            return f"--stop-iter {stop_iter}"
        if budget_s is not None and now - t_process + 1.5 * per_iter + reserve_s > budget_s:
            return f"time budget {budget_s:.0f} s (elapsed {now - t_process:.0f} s, {per_iter:.1f} s/it)"
        return None

    res = run(argv, TrainHooks(should_stop=should_stop))
    return {"rc": 0, "start_iteration": res.start_iteration, "iterations_run": res.end_iteration - res.start_iteration,
            "end_iteration": res.end_iteration, "stop_reason": res.stop_reason}


def main(argv: Optional[list[str]] = None) -> int:
    t_process = time.time()
    parser = build_parser()
    a = parser.parse_args(argv)
    rd = run_dir(a)
    done = tracker_iteration(rd)
    if done is not None and done != "release" and int(done) >= a.train_iters:
        print(f" > extend_context: {rd} is finished (iteration {done} of {a.train_iters}); nothing to do")
        return 0
    flags_file = Path(a.base_flags or Path(a.base) / "pretrain_flags.txt")
    if a.base_flags and not flags_file.is_file():
        parser.error(f"--base-flags {a.base_flags}: not a file")
    if not flags_file.is_file():
        parser.error(f"--base {a.base}: no pretrain_flags.txt there; convert the model first "
                     f"(python tools/convert_smollm2.py --gguf GGUF --out {a.base}) or give --base-flags")
    load = str(rd) if done is not None else a.base
    # before torch is imported: fragmentation at long sequences (an out-of-memory at 256K end to end without it)
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

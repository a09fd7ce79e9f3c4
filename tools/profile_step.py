#!/usr/bin/env python3
"""Where one training iteration's time goes: dense vs MTraining attention, by region, with host syncs.

For each mode (``dense``: ``--cp-attention mtraining`` without a config, the CP=1 fast path;
``mtraining``: with ``--mtraining-config``), in its own process: the example trainer's model and
optimizer (:mod:`megatron_mtraining.training`: the same ``GPTModel``, CP plan, batch split,
``forward_backward`` with the exact per-token loss, ``finalize_model_grads``, optimizer and LR
step) on synthetic tokens (uniform random ids below ``--vocab-size``; no tokenizer or data files;
``--load`` loads real weights, whose attention patterns are the model's own). Then:

1. ``--warmup`` iterations (compilation, caches, the per-signature input checks);
2. ``--timed`` iterations without the profiler: the median iteration wall time (``step_s``);
3. ``--active`` iterations under ``torch.profiler`` (CPU + CUDA activities), summed by region
   (:mod:`megatron_mtraining.bench.profile`): estimator scores / selection, index conversion,
   kernel plans, attention forward / backward, q/k/v and output copies, LM head + loss, optimizer,
   other; device and host ms per iteration and the host synchronisations (CUDA runtime
   ``cuda*Synchronize`` / blocking ``cudaMemcpy`` calls) with their wall time. On the CPU there are
   no device syncs: the counts are ``n/a``.

Output: a JSON result record (``--json``, :func:`megatron_mtraining.bench.result_record`) and a
markdown table (stdout and ``--markdown``); ``--trace-dir`` also keeps each mode's Chrome trace. On
CUDA each mode also records ``kernels``: the ``--kernels`` device kernels with the most time per
iteration, summed by name over the exported trace
(:func:`~megatron_mtraining.bench.profile.trace_kernel_rows`), whoever launched them: the region sums
charge a kernel to the CPU event that launched it, and some launches (among them the sparse
attention's Triton kernels) are charged to ``other``. ``region_kernels`` charges every kernel of the
trace to the region open around its launch call, Triton's included
(:func:`~megatron_mtraining.bench.profile.trace_region_kernels`), and ``overhead`` sums them into the
pattern's overhead: estimation + conversion + plans, in ms per iteration and as a share of the
attention kernels' device time (:func:`~megatron_mtraining.bench.profile.overhead_share`).

    # SmolLM2-135M shape, 32K, 8 micro-batches per iteration, one H200
    python tools/profile_step.py --shape smollm2-135m --seq-length 32768 --global-batch-size 8 \\
        --mtraining-config configs/long_context_r098.yaml --json profile_32k.json --markdown profile_32k.md
    python tools/profile_step.py --shape tiny --seq-length 512 --warmup 1 --timed 1 --active 1   # CPU
    python tools/profile_step.py ... -- --recompute-granularity full ...    # more pretrain_gpt.py flags
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from megatron_mtraining.bench.cli import positive_int
from megatron_mtraining.bench.inputs import QWEN25_3B_LAYER_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: model flags of the shapes (``examples/pretrain_gpt.py`` / Megatron-LM names) and their vocabulary
SHAPES = {
    # SmolLM2-135M (tools/convert_smollm2.py): 30 layers, hidden 576, 9 query / 3 KV heads of 64, tied embeddings
    "smollm2-135m": (["--num-layers", "30", "--hidden-size", "576", "--ffn-hidden-size", "1536",
                      "--num-attention-heads", "9", "--group-query-attention", "--num-query-groups", "3",
                      "--kv-channels", "64", "--position-embedding-type", "rope", "--rotary-base", "1000000",
                      "--normalization", "RMSNorm", "--norm-epsilon", "1e-05", "--swiglu", "--disable-bias-linear",
                      "--make-vocab-size-divisible-by", "128"], 49152),
    # the Qwen2.5-3B-shaped layers of tools/bench_e2e.py, 4 layers (16 query / 2 KV heads of 128, untied), the
    # Mistral v1 vocabulary that tool's data uses
    "qwen2.5-3b-4l": (["--num-layers", "4", *QWEN25_3B_LAYER_FLAGS], 32000),
    # a CPU-sized GQA model (the test's)
    "tiny": (["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
              "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "rope",
              "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"], 256),
}
MODES = ("dense", "mtraining")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m", help="model flags preset")
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="token ids drawn below this (default: the shape's)")
    p.add_argument("--seq-length", type=int, default=32768)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=8, help="micro-batches per iteration x micro-batch size")
    p.add_argument("--modes", default="dense,mtraining")
    p.add_argument("--mtraining-config", default=os.path.join(REPO, "configs", "long_context_r098.yaml"))
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto", help="auto: bf16 on CUDA")
    p.add_argument("--warmup", type=int, default=2, help="iterations before measuring")
    p.add_argument("--timed", type=int, default=3, help="unprofiled iterations (median wall time)")
    p.add_argument("--active", type=int, default=1, help="profiled iterations")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="result record")
    p.add_argument("--markdown", default=None, help="the table as a markdown file")
    p.add_argument("--trace-dir", default=None, help="keep each mode's Chrome trace here")
    p.add_argument("--kernels", type=int, default=25,
                   help="on CUDA: record (and print) the N device kernels with the most time per iteration")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per mode")
    p.add_argument("--one-mode", choices=MODES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py flags (after --)")
    return p


def trainer_argv(a, mode: str) -> list[str]:
    """The ``pretrain_gpt.py`` flags of one mode (no data or tokenizer flags: the tokens are synthetic)."""
    flags, _ = SHAPES[a.shape]
    iters = a.warmup + a.timed + a.active
    argv = [*flags, "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
            "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
            "--cp-attention", "mtraining", "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.global_batch_size), "--train-iters", str(iters), "--lr", "1e-5",
            "--min-lr", "0", "--lr-warmup-iters", "0", "--clip-grad", "1.0", "--seed", str(a.seed),
            "--attention-dropout", "0", "--hidden-dropout", "0", "--split", "100,0,0", "--eval-iters", "0",
            "--log-interval", "1"]
    if mode == "mtraining":
        argv += ["--mtraining-config", a.mtraining_config]
    return argv + list(a.extra)


def _unwrap(model):
    m = model
    while hasattr(m, "module") and not hasattr(m, "output_layer"):
        m = m.module
    return m


def _label(obj, attr: str, region: str) -> None:
    """Run ``obj.attr`` (an instance attribute or method) inside ``record_function(region)``."""
    from torch.profiler import record_function

    fn = getattr(obj, attr)

    def wrapped(*args, **kwargs):
        with record_function(region):
            return fn(*args, **kwargs)

    setattr(obj, attr, wrapped)


def synthetic_batches(n: int, mbs: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """``n`` micro-batches of uniform random token ids (the dataset's keys: tokens, labels, loss_mask,
    position_ids; ``[mbs, seq]`` each)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
        out.append({"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
                    "loss_mask": torch.ones(mbs, seq), "position_ids": torch.arange(seq).expand(mbs, seq).contiguous()})
    return out


def run_one(a, mode: str) -> dict:
    """Build the trainer's model for ``mode``, run and profile it; returns the mode's result."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from megatron_mtraining.bench.profile import (FLUSH, overhead_share, region_rows, summarize, trace_kernel_rows,
                                                  trace_region_kernels)
    from megatron_mtraining.common import REGION_LM_HEAD_LOSS, REGION_OPTIMIZER
    from megatron_mtraining.megatron.args import build_parser as trainer_parser, validate_args
    from megatron_mtraining.training.build import (build_model, build_optimizer, build_plan, padded_vocab_size,
                                                   transformer_config)
    from megatron_mtraining.training.data import CPBatchSplit
    from megatron_mtraining.training.runtime import init_distributed
    from megatron_mtraining.training.step import forward_backward

    argv = trainer_argv(a, mode)
    cuda = torch.cuda.is_available()
    if a.precision == "bf16" or (a.precision == "auto" and cuda):
        argv.append("--bf16")
    args = trainer_parser().parse_args(argv)
    validate_args(args, check_files=False)
    device = init_distributed(args)

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_seed

    apply_cpu_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=args.context_parallel_size,
                                 hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
                                 distributed_timeout_minutes=args.distributed_timeout_minutes)
    cpu_seed(args.seed)
    vocab_ids = a.vocab_size or SHAPES[a.shape][1]
    vocab = padded_vocab_size(vocab_ids, args)
    args.padded_vocab_size = vocab
    plan = build_plan(args)
    config = transformer_config(args)
    torch.manual_seed(args.seed)
    model = build_model(args, config, vocab, device, plan=plan)
    if args.load:          # weights only, before the optimizer copies them (fp32 main weights)
        from megatron_mtraining.training.checkpoint import load_model_weights

        load_model_weights(args.load, model, args.ckpt_format, plan=plan)
    model, optimizer, scheduler = build_optimizer(args, config, model)
    gpt = _unwrap(model)
    _label(gpt.output_layer, "forward", REGION_LM_HEAD_LOSS)
    _label(gpt, "compute_language_model_loss", REGION_LM_HEAD_LOSS)
    split = CPBatchSplit(args, plan, device)
    micro = synthetic_batches(args.num_microbatches, args.micro_batch_size, args.seq_length, vocab_ids, a.seed)
    gbs = args.global_batch_size

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def iteration():
        with record_function(REGION_OPTIMIZER):
            model.zero_grad_buffer()
            optimizer.zero_grad()
        loss_sum, n_tok = forward_backward(model, optimizer, micro, split, device, train=True)
        with record_function(REGION_OPTIMIZER):
            finalize_model_grads([model])
            ok, _, _ = optimizer.step()
            if ok:
                scheduler.step(increment=gbs)
        return loss_sum, n_tok

    model.train()
    for _ in range(a.warmup):
        iteration()
    sync()
    if plan is not None:
        plan.track_kept_fraction()
        plan.take_kept_fraction()             # the timed iterations' kept work only
    times, kept = [], []
    for _ in range(a.timed):
        t0 = time.perf_counter()
        loss_sum, n_tok = iteration()
        sync()
        times.append(time.perf_counter() - t0)
        kept.append(plan.take_kept_fraction() if plan is not None else None)   # after the timing: not timed
    kept = ({k: statistics.mean(x[k] for x in kept) for k in ("mean", "min", "max")} | {"layers": kept[0]["layers"]}
            if kept and all(kept) else None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(a.active):
            loss_sum, n_tok = iteration()
        with record_function(FLUSH):       # left out of the sums
            sync()
    prof_wall = (time.perf_counter() - t0) / max(1, a.active)
    rank = dist.get_rank()
    kernels = region_kernels = None
    if rank == 0 and (a.trace_dir or cuda):
        trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="profile_trace_")
        os.makedirs(trace_dir, exist_ok=True)
        trace = os.path.join(trace_dir, f"trace_{mode}_{a.seq_length}.json")
        prof.export_chrome_trace(trace)
        if cuda:            # device time per kernel name, whoever launched it (regions miss some launches)
            kernels = trace_kernel_rows(trace, iterations=a.active, top=a.kernels)
            region_kernels = trace_region_kernels(trace, iterations=a.active)
        if not a.trace_dir:
            shutil.rmtree(trace_dir, ignore_errors=True)
    rows = region_rows(prof.events(), iterations=a.active)
    layer_calls = args.num_layers * args.num_microbatches
    res = summarize(rows, device.type, layer_calls, statistics.median(times) if times else None)
    res.update(mode=mode, argv=argv, all_step_s=times, profiled_step_s=prof_wall,
               lm_loss=float(loss_sum / n_tok.clamp(min=1)), micro_batches=args.num_microbatches,
               num_layers=args.num_layers, seq_length=args.seq_length,
               max_memory_allocated=torch.cuda.max_memory_allocated() if cuda else None,
               max_memory_reserved=torch.cuda.max_memory_reserved() if cuda else None,
               memory_outside_torch=_memory_outside_torch() if cuda else None,
               mtraining_config=a.mtraining_config if mode == "mtraining" else None, kernels=kernels,
               region_kernels=region_kernels,
               overhead=overhead_share(region_kernels) if region_kernels is not None else None,
               attention_kept=kept)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return res


def _memory_outside_torch() -> int:
    """Bytes in use on the GPU beyond what torch's caching allocator holds (CUDA context, kernel modules and their
    local memory, library workspaces; other processes on the GPU count too), now."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    for name in ("warmup", "timed", "active"):
        if getattr(a, name) < (1 if name == "active" else 0):
            ap.error(f"--{name} must be >= {1 if name == 'active' else 0}")
    if a.one_mode:
        res = run_one(a, a.one_mode)
        if a.out:
            from megatron_mtraining.bench import write_json

            if int(os.environ.get("RANK", "0")) == 0:
                write_json(a.out, res)
        return 0

    from megatron_mtraining.bench import result_record, write_json
    from megatron_mtraining.bench.profile import markdown_table

    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (dense, mtraining)")
    if not modes:
        ap.error(f"--modes {a.modes!r}: no mode to run (dense, mtraining)")
    if "mtraining" in modes and (a.seq_length < 64 or a.seq_length % 64):
        ap.error(f"--seq-length must be a positive multiple of 64 for the mtraining mode (64-token blocks), "
                 f"got {a.seq_length}")
    if a.micro_batch_size < 1 or a.global_batch_size < 1 or a.global_batch_size % a.micro_batch_size:
        ap.error(f"--global-batch-size {a.global_batch_size} must be a positive multiple of --micro-batch-size "
                 f"{a.micro_batch_size}")
    if not a.run_timeout > 0:
        ap.error(f"--run-timeout must be > 0 seconds, got {a.run_timeout}")
    runs, errors = {}, {}
    tmp = tempfile.mkdtemp(prefix="profile_step_")
    for m in modes:
        out = os.path.join(tmp, f"{m}.json")
        cmd = [sys.executable, os.path.abspath(__file__), *_own_flags(a), "--one-mode", m, "--out", out,
               "--", *a.extra]
        print("+ " + " ".join(cmd), flush=True)
        try:
            p = subprocess.run(cmd, cwd=REPO, timeout=a.run_timeout, capture_output=True, text=True)
            rc, log = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired:
            rc, log = "timeout", ""
        if rc == 0 and os.path.exists(out):
            with open(out) as f:
                runs[m] = json.load(f)
        else:
            errors[m] = {"rc": rc, "log_tail": "\n".join(log.strip().splitlines()[-15:])}
            print(f"{m}: failed ({rc})\n{errors[m]['log_tail']}", flush=True)
    table = markdown_table(runs) if runs else ""
    for m, r in runs.items():
        if r.get("kernels"):
            table += f"\n\n| {m}: kernel | device ms per iteration | calls per iteration |\n|---|---|---|\n" + "\n".join(
                f"| `{k['kernel'][:90]}` | {k['device_ms']:.2f} | {k['calls']:g} |" for k in r["kernels"]) + "\n"
    print(table, flush=True)
    if a.json:
        write_json(a.json, result_record({"config": {k: v for k, v in vars(a).items() if k not in ("one_mode", "out")},
                                          "runs": runs, "errors": errors, "table": table}, tool="profile_step"))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(table)
    return 0 if not errors else 1


def _own_flags(a) -> list[str]:
    """The tool's flags of ``a`` for the per-mode subprocess."""
    out = ["--shape", a.shape, "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
           "--global-batch-size", str(a.global_batch_size), "--mtraining-config", a.mtraining_config,
           "--precision", a.precision, "--warmup", str(a.warmup), "--timed", str(a.timed), "--active", str(a.active),
           "--seed", str(a.seed), "--kernels", str(a.kernels)]
    if a.vocab_size:
        out += ["--vocab-size", str(a.vocab_size)]
    if a.trace_dir:
        out += ["--trace-dir", a.trace_dir]
    return out


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark the LM-head loss (output matmul + per-token cross entropy, forward + backward) on one GPU.

    python tools/bench_lm_loss.py --tokens 32768,65536,131072 --hidden 576 --vocab 49152 --json out.json

Rows, all in one process, on the same inputs (bf16 unless ``--dtype fp32``; hidden ``[s, 1, h]``,
weight ``[V, h]``, random labels, an upstream gradient of ``1/s`` per token as the trainer's per-token
mean gives):

* ``megatron``: :func:`megatron_mtraining.megatron.lm_loss.chunked_lm_loss` with the trainer's
  ``--cross-entropy-chunk-tokens auto`` chunk (megatron-core's ``vocab_parallel_cross_entropy``, each
  chunk's logits recomputed in the backward); only where ``auto`` chunks (elsewhere the trainer runs the unchunked loss below);
* ``megatron_unchunked``: the output matmul and megatron-core's ``vocab_parallel_cross_entropy`` over
  every token at once (megatron-core's own LM-head loss), where ``--max-logits-gib`` allows;
* ``liger``: :func:`megatron_mtraining.megatron.lm_loss.fused_lm_loss` (``--lm-loss liger``).

Per row: the median forward + backward time (:func:`megatron_mtraining.bench.measure`), the peak
memory above the inputs (``torch.cuda.max_memory_allocated``, GiB) and the relative error of the loss
and of the hidden and weight gradients against the first row.
"""
from __future__ import annotations

import argparse
import os

import torch

from megatron_mtraining.bench import measure, result_record, write_json
from megatron_mtraining.bench.cli import check_output_dir, checked_device, int_list, positive_float, positive_int
from megatron_mtraining.common import free_local_port

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _init_megatron(device):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{free_local_port()}", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def loss_impls(s: int, vocab: int, max_logits_gib: float):
    """``{name: fn(hidden, weight, labels) -> [b, s] loss}`` of the rows measured at ``s`` tokens."""
    from megatron.core import tensor_parallel

    from megatron_mtraining.megatron.lm_loss import auto_chunk_tokens, chunked_lm_loss, fused_lm_loss

    chunk = auto_chunk_tokens(s, 1, vocab)
    impls = {}
    if chunk:
        impls["megatron"] = lambda h, w, y: chunked_lm_loss(h, w, y, chunk)
    if s * vocab * 4 <= max_logits_gib * 2 ** 30:
        impls["megatron_unchunked"] = lambda h, w, y: tensor_parallel.vocab_parallel_cross_entropy(
            torch.matmul(h, w.t()), y.transpose(0, 1).contiguous()).transpose(0, 1)
    impls["liger"] = fused_lm_loss
    return impls, chunk


def bench(args) -> list[dict]:
    device = args.device
    dtype = DTYPES[args.dtype]
    cuda = device.type == "cuda"
    if cuda and device.index is not None:
        torch.cuda.set_device(device)
    _init_megatron(device)
    rows = []
    for s in args.tokens:
        g = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(s, 1, args.hidden, device=device, generator=g).to(dtype)
        weight = (args.hidden ** -0.5 * torch.randn(args.vocab, args.hidden, device=device, generator=g)).to(dtype)
        labels = torch.randint(0, args.vocab, (1, s), device=device, generator=g)
        grad = torch.full((1, s), 1.0 / s, device=device)
        impls, chunk = loss_impls(s, args.vocab, args.max_logits_gib)
        first = None
        for name, fn in impls.items():
            h = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()

            def step():
                h.grad = w.grad = None
                loss = fn(h, w, labels)
                (loss * grad).sum().backward()
                return loss

            loss = step().detach()
            got = (loss, h.grad.detach().clone(), w.grad.detach().clone())
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t = measure(step, device=device, budget_s=args.budget, warmup=1, long_call_ms=500)
            peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 30 if cuda else None
            row = {"tokens": s, "hidden": args.hidden, "vocab": args.vocab, "impl": name,
                   "chunk_tokens": chunk if name == "megatron" else None, "fwd_bwd_ms": t.median_ms,
                   "timing": t.to_dict(), "peak_gib_above_inputs": peak}
            if first is None:
                first = (name, got)
            else:
                row["rel_err_vs"] = first[0]
                row.update({f"rel_err_{k}": _rel(a, b) for k, a, b in zip(("loss", "d_hidden", "d_weight"), got,
                                                                          first[1])})
            rows.append(row)
            print(f"s={s:7d} h={args.hidden} V={args.vocab} {name:19s} {t.median_ms:9.2f} ms  "
                  f"peak {peak if peak is None else round(peak, 2)} GiB"
                  + ("" if "rel_err_loss" not in row else
                     f"  rel err vs {row['rel_err_vs']}: loss {row['rel_err_loss']:.1e}"
                     f" dh {row['rel_err_d_hidden']:.1e}"
                     f" dw {row['rel_err_d_weight']:.1e}"), flush=True)
            del h, w, got, loss
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int_list(), default=[32768, 65536, 131072], help="sequence lengths (batch 1)")
    p.add_argument("--hidden", type=positive_int, default=576, help="hidden size (SmolLM2-135M: 576)")
    p.add_argument("--vocab", type=positive_int, default=49152, help="padded vocabulary (SmolLM2-135M: 49152)")
    p.add_argument("--max-logits-gib", type=positive_float, default=40.0,
                   help="run megatron_unchunked only where the fp32 logits take at most this")
    p.add_argument("--budget", type=positive_float, default=2.0, help="seconds of timed calls per row")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda, or cpu (Liger-Kernel's kernels need TRITON_INTERPRET=1 there; small sizes only)")
    p.add_argument("--json", default=None, help="result record")
    args = p.parse_args(argv)
    args.device = checked_device(p, args.device)
    check_output_dir(p, "--json", args.json)
    from megatron_mtraining.megatron.lm_loss import liger_problem

    problem = liger_problem(args.device, what="the liger row (the fused loss)")
    if problem:
        p.error(f"--device {args.device}: {problem}")
    rows = bench(args)
    if args.json:
        write_json(args.json, result_record({"config": {**vars(args), "device": str(args.device)}, "rows": rows},
                                            device=args.device, tool="bench_lm_loss"))
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()

"""Apple's cut-cross-entropy 25.1.1 (``linear_cross_entropy``, reduction "none") on the inputs of
tools/bench_lm_loss.py, with the same timer, against ``fused_lm_loss`` (Liger-Kernel) in the same
process: exact gradients (filter_eps=None) and CCE's default gradient filter ("high").

    python docs/results/raw/lm_loss/cce_rows.py --tokens 65536,131072 --hidden 576 --vocab 49152
"""
import argparse

import torch
from cut_cross_entropy import linear_cross_entropy

from megatron_mtraining.bench import measure
from megatron_mtraining.megatron.lm_loss import fused_lm_loss

p = argparse.ArgumentParser()
p.add_argument("--tokens", default="65536,131072")
p.add_argument("--hidden", type=int, default=576)
p.add_argument("--vocab", type=int, default=49152)
a = p.parse_args()


def rel(x, y):
    return float((x.double() - y.double()).norm() / y.double().norm())


for s in [int(t) for t in a.tokens.split(",")]:
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(s, 1, a.hidden, device="cuda", generator=g).bfloat16()
    weight = (a.hidden ** -0.5 * torch.randn(a.vocab, a.hidden, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, a.vocab, (1, s), device="cuda", generator=g)
    grad = torch.full((1, s), 1.0 / s, device="cuda")
    impls = {
        "liger": lambda h, w: fused_lm_loss(h, w, labels),
        "cce_exact": lambda h, w: linear_cross_entropy(h.transpose(0, 1), w, labels, reduction="none",
                                                       filter_eps=None),
        "cce_filter_high": lambda h, w: linear_cross_entropy(h.transpose(0, 1), w, labels, reduction="none",
                                                             filter_eps="high"),
    }
    ref = None
    for name, fn in impls.items():
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()

        def step():
            h.grad = w.grad = None
            loss = fn(h, w)
            (loss.float() * grad).sum().backward()
            return loss

        loss = step().detach().float()
        got = (loss, h.grad.clone(), w.grad.clone())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = measure(step, budget_s=2.0, warmup=1, long_call_ms=500)
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
        err = "" if ref is None else "  rel err vs liger: loss %.1e dh %.1e dw %.1e" % tuple(
            rel(x, y) for x, y in zip(got, ref))
        ref = ref or got
        print(f"s={s:7d} h={a.hidden} V={a.vocab} {name:19s} {t.median_ms:9.2f} ms  peak {peak:.2f} GiB{err}",
              flush=True)

"""GPU accuracy check of the Triton dense ring with packed documents (THD): the cases, the check, a CLI.

    pytest -m gpu tests/kernels/test_gpu_packed.py                # one test per case
    python tests/workers/gpu_packed_check.py --json OUT.json      # the same cases as one JSON report

A CP ring of ``cp`` ranks is simulated on one device (tests/helpers/ring_sim.py: every rank's steps
of :class:`~megatron_mtraining.ops.dense_gpu.DenseGpuStepKernel` with the documents, the fp32 LSE
merge, the backward with the merged out/LSE). Oracle: every document attended alone in fp64
(its own causal attention, placed at its slot; padding rows zero, LSE ``-inf``). Criterion, for
out, LSE, dQ, dK, dV separately: ``err(ours) <= 2 * err(bf16 torch reference)``, the bf16
reference being the same per-document attention in bf16 torch ops. Padding tokens (past
``cu_seqlens`` in a padded slot, or past the last document) must give exact zeros in out, dQ, dK
and dV; no NaN anywhere (the allocator is filled with NaN before each run).

:func:`run_ring_case` checks the one-rank cases (:data:`RING_CASES`) through ``ring_attention``
itself (its autograd function and the backend's delta kernel; ``kernel_backend: auto``, as a run
with documents chooses). Cases (:data:`CASES`): documents of length 1, lengths not divisible by 64, documents straddling
stripes, padded slots and trailing padding, GQA, striped cp 1/2/4 and zigzag cp 2, bf16 and fp16.
:data:`SMOKE_CASES`: tiny fp16 cases for the CPU under ``TRITON_INTERPRET=1`` (the interpreter has
no bf16 arithmetic).

:func:`run_fa4_varlen_case` checks FlashAttention-4's varlen interface at CP=1 (:data:`FA4_VARLEN_CASES`:
``kernel_backend='fa4'`` with documents, through ``ring_attention``; LSE from
``fa4_varlen_attention``), with the same oracle, reference, criterion and padding checks.

:func:`run_sparse_case` checks the vertical-slash sparse ring over the documents
(:data:`SPARSE_CASES`): the pattern estimated on the whole sequence with the documents, each rank's
steps converted and restricted to the documents, run by the Triton sparse step kernels with their
document mask (the ring simulated as above). Oracle: masked attention in fp64 under (pattern) ∧
causal ∧ same document; the bf16 reference is the same masked attention in bf16 torch ops; same
criterion, padding and NaN checks. :data:`SPARSE_SMOKE_CASES`: tiny fp16 cases for the CPU
interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron_mtraining.layout import Layout, PackedDocuments  # noqa: E402
from megatron_mtraining.ops.dense_gpu import DenseGpuStepKernel  # noqa: E402
from tests.helpers.ring_sim import simulate_dense_ring  # noqa: E402
from tests.workers.gpu_common import bf16_reference, oracle, rel_err  # noqa: E402

NAMES = ("out", "lse", "dq", "dk", "dv")
bf16, fp16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Case:
    """``layout``: ``(kind, cp_size, granularity)``; ``lengths``: real tokens per document; ``slots``:
    each document's padded slot (``None``: contiguous); tokens past the last slot are padding."""

    id: str
    layout: tuple
    seq: int
    lengths: tuple
    slots: tuple = None
    hq: int = 8
    hkv: int = 2
    d: int = 128
    dtype: torch.dtype = bf16
    seed: int = 0
    batch: int = 1
    extra: dict = field(default_factory=dict)


def offsets(case: Case) -> tuple[list, list]:
    """``(cu_seqlens, cu_seqlens_padded)`` of a case (THD offsets over the batch rows)."""
    cu, pad = [0], [0]
    for i, n in enumerate(case.lengths):
        cu.append(cu[-1] + n)
        pad.append(pad[-1] + (n if case.slots is None else case.slots[i]))
    return cu, pad


# lengths: 1, odd, not multiples of 64, long ones straddling many 64-token stripes
_MIXED_8K = (1, 63, 65, 1000, 1, 2049, 3, 129, 4881)                     # sums to 8192
_PADDED_8K = ((1, 700, 64, 3000, 1, 999), (64, 768, 64, 3072, 64, 1024))   # slots sum to 5056: rest is padding

CASES = (
    Case("packed-cp1-mixed-8k", ("striped", 1, 64), 8192, _MIXED_8K),
    Case("packed-striped-cp2-mixed-8k", ("striped", 2, 64), 8192, _MIXED_8K, seed=1),
    Case("packed-striped-cp4-mixed-8k", ("striped", 4, 64), 8192, _MIXED_8K, seed=2),
    Case("packed-striped-cp4-g128-mixed-8k-d64", ("striped", 4, 128), 8192, _MIXED_8K, d=64, seed=3),
    Case("packed-zigzag-cp2-mixed-8k", ("zigzag", 2, 64), 8192, _MIXED_8K, seed=4),
    Case("packed-striped-cp2-padded-8k", ("striped", 2, 64), 8192, _PADDED_8K[0], _PADDED_8K[1], seed=5),
    Case("packed-striped-cp4-padded-8k-gqa8", ("striped", 4, 64), 8192, _PADDED_8K[0], _PADDED_8K[1],
         hq=16, hkv=2, seed=6),
    Case("packed-cp1-padded-8k", ("striped", 1, 64), 8192, _PADDED_8K[0], _PADDED_8K[1], seed=7),
    Case("packed-striped-cp2-short-docs-16k", ("striped", 2, 64), 16384, (1, 5, 77, 300, 1) * 40 + (1024,), seed=8),
    Case("packed-striped-cp2-mixed-8k-fp16", ("striped", 2, 64), 8192, _MIXED_8K, dtype=fp16, seed=9),
)

#: one-rank cases run through ring_attention itself (autograd, delta kernel), the backend chosen by ``auto``
RING_CASES = tuple(c for c in CASES if c.layout[1] == 1)

#: FA4 varlen at CP=1 (:func:`run_fa4_varlen_case`): no padding (the THD batch is a view), padded
#: slots and a padding tail, GQA 8:1 / 3:1 / 4:1, head_dim 64 and 128, two streams (b = 2), 201
#: short documents (length 1 included), fp16.
FA4_VARLEN_CASES = (
    Case("fa4-varlen-mixed-8k", ("striped", 1, 64), 8192, _MIXED_8K, seed=30),
    Case("fa4-varlen-padded-8k-gqa8", ("striped", 1, 64), 8192, _PADDED_8K[0], _PADDED_8K[1], hq=16, hkv=2,
         seed=31),
    Case("fa4-varlen-padded-8k-d64-gqa3", ("striped", 1, 64), 8192, _PADDED_8K[0], _PADDED_8K[1], hq=9, hkv=3,
         d=64, seed=32),
    Case("fa4-varlen-two-streams-4k", ("striped", 1, 64), 4096, (1000, 63, 2000, 1, 2900, 1000),
         (1000, 63, 2000, 1033, 3000, 1096), batch=2, seed=33),
    Case("fa4-varlen-short-docs-16k", ("striped", 1, 64), 16384, (1, 5, 77, 300, 1) * 40 + (1024,), seed=34),
    Case("fa4-varlen-padded-8k-fp16", ("striped", 1, 64), 8192, _PADDED_8K[0], _PADDED_8K[1], dtype=fp16, seed=35),
)

SMOKE_CASES = (
    Case("smoke-packed-striped-cp2", ("striped", 2, 64), 256, (1, 63, 65, 100, 27), hq=2, hkv=1, d=64, dtype=fp16),
    Case("smoke-packed-padded-cp2", ("striped", 2, 64), 256, (1, 50, 70), (64, 64, 100), hq=2, hkv=1, d=64,
         dtype=fp16, seed=1),
    Case("smoke-packed-zigzag-cp2", ("zigzag", 2, 64), 256, (1, 63, 65, 100, 27), hq=2, hkv=1, d=64, dtype=fp16,
         seed=2),
)


SPARSE_CASES = (
    Case("sparse-packed-cp1-mixed-8k", ("striped", 1, 64), 8192, _MIXED_8K, seed=20),
    Case("sparse-packed-striped-cp2-mixed-8k", ("striped", 2, 64), 8192, _MIXED_8K, seed=21),
    Case("sparse-packed-zigzag-cp2-padded-8k", ("zigzag", 2, 64), 8192, _PADDED_8K[0], _PADDED_8K[1], seed=22),
    Case("sparse-packed-striped-cp4-padded-8k-kvgroup", ("striped", 4, 64), 8192, _PADDED_8K[0], _PADDED_8K[1],
         hq=16, hkv=2, seed=23, extra={"share_pattern": "kv_group"}),
    Case("sparse-packed-striped-cp2-b128-mixed-8k-d64", ("striped", 2, 128), 8192, _MIXED_8K, d=64, seed=24,
         extra={"block_size": 128}),
    Case("sparse-packed-striped-cp2-mixed-8k-fp16", ("striped", 2, 64), 8192, _MIXED_8K, dtype=fp16, seed=25),
)

SPARSE_SMOKE_CASES = (
    Case("smoke-sparse-packed-striped-cp2", ("striped", 2, 64), 512, (1, 63, 65, 300, 83), hq=2, hkv=1, d=64,
         dtype=fp16, seed=30),
    Case("smoke-sparse-packed-padded-cp1", ("striped", 1, 64), 256, (1, 50, 70), (64, 64, 100), hq=2, hkv=1, d=64,
         dtype=fp16, seed=31),
)


def _sparse_config(case: Case):
    from megatron_mtraining.patterns.estimator import VerticalSlashConfig

    kw = dict(recall=0.9, last_q=64, block_size=64, sink_tokens=16, local_blocks=1, max_vertical=256, max_slash=16)
    kw.update(case.extra)
    return VerticalSlashConfig(**kw)


def _inputs(case: Case, device):
    """The case's layout, document offsets, sequence length, documents, ``(q, k, v, dout)`` (seeded)
    and softmax scale."""
    layout = Layout(*case.layout)
    cu, pad = offsets(case)
    s = case.seq
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), s, batch_size=case.batch,
                                           cu_seqlens_padded=torch.tensor(pad), device=device)
    g = torch.Generator(device=device).manual_seed(case.seed)
    mk = lambda h: torch.randn(case.batch, s, h, case.d, generator=g, device=device).to(case.dtype)  # noqa: E731
    return layout, cu, pad, s, docs, (mk(case.hq), mk(case.hkv), mk(case.hkv), mk(case.hq)), case.d ** -0.5


def _score(case: Case, ours, gold, ref, docs, t0: float, **extra) -> dict:
    """The result row of ``ours = (out, lse, dq, dk, dv)`` against the fp64 ``gold`` and the bf16
    reference ``ref``: errors, their ratios, NaN and padding checks, and the criterion ``ok``."""
    e_ours = {n: rel_err(a, r) for n, a, r in zip(NAMES, ours, gold)}
    e_ref = {n: rel_err(a, r) for n, a, r in zip(NAMES, ref, gold)}
    ratio = {n: e_ours[n] / max(e_ref[n], 1e-12) for n in NAMES}
    nan = any(bool(torch.isnan(t).any()) for t in ours)
    padding = ~docs.real()                                               # [b, S]
    pad_zero = all(bool((t[padding] == 0).all()) for t in (ours[0], ours[2], ours[3], ours[4]))
    pad_lse = bool(torch.isneginf(ours[1].transpose(1, 2)[padding]).all())
    ok = (not nan) and pad_zero and all(ratio[n] <= 2.0 for n in NAMES)
    return dict(case=case.id, layout=list(case.layout), seq=case.seq, documents=len(case.lengths),
                padding_tokens=int(padding.sum()), dtype=str(case.dtype).replace("torch.", ""),
                heads=[case.hq, case.hkv], head_dim=case.d, **extra, err_ours=e_ours, err_bf16_ref=e_ref,
                ratio=ratio, nan=nan, padding_exact_zero=pad_zero, padding_lse_neginf=pad_lse, ok=ok,
                seconds=round(time.time() - t0, 1))


def run_sparse_case(case: Case, device="cuda", use_documents: bool = True) -> dict:
    """Run one sparse case (:data:`SPARSE_CASES`); ``use_documents=False`` (a negative control) gives
    the Triton steps the same restricted indices without their document bounds."""
    from megatron_mtraining.ops.triton import make_sparse_step_kernel
    from megatron_mtraining.patterns.convert import convert_pattern, restrict_to_documents
    from megatron_mtraining.patterns.estimator import estimate_vertical_slash
    from megatron_mtraining.patterns.indices import StepIndices

    t0 = time.time()
    layout, cu, pad, s, docs, (q, k, v, dout), scale = _inputs(case, device)
    cfg = _sparse_config(case)
    pattern = estimate_vertical_slash(q.double(), k.double(), layout=Layout("striped", 1, cfg.block_size),
                                      config=cfg, softmax_scale=scale, documents=docs)
    mask = pattern.dense_mask(s)                                        # [b, h_pattern, S, S]
    mask = mask.repeat_interleave(case.hq // mask.shape[1], dim=1)
    t = torch.arange(s, device=device)
    mask &= ((docs.lo[:, :, None] <= t) & (t <= docs.hi[:, :, None]))[:, None]
    mask_fn = lambda r0, r1: mask[:, :, r0:r1]  # noqa: E731
    gold = oracle(q, k, v, mask_fn, scale, dout)[:5]
    ref = bf16_reference(q, k, v, mask_fn, scale, dout)
    del mask

    def kernel(rank):
        steps = restrict_to_documents(convert_pattern(pattern, layout, rank, impl="torch"), docs, layout, rank)
        if not use_documents:
            steps = [StepIndices(st.block_count, st.block_index, st.column_count, st.column_index, st.causal,
                                 st.block_size) for st in steps]
        return make_sparse_step_kernel(steps, scale)

    ours = _poisoned(lambda: simulate_dense_ring(layout, q, k, v, dout, kernel), device)
    return _score(case, ours, gold, ref, docs, t0, block_size=cfg.block_size, share_pattern=cfg.share_pattern)


def _per_document(fn, q, k, v, dout, cu, pad, scale):
    """``fn`` (the fp64 oracle or the bf16 reference) on every document alone; results at the
    documents' slots, zeros (LSE ``-inf``) elsewhere: ``(out, lse, dq, dk, dv)``."""
    b, s, hq, d = q.shape
    out, dq = torch.zeros(b, s, hq, d, dtype=torch.float64, device=q.device), torch.zeros(
        b, s, hq, d, dtype=torch.float64, device=q.device)
    dk, dv = (torch.zeros(k.shape, dtype=torch.float64, device=q.device) for _ in range(2))
    lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float64, device=q.device)
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        if n == 0:
            continue
        row, a = divmod(pad[i], s)
        sl = slice(a, a + n)
        causal = lambda r0, r1, n=n: (torch.arange(n, device=q.device)[None, :] <=  # noqa: E731
                                      torch.arange(r0, r1, device=q.device)[:, None])[None, None].expand(1, hq, r1 - r0, n)
        parts = fn(*(t[row:row + 1, sl] for t in (q, k, v)), causal, scale, dout[row:row + 1, sl])
        o, l, gq, gk, gv = (p.double() for p in parts[:5])
        out[row, sl], lse[row, :, sl], dq[row, sl], dk[row, sl], dv[row, sl] = o[0], l[0], gq[0], gk[0], gv[0]
    return out, lse, dq, dk, dv


def _poisoned(fn, device):
    junk = torch.full((1 << 28,) if torch.device(device).type == "cuda" else (16,), float("nan"), device=device)
    del junk
    return fn()


def run_case(case: Case, device="cuda") -> dict:
    """Run one case; returns its result row (``row["ok"]`` is the criterion of the module docstring)."""
    t0 = time.time()
    layout, cu, pad, s, docs, (q, k, v, dout), scale = _inputs(case, device)
    gold = _per_document(lambda *a: oracle(*a), q, k, v, dout, cu, pad, scale)
    ref = _per_document(lambda *a: bf16_reference(*a), q, k, v, dout, cu, pad, scale)
    ours = _poisoned(lambda: simulate_dense_ring(
        layout, q, k, v, dout, lambda r: DenseGpuStepKernel(layout, r, s, scale, device=device, documents=docs)),
        device)
    return _score(case, ours, gold, ref, docs, t0)


def run_ring_case(case: Case, device="cuda", kernel_backend: str = "triton") -> dict:
    """A one-rank case through :func:`~megatron_mtraining.ring.ring_attention` itself (its autograd
    function, the backend's delta kernel and merge) with ``kernel_backend`` (``triton``: the Triton
    dense steps with the document mask; ``auto`` takes FA4 varlen where it is available, checked
    by :func:`run_fa4_varlen_case`); same oracle, reference and criterion as :func:`run_case`."""
    from megatron_mtraining.ops.backends import select_backend
    from megatron_mtraining.ring import ring_attention

    if case.layout[1] != 1:
        raise ValueError("run_ring_case runs one rank (cp 1)")
    t0 = time.time()
    layout, cu, pad, s, docs, (q, k, v, dout), scale = _inputs(case, device)
    gold = _per_document(lambda *a: oracle(*a), q, k, v, dout, cu, pad, scale)
    ref = _per_document(lambda *a: bf16_reference(*a), q, k, v, dout, cu, pad, scale)
    backend = select_backend(kernel_backend, device=device, dtype=case.dtype, head_dim=case.d, seq_len_local=s,
                             packed=True, deterministic=False)

    def run():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = ring_attention(qq, kk, vv, layout=layout, group=None, softmax_scale=scale, backend=backend,
                             documents=docs)
        out.backward(dout)
        return out.detach(), qq.grad, kk.grad, vv.grad

    out, dq, dk, dv = _poisoned(run, device)
    ours = (out, dq, dk, dv)
    names = ("out", "dq", "dk", "dv")
    gold4, ref4 = (gold[0], *gold[2:]), (ref[0], *ref[2:])
    e_ours = {n: rel_err(a, r) for n, a, r in zip(names, ours, gold4)}
    e_ref = {n: rel_err(a, r) for n, a, r in zip(names, ref4, gold4)}
    ratio = {n: e_ours[n] / max(e_ref[n], 1e-12) for n in names}
    nan = any(bool(torch.isnan(t).any()) for t in ours)
    padding = ~docs.real()
    pad_zero = all(bool((t[padding] == 0).all()) for t in ours)
    ok = (not nan) and pad_zero and all(ratio[n] <= 2.0 for n in names)
    return dict(case=case.id + "-ring", backend=backend.name, err_ours=e_ours, err_bf16_ref=e_ref, ratio=ratio,
                nan=nan, padding_exact_zero=pad_zero, ok=ok, seconds=round(time.time() - t0, 1))


def run_fa4_varlen_case(case: Case, device="cuda", deterministic: bool = False) -> dict:
    """A one-rank case on FlashAttention-4's varlen interface (:data:`FA4_VARLEN_CASES`): out, dQ, dK,
    dV through :func:`~megatron_mtraining.ring.ring_attention` with ``kernel_backend='fa4'`` (its
    ``packed_cp1``), LSE from :func:`~megatron_mtraining.ops.fa4.fa4_varlen_attention` on the same
    inputs; same oracle, bf16 reference and criterion as :func:`run_case` (out, LSE, dQ, dK, dV each
    within 2x the bf16 reference's error; padding exact zeros, LSE ``-inf``; no NaN).

    The row also names the backend chosen (``backend``, ``varlen``: whether FA4 varlen ran) and the
    varlen self-check's verdict (``self_check``: ``None`` or why FA4 was not used); with
    ``deterministic`` also whether a second run is bitwise equal (``bitwise_repeatable``)."""
    from megatron_mtraining.ops.backends import select_backend
    from megatron_mtraining.ops.fa4 import fa4_varlen_attention, fa4_varlen_self_check
    from megatron_mtraining.ring import ring_attention

    if case.layout[1] != 1:
        raise ValueError("run_fa4_varlen_case runs one rank (cp 1)")
    t0 = time.time()
    layout, cu, pad, s, docs, (q, k, v, dout), scale = _inputs(case, device)
    gold = _per_document(lambda *a: oracle(*a), q, k, v, dout, cu, pad, scale)
    ref = _per_document(lambda *a: bf16_reference(*a), q, k, v, dout, cu, pad, scale)
    why = fa4_varlen_self_check(device, case.dtype, case.d, case.hq, case.hkv, deterministic)
    backend = select_backend("fa4", device=device, dtype=case.dtype, head_dim=case.d, seq_len_local=s,
                             packed=True, deterministic=deterministic)

    def run():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = ring_attention(qq, kk, vv, layout=layout, group=None, softmax_scale=scale, backend=backend,
                             documents=docs)
        out.backward(dout)
        with torch.no_grad():
            _, lse = fa4_varlen_attention(q, k, v, docs, softmax_scale=scale, deterministic=deterministic,
                                          return_lse=True)
        return out.detach(), lse, qq.grad, kk.grad, vv.grad

    ours = _poisoned(run, device)
    extra = dict(backend=backend.name, varlen=backend.packed_cp1 is not None, self_check=why,
                 deterministic=deterministic, batch=case.batch)
    if deterministic:
        again = run()
        extra["bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(ours, again))
    return _score(case, ours, gold, ref, docs, t0, **extra)


def describe(row: dict) -> str:
    return (f"{'OK ' if row['ok'] else 'BAD'} {row['case']:40s} "
            + " ".join(f"{n}={row['err_ours'][n]:.2e}/{row['err_bf16_ref'][n]:.2e}" for n in row["err_ours"])
            + f" pad0={row['padding_exact_zero']} nan={row['nan']} ({row['seconds']}s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny fp16 cases on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    device, cases = ("cpu", SMOKE_CASES) if args.cpu_smoke else ("cuda", CASES)
    sparse = SPARSE_SMOKE_CASES if args.cpu_smoke else SPARSE_CASES
    if device == "cuda":
        print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    results, oks = [], []
    runs = [(run_case, c) for c in cases] + [(run_ring_case, c) for c in (RING_CASES if device == "cuda" else ())]
    if device == "cuda":
        from megatron_mtraining.ops.fa4 import fa4_unavailable_reason

        if fa4_unavailable_reason("cuda") is None:
            runs += [(run_fa4_varlen_case, c) for c in FA4_VARLEN_CASES]
    runs += [(run_sparse_case, c) for c in sparse]
    for fn, c in runs:
        try:
            row = fn(c, device)
            results.append(row)
            print(describe(row), flush=True)
            oks.append(row["ok"])
        except Exception:
            traceback.print_exc()
            oks.append(False)
        if device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"RESULT {'PASS' if all(oks) else 'FAIL'} {sum(oks)}/{len(oks)}", flush=True)


if __name__ == "__main__":
    main()

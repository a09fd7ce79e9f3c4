"""Triton budgets and selection of the online vertical-slash estimator (MTraining §3.2, steps 4-5 of
:mod:`megatron_mtraining.patterns.estimator`): one kernel launch per line kind instead of segment sorts,
cumsums and a sort of the kept set in torch.

For each row (one sample and head) of line scores ``x[0 .. n-1]`` (non-negative; the first ``n_floor``
lines are the floors), the torch path takes lines in the priority order -- floors first, then score
descending, ties by ascending index -- and keeps the shortest prefix whose fp64 cumulative score reaches
``target``, at least the floors and at most ``cap`` lines (``count = clamp(#(cumsum < target) + 1, lo,
hi)``, ``lo = min(n_floor, n)``, ``hi = min(cap, n)``; every line up to the cap with ``take_all``).
The kept lines' indices are returned ascending.

The kernel finds the same lines without sorting. The floors are always kept (``hi >= lo``, which
:class:`~megatron_mtraining.patterns.estimator.VerticalSlashConfig` guarantees), so only the non-floor
lines (the *rest*) are ranked, by a bisection on the scores' bit patterns (non-negative IEEE floats order
like their bits as integers; ``-0.0`` counts as ``+0.0``):

1. ``F`` = the floors' sum, ``R`` = the rest's sum (fp64); the rest must supply ``t = target - F``.
2. ``t <= 0``: no rest line (count ``lo``). ``R < t``: the budget cannot be met: count ``hi``.
   Otherwise the largest score ``v`` with ``sum(rest >= v) >= t`` (one bisection over the bits, each
   step one pass over the row); ``G = sum(rest > v)``, ``C = #(rest > v)``, ``E = #(rest == v)``; the
   prefix reaches ``t`` inside the tie run at ``v`` after ``e = clamp(ceil((t - G) / v), 1, E)``
   ties: count ``lo + C + e``, capped at ``hi``.
3. A capped count (and ``take_all``) keeps the top ``count - lo`` rest lines: the largest score ``v``
   with ``#(rest >= v) >= count - lo`` (a bisection on counts) and its first ties by index.
4. One pass writes the kept indices ascending (in-register prefix sums), then ``-1`` padding to the
   output width, the count, and the covered fraction ``sum(kept) / L``.

Agreement with the torch path: the kept lines and counts are the same except where a cumulative sum lands
within rounding (about 1e-16 relative) of the target, since the sums here run in another order: the same
caveat the estimator documents between CP sizes. The covered fraction agrees to that rounding.

Cost: about ``2 * 31 + 3`` passes over each row for fp32 scores (``2 * 63 + 3`` for fp64), one program
per row, reading the row from L1/L2 after the first pass.

Imported lazily (``triton.jit`` picks compiled or interpreted mode at decoration time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["select_lines", "CHUNK"]

CHUNK = 2048        # lines per step of a program's loops (one tl.cumsum / tl.sum)


@triton.jit
def _keys(Row, idx, N, FP64: tl.constexpr):
    """``(x fp64, key, in range)`` of lines ``idx``: the score and its bits as a non-negative integer
    (``-0.0`` -> 0); out-of-range lines read as 0."""
    ok = idx < N
    if FP64:
        x = tl.load(Row + idx, mask=ok, other=0.0)
        key = tl.maximum(x.to(tl.int64, bitcast=True), 0)
    else:
        x32 = tl.load(Row + idx, mask=ok, other=0.0)
        key = tl.maximum(x32.to(tl.int32, bitcast=True), 0)
        x = x32.to(tl.float64)
    return x, key, ok


@triton.jit
def _select_kernel(
    Score, Sel, Cnt, Mass,
    N, LO, HI, W, H,
    s_b, s_h,
    target: tl.float64, L: tl.float64,
    TAKE_ALL: tl.constexpr, FP64: tl.constexpr, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr,
):
    r = tl.program_id(0)                               # sample * H + head
    row = Score + (r // H).to(tl.int64) * s_b + (r % H).to(tl.int64) * s_h
    offs = tl.arange(0, CHUNK)
    if KEY_BITS == 64:
        one_k = tl.full([], 1, tl.int64)
        key_top = tl.full([], 0x7FFFFFFFFFFFFFFF, tl.int64)     # the largest non-negative key
    else:
        one_k = tl.full([], 1, tl.int32)
        key_top = tl.full([], 0x7FFFFFFF, tl.int32)
    f0 = tl.full([], 0.0, tl.float64)

    # ---- 1. the floors' and the rest's sums; the rest's largest key
    f_sum = f0
    r_sum = f0
    k_max = one_k * 0
    for c0 in range(0, N, CHUNK):
        idx = c0 + offs
        x, key, ok = _keys(row, idx, N, FP64)
        rest = ok & (idx >= LO)
        f_sum += tl.sum(tl.where(idx < LO, x, 0.0), 0)
        r_sum += tl.sum(tl.where(rest, x, 0.0), 0)
        k_max = tl.maximum(k_max, tl.max(tl.where(rest, key, 0), 0))

    n_rest = N - LO
    t = target - f_sum
    # ---- 2. the count, and (unless capped) the threshold key and the number of its ties to keep
    thr = one_k * 0
    ties = n_rest * 0
    count = HI + 0 * n_rest
    by_count = 1 + 0 * n_rest                          # 1: step 3 decides the threshold
    if not TAKE_ALL:
        if t <= 0.0:
            # the floors reach the target (the count is the floors; one line when there are none)
            count = tl.maximum(LO + 0 * n_rest, 1)
        elif r_sum >= t:
            # largest key v with sum(rest >= v) >= t: invariant S(lo_k) >= t > S(hi_k)
            lo_k = one_k * 0
            hi_k = k_max + 1
            s_hi = f0                    # sum(rest >= hi_k) = 0
            c_hi = n_rest * 0
            c_lo = n_rest                              # #(rest >= 0) = every rest line
            while hi_k - lo_k > 1:
                mid = lo_k + (hi_k - lo_k) // 2
                s_mid = f0
                c_mid = n_rest * 0
                for c0 in range(0, N, CHUNK):
                    idx = c0 + offs
                    x, key, ok = _keys(row, idx, N, FP64)
                    ge = ok & (idx >= LO) & (key >= mid)
                    s_mid += tl.sum(tl.where(ge, x, 0.0), 0)
                    c_mid += tl.sum(ge.to(tl.int32), 0)
                if s_mid >= t:
                    lo_k = mid
                    c_lo = c_mid
                else:
                    hi_k = mid
                    s_hi = s_mid
                    c_hi = c_mid
            if KEY_BITS == 64:
                v = lo_k.to(tl.float64, bitcast=True)
            else:
                v = lo_k.to(tl.float32, bitcast=True).to(tl.float64)
            n_eq = c_lo - c_hi
            e = tl.minimum(tl.maximum(tl.math.ceil((t - s_hi) / v), 1.0), n_eq.to(tl.float64)).to(tl.int32)
            count = tl.minimum(LO + c_hi + e, HI)
            if count == LO + c_hi + e:
                thr = lo_k
                ties = e
                by_count = 0 * n_rest
    # ---- 3. the top (count - lo) rest lines by a bisection on counts
    need = count - LO
    if by_count > 0:
        if need > 0:
            lo_k = one_k * 0
            hi_k = k_max + 1
            c_hi = n_rest * 0
            while hi_k - lo_k > 1:
                mid = lo_k + (hi_k - lo_k) // 2
                c_mid = n_rest * 0
                for c0 in range(0, N, CHUNK):
                    idx = c0 + offs
                    x, key, ok = _keys(row, idx, N, FP64)
                    c_mid += tl.sum((ok & (idx >= LO) & (key >= mid)).to(tl.int32), 0)
                if c_mid >= need:
                    lo_k = mid
                else:
                    hi_k = mid
                    c_hi = c_mid
            thr = lo_k
            ties = need - c_hi
        else:
            thr = key_top
            ties = n_rest * 0
    elif need <= 0:
        thr = key_top
        ties = n_rest * 0
    # ---- 4. kept indices ascending, padding, count and covered fraction
    out = Sel + r.to(tl.int64) * W
    base = n_rest * 0
    seen = n_rest * 0
    covered = f0
    for c0 in range(0, N, CHUNK):
        idx = c0 + offs
        x, key, ok = _keys(row, idx, N, FP64)
        rest = ok & (idx >= LO)
        eq = (rest & (key == thr)).to(tl.int32)
        eq_rank = seen + tl.cumsum(eq, 0) - eq           # ties before this line
        keep = (ok & (idx < LO)) | (rest & (key > thr)) | ((eq > 0) & (eq_rank < ties))
        keep32 = keep.to(tl.int32)
        pos = base + tl.cumsum(keep32, 0) - 1
        tl.store(out + pos, idx.to(tl.int64), mask=keep)
        covered += tl.sum(tl.where(keep, x, 0.0), 0)
        base += tl.sum(keep32, 0)
        seen += tl.sum(eq, 0)
    for c0 in range(0, W, CHUNK):
        idx = c0 + offs
        tl.store(out + idx, tl.full([CHUNK], -1, tl.int64), mask=(idx >= base) & (idx < W))
    tl.store(Cnt + r, base.to(tl.int64))
    tl.store(Mass + r, covered / L)


def select_lines(score: torch.Tensor, n_floor: int, cap: int, target: float, take_all: bool, width: int,
                 last_q: float):
    """Budget and selection of one line kind for every row, as the estimator's torch path.

    Args:
        score: ``[b, h, n]`` fp32 or fp64 line scores, non-negative, unit stride along ``n`` (any strides
            over ``b``, ``h``); the first ``n_floor`` lines are the floors.
        n_floor: floors per row (kept always); cap: the most lines kept per row, ``>= min(n_floor, n)``.
        target: the cumulative score to reach (``recall * last_q``); take_all: keep every line up to
            the cap (``recall == 1``).
        width: output slots per row, ``>= min(cap, n)`` (and >= 1).
        last_q: the probe mass the covered sum is divided by.

    Returns:
        ``(selected [b, h, width] int64 ascending, -1 padded; count [b, h] int64; covered [b, h] fp64 =
        kept score / last_q)``.

    Raises:
        ValueError: a dtype other than fp32/fp64, a non-unit inner stride, ``cap < min(n_floor, n)`` or
            ``width < min(cap, n)`` (the kernel writes only inside the row's slots).
    """
    if score.dim() != 3 or score.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"select_lines: score [b, h, n] fp32/fp64 expected, got {tuple(score.shape)} {score.dtype}")
    b, h, n = score.shape
    if n and score.stride(2) != 1:
        raise ValueError("select_lines: score needs a unit stride along the lines")
    lo, hi = min(max(n_floor, 0), n), min(cap, n)
    if hi < lo:
        raise ValueError(f"select_lines: cap {cap} is below the {lo} floors: the floors must fit under the cap")
    if width < max(1, hi):
        raise ValueError(f"select_lines: width {width} is below min(cap, n) = {hi}")
    dev = score.device
    sel = torch.empty((b, h, width), dtype=torch.long, device=dev)
    cnt = torch.empty((b, h), dtype=torch.long, device=dev)
    mass = torch.empty((b, h), dtype=torch.float64, device=dev)
    if b * h == 0:
        return sel, cnt, mass
    if hi <= 0:                                        # n == 0 or cap == 0: nothing is kept
        return sel.fill_(-1), cnt.zero_(), mass.zero_()
    fp64 = score.dtype == torch.float64
    _select_kernel[(b * h,)](
        score, sel, cnt, mass,
        n, lo, hi, width, h,
        score.stride(0), score.stride(1),
        float(target), float(last_q),
        TAKE_ALL=bool(take_all), FP64=fp64, KEY_BITS=64 if fp64 else 32, CHUNK=CHUNK, num_warps=8,
    )
    return sel, cnt, mass

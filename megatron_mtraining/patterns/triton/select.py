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
lines (the *rest*) are ranked, by their scores' bit patterns (non-negative IEEE floats order like their
bits as integers, the *keys*; ``-0.0`` counts as ``+0.0``):

1. One pass: ``F`` = the floors' sum, ``R`` = the rest's sum (fp64), the largest rest key, and the counts
   of the keys' leading ``DIGIT`` bits.
2. The number of rest lines to keep when the count is capped (``need = hi - lo``; ``take_all``; ``F + R <
   target``, the budget cannot be met) or when the floors reach the target (``F >= target``: ``need`` is 0,
   or 1 without floors, as the torch path's ``#(cumsum < target) + 1``).
3. The ``need``-th largest rest score ``v`` by a radix search: each further ``DIGIT``-bit digit of the keys
   is one pass counting them (``tl.histogram``) among the lines that share the leading digits chosen so far,
   until at most ``CAND`` lines do; one pass copies those to a scratch row, and their remaining digits are
   counted in registers, one histogram per digit. The same copy pass sums the lines above them: ``G = sum(rest
   > v)``; ``C = #(rest > v)``; the top ``need`` lines are those above ``v`` and the first ``need - C`` of its
   ties by index.
4. Otherwise (``F < target <= F + R``) the count is capped exactly when the first ``hi - 1`` lines in
   priority order stay below the target, ``F + G + (need - C - 1) v < target`` (step 3 run for ``need = hi -
   lo``). If not, the budget's threshold lies at or above ``v``: the largest score ``u >= v`` with ``F +
   sum(rest >= u) >= target`` by a bisection by sums over the keys from ``v`` up (at most ``CAND`` lines
   lie there unless many tie at ``v``; more take one pass per step first); with ``G' = sum(rest > u)``,
   ``C' = #(rest > u)``, ``E' = #(rest == u)`` the prefix reaches the target inside the tie run at ``u``
   after ``e = clamp(ceil((target - (F + G')) / u), 1, E')`` ties: count ``lo + C' + e``.
5. One pass writes the kept indices ascending (in-register prefix sums), then ``-1`` padding to the
   output width, the count, and the covered fraction ``sum(kept) / L``.

:func:`select_line_kinds` runs two line kinds (the block diagonals and the columns) in one launch, one
program per row of either kind, side by side.

Agreement with the torch path: the kept lines and counts are the same except where the target lies within
the rounding of an fp64 sum of the kept lines (about ``n * 2**-53`` relative for ``n`` lines summed; a tie
run counts its ties by one division, not by repeated additions), since the sums here run in another order:
the caveat the estimator documents between CP sizes. fp32 scores (the column scores of one probe block)
usually sum exactly in fp64. The covered fraction agrees to that rounding. Scores must be non-negative; a
NaN ranks above every number (as in torch's descending sort), but a row holding one keeps ``hi`` lines
where torch stops counting at the NaN; such a row never writes outside its slots.

Cost: per row, pass 1, one pass per further digit while more than ``CAND`` lines share the chosen digits
(none or one for spread-out scores: the first digit holds the exponent), the copy pass, a second copy pass
when the budget is not capped, and the writing pass; in registers one histogram per remaining digit of the
capped count's search, and up to 31 (fp32) or 63 (fp64) bisection steps for the budget's; one program per row,
so ``b * h`` programs in all. Rows of more than ``LONG_ROW`` lines take longer loop
steps with more warps.

Imported lazily (``triton.jit`` picks compiled or interpreted mode at decoration time).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ...common import cuda_index

__all__ = ["select_lines", "select_line_kinds", "CHUNK", "CAND"]

CHUNK = 2048        # lines per step of a program's loops over the row (rows up to LONG_ROW lines)
NUM_WARPS = 8
LONG_ROW = 65536    # longer rows: LONG_CHUNK lines per step, LONG_NUM_WARPS warps
LONG_CHUNK = 8192
LONG_NUM_WARPS = 16
CAND = 2048         # candidates left when the bisection moves to registers
MAX_REGISTERS = 184  # per thread, launches of NUM_WARPS warps (launch_registers)
DIGIT = 6           # bits per digit of the radix search (step 3)


@triton.jit
def _keys(Row, idx, N, FP64: tl.constexpr):
    """``(x fp64, key, in range)`` of lines ``idx``: the score and its bits as a non-negative integer
    (``-0.0`` -> 0; every NaN -> one key above ``+inf``'s, so NaNs rank first, as in torch's descending
    sort, and no key is near the integer range's end); out-of-range lines read as 0."""
    ok = idx < N
    if FP64:
        x = tl.load(Row + idx, mask=ok, other=0.0)
        key = tl.where(x != x, 0x7FF0000000000001, tl.maximum(x.to(tl.int64, bitcast=True), 0))
    else:
        x32 = tl.load(Row + idx, mask=ok, other=0.0)
        key = tl.where(x32 != x32, 0x7F800001, tl.maximum(x32.to(tl.int32, bitcast=True), 0))
        x = x32.to(tl.float64)
    return x, key, ok


@triton.jit
def _key_value(k, FP64: tl.constexpr):
    """The score (fp64) whose key is ``k``."""
    if FP64:
        v = k.to(tl.float64, bitcast=True)
    else:
        v = k.to(tl.int32).to(tl.float32, bitcast=True).to(tl.float64)
    return v


@triton.jit
def _step(up, mid, s_mid, c_mid, lo_k, hi_k, s_hi, c_lo, c_hi):
    """One bisection step: the condition held at ``mid`` (``up``: ``mid`` becomes ``lo_k``) or failed (``hi_k``,
    with its sum and count). Returns ``(lo_k, hi_k, s_hi, c_lo, c_hi)``."""
    if up:
        lo_k = mid
        c_lo = c_mid
    else:
        hi_k = mid
        s_hi = s_mid
        c_hi = c_mid
    return lo_k, hi_k, s_hi, c_lo, c_hi


@triton.jit
def _search(row, N, LO, lo_k, hi_k, s_hi, c_lo, c_hi, s_base, goal_s, Cx, Ck, FP64: tl.constexpr,
            CHUNK: tl.constexpr, CAND: tl.constexpr):
    """Bisection by sums over the rest lines' keys (int64 here): the largest key ``v`` in ``[lo_k, hi_k)`` with
    ``s_base + sum(rest >= v) >= goal_s``. Invariant: the condition holds at ``lo_k`` and fails at ``hi_k``;
    ``s_hi`` / ``c_hi`` are the sum / count of the rest lines at or above ``hi_k``, ``c_lo`` the count at
    ``lo_k``. One full pass over the row per step until at most ``CAND`` lines lie in ``[lo_k, hi_k)``; those
    are then copied to the scratch rows ``Cx`` / ``Ck`` and the bisection ends in registers. Returns the final
    ``(lo_k, hi_k, s_hi, c_lo, c_hi)`` (``hi_k = lo_k + 1``)."""
    offs = tl.arange(0, CHUNK)
    while (hi_k - lo_k > 1) & (c_lo - c_hi > CAND):
        mid = lo_k + (hi_k - lo_k) // 2
        acc_s = tl.zeros([CHUNK], tl.float64)
        acc_c = tl.zeros([CHUNK], tl.int32)
        for c0 in range(0, N, CHUNK):
            idx = c0 + offs
            x, key, ok = _keys(row, idx, N, FP64)
            ge = ok & (idx >= LO) & (key.to(tl.int64) >= mid)
            acc_s += tl.where(ge, x, 0.0)
            acc_c += ge.to(tl.int32)
        s_mid = tl.sum(acc_s, 0)
        c_mid = tl.sum(acc_c, 0)
        lo_k, hi_k, s_hi, c_lo, c_hi = _step(s_base + s_mid >= goal_s, mid, s_mid, c_mid, lo_k, hi_k, s_hi, c_lo,
                                             c_hi)
    if hi_k - lo_k > 1:
        # at most CAND candidates left: copy them (any order) and finish in registers
        base = c_hi * 0
        for c0 in range(0, N, CHUNK):
            idx = c0 + offs
            x, key, ok = _keys(row, idx, N, FP64)
            k64 = key.to(tl.int64)
            cand = (ok & (idx >= LO) & (k64 >= lo_k) & (k64 < hi_k)).to(tl.int32)
            pos = base + tl.cumsum(cand, 0) - 1
            put = (cand > 0) & (pos < CAND)            # always (the counts are exact): never outside the row
            tl.store(Cx + pos, x, mask=put)
            tl.store(Ck + pos, k64, mask=put)
            base += tl.sum(cand, 0)
        tl.debug_barrier()                             # the stores above are read by other threads below
        o2 = tl.arange(0, CAND)
        valid = o2 < base
        xs = tl.load(Cx + o2, mask=valid, other=0.0)
        ks = tl.load(Ck + o2, mask=valid, other=-1)    # -1: below every key
        s_out = s_hi                                   # the lines above the candidates
        c_out = c_hi
        while hi_k - lo_k > 1:
            mid = lo_k + (hi_k - lo_k) // 2
            ge = ks >= mid
            c_mid = c_out + tl.sum(ge.to(tl.int32), 0)
            s_mid = s_out + tl.sum(tl.where(ge, xs, 0.0), 0)
            lo_k, hi_k, s_hi, c_lo, c_hi = _step(s_base + s_mid >= goal_s, mid, s_mid, c_mid, lo_k, hi_k, s_hi,
                                                 c_lo, c_hi)
    return lo_k, hi_k, s_hi, c_lo, c_hi


@triton.jit
def _digit_hist(row, N, LO, prefix, prev, shift, FP64: tl.constexpr, CHUNK: tl.constexpr, DIGIT: tl.constexpr):
    """Counts of the next digit, bits ``[shift, prev)`` of the key, over the rest lines whose bits from ``prev``
    up equal ``prefix``: ``[2 * 2**DIGIT]`` int32 (bins ``>= 2**DIGIT`` count the other lines)."""
    offs = tl.arange(0, CHUNK)
    hist = tl.zeros([2 << DIGIT], tl.int32)
    for c0 in range(0, N, CHUNK):
        idx = c0 + offs
        x, key, ok = _keys(row, idx, N, FP64)
        k64 = key.to(tl.int64)
        match = ok & (idx >= LO) & ((k64 >> prev) == prefix)
        d = tl.where(match, ((k64 >> shift) & ((1 << DIGIT) - 1)).to(tl.int32), 1 << DIGIT)
        hist += tl.histogram(d, 2 << DIGIT)
    return hist


@triton.jit
def _pick_digit(hist, above, need, DIGIT: tl.constexpr):
    """The digit bin holding the ``need``-th largest rest line, given ``above`` lines above the bins: ``(bin,
    lines above it, lines in it)``."""
    ar = tl.arange(0, 2 << DIGIT)
    h = tl.where(ar < (1 << DIGIT), hist, 0)
    suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h          # lines in bins >= j
    j = tl.max(tl.where(above + suffix >= need, ar, -1), 0)
    in_j = tl.sum(tl.where(ar == j, h, 0), 0)
    at_or_above = tl.sum(tl.where(ar == j, suffix, 0), 0)
    return j.to(tl.int64), above + at_or_above - in_j, in_j


@triton.jit
def _top_count(row, N, LO, need, hist0, cx, ck, FP64: tl.constexpr, CHUNK: tl.constexpr, CAND: tl.constexpr,
               DIGIT: tl.constexpr):
    """The ``need``-th largest rest key ``v`` (``need >= 1``) by a radix search over the key's digits (``hist0``:
    the first digit's counts, from pass 1): one pass per digit while more than ``CAND`` lines share the chosen
    leading digits; then one pass copies those lines to the scratch row (and sums the lines above them), and the
    remaining digits are counted in registers. Returns ``(v, #(rest > v), #(rest >= v), sum(rest > v))``."""
    if FP64:                                           # key bits: 63 (fp64) or 31 (fp32)
        top = 63
    else:
        top = 31
    prev = tl.full([], top - DIGIT, tl.int32)
    prefix, above, cand = _pick_digit(hist0, need * 0, need, DIGIT)
    while (cand > CAND) & (prev > 0):
        shift = tl.maximum(prev - DIGIT, 0)
        hist = _digit_hist(row, N, LO, prefix, prev, shift, FP64, CHUNK, DIGIT)
        j, above, cand = _pick_digit(hist, above, need, DIGIT)
        prefix = (prefix << (prev - shift)) | j
        prev = shift
    offs = tl.arange(0, CHUNK)
    acc_a = tl.zeros([CHUNK], tl.float64)              # the rest lines above the chosen leading digits
    if prev > 0:
        # at most CAND lines share them: copy those (any order), then count their remaining digits in registers
        base = need * 0
        for c0 in range(0, N, CHUNK):
            idx = c0 + offs
            x, key, ok = _keys(row, idx, N, FP64)
            k64 = key.to(tl.int64)
            rest = ok & (idx >= LO)
            lead = k64 >> prev
            take = (rest & (lead == prefix)).to(tl.int32)
            pos = base + tl.cumsum(take, 0) - 1
            put = (take > 0) & (pos < CAND)            # always (the counts are exact): never outside the row
            tl.store(cx + pos, x, mask=put)
            tl.store(ck + pos, k64, mask=put)
            base += tl.sum(take, 0)
            acc_a += tl.where(rest & (lead > prefix), x, 0.0)
        tl.debug_barrier()                             # the stores above are read by other threads below
        o2 = tl.arange(0, CAND)
        valid = o2 < base
        xs = tl.load(cx + o2, mask=valid, other=0.0)
        ks = tl.load(ck + o2, mask=valid, other=-1)    # -1: shares no leading digits
        while prev > 0:
            shift = tl.maximum(prev - DIGIT, 0)
            match = (ks >> prev) == prefix
            d = tl.where(match, ((ks >> shift) & ((1 << DIGIT) - 1)).to(tl.int32), 1 << DIGIT)
            j, above, cand = _pick_digit(tl.histogram(d, 2 << DIGIT), above, need, DIGIT)
            prefix = (prefix << (prev - shift)) | j
            prev = shift
        s_gt = tl.sum(acc_a, 0) + tl.sum(tl.where(ks > prefix, xs, 0.0), 0)
    else:
        # every digit counted over the row (more than CAND lines tie at v): one pass sums the lines above v
        for c0 in range(0, N, CHUNK):
            idx = c0 + offs
            x, key, ok = _keys(row, idx, N, FP64)
            acc_a += tl.where(ok & (idx >= LO) & (key.to(tl.int64) > prefix), x, 0.0)
        s_gt = tl.sum(acc_a, 0)
    return prefix, above, above + cand, s_gt


@triton.jit
def _select_row(r, Score, Sel, Cnt, Mass, Cx, Ck, N, LO, HI, W, H, s_b, s_h, target, L, TAKE_ALL,
                FP64: tl.constexpr, CHUNK: tl.constexpr, CAND: tl.constexpr, DIGIT: tl.constexpr):
    """Steps 1-5 of the module docstring for row ``r`` (sample * H + head) of one line kind."""
    row = Score + (r // H).to(tl.int64) * s_b + (r % H).to(tl.int64) * s_h
    cx = Cx + r.to(tl.int64) * CAND                    # this row's scratch (candidate scores and keys)
    ck = Ck + r.to(tl.int64) * CAND
    offs = tl.arange(0, CHUNK)
    f0 = tl.full([], 0.0, tl.float64)
    if FP64:                                           # key bits: 63 (fp64) or 31 (fp32)
        top = 63
    else:
        top = 31

    # ---- 1. the floors' and the rest's sums; the rest's largest key; the counts of its keys' leading digits
    acc_f = tl.zeros([CHUNK], tl.float64)
    acc_r = tl.zeros([CHUNK], tl.float64)
    acc_k = tl.zeros([CHUNK], tl.int64)
    hist0 = tl.zeros([2 << DIGIT], tl.int32)          # bins >= 2**DIGIT: the floors and past the row
    for c0 in range(0, N, CHUNK):
        idx = c0 + offs
        x, key, ok = _keys(row, idx, N, FP64)
        rest = ok & (idx >= LO)
        k64 = key.to(tl.int64)
        acc_f += tl.where(idx < LO, x, 0.0)
        acc_r += tl.where(rest, x, 0.0)
        acc_k = tl.maximum(acc_k, tl.where(rest, k64, 0))
        d = tl.where(rest, ((k64 >> (top - DIGIT)) & ((1 << DIGIT) - 1)).to(tl.int32), 1 << DIGIT)
        hist0 += tl.histogram(d, 2 << DIGIT)
    f_sum = tl.sum(acc_f, 0)
    r_sum = tl.sum(acc_r, 0)
    k_max = tl.max(acc_k, 0)

    n_rest = N - LO
    # ---- 2. the rest lines to keep when the count is capped (or the floors reach the target)
    thr = tl.full([], 0x7FFFFFFFFFFFFFFF, tl.int64)   # no rest line kept unless a search sets it
    ties = n_rest * 0
    count = HI + 0 * n_rest
    need = HI - LO
    budget = 0 * n_rest
    if TAKE_ALL == 0:
        # the cumulative score is compared as the torch path does: floors' sum + rest's partial sum vs target
        if f_sum >= target:
            # the floors reach the target (the count is the floors; one line when there are none)
            count = tl.maximum(LO + 0 * n_rest, 1)
            need = count - LO
        elif f_sum + r_sum >= target:
            budget = 1 + 0 * n_rest
    # ---- 3. the need-th largest rest key by the radix search, and the lines above it
    if need > 0:
        v_c, c_gt, c_ge, s_gt = _top_count(row, N, LO, need, hist0, cx, ck, FP64, CHUNK, CAND, DIGIT)
        thr = v_c
        ties = need - c_gt
        # ---- 4. capped unless the first hi - 1 lines in priority order reach the target
        if budget > 0:
            extra = tl.where(ties > 1, (ties - 1).to(tl.float64) * _key_value(v_c, FP64), 0.0)
            if f_sum + s_gt + extra >= target:
                # the largest key u >= v_c with F + sum(rest >= u) >= target: it holds at v_c, fails past k_max
                lo_k, hi_k, s_hi, c_lo, c_hi = _search(row, N, LO, v_c, k_max + 1, f0, c_ge, n_rest * 0,
                                                       f_sum, target, cx, ck, FP64, CHUNK, CAND)
                u = _key_value(lo_k, FP64)
                n_eq = c_lo - c_hi
                e = tl.minimum(tl.maximum(tl.math.ceil((target - (f_sum + s_hi)) / u), 1.0),
                               n_eq.to(tl.float64)).to(tl.int32)
                if LO + c_hi + e < HI:                 # else capped after all (a sum rounded the other way)
                    count = LO + c_hi + e
                    thr = lo_k
                    ties = e
    # ---- 5. kept indices ascending, padding, count and covered fraction
    out = Sel + r.to(tl.int64) * W
    base = n_rest * 0
    seen = n_rest * 0
    acc_cov = tl.zeros([CHUNK], tl.float64)
    for c0 in range(0, N, CHUNK):
        idx = c0 + offs
        x, key, ok = _keys(row, idx, N, FP64)
        rest = ok & (idx >= LO)
        eq = (rest & (key == thr)).to(tl.int32)
        eq_rank = seen + tl.cumsum(eq, 0) - eq           # ties before this line
        keep = (ok & (idx < LO)) | (rest & (key > thr)) | ((eq > 0) & (eq_rank < ties))
        keep32 = keep.to(tl.int32)
        pos = base + tl.cumsum(keep32, 0) - 1
        tl.store(out + pos, idx.to(tl.int64), mask=keep & (pos < W))   # pos < W always: never outside the row
        acc_cov += tl.where(keep, x, 0.0)
        base += tl.sum(keep32, 0)
        seen += tl.sum(eq, 0)
    for c0 in range(0, W, CHUNK):
        idx = c0 + offs
        tl.store(out + idx, tl.full([CHUNK], -1, tl.int64), mask=(idx >= base) & (idx < W))
    tl.store(Cnt + r, base.to(tl.int64))
    tl.store(Mass + r, tl.sum(acc_cov, 0) / L)


@triton.jit
def _select_kernel(
    ScoreA, SelA, CntA, MassA, CxA, CkA, NA, LOA, HIA, WA, HA, sa_b, sa_h, targetA: tl.float64, LA: tl.float64,
    TAKE_ALL_A,
    ScoreB, SelB, CntB, MassB, CxB, CkB, NB, LOB, HIB, WB, HB, sb_b, sb_h, targetB: tl.float64, LB: tl.float64,
    TAKE_ALL_B,
    RA,
    FP64_A: tl.constexpr, FP64_B: tl.constexpr, CHUNK: tl.constexpr, CAND: tl.constexpr, DIGIT: tl.constexpr,
):
    """One program per row: rows ``0 .. RA - 1`` of line kind A, then those of kind B (the two kinds run
    side by side in one launch)."""
    pid = tl.program_id(0)
    if pid < RA:
        _select_row(pid, ScoreA, SelA, CntA, MassA, CxA, CkA, NA, LOA, HIA, WA, HA, sa_b, sa_h, targetA, LA,
                    TAKE_ALL_A, FP64_A, CHUNK, CAND, DIGIT)
    else:
        _select_row(pid - RA, ScoreB, SelB, CntB, MassB, CxB, CkB, NB, LOB, HIB, WB, HB, sb_b, sb_h, targetB, LB,
                    TAKE_ALL_B, FP64_B, CHUNK, CAND, DIGIT)


def launch_shape(n: int):
    """``(lines per loop step, warps)`` for rows of up to ``n`` lines."""
    return (CHUNK, NUM_WARPS) if n <= LONG_ROW else (LONG_CHUNK, LONG_NUM_WARPS)


def launch_registers(warps: int, programs: int = 1, sms: Optional[int] = None) -> dict:
    """The register limit of a launch of ``programs`` programs of ``warps`` warps (``maxnreg``): with at most one
    program per SM (``sms``: the GPU's SM count, ``None``: not known) a program may take more registers than two
    programs per SM leave it (the compiler's 128 at 8 warps spills); more programs keep two per SM, and 16 warps
    keep the hardware's 128."""
    if warps * 32 * MAX_REGISTERS > 65536 or (sms is not None and programs > sms):
        return {}
    return {"maxnreg": MAX_REGISTERS}


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _prepare(score: torch.Tensor, n_floor: int, cap: int, target: float, take_all: bool, width: int,
             last_q: float):
    """Checks one line kind; returns its outputs and, when the kernel has rows to select, its launch arguments."""
    if score.dim() != 3 or score.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"select_lines: score [b, h, n] fp32/fp64 expected, got {tuple(score.shape)} {score.dtype}")
    b, h, n = score.shape
    if n and score.stride(2) != 1:
        raise ValueError("select_lines: score needs a unit stride along the lines")
    lo, hi = min(max(n_floor, 0), n), min(cap, n)
    if hi < lo:
        raise ValueError(f"select_lines: cap {cap} keeps {hi} of {n} lines, below the {lo} floors: the floors must "
                         "fit under the cap")
    if width < max(1, hi):
        raise ValueError(f"select_lines: width {width} is below min(cap, n) = {hi}")
    dev = score.device
    sel = torch.empty((b, h, width), dtype=torch.long, device=dev)
    cnt = torch.empty((b, h), dtype=torch.long, device=dev)
    mass = torch.empty((b, h), dtype=torch.float64, device=dev)
    out = (sel, cnt, mass)
    if b * h == 0:
        return out, None
    if hi <= 0:                                        # n == 0 or cap == 0: nothing is kept
        sel.fill_(-1), cnt.zero_(), mass.zero_()
        return out, None
    cx = torch.empty((b * h, CAND), dtype=torch.float64, device=dev)
    ck = torch.empty((b * h, CAND), dtype=torch.int64, device=dev)
    args = (score, sel, cnt, mass, cx, ck, n, lo, hi, width, h, score.stride(0), score.stride(1), float(target),
            float(last_q), int(bool(take_all)))
    return out, (b * h, args, score.dtype == torch.float64)


def select_line_kinds(*kinds):
    """:func:`select_lines` for one or two line kinds (each a tuple of its arguments) in one kernel launch,
    whose programs select both kinds' rows side by side; returns one ``(selected, count, covered)`` per kind.

    Raises:
        ValueError: as :func:`select_lines` for any kind; more than two kinds, or two on different devices; rows
            of ``2**15 * LONG_CHUNK`` lines or more.
    """
    if not 1 <= len(kinds) <= 2:
        raise ValueError(f"select_line_kinds: one or two line kinds, got {len(kinds)}")
    if len(kinds) == 2 and kinds[0][0].device != kinds[1][0].device:
        raise ValueError(f"select_line_kinds: the kinds' scores are on {kinds[0][0].device} and {kinds[1][0].device}")
    prepared = [_prepare(*k) for k in kinds]
    jobs = [p[1] for p in prepared if p[1] is not None]
    if jobs:
        (ra, a, fa), (rb, b, fb) = jobs[0], (jobs[1] if len(jobs) == 2 else (0, jobs[0][1], jobs[0][2]))
        n = max(k[0].shape[-1] for k in kinds)
        chunk, warps = launch_shape(n)
        if n >= 2 ** 15 * chunk:
            raise ValueError(f"select_line_kinds: rows of {n} lines; the kernel counts at most {2 ** 15 * chunk - 1} "
                             "(a pass's per-lane counts are packed in 16 bits)")
        dev = kinds[0][0].device
        sms = _sm_count(cuda_index(dev)) if dev.type == "cuda" else None
        _select_kernel[(ra + rb,)](*a, *b, ra, FP64_A=fa, FP64_B=fb, CHUNK=chunk, CAND=CAND, DIGIT=DIGIT,
                                   num_warps=warps, **launch_registers(warps, ra + rb, sms))
    return [p[0] for p in prepared]


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
        ValueError: a score that is not 3-D fp32/fp64, a non-unit inner stride, ``min(cap, n) <
            min(n_floor, n)`` (the floors must fit under the cap) or ``width < min(cap, n)`` (the kernel
            writes only inside the row's slots).
    """
    return select_line_kinds((score, n_floor, cap, target, take_all, width, last_q))[0]

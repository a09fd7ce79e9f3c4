"""Full passes over a column row that the selection kernel makes, the searches one after the other (the kernel
of 4073e91) against step 2's passes also advancing step 3's search (LOCKSTEP), on the rows of
bench_lockstep.py (heavy-tailed and near-uniform fp32 column scores, 64 floors, recall 0.98 of 64); a CPU
simulation of the kernel's search loops (numpy, CAND = 2048). Passes counted: pass 1, each streaming search
step, each copy of the candidates, the writing pass. One line per case.

    python docs/results/raw/select_lockstep/passes_sim.py
"""
import numpy as np
import torch

CAND = 2048


def columns(h, S, kind):
    x = torch.rand(1, h, S, dtype=torch.float64)
    if kind == "heavy":
        x = x ** 12
        x[..., :4] += 5.0
    return (x / x.sum(-1, keepdim=True) * 64).float()


def streaming(kr, xr, state, by_sum, F, target, need):
    lo, hi, c_lo, c_hi = state
    if not (hi - lo > 1 and c_lo - c_hi > CAND):
        return state, False
    mid = lo + (hi - lo) // 2
    ge = kr >= mid
    up = (F + xr[ge].sum() >= target) if by_sum else (ge.sum() >= need)
    c = int(ge.sum())
    return ((mid, hi, c, c_hi) if up else (lo, mid, c_lo, c)), True


def search(kr, xr, state, by_sum, F, target, need):
    """Passes of one search from ``state`` to the end (streaming steps, then one copy when an interval is left),
    and the final state (exact: finished by brute force here)."""
    n = 0
    while True:
        state, moved = streaming(kr, xr, state, by_sum, F, target, need)
        if not moved:
            break
        n += 1
    lo, hi, _, _ = state
    if hi - lo > 1:
        n += 1                                   # the copy of the candidates; the rest runs in registers
    return n


def passes(row, lo_f, cap, target, lockstep):
    x = row.numpy().astype(np.float64)
    keys = np.maximum(row.view(torch.int32).to(torch.int64).numpy(), 0)
    rest = np.arange(len(x)) >= lo_f
    kr, xr = keys[rest], x[rest]
    F, R = x[~rest].sum(), xr.sum()
    hi_cnt = min(cap, len(x))
    need_cap = hi_cnt - lo_f
    n = 2                                        # pass 1 and the writing pass
    full = (0, int(kr.max()) + 1, len(kr), 0)
    if F >= target:
        return n + search(kr, xr, full, False, F, target, 1), "floors"
    if F + R < target:
        return n + search(kr, xr, full, False, F, target, need_cap), "capped"
    cap_state = full
    s_state = full
    while True:                                  # step 2's streaming steps (and step 3's, in lockstep)
        s_state, moved = streaming(kr, xr, s_state, True, F, target, 0)
        if not moved:
            break
        n += 1
        if lockstep:
            cap_state, _ = streaming(kr, xr, cap_state, False, F, target, need_cap)
    n += search(kr, xr, s_state, True, F, target, 0)
    srt = np.sort(xr)[::-1]                      # the count, exactly
    cnt = int(np.searchsorted(np.cumsum(srt) + F >= target, True)) + 1 + lo_f
    if cnt > hi_cnt:
        n += search(kr, xr, cap_state, False, F, target, need_cap)
        return n, "capped"
    return n, "reached"


if __name__ == "__main__":
    torch.manual_seed(0)
    for S in (32768, 131072):
        for kind in ("heavy", "uniform"):
            col = columns(9, S, kind)
            for cap in (2048, 4096):
                seq = [passes(col[0, i], 64, cap, 0.98 * 64, False) for i in range(9)]
                lock = [passes(col[0, i], 64, cap, 0.98 * 64, True) for i in range(9)]
                print(f"S={S} rows={kind} cap={cap}: sequential {[p for p, _ in seq]} lockstep {[p for p, _ in lock]} "
                      f"counts {sorted({c for _, c in seq})}", flush=True)

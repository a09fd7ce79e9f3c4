"""Benchmark: _convert_rows_kernel launch time by CHUNK and num_warps at 32K and 128K (b=1, hq=9, bs=64,
2048 ascending columns, 128-256 ascending offsets), outputs checked equal to the default launch."""
import json, sys, torch
from megatron_mtraining.patterns.triton import convert as C

def pattern(S, bs, hq, nv, ns, gen):
    """Ascending columns (half among the first 4K tokens, half anywhere), ascending offsets (0-3 always)."""
    nb = S // bs
    rows = [torch.unique(torch.cat([torch.randperm(min(4096, S), generator=gen)[: nv // 2],
                                    torch.randperm(S, generator=gen)[: nv // 2]])) for _ in range(hq)]
    V = torch.full((1, hq, max(r.numel() for r in rows)), -1, dtype=torch.int64)
    for h, r in enumerate(rows):
        V[0, h, : r.numel()] = r
    sl = torch.stack([torch.sort(torch.cat([torch.arange(4), 4 + torch.randperm(nb - 4, generator=gen)[: ns - 4]])).values
                      for _ in range(hq)])[None]
    return V.to(DEV), sl.to(DEV)


def launch(dd, vt, sm, nqb, bs, chunk, warps, bits, rev, asc=False):
    b, hq, nv = vt.shape
    ns = dd.shape[-1]
    dd2, vt2, sm2 = dd.reshape(b * hq, ns), vt.reshape(b * hq, nv), sm.reshape(b * hq, -1)
    dev = vt.device
    wb, wc, nw = max(1, ns), max(1, nv), -(-nv // 64)
    bcnt = torch.empty((b, hq, nqb), dtype=torch.int32, device=dev); ccnt = torch.empty_like(bcnt)
    bidx = torch.empty((b, hq, nqb, wb), dtype=torch.int32, device=dev)
    cidx = torch.empty((b, hq, nqb, wc), dtype=torch.int32, device=dev)
    masks = torch.empty((b, hq, nqb, nw), dtype=torch.int64, device=dev)
    names = C._convert_rows_kernel.arg_names
    extra = {k: v for k, v in (("REVERSED", rev), ("ASC_COLS", asc)) if k in names}
    C._convert_rows_kernel[(nqb, b * hq)](dd2, vt2, sm2, bcnt, bidx, ccnt, cidx, masks if bits else ccnt,
                                          ns, nv, wb, wc, nqb, bs, nw, dd2.stride(0), vt2.stride(0), sm2.stride(0),
                                          CHUNK=chunk, WRITE_BITS=bits, num_warps=warps, **extra)
    return bcnt, bidx, ccnt, cidx, masks if bits else None

def timeit(fn, n=50):
    if DEV != "cuda":
        fn(); return 0.0
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * n)]
    ts = []
    for i in range(n):
        ev[2 * i].record(); fn(); ev[2 * i + 1].record()
    torch.cuda.synchronize()
    ts = sorted(ev[2 * i].elapsed_time(ev[2 * i + 1]) * 1000 for i in range(n))
    return ts[n // 2]

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
out = []
for S, ns in ((32768, 128), (131072, 256)) if DEV == "cuda" else ((8192, 16),):
    bs = 64
    nqb = S // bs
    V, sl = pattern(S, bs, 9, 2048 if DEV == "cuda" else 300, ns, gen)
    sm = torch.zeros((1, 9, nqb + 1), dtype=torch.int8, device=DEV)
    sm.scatter_(-1, torch.where(sl >= 0, sl, nqb), 1)
    sm = sm[..., :nqb]
    desc = sl.sort(-1, descending=True).values
    rev = "REVERSED" in C._convert_rows_kernel.arg_names
    ref = launch(desc, V, sm, nqb, bs, 256, 4, True, False)
    for chunk in (256, 512, 1024) if DEV == "cuda" else (64, 256):
        for warps in (4, 8) if DEV == "cuda" else (4,):
            for r, asc in (((False, False), (True, False), (True, True)) if rev else ((False, False),)):
                src = sl if r else desc
                got = launch(src, V, sm, nqb, bs, chunk, warps, True, r, asc)
                same = all(torch.equal(a, b) for a, b in zip(got, ref) if a is not None)
                us = timeit(lambda: launch(src, V, sm, nqb, bs, chunk, warps, True, r, asc))
                row = dict(S=S, chunk=chunk, warps=warps, reversed=r, asc_cols=asc, us=round(us, 1), same=same)
                print(row); out.append(row)
    sort_us = timeit(lambda: sl.sort(-1, descending=True))
    print(dict(S=S, sort_us=round(sort_us, 1))); out.append(dict(S=S, sort_us=round(sort_us, 1)))
json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "bench_convert.json", "w"), indent=1)

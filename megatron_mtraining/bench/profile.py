"""Time and host synchronisations of a ``torch.profiler`` trace, summed by labelled region.

The package labels its attention path with :func:`torch.profiler.record_function` ranges of stable
names (``megatron_mtraining.common.REGIONS``: estimator scores and selection, index conversion,
kernel plans, attention forward / backward, layout copies, LM head + loss, optimizer). A profiler
event belongs to the innermost such range around it on its thread. An event of the backward pass
(under ``autograd::engine::evaluate_function: ...``) outside any range belongs to the region of the
forward op that created its autograd node (the profiler's ``sequence_nr`` links the two), so the
backward of the LM head or of the layout copies lands in their region too; regions named
``*.forward`` then become ``*.backward``. Everything else is ``other``.

Per region and phase (``forward`` / ``backward`` / ``step`` for the optimizer): host time (the
events' own CPU time), device time (the kernels' time charged to those events; 0 on the CPU) and the
host synchronisations: CUDA runtime calls that make the host wait for the device
(:data:`SYNC_EVENTS`), counted with their wall time. On the CPU no such call exists; the count is
then reported as not applicable (``None``) by :func:`summarize`.

Public API::

    rows = region_rows(prof.events(), iterations=2)       # list of dicts, one per (region, phase)
    summary = summarize(rows, device_type="cuda", layer_calls=240)
    print(markdown_table({"dense": summary_d, "mtraining": summary_m}))
    kernels = trace_kernel_rows("trace.json", iterations=2)  # device time per kernel name, from the trace

Region sums charge a kernel to the CPU event that launched it; a kernel launched through the driver
API (Triton's launcher) or from the autograd thread may land in ``other``. :func:`trace_kernel_rows`
sums the device kernels of an exported Chrome trace by name instead, whoever launched them, and
:func:`trace_region_kernels` charges each of them to the region open around its launch call (runtime
or driver API), so Triton kernels count in their region too; :func:`overhead_share` sums those rows
into the pattern's overhead (estimation, conversion, plans) over the attention kernels' time.
"""

from __future__ import annotations

from typing import Iterable, Optional

from ..common import (REGION_ATTENTION_BWD, REGION_ATTENTION_FWD, REGION_CONVERT, REGION_ESTIMATOR_SCORES,
                      REGION_ESTIMATOR_SELECTION, REGION_OPTIMIZER, REGION_PLAN, REGIONS)

__all__ = ["SYNC_EVENTS", "OTHER", "FLUSH", "ATTENTION_PATH", "OVERHEAD_REGIONS", "SPARSE_REGIONS",
           "region_of_events", "region_rows", "summarize", "markdown_table", "trace_kernel_rows", "trace_region_kernels",
           "overhead_share"]

#: CUDA runtime calls that block the host until the device (stream, event, whole device) is done.
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2")
OTHER = "other"
#: a range whose events are left out (the profiling tool's own wait for the device at the end)
FLUSH = "profile.flush"
_BWD_MARK = "autograd::engine::evaluate_function"
#: regions of the attention path (run once per layer and micro-batch)
ATTENTION_PATH = tuple(r for r in REGIONS if r.startswith("mtraining.") and r not in
                       ("mtraining.lm_head_loss", "mtraining.optimizer"))
#: the pattern's per-layer overhead: estimation (scores, selection), index conversion, kernel plans
OVERHEAD_REGIONS = (REGION_ESTIMATOR_SCORES, REGION_ESTIMATOR_SELECTION, REGION_CONVERT, REGION_PLAN)
#: the attention kernels themselves (ring steps, merges; forward and backward)
SPARSE_REGIONS = (REGION_ATTENTION_FWD, REGION_ATTENTION_BWD)


def _is_sync(name: str) -> bool:
    return name in SYNC_EVENTS


def _ancestors(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def _self_device_us(e) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, attr, None)
        if v is not None:
            return float(v)
    return 0.0


def _backward_name(region: str) -> str:
    return region[: -len(".forward")] + ".backward" if region.endswith(".forward") else region


def region_of_events(events: Iterable) -> list:
    """``[(event, region, phase)]`` for the CPU-side events of a profiler trace (``prof.events()``).

    ``region``: a name of ``REGIONS`` or :data:`OTHER`; ``phase``: ``"forward"``, ``"backward"`` or
    ``"step"`` (optimizer)."""
    names = set(REGIONS)
    evs = [e for e in events if str(getattr(e, "device_type", "CPU")).endswith("CPU") and e.name != FLUSH
           and not any(a.name == FLUSH for a in _ancestors(e))]
    # pass 1: the explicit region and backward flag of every event
    info = []
    fwd_region = {}
    for e in evs:
        region, backward = None, False
        for a in _ancestors(e):
            if region is None and a.name in names:
                region = a.name
            if a.name.startswith(_BWD_MARK):
                backward = True
        if e.name.startswith(_BWD_MARK):
            backward = True
        info.append((e, region, backward))
        seq = getattr(e, "sequence_nr", -1)
        if not backward and seq is not None and seq >= 0:
            # ops record the number the next autograd node will get; the node's creator is the
            # last op (with its children) before the counter moves on: keep the last one seen
            fwd_region[(e.thread, seq)] = region
    out = []
    for e, region, backward in info:
        if e.name in names:                        # the range markers themselves: their own host time
            region = e.name if region is None else region
        if region is None and backward:            # the autograd node's forward op
            node = e if e.name.startswith(_BWD_MARK) else next(
                (a for a in _ancestors(e) if a.name.startswith(_BWD_MARK)), None)
            if node is not None:
                r = fwd_region.get((getattr(node, "fwd_thread", e.thread), getattr(node, "sequence_nr", -1)))
                region = _backward_name(r) if r is not None else None
        region = region or OTHER
        if region == REGION_ATTENTION_BWD:
            backward = True
        phase = "step" if region == REGION_OPTIMIZER else ("backward" if backward else "forward")
        out.append((e, region, phase))
    return out


def region_rows(events: Iterable, iterations: int = 1) -> list:
    """Per (region, phase): ``host_ms``, ``device_ms``, ``syncs``, ``sync_ms`` per iteration (the trace
    covers ``iterations`` iterations) and ``events`` (op count per iteration), sorted by region order."""
    acc: dict = {}
    for e, region, phase in region_of_events(events):
        r = acc.setdefault((region, phase), dict(host_us=0.0, device_us=0.0, syncs=0, sync_us=0.0, events=0))
        r["host_us"] += float(e.self_cpu_time_total)
        r["device_us"] += _self_device_us(e)
        r["events"] += 1
        if _is_sync(e.name):
            r["syncs"] += 1
            r["sync_us"] += float(e.cpu_time_total)
    order = {r: i for i, r in enumerate(REGIONS + (OTHER,))}
    phases = {"forward": 0, "backward": 1, "step": 2}
    n = max(1, int(iterations))
    rows = []
    for (region, phase), r in sorted(acc.items(), key=lambda kv: (order.get(kv[0][0], 99), phases[kv[0][1]])):
        rows.append(dict(region=region, phase=phase, host_ms=r["host_us"] / 1e3 / n,
                         device_ms=r["device_us"] / 1e3 / n, syncs=r["syncs"] / n, sync_ms=r["sync_us"] / 1e3 / n,
                         events=r["events"] / n))
    return rows


def summarize(rows: list, device_type: str, layer_calls: int, step_s: Optional[float] = None) -> dict:
    """Totals of :func:`region_rows` for one run.

    Args:
        rows: :func:`region_rows`.
        device_type: ``"cuda"`` or ``"cpu"``; on the CPU the sync counts are ``None`` (not applicable).
        layer_calls: attention calls per iteration (layers x micro-batches), for the per-layer count.
        step_s: the unprofiled iteration time, if measured.
    """
    cuda = device_type == "cuda"
    tot = lambda key, sel=lambda r: True: sum(r[key] for r in rows if sel(r))  # noqa: E731
    on_path = lambda r: r["region"] in ATTENTION_PATH  # noqa: E731
    out = dict(device_type=device_type, step_s=step_s, layer_calls=layer_calls, rows=rows,
               host_ms=tot("host_ms"), device_ms=tot("device_ms") if cuda else None,
               syncs=tot("syncs") if cuda else None, sync_ms=tot("sync_ms") if cuda else None,
               attention_path_syncs=tot("syncs", on_path) if cuda else None,
               attention_path_syncs_per_layer=(tot("syncs", on_path) / max(1, layer_calls)) if cuda else None)
    if not cuda:
        for r in rows:
            r["syncs"] = r["sync_ms"] = r["device_ms"] = None
    return out


def _fmt(v, spec=".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown_table(runs: dict) -> str:
    """Markdown table of :func:`summarize` results ``{mode: summary}``: one row per (region, phase),
    per mode device ms, host ms and syncs per iteration, then the totals."""
    modes = list(runs)
    order = {r: i for i, r in enumerate(REGIONS + (OTHER,))}
    phases = {"forward": 0, "backward": 1, "step": 2}
    keys = sorted({(r["region"], r["phase"]) for s in runs.values() for r in s["rows"]},
                  key=lambda k: (order.get(k[0], 99), phases.get(k[1], 9)))
    head = "| region | phase | " + " | ".join(f"{m} device ms | {m} host ms | {m} syncs" for m in modes) + " |"
    lines = [head, "|" + "---|" * (2 + 3 * len(modes))]
    for key in keys:
        cells = []
        for m in modes:
            r = next((x for x in runs[m]["rows"] if (x["region"], x["phase"]) == key), None)
            cells += [_fmt(r and r["device_ms"]), _fmt(r and r["host_ms"]), _fmt(r and r["syncs"], ".0f")] \
                if r else ["-", "-", "-"]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    tot = []
    for m in modes:
        s = runs[m]
        tot += [_fmt(s["device_ms"]), _fmt(s["host_ms"]), _fmt(s["syncs"], ".0f")]
    lines.append("| **total** | | " + " | ".join(tot) + " |")
    lines.append("")
    for m in modes:
        s = runs[m]
        lines.append(f"* {m}: iteration {_fmt(s['step_s'], '.3f')} s unprofiled; host syncs per iteration "
                     f"{_fmt(s['syncs'], '.0f')} ({_fmt(s['sync_ms'])} ms), on the attention path "
                     f"{_fmt(s['attention_path_syncs'], '.0f')} = {_fmt(s['attention_path_syncs_per_layer'])} "
                     f"per layer call ({s['layer_calls']} calls)"
                     + (f"; sparse layers kept {s['attention_kept']['mean']:.3f} of the causal attention work "
                        f"({s['attention_kept']['min']:.3f} to {s['attention_kept']['max']:.3f} by layer)"
                        if s.get("attention_kept") else "")
                     + (f"; estimation + conversion + plans {s['overhead']['overhead_ms']:.2f} ms on the device, "
                        f"{100 * s['overhead']['share']:.1f} % of the attention kernels' "
                        f"{s['overhead']['attention_ms']:.2f} ms (every kernel charged to the range around its launch)"
                        if (s.get("overhead") or {}).get("share") is not None else ""))
    return "\n".join(lines) + "\n"


def trace_kernel_rows(trace, iterations: int = 1, top: Optional[int] = None) -> list:
    """Device kernels of a Chrome trace (``prof.export_chrome_trace``), summed by name.

    Args:
        trace: the trace file's path or its parsed JSON (a dict with ``traceEvents``, or the list).
        iterations: profiled iterations in the trace (times and calls are per iteration).
        top: keep the ``top`` kernels with the most time (``None``: all).

    Returns:
        ``[{"kernel": name, "device_ms": ms per iteration, "calls": per iteration}]``, most time first:
        complete events (``"ph": "X"``) of categories ``kernel``, ``gpu_memcpy`` and ``gpu_memset``
        (``dur`` in microseconds).
    """
    events = _trace_events(trace)
    total, calls = {}, {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = e.get("name", "?")
            total[name] = total.get(name, 0.0) + float(e.get("dur", 0.0))
            calls[name] = calls.get(name, 0) + 1
    n = max(1, int(iterations))
    rows = [{"kernel": k, "device_ms": total[k] / 1e3 / n, "calls": calls[k] / n}
            for k in sorted(total, key=lambda k: -total[k])]
    return rows if top is None else rows[:top]


def _trace_events(trace) -> list:
    import json

    if not isinstance(trace, (dict, list)):
        with open(trace, encoding="utf-8") as f:
            trace = json.load(f)
    return trace.get("traceEvents", []) if isinstance(trace, dict) else trace


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def trace_region_kernels(trace, iterations: int = 1) -> list:
    """Device time of a Chrome trace (``prof.export_chrome_trace``) by region and kernel name.

    Each device event (``"ph": "X"`` of category ``kernel``, ``gpu_memcpy`` or ``gpu_memset``) is matched
    by its ``args.correlation`` to the host call that launched it (category ``cuda_runtime``, or
    ``cuda_driver``: Triton launches through the driver API), and charged to the innermost range
    named in ``REGIONS`` (category ``user_annotation``) open on that call's thread at its start. That
    covers kernels launched by any API on any thread, side streams included; a kernel whose launch
    call is missing from the trace, or lies outside every region, is charged to :data:`OTHER`.
    Unlike :func:`region_rows` there is no forward / backward phase and no autograd-node link: the
    backward of an op outside a region (the LM head's, say) lands in ``other`` here.

    Args:
        trace: the trace file's path or its parsed JSON (a dict with ``traceEvents``, or the list).
        iterations: profiled iterations in the trace (times and calls are per iteration).

    Returns:
        ``[{"region", "kernel", "device_ms", "calls"}]`` per iteration, by region order, then most
        time first (``dur`` is in microseconds in the trace).
    """
    events = _trace_events(trace)
    names = set(REGIONS)
    ranges: dict = {}         # (pid, tid) -> [(start, end, region)]
    launches: dict = {}       # correlation -> ((pid, tid), ts)
    device = []
    flushes: dict = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in _DEVICE_CATS:
            device.append(e)
        elif cat in _LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = ((e.get("pid"), e.get("tid")), float(e.get("ts", 0.0)))
        elif cat == "user_annotation" and (e.get("name") in names or e.get("name") == FLUSH):
            t0 = float(e.get("ts", 0.0))
            item = (t0, t0 + float(e.get("dur", 0.0)), e["name"])
            (flushes if e["name"] == FLUSH else ranges).setdefault((e.get("pid"), e.get("tid")), []).append(item)
    # per thread: launches in time order, swept against the ranges (they nest on one thread)
    by_thread: dict = {}
    for corr, (thread, ts) in launches.items():
        by_thread.setdefault(thread, []).append((ts, corr))
    region_of: dict = {}
    for thread, calls in by_thread.items():
        calls.sort()
        rs = sorted(ranges.get(thread, []), key=lambda r: (r[0], -r[1]))
        stack, i = [], 0
        for ts, corr in calls:
            while i < len(rs) and rs[i][0] <= ts:
                stack.append(rs[i])
                i += 1
            while stack and stack[-1][1] < ts:
                stack.pop()
            # an enclosing range may end before an inner one that was pushed later: look down the stack
            region = next((r[2] for r in reversed(stack) if r[0] <= ts <= r[1]), None)
            if region is None and any(f[0] <= ts <= f[1] for f in flushes.get(thread, [])):
                region = FLUSH
            region_of[corr] = region or OTHER
    total: dict = {}
    for e in device:
        region = region_of.get((e.get("args") or {}).get("correlation"), OTHER)
        if region == FLUSH:
            continue
        key = (region, e.get("name", "?"))
        t, c = total.get(key, (0.0, 0))
        total[key] = (t + float(e.get("dur", 0.0)), c + 1)
    order = {r: i for i, r in enumerate(REGIONS + (OTHER,))}
    n = max(1, int(iterations))
    keys = sorted(total, key=lambda k: (order.get(k[0], 99), -total[k][0]))
    return [{"region": r, "kernel": k, "device_ms": total[(r, k)][0] / 1e3 / n, "calls": total[(r, k)][1] / n}
            for r, k in keys]


def overhead_share(rows: list) -> dict:
    """The pattern's per-layer overhead from :func:`trace_region_kernels` rows: ``{"regions": {region:
    device_ms}, "overhead_ms": ..., "attention_ms": ..., "share": overhead_ms / attention_ms}`` with
    the overhead the device time of :data:`OVERHEAD_REGIONS` (estimation, conversion, plans) and the
    attention the device time of :data:`SPARSE_REGIONS` (the attention kernels, forward and
    backward); ``share`` is ``None`` without attention time."""
    regions: dict = {}
    for r in rows:
        regions[r["region"]] = regions.get(r["region"], 0.0) + r["device_ms"]
    over = sum(regions.get(r, 0.0) for r in OVERHEAD_REGIONS)
    att = sum(regions.get(r, 0.0) for r in SPARSE_REGIONS)
    return dict(regions=regions, overhead_ms=over, attention_ms=att, share=over / att if att > 0 else None)

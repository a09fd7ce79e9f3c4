"""tools/profile_step.py and megatron_mtraining.bench.profile on CPU.

The region sums are checked against a trace whose ops are known (record_function ranges, an
autograd backward, a fake CUDA sync call); the tool itself runs one mode of a tiny model end to end
(``slow``: one subprocess, about 20 s on one core).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from megatron_mtraining.bench.profile import FLUSH, OTHER, markdown_table, region_of_events, region_rows, summarize
from megatron_mtraining.common import (REGION_ATTENTION_FWD, REGION_CONVERT, REGION_LM_HEAD_LOSS, REGION_OPTIMIZER,
                                       REGIONS)
from tools import profile_step as ps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trace():
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(REGION_ATTENTION_FWD):
            y = torch.tanh(x @ w)                   # its backward belongs to attention.backward
        with record_function(REGION_CONVERT):
            with torch.no_grad():
                torch.cumsum(torch.ones(5), 0)      # no autograd node, forward only
        with record_function(REGION_LM_HEAD_LOSS):
            loss = (y.exp()).sum()
        z = y.detach() * 2                          # outside every range: other
        loss.backward()
        with record_function(REGION_OPTIMIZER):
            with torch.no_grad():
                w -= 0.1 * w.grad
    return prof, z


def test_backward_ops_land_in_their_forward_region():
    prof, _ = _trace()
    got = {}
    for e, region, phase in region_of_events(prof.events()):
        got.setdefault((region, phase), set()).add(e.name)
    assert "aten::mm" in got[(REGION_ATTENTION_FWD, "forward")]
    bwd_attn = got[("mtraining.attention.backward", "backward")]
    assert any("TanhBackward" in n for n in bwd_attn) and any("MmBackward" in n for n in bwd_attn)
    assert any("ExpBackward" in n for n in got[(REGION_LM_HEAD_LOSS, "backward")])
    assert "aten::cumsum" in got[(REGION_CONVERT, "forward")]
    assert ("mtraining.convert", "backward") not in got
    assert "aten::mul" in got[(OTHER, "forward")]
    assert any(n.startswith("aten::sub") for n in got[(REGION_OPTIMIZER, "step")])
    # negative control: the tanh backward is not charged to the LM head
    assert not any("TanhBackward" in n for n in got[(REGION_LM_HEAD_LOSS, "backward")])


def test_rows_sum_to_the_trace_and_cpu_syncs_are_not_applicable():
    prof, _ = _trace()
    rows = region_rows(prof.events(), iterations=2)
    total = sum(float(e.self_cpu_time_total) for e in prof.events()) / 1e3 / 2
    assert sum(r["host_ms"] for r in rows) == pytest.approx(total, rel=1e-9)
    s = summarize(rows, "cpu", layer_calls=4, step_s=0.5)
    assert s["syncs"] is None and s["attention_path_syncs_per_layer"] is None
    assert all(r["syncs"] is None for r in s["rows"])
    table = markdown_table({"dense": s})
    assert "| **total** |" in table and "n/a" in table
    lines = [x.split("|")[1].strip() for x in table.splitlines() if x.startswith("| mtraining.")]
    assert lines == sorted(lines, key=lambda r: REGIONS.index(r))


def _event(name, parent=None, cpu_us=1.0, total_us=None, device_us=0.0):
    return SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=cpu_us,
                           cpu_time_total=cpu_us if total_us is None else total_us,
                           self_device_time_total=device_us, device_type="DeviceType.CPU", sequence_nr=-1,
                           thread=1, fwd_thread=0)


def test_sync_calls_are_counted_per_region():
    """The CUDA path of the counter on hand-made events: a stream sync under the estimator's
    selection (one per layer call), a device sync in the optimizer; launches are not syncs."""
    sel = _event("mtraining.estimator.selection")
    item = _event("aten::_local_scalar_dense", sel)
    opt = _event(REGION_OPTIMIZER)
    flush = _event(FLUSH)
    evs = [sel, item, _event("cudaStreamSynchronize", item, total_us=300.0),
           _event("cudaLaunchKernel", item, device_us=50.0), opt,
           _event("cudaDeviceSynchronize", opt, total_us=1000.0), flush,
           _event("cudaDeviceSynchronize", flush, total_us=5000.0)]          # the tool's own wait: left out
    rows = region_rows(evs, iterations=1)
    s = summarize(rows, "cuda", layer_calls=1)
    by = {(r["region"], r["phase"]): r for r in rows}
    assert by[("mtraining.estimator.selection", "forward")]["syncs"] == 1
    assert by[("mtraining.estimator.selection", "forward")]["sync_ms"] == pytest.approx(0.3)
    assert by[("mtraining.estimator.selection", "forward")]["device_ms"] == pytest.approx(0.05)
    assert by[(REGION_OPTIMIZER, "step")]["syncs"] == 1
    assert s["syncs"] == 2 and s["attention_path_syncs"] == 1 and s["attention_path_syncs_per_layer"] == 1


def test_input_check_range_only_when_the_check_runs():
    """``mtraining.input_check`` marks the cross-rank check: present on a new signature, absent on a
    signature already passed (the end-to-end test below relies on it)."""
    from megatron_mtraining.plan import resolve

    plan = resolve(None, cp_group=None)
    q = torch.randn(1, 64, 2, 8, dtype=torch.float64)
    for expect in (True, False):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            plan.check_inputs(q, q, q, softmax_scale=0.5)
        assert any(e.name == "mtraining.input_check" for e in prof.events()) == expect


def test_trace_kernel_rows_sum_device_events_by_name(tmp_path):
    import json

    from megatron_mtraining.bench.profile import trace_kernel_rows

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "_sparse_fwd_kernel", "dur": 1500.0},
        {"ph": "X", "cat": "kernel", "name": "_sparse_bwd_dkdv_kernel", "dur": 2000.0},
        {"ph": "X", "cat": "kernel", "name": "_sparse_fwd_kernel", "dur": 600.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "dur": 10.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9000.0},          # host op: not a kernel
        {"ph": "i", "cat": "kernel", "name": "marker"}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    rows = trace_kernel_rows(str(path), iterations=2)
    assert rows == [{"kernel": "_sparse_fwd_kernel", "device_ms": 1.05, "calls": 1.0},
                    {"kernel": "_sparse_bwd_dkdv_kernel", "device_ms": 1.0, "calls": 0.5},
                    {"kernel": "Memset (Device)", "device_ms": 0.005, "calls": 0.5}]
    assert [r["kernel"] for r in trace_kernel_rows(trace, top=1)] == ["_sparse_fwd_kernel"]
    assert trace_kernel_rows(trace["traceEvents"], iterations=1)[-1]["device_ms"] == 0.01


def test_trace_region_kernels_charge_kernels_to_the_range_around_their_launch():
    from megatron_mtraining.bench.profile import OTHER, overhead_share, trace_region_kernels
    from megatron_mtraining.common import REGION_ATTENTION_BWD, REGION_ATTENTION_FWD, REGION_ESTIMATOR_SCORES, REGION_PLAN

    X = lambda cat, name, ts, dur, tid=1, corr=None: dict(  # noqa: E731
        ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=7, tid=tid, **({"args": {"correlation": corr}} if corr else {}))
    ev = [
        X("user_annotation", REGION_ATTENTION_FWD, 0, 100),
        X("user_annotation", REGION_PLAN, 10, 20),                   # nested: the innermost range wins
        X("cuda_driver", "cuLaunchKernelEx", 12, 1, corr=1),         # Triton launch inside the plan range
        X("cuda_runtime", "cudaLaunchKernel", 40, 1, corr=2),        # after it, still in the forward range
        X("cuda_runtime", "cudaLaunchKernel", 150, 1, corr=3),       # outside every range
        X("user_annotation", REGION_ATTENTION_BWD, 200, 50, tid=2),  # another thread (autograd)
        X("cuda_driver", "cuLaunchKernelEx", 210, 1, tid=2, corr=4),
        X("cuda_runtime", "cudaLaunchKernel", 20, 1, tid=2, corr=5),  # the plan range is on thread 1, not 2
        X("user_annotation", "profile.flush", 300, 10),
        X("cuda_runtime", "cudaMemcpyAsync", 301, 1, corr=6),        # the tool's own flush: left out
        X("user_annotation", REGION_ESTIMATOR_SCORES, 400, 10),
        X("kernel", "_col_bits_kernel", 500, 3000.0, corr=1),
        X("kernel", "_sparse_fwd_kernel", 510, 5000.0, corr=2),
        X("kernel", "elementwise", 520, 700.0, corr=3),
        X("kernel", "_sparse_bwd_dq_kernel", 530, 4000.0, corr=4),
        X("kernel", "elementwise", 540, 100.0, corr=5),
        X("gpu_memcpy", "Memcpy DtoH", 550, 50.0, corr=6),
        X("kernel", "orphan", 560, 20.0, corr=99),                   # its launch call is not in the trace
        X("kernel", "_col_bits_kernel", 600, 1000.0, corr=1)]        # same launch id: same region
    rows = trace_region_kernels({"traceEvents": ev}, iterations=2)
    assert rows == [
        {"region": REGION_PLAN, "kernel": "_col_bits_kernel", "device_ms": 2.0, "calls": 1.0},
        {"region": REGION_ATTENTION_FWD, "kernel": "_sparse_fwd_kernel", "device_ms": 2.5, "calls": 0.5},
        {"region": REGION_ATTENTION_BWD, "kernel": "_sparse_bwd_dq_kernel", "device_ms": 2.0, "calls": 0.5},
        {"region": OTHER, "kernel": "elementwise", "device_ms": 0.4, "calls": 1.0},
        {"region": OTHER, "kernel": "orphan", "device_ms": 0.01, "calls": 0.5}]
    share = overhead_share(rows)
    assert share["overhead_ms"] == 2.0 and share["attention_ms"] == 4.5
    assert abs(share["share"] - 2.0 / 4.5) < 1e-12
    assert overhead_share([])["share"] is None


def test_trainer_argv_and_shapes():
    a = ps.build_parser().parse_args(["--shape", "smollm2-135m", "--seq-length", "32768", "--", "--foo"])
    argv = ps.trainer_argv(a, "mtraining")
    assert argv[argv.index("--num-layers") + 1] == "30" and argv[argv.index("--num-attention-heads") + 1] == "9"
    assert argv[argv.index("--num-query-groups") + 1] == "3" and argv[argv.index("--kv-channels") + 1] == "64"
    assert "--mtraining-config" in argv and argv[-1] == "--foo"
    assert "--mtraining-config" not in ps.trainer_argv(a, "dense")
    q = ps.trainer_argv(ps.build_parser().parse_args(["--shape", "qwen2.5-3b-4l"]), "dense")
    assert q[q.index("--num-layers") + 1] == "4" and q[q.index("--hidden-size") + 1] == "2048"
    assert q[q.index("--num-query-groups") + 1] == "2" and "--untie-embeddings-and-output-weights" in q
    with pytest.raises(SystemExit):
        ps.main(["--modes", "dense,sparse", "--shape", "tiny"])
    with pytest.raises(SystemExit):
        ps.main(["--active", "0"])


@pytest.mark.slow
def test_one_mode_end_to_end_on_cpu(tmp_path):
    cfg = tmp_path / "vs.yaml"
    cfg.write_text("implementation: striped\ngranularity: 64\npattern: vertical_slash\n"
                   "vertical_slash: {recall: 0.9, last_q: 64, block_size: 64, sink_tokens: 16, local_blocks: 1, "
                   "max_vertical: 64, max_slash: 4}\n")
    out = tmp_path / "p.json"
    md = tmp_path / "p.md"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "profile_step.py"), "--shape", "tiny",
                        "--seq-length", "256", "--global-batch-size", "2", "--warmup", "1", "--timed", "1",
                        "--active", "1", "--modes", "mtraining", "--mtraining-config", str(cfg), "--json", str(out),
                        "--markdown", str(md)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads(out.read_text())
    run = rec["runs"]["mtraining"]
    assert rec["meta"]["tool"] == "profile_step"
    regions = {r["region"] for r in run["rows"]}
    for name in ("mtraining.estimator.scores", "mtraining.estimator.selection", "mtraining.convert",
                 "mtraining.plan", "mtraining.attention.forward", "mtraining.attention.backward",
                 "mtraining.copies", "mtraining.lm_head_loss", "mtraining.optimizer"):
        assert name in regions, name
    assert run["layer_calls"] == 4 and run["syncs"] is None and run["step_s"] > 0
    # the cross-rank input check ran in the warm-up (once per signature), not in the profiled iteration
    assert "mtraining.input_check" not in regions
    assert "| mtraining.convert | forward |" in md.read_text()
    kept = run["attention_kept"]           # the timed iteration's sparse layers (2 layers)
    assert kept["layers"] == 2 and 0 < kept["min"] <= kept["mean"] <= kept["max"] <= 1, kept
    assert "sparse layers kept" in md.read_text()


@pytest.mark.gpu
def test_cuda_syncs_are_found_in_a_real_trace():
    """CUDA: an ``.item()`` inside a range is counted as a host sync of that range; queued kernels
    without a read are not."""
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(REGION_CONVERT):
            (x @ x).sum().item()
        with record_function(REGION_ATTENTION_FWD):
            x @ x
        torch.cuda.synchronize()
    by = {(r["region"], r["phase"]): r for r in region_rows(prof.events())}
    assert by[(REGION_CONVERT, "forward")]["syncs"] >= 1
    assert by[(REGION_CONVERT, "forward")]["device_ms"] > 0
    assert by[(REGION_ATTENTION_FWD, "forward")]["syncs"] == 0 and by[(REGION_ATTENTION_FWD, "forward")]["device_ms"] > 0


@pytest.mark.gpu
def test_triton_launches_are_charged_to_their_region_in_a_real_trace(tmp_path):
    """CUDA: a Triton kernel (launched through the driver API) inside a range, on the main thread and
    in an autograd backward (another thread), lands in that range's region of
    ``trace_region_kernels``; a torch kernel outside every range lands in ``other``."""
    from megatron_mtraining.bench.profile import OTHER, trace_region_kernels
    from megatron_mtraining.common import REGION_ATTENTION_BWD, REGION_PLAN
    from megatron_mtraining.ops.triton.launch import _leading_below

    index = torch.arange(64, device="cuda", dtype=torch.int32).view(1, 1, 1, 64).expand(1, 2, 4, 64).contiguous()
    count = torch.full((1, 2, 4), 64, device="cuda", dtype=torch.int32)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            with record_function(REGION_ATTENTION_BWD):
                _leading_below(index, count, 1)
            return g * 2

    x = torch.randn(256, device="cuda", requires_grad=True)
    _leading_below(index, count, 1)          # compiled before the trace
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(REGION_PLAN):
            _leading_below(index, count, 1)
        Probe.apply(x).sum().backward()
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    rows = trace_region_kernels(str(path))
    where = {(r["region"], r["kernel"]) for r in rows}
    assert (REGION_PLAN, "_leading_below_kernel") in where, rows
    assert (REGION_ATTENTION_BWD, "_leading_below_kernel") in where, rows
    assert all(r["region"] == OTHER for r in rows if r["kernel"] != "_leading_below_kernel"), rows


@pytest.mark.parametrize("argv, message", [
    (["--seq-length", "100"], "--seq-length must be a positive multiple of 64 for the mtraining mode"),
    (["--global-batch-size", "3", "--micro-batch-size", "2"],
     "--global-batch-size 3 must be a positive multiple of --micro-batch-size 2"),
    (["--run-timeout", "-1"], "--run-timeout must be > 0 seconds"),
    (["--modes", ""], "--modes '': no mode to run"),
])
def test_profile_step_refuses_bad_arguments_before_any_run(capsys, argv, message):
    from tools.profile_step import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

"""megatron_mtraining.bench: the timer's semantics (on a scripted clock), the result record and the
strict JSON writer."""
from __future__ import annotations

import json
import math
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_mtraining.bench import environment, measure, result_record, to_jsonable, write_json
from megatron_mtraining.bench import timer as timer_mod

REPO = Path(__file__).resolve().parents[2]


class ScriptedClock:
    """``perf_counter`` that advances only when the timed function runs: call ``i`` takes ``durations[i]`` s."""

    def __init__(self, durations):
        self.t, self.durations, self.calls = 0.0, list(durations), 0

    def perf_counter(self):
        return self.t

    def fn(self):
        self.t += self.durations[self.calls]
        self.calls += 1


@pytest.fixture
def clock(monkeypatch):
    def make(durations):
        c = ScriptedClock(durations)
        monkeypatch.setattr(timer_mod, "time", types.SimpleNamespace(perf_counter=c.perf_counter))
        return c
    return make


def test_fixed_repeats_skip_warmup_and_take_the_median(clock):
    c = clock([9.0, 9.0, 0.005, 0.001, 0.003, 0.002, 0.004])       # two warm-ups, then 5 samples
    t = measure(c.fn, device="cpu", warmup=2, repeats=5)
    assert c.calls == 7 and t.warmup == 2 and t.reps == 5 and t.clock == "perf_counter"
    assert t.median_ms == pytest.approx(3.0) and t.min_ms == pytest.approx(1.0) and t.max_ms == pytest.approx(5.0)
    assert t.median_s == pytest.approx(3e-3)
    assert t.to_dict()["median_ms"] == pytest.approx(3.0) and t.to_dict()["reps"] == 5


def test_even_count_median_is_the_mean_of_the_middle_two(clock):
    c = clock([0.001, 0.004, 0.002, 0.003])
    assert measure(c.fn, device="cpu", warmup=0, repeats=4).median_ms == pytest.approx(2.5)


def test_budget_sets_the_count_from_the_first_sample_within_bounds(clock):
    c = clock([1.0] + [0.125] * 100)                    # warm-up 1 s, samples 125 ms (exact in binary)
    t = measure(c.fn, device="cpu", warmup=1, budget_s=0.5, min_repeats=2, max_repeats=50)
    assert t.reps == 4 and c.calls == 5                 # 0.5 s / 125 ms; the first sample counts
    c = clock([0.1] * 100)
    assert measure(c.fn, device="cpu", warmup=0, budget_s=0.05, min_repeats=3).reps == 3     # floor
    c = clock([0.001] * 100)
    assert measure(c.fn, device="cpu", warmup=0, budget_s=10.0, max_repeats=7).reps == 7     # cap


def test_long_call_ends_warmup(clock):
    c = clock([2.0, 0.01, 0.01, 0.01, 0.01])
    t = measure(c.fn, device="cpu", warmup=3, repeats=2, long_call_ms=1000)
    assert t.warmup == 1 and c.calls == 3               # a 2 s warm-up call: no further warm-up
    c = clock([0.5, 0.5, 0.5, 0.01, 0.01])
    assert measure(c.fn, device="cpu", warmup=3, repeats=2, long_call_ms=1000).warmup == 3


def test_cuda_samples_are_synchronized_event_pairs(monkeypatch):
    log = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            log.append("record")
            self.at = len(log)

        def elapsed_time(self, other):
            return float(other.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: log.append("sync"))
    t = measure(lambda: log.append("fn"), device="cuda", warmup=1, repeats=2)
    assert log == ["sync", "record", "fn", "record", "sync"] * 3
    assert t.clock == "cuda_event" and t.reps == 2 and t.median_ms == 2.0


@pytest.mark.parametrize("kw, msg", [(dict(), "exactly one"), (dict(repeats=2, budget_s=1.0), "exactly one"),
                                     (dict(repeats=0), "repeats"), (dict(budget_s=0.0), "budget_s"),
                                     (dict(repeats=1, warmup=-1), "warmup"),
                                     (dict(budget_s=1.0, min_repeats=5, max_repeats=2), "min_repeats")])
def test_bad_arguments_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        measure(lambda: None, device="cpu", **kw)


def test_environment_names_versions_commit_and_command():
    meta = environment(device="cpu", argv=["--json", "x.json"], tool="demo")
    assert meta["tool"] == "demo" and meta["device"] == "cpu" and meta["argv"] == ["--json", "x.json"]
    assert meta["command"].endswith("--json x.json") and meta["torch"] == torch.__version__
    assert meta["date"] == meta["timestamp_utc"][:10]
    for key in ("python", "triton", "megatron_core", "cuda", "host", "git_dirty"):
        assert key in meta
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert meta["git_commit"] == head.stdout.strip()
    json.dumps(meta, allow_nan=False)


def test_result_record_puts_meta_first_and_lets_the_tool_add_to_it():
    rec = result_record({"rows": [1], "meta": {"note": "x", "device": "cpu-dry-run"}}, device="cpu", argv=[],
                        tool="t")
    assert list(rec) == ["meta", "rows"] and rec["rows"] == [1]
    assert rec["meta"]["note"] == "x" and rec["meta"]["device"] == "cpu-dry-run" and rec["meta"]["tool"] == "t"


def _strict_load(path):
    def bad(token):
        raise AssertionError(f"non-standard JSON constant {token}")
    return json.loads(Path(path).read_text(), parse_constant=bad)


def test_write_json_is_strict_converts_arrays_and_is_atomic(tmp_path):
    out = tmp_path / "sub" / "r.json"
    obj = {"nan": float("nan"), "inf": -math.inf, "ok": 1.5, "np": np.arange(3), "np_scalar": np.float32(2.0),
           "np_bool": np.bool_(True), "t": torch.tensor([[1, 2]]), "t_scalar": torch.tensor(0.5),
           "dtype": torch.bfloat16, "path": Path("a/b"), "tuple": (1, 2), 3: "int key",
           "nested": [{"x": float("nan")}], "np_nan": np.array([1.0, np.nan])}
    write_json(out, obj)
    back = _strict_load(out)
    assert back == {"nan": None, "inf": None, "ok": 1.5, "np": [0, 1, 2], "np_scalar": 2.0, "np_bool": True,
                    "t": [[1, 2]], "t_scalar": 0.5, "dtype": "torch.bfloat16", "path": "a/b", "tuple": [1, 2],
                    "3": "int key", "nested": [{"x": None}], "np_nan": [1.0, None]}
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]        # no temporary file left


def test_write_json_refuses_unknown_objects_and_keeps_the_old_file(tmp_path):
    out = tmp_path / "r.json"
    write_json(out, {"a": 1})
    with pytest.raises(TypeError, match=r"\$\.rows\[1\]\.bad: object"):
        write_json(out, {"rows": [{}, {"bad": object()}]})
    assert _strict_load(out) == {"a": 1} and len(list(tmp_path.iterdir())) == 1
    assert to_jsonable({"x": float("inf")}) == {"x": None}


def test_forward_backward_timing_runs_both_passes_with_a_fixed_gradient():
    """time_forward_backward: every timed call is a forward and the backward of the same output gradient
    (the gradients agree call to call, nothing accumulates, the caller's tensors get none); compare_speed
    times sparse then dense and reports dense / sparse. A fake timer stands in for measure."""
    from megatron_mtraining.bench import Timing, compare_speed, time_forward_backward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g) for _ in range(3))
    calls, grads = [], []

    def attention(q_, k_, v_):
        calls.append(q_.requires_grad and k_.requires_grad and v_.requires_grad)
        probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q_, k_), -1)
        return torch.einsum("bhqk,bkhd->bqhd", probs, v_)

    def fake_timer(step, *, device, warmup, repeats):
        assert (device, warmup, repeats) == ("cpu", 2, 3)
        grads.extend(step() for _ in range(warmup + repeats))
        return Timing((float(len(grads)),) * repeats, warmup, "fake")

    t = time_forward_backward(attention, q, k, v, device="cpu", warmup=2, repeats=3, timer=fake_timer)
    assert t.median_ms == 5.0 and all(calls) and len(calls) == 5
    assert all(torch.equal(a, b) for g_ in grads[1:] for a, b in zip(g_, grads[0]))
    assert all(x.grad is None and not x.requires_grad for x in (q, k, v))
    assert [x.shape for x in grads[0]] == [q.shape, k.shape, v.shape] and grads[0][0].abs().sum() > 0
    cmp = compare_speed(attention, attention, q, k, v, device="cpu", warmup=2, repeats=3, timer=fake_timer)
    assert (cmp.sparse.median_ms, cmp.dense.median_ms, cmp.speedup) == (10.0, 15.0, 1.5)
    assert cmp.to_dict() == {"sparse_ms": 10.0, "dense_ms": 15.0, "speedup": 1.5, "repeats": 3, "warmup": 2,
                             "clock": "fake"}
    real = time_forward_backward(attention, q, k, v, device="cpu", warmup=1, repeats=2)   # the one timer
    assert real.clock == "perf_counter" and real.reps == 2 and real.median_ms > 0

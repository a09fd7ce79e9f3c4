"""tools/imbalance.py: FLOP model vs brute force on dense masks, metrics, schedules, files, GPU path on CPU."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_mtraining.layout import Layout
from tools import imbalance as im

S = 1024


def brute_force(pattern, layout: Layout):
    """Per (query rank, key owner) work from the dense token mask, by the definitions of the tool:
    ``{unit: (slash [cp, cp], vertical [cp, cp])}``."""
    cp, n = layout.cp_size, S // layout.cp_size
    pos = torch.arange(S)
    d = pos[:, None] // 64 - pos[None, :] // 64
    causal = pos[None, :] <= pos[:, None]
    perm = layout.permutation(S)
    slash = (pattern.slash_mask()[0][:, d.clamp(min=0)] & (d >= 0) & causal)[:, perm][:, :, perm]
    vert = (pattern.vertical_mask()[0][:, None, :] & causal)[:, perm][:, :, perm] & ~slash
    h = slash.shape[0]
    # 64x64 local tiles holding a slash pair; columns seen by some row of a tile outside such tiles
    act = slash.reshape(h, S // 64, 64, S // 64, 64).any(4).any(2)
    seen = vert.reshape(h, S // 64, 64, S).any(2) & ~act.repeat_interleave(64, dim=2)
    t = n // 64
    out = {u: (np.zeros((cp, cp)), np.zeros((cp, cp))) for u in im.UNITS}
    for r in range(cp):
        for o in range(cp):
            out["pairs"][0][r, o] = int(slash[:, r * n:(r + 1) * n, o * n:(o + 1) * n].sum())
            out["pairs"][1][r, o] = int(vert[:, r * n:(r + 1) * n, o * n:(o + 1) * n].sum())
            out["tiles"][0][r, o] = int(act[:, r * t:(r + 1) * t, o * t:(o + 1) * t].sum()) * 64 * 64
            out["tiles"][1][r, o] = int(seen[:, r * t:(r + 1) * t, o * n:(o + 1) * n].sum()) * 64
    return out


def hand_pattern():
    """Two heads; head 1 lacks block diagonal 0 (columns inside the diagonal block are then kept)."""
    return im.pattern_from_arrays(S, [np.array([0, 1, 5, 9]), np.array([1, 3, 7])],
                                  [np.array([0, 1, 2, 100, 101, 640, 1000]), np.array([0, 5, 64, 65, 700, 1023])])


def small_synthetic(heads=2):
    return im.synthetic_pattern(S, im.SyntheticConfig(heads=heads, sparsity=0.8, sinks=8, window=2,
                                                      max_vertical=48, seed=3))


@pytest.mark.parametrize("kind,cp,g", [("contiguous", 4, 64), ("zigzag", 4, 64), ("striped", 4, 64),
                                       ("striped", 2, 128), ("striped", 4, 1), ("striped", 2, 16)])
def test_flop_model_equals_brute_force(kind, cp, g):
    layout = Layout(kind, cp, g)
    geo = im.Geometry(layout, S)
    for pattern in (hand_pattern(), small_synthetic()):
        ref = brute_force(pattern, layout)
        for unit in im.UNITS:
            ws, wv = im.pair_work(geo, pattern, unit)
            np.testing.assert_array_equal(ws, ref[unit][0])
            np.testing.assert_array_equal(wv, ref[unit][1])


@pytest.mark.parametrize("kind,g", [("striped", 64), ("zigzag", 64), ("contiguous", 64)])
def test_tiles_unit_is_the_converters_work(kind, g):
    from megatron_mtraining.patterns.convert import convert_pattern

    layout = Layout(kind, 4, g)
    pattern = hand_pattern()
    ws, wv = im.pair_work(im.Geometry(layout, S), pattern, "tiles")
    for r in range(4):
        for o, st in enumerate(convert_pattern(pattern, layout, r)):
            assert ws[r, o] == int(st.block_count.sum()) * 64 * 64
            assert wv[r, o] == int(st.column_count.sum()) * 64


def test_pairs_unit_dense_total_is_causal():
    ws, wv = im.pair_work(im.Geometry(Layout("zigzag", 4, 64), S), im.dense_pattern(S, 3), "pairs")
    assert ws.sum() == 3 * S * (S + 1) // 2 and wv.sum() == 0


def test_metric_definitions_on_hand_made_W():
    W = np.array([[4.0, 1.0, 1.0],
                  [2.0, 2.0, 2.0]])
    m = im.metrics(W, ring_steps=3)
    colmax, colmean = W.max(0), W.mean(0)
    assert m["worker_imbalance"] == pytest.approx(colmax.sum() / colmean.sum())          # 8 / 6
    assert m["worker_imbalance"] == pytest.approx(8 / 6)
    assert m["step_imbalance"] == pytest.approx(((4 / 2) + (2 / 2)) / 2)                 # 1.5
    assert m["ring_time_over_ideal"] == pytest.approx(8 / (12 / 2))
    assert m["total_imbalance"] == pytest.approx(1.0)
    # an extra (columns) phase counts for the worker level but not for the step level
    W2 = np.concatenate([W, [[0.0], [6.0]]], axis=1)
    m2 = im.metrics(W2, ring_steps=3)
    assert m2["worker_imbalance"] == pytest.approx(14 / 9)
    assert m2["step_imbalance"] == pytest.approx(1.5)


def test_by_step_follows_the_ring():
    pair = np.arange(16.0).reshape(4, 4)
    W = im.by_step(pair)
    for r in range(4):
        for s in range(4):
            assert W[r, s] == pair[r, (r - s) % 4]


def test_schedules_conserve_work_and_deferred_fills_bubbles_only():
    rng = np.random.default_rng(0)
    slash, vert = rng.random((8, 8)) * 10, rng.random((8, 8)) * 3
    vert[:, 0] += 20                                      # owner 0 is column-heavy (sinks)
    total = slash.sum() + vert.sum()
    ring = im.schedule(slash, vert, "in-ring")
    oor = im.schedule(slash, vert, "out-of-ring")
    dfr = im.schedule(slash, vert, "deferred")
    for W in (ring, oor, dfr):
        assert W.sum() == pytest.approx(total)
    level = im.by_step(slash).max(0)
    assert np.all(dfr[:, :8].max(0) <= level + 1e-9)      # never lengthens a ring step
    assert np.all(dfr[:, 8] <= oor[:, 8] + 1e-9)
    assert im.metrics(dfr, 8)["ring_time"] <= im.metrics(oor, 8)["ring_time"] + 1e-9
    assert im.metrics(oor, 8)["worker_imbalance"] < im.metrics(ring, 8)["worker_imbalance"]


def test_dense_causal_step_imbalance_closed_forms():
    """Dense causal, pairs: zigzag step 0 holds 2c^2 + c pairs, every other step 2c^2 (c = S/(2 cp));
    striped-1 rank r holds n(n+1)/2 pairs at steps s <= r and n(n-1)/2 after (n = S/cp). Both are
    1 + (1 - 1/cp)/n to first order: for dense attention zigzag is NOT more step-imbalanced than
    striped (exactly, it is marginally less); contiguous is far worse than both."""
    seq, cp = 4096, 4
    pattern = im.dense_pattern(seq, 1)
    z = im.flop_model(pattern, Layout("zigzag", cp, 64), "pairs", "in-ring")
    st = im.flop_model(pattern, Layout("striped", cp, 1), "pairs", "in-ring")
    c, n = seq // (2 * cp), seq // cp
    assert z["step_imbalance"] == pytest.approx((2 * c * c + c) / (2 * c * c + c / cp), rel=1e-12)
    ref = np.mean([(n * (n + 1) / 2) / (n * (n - 1) / 2 + n * (r + 1) / cp) for r in range(cp)])
    assert st["step_imbalance"] == pytest.approx(ref, rel=1e-12)
    assert z["step_imbalance"] <= st["step_imbalance"] < 1 + 2 / n
    assert z["worker_imbalance"] == pytest.approx(1.0)
    contiguous = im.flop_model(pattern, Layout("contiguous", cp, 64), "pairs", "in-ring")
    assert contiguous["step_imbalance"] > 2 and contiguous["worker_imbalance"] > 1.5


def test_sparse_zigzag_step_imbalance_far_above_striped():
    pattern = im.synthetic_pattern(65536, im.SyntheticConfig(heads=4))
    z = im.flop_model(pattern, Layout("zigzag", 8, 64), "tiles", "in-ring")
    st = im.flop_model(pattern, Layout("striped", 8, 64), "tiles", "in-ring")
    assert z["step_imbalance"] - 1 > 5 * (st["step_imbalance"] - 1)
    assert z["worker_imbalance"] > st["worker_imbalance"]


def test_synthetic_pattern_is_rope_like_and_seeded():
    seq = 524288
    nb_q = seq // 64
    cfg = im.SyntheticConfig(heads=3, seed=7)
    a, b = im.synthetic_pattern(seq, cfg), im.synthetic_pattern(seq, cfg)
    assert a.same_selection(b)
    assert not a.same_selection(im.synthetic_pattern(seq, im.SyntheticConfig(heads=3, seed=8)))
    for offs, cols in im.head_lines(a):
        assert set(range(16)) <= set(offs.tolist())       # local window >= 16 blocks
        assert set(range(64)) <= set(cols.tolist())       # attention sinks
        assert offs.max() > 1024 and cols.max() > 65536   # heavy tails reach far
        assert np.median(offs) < nb_q // 8 and np.median(cols) < seq // 16   # most mass near the start
    r = im.flop_model(a, Layout("contiguous", 1, 64), "tiles", "in-ring")
    nb = seq // 64
    assert r["total_work"] / 4096 / 3 / (nb * (nb + 1) / 2) == pytest.approx(0.05, rel=0.05)   # ~95 % sparse


@pytest.mark.parametrize("ext", [".npz", ".pt"])
def test_pattern_file_roundtrip_and_cli(tmp_path, ext):
    pattern = small_synthetic()
    path = str(tmp_path / f"p{ext}")
    im.save_pattern(path, pattern, {"source": "test"})
    back, meta = im.load_pattern(path)
    assert back.same_selection(pattern) and meta == {"source": "test"}
    out = tmp_path / "o.json"
    assert im.main(["--pattern", "file", "--pattern-file", path, "--cp", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["seq_len"] == S


def test_json_keys(tmp_path):
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    assert im.main(["--cp", "4", "--seq-len", "4096", "--heads", "2", "--vertical", "out-of-ring",
                    "--json", str(out), "--png", str(png)]) == 0
    res = json.loads(out.read_text())
    for key in ("worker_imbalance", "step_imbalance", "ring_time_over_ideal", "total_imbalance", "W", "config",
                "phases", "unit", "work_fraction_of_causal", "bytes"):
        assert key in res
    assert np.asarray(res["W"]).shape == (4, 5) and png.stat().st_size > 0
    sweep = tmp_path / "s.json"
    assert im.main(["--sweep", "--cps", "2,4", "--seq-len", "4096", "--heads", "2", "--layouts", "zigzag,striped-64",
                    "--verticals", "in-ring,deferred", "--json", str(sweep)]) == 0
    rows = json.loads(sweep.read_text())["rows"]
    assert len(rows) == 8 and all("step_imbalance_vs_zigzag" in r for r in rows)


def test_out_of_ring_column_phase_computes_the_same_attention():
    """Ring steps without columns + the gathered column phase == the in-ring steps (fp64)."""
    from megatron_mtraining.ops.merge import merge_attention
    from megatron_mtraining.ops.sparse_reference import sparse_attention_forward
    from megatron_mtraining.patterns.convert import convert_pattern, without_columns

    layout, cp = Layout("striped", 2, 64), 2
    pattern = small_synthetic()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, S, 2, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, S, 1, 16, generator=g, dtype=torch.float64)
    v = torch.randn(1, S, 1, 16, generator=g, dtype=torch.float64)
    for r in range(cp):
        steps = convert_pattern(pattern, layout, r)
        q_r = layout.shard(q, r, 1)
        shards = [(layout.shard(k, o, 1), layout.shard(v, o, 1)) for o in range(cp)]

        def run(parts):
            out = lse = None
            for idx, kk, vv in parts:
                o_, l_ = sparse_attention_forward(q_r, kk, vv, idx)
                out, lse = (o_, l_) if out is None else merge_attention(out, lse, o_, l_)
            return out, lse
        ref = run([(steps[o], *shards[o]) for o in range(cp)])
        cidx, kc, vc = im.column_phase(steps, layout, r, S, k, v)
        got = run([(without_columns(steps[o]), *shards[o]) for o in range(cp)] + [(cidx, kc, vc)])
        torch.testing.assert_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1])


@pytest.mark.parametrize("vertical", ["in-ring", "out-of-ring"])
def test_gpu_model_runs_on_cpu(tmp_path, vertical):
    pytest.importorskip("megatron_mtraining.ops.sparse_reference")
    out = tmp_path / "g.json"
    assert im.main(["--model", "gpu", "--device", "cpu", "--cp", "2", "--seq-len", "1024", "--heads", "2",
                    "--kv-heads", "1", "--head-dim", "16", "--dtype", "fp32", "--repeats", "1", "--warmup", "0",
                    "--window-blocks", "2", "--sinks", "8", "--vertical", vertical, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["step_ms_fwd_max"]) == 2 and len(res["step_ms_bwd_max"]) == 2
    W = np.asarray(res["W_fwd_ms"])
    assert W.shape == (2, 3 if vertical == "out-of-ring" else 2) and (W[:, 0] > 0).all()
    assert "flop_model" in res and res["kernel"] in ("triton", "torch-reference")


BAD_ARGS = [(["--sweep", "--cps", "0"], "--cps '0': expected a comma list of integers >= 1"),
            (["--sweep", "--cps", "8,,16"], "--cps '8,,16'"),
            (["--sweep", "--layouts", "foo"], "--layouts: 'foo' is not zigzag, contiguous, striped or striped-G"),
            (["--sweep", "--layouts", "zigzag,striped-0"], "--layouts: 'striped-0'"),
            (["--sweep", "--verticals", "sideways"], "--verticals: 'sideways' is not one of"),
            (["--cp", "0"], "--cp must be >= 1"),
            (["--granularity", "0"], "--granularity must be >= 1"),
            (["--heads", "0"], "--heads must be >= 1"),
            (["--window-blocks", "0"], "--window-blocks must be >= 1"),
            (["--sparsity", "nan"], "--sparsity must be in [0, 1]"),
            (["--seq-len", "-64"], "--seq-len must be a positive multiple of 64"),
            (["--cp", "3", "--seq-len", "4096"], "--seq-len 4096 with --cp 3, --layout striped, --granularity 64: "
                                                 "cannot split"),
            (["--cps", "2,4"], "--cps applies to --sweep only"),
            (["--layouts", "zigzag", "--verticals", "in-ring"], "--layouts/--verticals apply to --sweep only"),
            (["--model", "gpu", "--sweep"], "--sweep uses the FLOP model"),
            (["--model", "gpu", "--device", "cpu", "--vertical", "deferred"], "--vertical deferred: --model gpu"),
            (["--model", "gpu", "--device", "meta"], "--device meta: cpu or cuda"),
            (["--save-pattern", "p.txt"], "--save-pattern p.txt: the name must end in .npz or .pt"),
            (["--model", "gpu", "--device", "cpu", "--head-dim", "48"],
             "--head-dim 48: --kernel auto runs the Triton kernels"),
            (["--pattern", "file"], "--pattern file needs --pattern-file"),
            (["--pattern", "file", "--pattern-file", "/nonexistent/p.npz"], "--pattern-file: file not found"),
            (["--pattern", "dense", "--pattern-file", "/nonexistent/p.npz"],
             "--pattern-file applies to --pattern file only (got --pattern dense)"),
            # the cheap flags before the corpus file of --doc-lengths corpus (default --data-path)
            (["--pattern", "packed", "--sweep", "--cps", "0"], "--cps '0'"),
            (["--pattern", "packed", "--cp", "0", "--data-path", "/nonexistent/corpus"], "--cp must be >= 1"),
            (["--pattern", "packed", "--sweep", "--verticals", "in-ring"],
             "--verticals does not apply to --pattern packed"),
            (["--pattern", "packed", "--data-path", "/nonexistent/corpus"],
             "--data-path: /nonexistent/corpus.idx not found")]


@pytest.mark.parametrize("argv,needle", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_arguments_are_one_line_errors_before_any_work(argv, needle, capsys):
    """A bad flag ends with argparse's 'error: ...' line naming the flag and the rule (exit 2), before a
    pattern is built: no traceback from Layout, and --cps/--layouts/--verticals are refused without --sweep."""
    with pytest.raises(SystemExit) as exc:
        im.main(argv)
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert exc.value.code == 2 and ": error: " in last and needle in last, captured.err
    assert captured.out == ""                          # nothing ran


def test_pattern_file_length_the_layout_cannot_split(tmp_path, capsys):
    path = str(tmp_path / "p.npz")
    im.save_pattern(path, small_synthetic(), {})
    with pytest.raises(SystemExit) as exc:
        im.main(["--pattern", "file", "--pattern-file", path, "--cp", "3"])
    assert exc.value.code == 2 and "(seq_len 1024) with --cp 3" in capsys.readouterr().err

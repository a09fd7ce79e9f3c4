"""Packed-sequence workloads: the FLOP model of megatron_mtraining/bench/packing.py against brute force
(every (query, key) pair and every 64x64 tile counted from the document mask) and against the Triton
kernels' own tile plan, tools/imbalance.py --pattern packed, and tools/bench_packed.py at tiny sizes
on the CPU (torch reference kernels)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from megatron_mtraining.bench.packing import (
    causal_tiles,
    pack_lengths,
    packed_pair_work,
    packed_tile_work,
    parse_length_spec,
    per_document_tiles,
)
from megatron_mtraining.layout import Layout, PackedDocuments
from tests.helpers.dist import REPO_ROOT, run_python
from tests.helpers.tiny_data import make_tiny_dataset


# ------------------------------------------------------------------------------ packing
def test_pack_lengths_fills_the_stream_with_capped_documents():
    assert pack_lengths([100, 50], 300) == [100, 50, 100, 50]                       # cycles a short corpus
    assert pack_lengths([10_000, 300], 4096, max_doc_len=1000) == [1000] * 4 + [96]  # split, last cut to fit
    assert pack_lengths([2500, 300], 4096, max_doc_len=1000) == [1000, 1000, 500, 300, 1000, 296]
    assert sum(pack_lengths([7, 1, 64], 1000)) == 1000
    with pytest.raises(ValueError, match="fewer than the stream"):
        pack_lengths([10], 100, cycle=False)
    with pytest.raises(ValueError, match="--max-doc-len must be >= 1"):
        pack_lengths([10], 100, max_doc_len=0)
    with pytest.raises(ValueError, match="positive document lengths"):
        pack_lengths([0], 100)


def test_length_specs():
    assert parse_length_spec("corpus") == ("corpus", None)
    assert parse_length_spec("fixed:4096") == ("fixed", [4096])
    assert parse_length_spec("list:1,63,65") == ("list", [1, 63, 65])
    for bad in ("fixed:", "fixed:1,2", "list:a", "list:0", "uniform:3", "corpus:x"):
        with pytest.raises(ValueError, match="--doc-lengths"):
            parse_length_spec(bad)


# ------------------------------------------------------------------------------ FLOP model
def _mask(lengths, s):
    """[S, S] bool: key t visible to query p (causal and same document; padding past the documents)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), s)
    t = torch.arange(s)
    return (t[None, :] >= docs.lo[0][:, None]) & (t[None, :] <= docs.hi[0][:, None])


def _brute(lengths, s, layout):
    """(pairs, tiles) [cp, cp] by (query rank, key owner) from the mask, local 64x64 tiles."""
    m = _mask(lengths, s)
    cp = layout.cp_size
    pairs, tiles = np.zeros((cp, cp)), np.zeros((cp, cp))
    for r in range(cp):
        qp = layout.positions(r, s)
        for o in range(cp):
            sub = m[qp][:, layout.positions(o, s)]
            pairs[r, o] = sub.sum().item()
            nt = sub.shape[0] // 64
            tiles[r, o] = sub.reshape(nt, 64, nt, 64).any(3).any(1).sum().item() * 4096
    return pairs, tiles


LENGTHS = [[1, 63, 65, 200, 1, 3, 100, 79], [512], [1, 1, 1, 300], [130, 70, 2], [64] * 8]
LAYOUTS = [Layout("striped", 1, 64), Layout("striped", 2, 64), Layout("striped", 4, 64), Layout("striped", 2, 128),
           Layout("zigzag", 2, 64), Layout("zigzag", 4, 64)]


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: f"{len(x)}docs")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.kind}-cp{l.cp_size}-g{l.granularity}")
def test_flop_model_equals_brute_force(lengths, layout):
    s = 512
    pairs, tiles = _brute(lengths, s, layout)
    np.testing.assert_array_equal(packed_pair_work(lengths, s, layout), pairs)
    np.testing.assert_array_equal(packed_tile_work(lengths, s, layout), tiles)


def test_flop_model_with_padding_and_token_striping():
    lay = Layout("striped", 2, 16)                       # 64-token blocks split across ranks: pairs only
    pairs, _ = _brute([100, 1, 30], 512, lay)            # tokens 131..511 padding
    np.testing.assert_array_equal(packed_pair_work([100, 1, 30], 512, lay), pairs)
    with pytest.raises(ValueError, match="64-token blocks whole"):
        packed_tile_work([100], 512, lay)
    _, tiles = _brute([100, 1, 30], 512, Layout("striped", 2, 64))
    np.testing.assert_array_equal(packed_tile_work([100, 1, 30], 512, Layout("striped", 2, 64)), tiles)


def test_flop_model_negative_control_and_per_document_tiles():
    one = packed_pair_work([512], 512, Layout("striped", 1, 64)).sum()
    assert one == 512 * 513 / 2
    two = packed_pair_work([256, 256], 512, Layout("striped", 1, 64)).sum()
    assert two == 2 * 256 * 257 / 2 and two < one                     # documents remove cross-document pairs
    assert causal_tiles(512) == 36 and causal_tiles(1) == 1 and causal_tiles(65) == 3
    assert per_document_tiles([64, 64, 1]) == 3
    assert packed_tile_work([64, 64, 1], 192, Layout("striped", 1, 64)).sum() / 4096 == 3


def test_tile_model_equals_the_triton_document_plan():
    """The tiles of the model are the tiles the Triton kernel lists (its plan, computed on the CPU)."""
    pytest.importorskip("triton")
    from megatron_mtraining.ops.triton import document_plan

    lengths, s = [1, 63, 65, 200, 1, 3, 100, 79], 512
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    docs = PackedDocuments.from_cu_seqlens(torch.tensor(cu), s)
    for layout in (Layout("striped", 1, 64), Layout("striped", 2, 64), Layout("zigzag", 2, 64)):
        model = packed_tile_work(lengths, s, layout) / 4096
        for r in range(layout.cp_size):
            lo, hi = docs.key_bounds(layout, r)
            for o in range(layout.cp_size):
                plan = document_plan(lo[0], hi[0], layout.positions(o, s))
                assert int(plan.block_count.sum()) == model[r, o], (layout, r, o)


# ------------------------------------------------------------------------------ imbalance tool
def test_imbalance_packed_single_document_equals_the_dense_pattern(tmp_path):
    """One document filling the stream is the dense causal pattern of the existing model (one head)."""
    from tools.imbalance import flop_model, packed_result
    from megatron_mtraining.patterns.synthetic import dense_pattern

    for layout in (Layout("striped", 4, 64), Layout("zigzag", 2, 64)):
        dense = flop_model(dense_pattern(2048, 1), layout, "tiles", "in-ring")
        packed = packed_result([2048], 2048, layout, "tiles")
        assert packed["W"] == dense["W"] and packed["worker_imbalance"] == pytest.approx(dense["worker_imbalance"])
        assert packed["work_fraction_of_causal"] == 1.0


def test_imbalance_cli_packed_rows(tmp_path, capsys):
    from tools.imbalance import main

    js = tmp_path / "imb.json"
    assert main(["--pattern", "packed", "--seq-len", "4096", "--doc-lengths", "list:1,63,65,700,3000",
                 "--cp", "4", "--json", str(js)]) == 0
    r = json.loads(js.read_text())
    assert r["cp"] == 4 and r["vertical"] == "packed" and len(r["W"]) == 4 and len(r["W"][0]) == 4
    assert r["worker_imbalance"] >= 1.0 and 0 < r["work_fraction_of_causal"] < 1
    assert r["pattern_source"]["documents"] == 9 and r["pattern_source"]["doc_len_min"] == 1
    js2 = tmp_path / "sweep.json"
    assert main(["--pattern", "packed", "--seq-len", "4096", "--doc-lengths", "fixed:500", "--sweep", "--cps", "2,4",
                 "--layouts", "zigzag,striped-64,striped-1", "--unit", "pairs", "--json", str(js2)]) == 0
    rows = json.loads(js2.read_text())["rows"]
    assert {(x["cp"], x["layout"]) for x in rows} == {(c, l) for c in (2, 4) for l in ("zigzag", "striped-64",
                                                                                         "striped-1")}
    # flag errors: argparse's error line (exit 2); the model's refusal: SystemExit('error: ...') (exit 1)
    for bad, needle, flag_error in ((["--doc-lengths", "nope"], "--doc-lengths", True),
                                    (["--seq-len", "100"], "--seq-len", True), (["--model", "gpu"], "FLOP model", True),
                                    (["--data-path", str(tmp_path / "none")], "not found", True),
                                    (["--layout", "striped", "--granularity", "16", "--doc-lengths", "fixed:100"],
                                     "64-token blocks whole", False)):
        with pytest.raises(SystemExit) as e:
            main(["--pattern", "packed", "--seq-len", "4096", "--cp", "2"] + bad)
        err = capsys.readouterr().err
        if flag_error:
            assert e.value.code == 2 and "error: " in err and needle in err, (bad, err)
        else:
            assert str(e.value).startswith("error: ") and needle in str(e.value), (bad, e.value)


# ------------------------------------------------------------------------------ timing tool
def test_bench_packed_runs_on_cpu_with_the_torch_reference(tmp_path):
    """The timing code path at a tiny size on the CPU; the corpus lengths of a tiny indexed dataset."""
    prefix, _ = make_tiny_dataset(tmp_path / "data")
    from megatron_mtraining.training.data import document_lengths

    lengths = document_lengths(prefix)
    assert lengths.size == 400 and (lengths > 0).all()
    size = os.path.getsize(prefix + ".bin")
    assert size % int(lengths.sum()) == 0 and size // int(lengths.sum()) in (2, 4)   # every token counted once
    js = tmp_path / "bench.json"
    res = run_python("tools/bench_packed.py", [
        "--seq-len", "512", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dtype", "fp32", "--device", "cpu",
        "--backend", "torch", "--data-path", prefix, "--max-doc-len", "none,32", "--repeats", "1", "--json", str(js)],
        timeout=300)
    assert res.returncode == 0, res.tail()
    rows = json.loads(js.read_text())["rows"]
    assert [r["max_doc_len"] for r in rows] == [None, 32]
    for r in rows:
        assert r["backend"] == "torch" and r["documents"] >= 2
        for k in ("packed_fwd_bwd_ms", "unmasked_fwd_bwd_ms", "per_document_sum_fwd_bwd_ms"):
            assert r[k] > 0, (k, r)
        assert r["packed_over_sum_fwd_bwd"] == pytest.approx(r["packed_fwd_bwd_ms"] / r["per_document_sum_fwd_bwd_ms"])
        assert r["model_tiles_unmasked"] == 36 and r["model_tiles_packed"] <= 36
    assert rows[1]["doc_len_max"] <= 32


def test_bench_packed_compares_backends_in_one_process(tmp_path):
    """--backend A,B --packed-only: one packed row per backend on the same inputs, each after the first
    with its speed-up over the first; no baselines. (On the GPU: --backend triton,fa4, FA4 varlen.)"""
    js = tmp_path / "bench.json"
    res = run_python("tools/bench_packed.py", [
        "--seq-len", "256", "--doc-lengths", "list:100,1,60", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--dtype", "fp32", "--device", "cpu", "--backend", "torch,auto", "--packed-only", "--repeats", "1",
        "--max-doc-len", "none,32", "--json", str(js)], timeout=300)
    assert res.returncode == 0, res.tail()
    rows = json.loads(js.read_text())["rows"]
    assert [(r["max_doc_len"], r["backend_requested"]) for r in rows] == [
        (None, "torch"), (None, "auto"), (32, "torch"), (32, "auto")]
    for first, second in (rows[:2], rows[2:]):
        assert first["backend"] == second["backend"] == "torch" and first["packed_path"] == "ring_steps"
        assert "packed_fwd_bwd_speedup" not in first and "unmasked_fwd_bwd_ms" not in first
        assert second["compared_with"] == "torch"
        assert second["packed_fwd_bwd_speedup"] == pytest.approx(first["packed_fwd_bwd_ms"] / second["packed_fwd_bwd_ms"])
    res = run_python("tools/bench_packed.py", ["--seq-len", "256", "--doc-lengths", "fixed:64", "--device", "cpu",
                                               "--backend", "torch,fa5"], timeout=120)
    assert res.returncode != 0 and "--backend: expected a comma list" in res.tail()


def test_bench_packed_sparse_mode_on_cpu(tmp_path):
    """--attention dense,sparse: a dense and a sparse row per cap (torch reference, tiny size); documents
    shorter than the sparse blocks and not a multiple of them are padded, their padding masked."""
    js = tmp_path / "bench.json"
    res = run_python("tools/bench_packed.py", [
        "--seq-len", "1024", "--doc-lengths", "list:300,1,700,23", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "32", "--dtype", "fp32", "--device", "cpu", "--backend", "torch", "--repeats", "1",
        "--attention", "dense,sparse", "--json", str(js)], timeout=300)
    assert res.returncode == 0, res.tail()
    assert "sparse max_doc_len" in res.stdout and "dense  max_doc_len" in res.stdout, res.tail()
    rows = json.loads(js.read_text())["rows"]
    assert [r["attention"] for r in rows] == ["dense", "sparse"]
    dense, sparse = rows
    assert "model_packed_over_sum" in dense and "unmasked_kept_fraction" not in dense
    assert sparse["backend"] == sparse["baseline_backend"] == "torch" and sparse["documents"] == 4
    assert sparse["length_buckets"] == 3 and sparse["doc_len_min"] == 1          # 300 -> 320, 1 and 23 -> 64
    for r in rows:
        for k in ("packed", "unmasked", "per_document_sum"):
            for ph in ("fwd", "fwd_bwd"):
                assert math.isfinite(r[f"{k}_{ph}_ms"]) and r[f"{k}_{ph}_ms"] > 0, (k, ph, r)
        for k in ("packed_over_sum_fwd", "packed_over_sum_fwd_bwd", "packed_over_unmasked_fwd_bwd"):
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
    assert 0 < sparse["unmasked_kept_fraction"] <= 1
    for k in ("packed_mean_vertical", "packed_mean_slash", "unmasked_mean_vertical", "unmasked_mean_slash"):
        assert sparse[k] >= 1, (k, sparse)
    # every document keeps its first sink_tokens (64 in the default config) as vertical floors
    assert sparse["packed_mean_vertical"] >= 1 + 23 + 64 * 2


def test_bench_packed_default_is_dense_only(tmp_path):
    """Without --attention the rows and the printed lines are the dense ones only."""
    js = tmp_path / "bench.json"
    res = run_python("tools/bench_packed.py", [
        "--seq-len", "256", "--doc-lengths", "list:100,156", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--dtype", "fp32", "--device", "cpu", "--backend", "torch", "--repeats", "1", "--json", str(js)], timeout=300)
    assert res.returncode == 0, res.tail()
    assert "sparse" not in res.stdout, res.tail()
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["attention"] == "dense" and rows[0]["model_tiles_unmasked"] == 10
    assert not any(k.endswith(("_mean_vertical", "_kept_fraction")) for k in rows[0])


def test_bench_packed_errors():
    from tools.bench_packed import main

    for argv, needle in ((["--seq-len", "100"], "--seq-len"), (["--doc-lengths", "fixed:x"], "--doc-lengths"),
                         (["--max-doc-len", "4k"], "--max-doc-len"), (["--heads", "3", "--kv-heads", "2"], "--heads"),
                         (["--data-path", "/nonexistent/prefix"], "not found"),
                         (["--attention", "dense,flash"], "--attention"),
                         (["--attention", "sparse", "--doc-lengths", "fixed:64", "--mtraining-config",
                           "/nonexistent.yaml"], "not found"),
                         (["--attention", "sparse", "--doc-lengths", "fixed:64", "--mtraining-config",
                           str(REPO_ROOT / "configs" / "demo.yaml")], "vertical_slash"),
                         (["--attention", "sparse", "--doc-lengths", "fixed:64", "--seq-len", "64"], "--seq-len"),
                         (["--attention", "sparse", "--seq-len", "1024", "--doc-lengths", "fixed:500",
                           "--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--backend", "sdpa"], "sdpa")):
        with pytest.raises(SystemExit) as e:
            main(["--device", "cpu", "--backend", "torch"] + argv)
        assert str(e.value).startswith("error: ") and needle in str(e.value), (argv, e.value)


@pytest.mark.gpu
def test_bench_packed_on_gpu(tmp_path):
    """The benchmark's GPU path at a small size: the Triton dense steps, packed and unmasked."""
    js = tmp_path / "bench.json"
    res = run_python("tools/bench_packed.py", [
        "--seq-len", "16384", "--doc-lengths", "list:1,63,65,1000,4096", "--max-doc-len", "none,1024",
        "--device", "cuda", "--backend", "triton", "--budget", "0.2", "--json", str(js)], timeout=600)
    assert res.returncode == 0, res.tail()
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 2
    for r in rows:
        assert r["backend"] == r["baseline_backend"] == "triton", r
        assert r["packed_fwd_bwd_ms"] > 0 and r["per_document_sum_fwd_bwd_ms"] > 0 and r["unmasked_fwd_bwd_ms"] > 0


@pytest.mark.gpu
def test_bench_packed_sparse_on_gpu(tmp_path):
    """The sparse rows' GPU path at a small size: the Triton sparse steps, packed, unmasked and per document."""
    js = tmp_path / "bench.json"
    res = run_python("tools/bench_packed.py", [
        "--seq-len", "16384", "--doc-lengths", "list:1,63,65,1000,4096", "--max-doc-len", "none,1024",
        "--device", "cuda", "--backend", "triton", "--attention", "sparse", "--budget", "0.2", "--json", str(js)],
        timeout=600)
    assert res.returncode == 0, res.tail()
    rows = json.loads(js.read_text())["rows"]
    assert [r["attention"] for r in rows] == ["sparse", "sparse"]
    for r in rows:
        assert r["backend"] == r["baseline_backend"] == "triton", r
        assert r["packed_fwd_bwd_ms"] > 0 and r["per_document_sum_fwd_bwd_ms"] > 0 and r["unmasked_fwd_bwd_ms"] > 0
        assert 0 < r["unmasked_kept_fraction"] < 1


def _fa4_missing() -> bool:
    if not torch.cuda.is_available():
        return True
    from megatron_mtraining.ops.fa4 import fa4_unavailable_reason

    return fa4_unavailable_reason("cuda") is not None


@pytest.mark.gpu
@pytest.mark.skipif(_fa4_missing(), reason="needs a Hopper/Blackwell GPU with flash-attn-4")
def test_bench_packed_fa4_varlen_against_triton_on_gpu(tmp_path):
    """--backend triton,fa4 --packed-only: the packed dense rows on the Triton steps and on FA4 varlen."""
    js = tmp_path / "bench.json"
    res = run_python("tools/bench_packed.py", [
        "--seq-len", "16384", "--doc-lengths", "list:1,63,65,1000,4096", "--max-doc-len", "none,1024",
        "--device", "cuda", "--backend", "triton,fa4", "--packed-only", "--budget", "0.2", "--json", str(js)],
        timeout=600)
    assert res.returncode == 0, res.tail()
    rows = json.loads(js.read_text())["rows"]
    assert [(r["backend"], r["packed_path"]) for r in rows] == [("triton", "ring_steps"), ("fa4", "fa4_varlen")] * 2, \
        res.tail()
    assert all(r["packed_fwd_bwd_speedup"] > 0 for r in rows[1::2])

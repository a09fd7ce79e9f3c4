"""Faults a long run meets, on the example trainer (tiny model, tiny data, CPU/gloo).

* Killed during a checkpoint save (SIGKILL at points inside megatron-core's
  ``dist_checkpointing.save`` and around it: the directory rename, the tracker file): the next
  start resumes from the last complete checkpoint, never a half-written one, and the loss of
  every iteration is bitwise the loss of an uninterrupted run.
* NaN/Inf in the loss or in a gradient stops the run before the step, naming the iteration and
  the first offending parameter, with the same verdict on every rank (a NaN gradient on one rank
  only); ``--no-check-for-nan-in-loss-and-grad`` is the negative control. A model TFLOP/s per GPU
  above the GPU's peak is refused.
* Bad data and a checkpoint of another network are clear errors before training starts: a
  truncated or corrupt ``.bin``/``.idx``, token ids outside the tokenizer's vocabulary, ``--load``
  of a checkpoint with another hidden size / layers / heads.

The faults are injected from the test side (``tests/workers/fault_worker.py`` monkeypatches the
save path and the gradients); the trainer has no test hooks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.dist import REPO_ROOT, run_python, run_reaped
from tests.helpers.tiny_data import make_tiny_dataset

SCRIPT = "examples/pretrain_gpt.py"
WORKER = "tests/workers/fault_worker.py"
TRACKER = "latest_checkpointed_iteration.txt"
PARAM = "decoder.layers.1.mlp.linear_fc1.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("tiny_data"))


def _argv(tiny, tmp_path, **over) -> list[str]:
    prefix, tok = tiny
    opts = {
        "--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--seq-length": 256,
        "--position-embedding-type": "rope", "--normalization": "RMSNorm", "--swiglu": None,
        "--micro-batch-size": 2, "--global-batch-size": 4, "--train-iters": 8, "--lr": 3e-3,
        "--lr-warmup-iters": 1, "--lr-decay-style": "cosine", "--min-lr": 1e-4, "--data-path": prefix,
        "--split": "90,10,0", "--tokenizer-model": tok, "--cp-granularity": 32, "--eod-mask-loss": None,
        "--log-interval": 1, "--eval-iters": 0, "--seed": 7, "--data-cache-path": tmp_path / "cache",
    }
    opts.update(over)
    argv: list[str] = []
    for k, v in opts.items():
        if v is not False:
            argv += [k] if v is None else [k, str(v)]
    return argv


def _rows(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []


def _curve(paths) -> dict[int, float]:
    """Loss per iteration of runs that resumed one another (the last row of an iteration wins)."""
    out: dict[int, float] = {}
    for p in paths:
        for r in _rows(p):
            out[r["iteration"]] = r["lm_loss"]
    return out


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The uninterrupted run (8 iterations, checkpoints every 2): its losses and its --save dir."""
    d = tmp_path_factory.mktemp("reference")
    m = d / "metrics.jsonl"
    r = run_python(SCRIPT, _argv(tiny, d, **{"--save": d / "ckpt", "--save-interval": 2, "--metrics-file": m}),
                   timeout=300)
    assert r.returncode == 0, r.tail()
    curve = _curve([m])
    assert sorted(curve) == list(range(1, 9)) and curve[8] < curve[1]
    return curve, d / "ckpt"


def _killed(r, rc=-9):
    assert not r.timed_out, r.tail()
    assert r.returncode == rc, r.tail()


# ------------------------------------------------------------------------- killed during a save
# (kill point, iteration whose save is killed, what the directory holds afterwards, the tracker then,
#  iteration the next start loads)
CHAIN = [
    ("save_start", 2, {"iter_0000002.tmp"}, None, None),
    ("after_common", 2, {"iter_0000002.tmp"}, None, None),
    ("torn_shard", 2, {"iter_0000002.tmp"}, None, None),
    ("before_metadata_json", 2, {"iter_0000002.tmp"}, None, None),
    ("before_commit", 2, {"iter_0000002.tmp"}, None, None),
    ("after_rename", 4, {"iter_0000002", "iter_0000004", TRACKER}, "2", 2),     # iter 4 complete, tracker old
    ("tracker_replace", 6, {"iter_0000002", "iter_0000004", "iter_0000006", TRACKER}, "4", 4),
]


@pytest.mark.slow
def test_killed_saves_resume_from_the_last_complete_checkpoint_bitwise(tiny, reference, tmp_path):
    """One --save/--load directory, restarted after each SIGKILL: every half-written checkpoint is
    ignored (and logged), each start loads the last complete one, and every iteration's loss,
    including the ones run again after a restart, is bitwise the uninterrupted run's."""
    ref, _ = reference
    ckpt = tmp_path / "ckpt"
    flags = {"--save": ckpt, "--load": ckpt, "--save-interval": 2}
    ckpt.mkdir()
    metrics, expect_load = [], None
    for i, (point, it, left, tracker, next_load) in enumerate(CHAIN):
        m = tmp_path / f"run{i}.jsonl"
        metrics.append(m)
        r = run_reaped(WORKER, [f"kill:{point}:{it}:0", "--", *_argv(tiny, tmp_path, **flags, **{"--metrics-file": m})],
                       timeout=300)
        _killed(r)
        if expect_load is None:
            assert "no checkpoint found under --load" in r.stdout, r.tail()
        else:
            assert f"loaded checkpoint {ckpt}/iter_{expect_load:07d} (iteration {expect_load})" in r.stdout, r.tail()
        if i > 0 and CHAIN[i - 1][2] == {"iter_0000002.tmp"}:
            assert f"ignoring incomplete checkpoint {ckpt}/iter_0000002.tmp" in r.stdout, r.tail()
        assert {p.name for p in ckpt.iterdir()} - {TRACKER + ".tmp"} == left, (point, sorted(ckpt.iterdir()))
        if tracker is not None:
            assert (ckpt / TRACKER).read_text() == tracker, point
        assert [x["iteration"] for x in _rows(m)][-1] == it, (point, _rows(m))
        expect_load = next_load
    m = tmp_path / "final.jsonl"
    metrics.append(m)
    r = run_reaped(SCRIPT, _argv(tiny, tmp_path, **flags, **{"--metrics-file": m}), timeout=300)
    assert r.returncode == 0, r.tail()
    assert "iter_0000006 is newer than the tracker's iteration 4; the tracker wins" in r.stdout, r.tail()
    assert f"loaded checkpoint {ckpt}/iter_0000004 (iteration 4)" in r.stdout, r.tail()
    assert (ckpt / TRACKER).read_text() == "8"
    assert sorted(p.name for p in ckpt.iterdir()) == [f"iter_{k:07d}" for k in (2, 4, 6, 8)] + [TRACKER]
    assert _curve(metrics) == ref                         # bitwise, every iteration
    for p in metrics:                                     # and every repeated iteration too
        for row in _rows(p):
            assert row["lm_loss"] == ref[row["iteration"]], (p.name, row)


@pytest.mark.slow
def test_killed_torch_format_save_and_resume_bitwise(tiny, reference, tmp_path):
    """``--ckpt-format torch``: a rank file cut in half by a SIGKILL stays in ``iter_0000004.tmp``;
    the next start loads iteration 2 and reproduces the uninterrupted losses bitwise."""
    ref, _ = reference
    ckpt = tmp_path / "ckpt"
    flags = {"--save": ckpt, "--load": ckpt, "--save-interval": 2, "--ckpt-format": "torch"}
    ckpt.mkdir()
    m1, m2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    r = run_reaped(WORKER, ["kill:torch_file:4:0", "--", *_argv(tiny, tmp_path, **flags, **{"--metrics-file": m1})],
                   timeout=300)
    _killed(r)
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000004.tmp", TRACKER]
    r = run_reaped(SCRIPT, _argv(tiny, tmp_path, **flags, **{"--metrics-file": m2}), timeout=300)
    assert r.returncode == 0, r.tail()
    assert f"ignoring incomplete checkpoint {ckpt}/iter_0000004.tmp" in r.stdout, r.tail()
    assert f"loaded checkpoint {ckpt}/iter_0000002 (iteration 2)" in r.stdout, r.tail()
    assert _curve([m1, m2]) == ref


@pytest.mark.slow
def test_rank_killed_during_a_cp2_save_resumes_bitwise(tiny, tmp_path):
    """CP=2 on 2 gloo ranks: rank 1 dies as the save of iteration 4 starts, while rank 0 (the
    writer of the replicated tensors) is inside ``dist_checkpointing.save``, waiting for it, until
    torchrun stops it. The restart at CP=2 loads iteration 2 and reproduces the uninterrupted CP=2
    losses bitwise."""
    base = {"--context-parallel-size": 2, "--train-iters": 4, "--save-interval": 2}
    ref_m = tmp_path / "ref.jsonl"
    r = run_reaped(SCRIPT, _argv(tiny, tmp_path, **base, **{"--metrics-file": ref_m}), nproc=2, timeout=300)
    assert r.returncode == 0, r.tail()
    ckpt = tmp_path / "ckpt"
    flags = {**base, "--save": ckpt, "--load": ckpt}
    ckpt.mkdir()
    m1, m2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    r = run_reaped(WORKER, ["kill:save_start:4:1", "--", *_argv(tiny, tmp_path, **flags, **{"--metrics-file": m1})],
                   nproc=2, timeout=300)
    assert not r.timed_out and r.returncode not in (0, None), r.tail()
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "iter_0000004.tmp", TRACKER]
    r = run_reaped(SCRIPT, _argv(tiny, tmp_path, **flags, **{"--metrics-file": m2}), nproc=2, timeout=300)
    assert r.returncode == 0, r.tail()
    assert f"loaded checkpoint {ckpt}/iter_0000002 (iteration 2)" in r.stdout, r.tail()
    assert _curve([m1, m2]) == _curve([ref_m]) and len(_curve([ref_m])) == 4


def test_resolve_checkpoint_rules(tmp_path):
    """Which checkpoint ``--load`` takes (no process, no model): the tracker's when complete, else
    the newest complete one; ``*.tmp`` and directories without ``metadata.json`` never."""
    from megatron_mtraining.training.checkpoint import resolve_checkpoint

    def make(name, complete=True):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "metadata.json").write_text("{}")

    assert resolve_checkpoint(tmp_path) == (None, [])
    make("iter_0000002")
    make("iter_0000004.tmp", complete=False)
    make("iter_0000006", complete=False)              # a non-atomic writer's half-written directory
    it, notes = resolve_checkpoint(tmp_path)
    assert it == 2 and any("iter_0000004.tmp" in n and "ignoring" in n for n in notes)
    assert any("iter_0000006" in n and "ignoring" in n for n in notes) and any("no " + TRACKER in n for n in notes)
    (tmp_path / TRACKER).write_text("6")              # names the incomplete one: fall back, say so
    it, notes = resolve_checkpoint(tmp_path)
    assert it == 2 and any("names iteration 6" in n for n in notes)
    (tmp_path / TRACKER).write_text("garbage")
    assert resolve_checkpoint(tmp_path)[0] == 2
    make("iter_0000008")
    (tmp_path / TRACKER).write_text("2")              # an edited tracker (going back) is honoured
    it, notes = resolve_checkpoint(tmp_path)
    assert it == 2 and any("tracker wins" in n for n in notes)
    shutil.rmtree(tmp_path / "iter_0000002")
    shutil.rmtree(tmp_path / "iter_0000008")
    with pytest.raises(SystemExit, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path)


# ------------------------------------------------------------------------------ numerical faults
def _fault_text(r) -> str:
    return r.stdout + r.stderr


@pytest.mark.slow
def test_nan_gradient_on_one_rank_stops_every_rank(tiny, tmp_path):
    """Rank 1's gradient of one parameter becomes NaN after the all-reduce of iteration 2 (rank
    0's stays finite): both ranks stop at iteration 2, before the step, naming that parameter."""
    m = tmp_path / "m.jsonl"
    r = run_reaped(WORKER, [f"nan_grad:2:1:{PARAM}", "--",
                            *_argv(tiny, tmp_path, **{"--context-parallel-size": 2, "--train-iters": 3,
                                                      "--metrics-file": m})], nproc=2, timeout=300)
    assert not r.timed_out and r.returncode not in (0, None), r.tail()
    msg = (f"pretrain_gpt.py: error: iteration 2: non-finite (NaN/Inf) gradient in parameter '{PARAM}' "
           "(the first in model order)")
    assert _fault_text(r).count(msg) == 2, r.tail()               # the same verdict on both ranks
    assert [x["iteration"] for x in _rows(m)] == [1]


@pytest.mark.slow
def test_nan_loss_stops_and_the_check_can_be_turned_off(tiny, tmp_path):
    """A parameter set to NaN before the first step: iteration 1's loss is NaN; the run stops with
    exit status 1 naming the parameter. With --no-check-for-nan-in-loss-and-grad the same run goes
    on and records NaN losses (the negative control)."""
    name = "decoder.final_layernorm.weight"
    m = tmp_path / "m.jsonl"
    r = run_reaped(WORKER, [f"nan_param:{name}", "--", *_argv(tiny, tmp_path, **{"--train-iters": 2,
                                                                                "--metrics-file": m})], timeout=300)
    assert r.returncode == 1, r.tail()
    assert "pretrain_gpt.py: error: iteration 1: the training loss is nan" in r.stderr, r.tail()
    assert f"first parameter with a non-finite value: '{name}'" in r.stderr, r.tail()
    assert _rows(m) == []
    r = run_reaped(WORKER, [f"nan_param:{name}", "--",
                            *_argv(tiny, tmp_path, **{"--train-iters": 2, "--metrics-file": m,
                                                      "--no-check-for-nan-in-loss-and-grad": None})], timeout=300)
    assert r.returncode == 0, r.tail()
    rows = _rows(m)
    assert len(rows) == 2 and all(x["lm_loss"] != x["lm_loss"] for x in rows)   # NaN


@pytest.mark.slow
def test_throughput_above_the_peak_is_refused_on_every_rank(tiny, tmp_path):
    """Every rank pretends to be a GPU with a peak of 1e-9 TFLOP/s: the tiny CPU model's real
    throughput is above it, so both ranks stop at iteration 1 with the same message."""
    m = tmp_path / "m.jsonl"
    r = run_reaped(WORKER, ["peak:1e-9", "--", *_argv(tiny, tmp_path, **{"--context-parallel-size": 2,
                                                                       "--train-iters": 2, "--metrics-file": m})],
                   nproc=2, timeout=300)
    assert not r.timed_out and r.returncode not in (0, None), r.tail()
    needle = "pretrain_gpt.py: error: iteration 1: model throughput"
    assert _fault_text(r).count(needle) == 2, r.tail()
    assert "is above the TF32 dense peak 1e-09 TFLOP/s of Test GPU" in r.output, r.tail()
    assert _rows(m) == []                                       # the bogus number is never reported


def test_peak_table_and_flag():
    import torch

    from megatron_mtraining.megatron.args import build_parser
    from megatron_mtraining.training.faults import device_peak_tflops, peak_tflops

    assert peak_tflops("NVIDIA H200", torch.bfloat16) == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", torch.float16) == 989.0
    assert peak_tflops("NVIDIA GH200 480GB", torch.bfloat16) == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", torch.float32) == 156.0
    assert peak_tflops("NVIDIA H20", torch.bfloat16) == 148.0
    assert peak_tflops("Tesla T4", torch.bfloat16) is None                # unknown: no check
    assert device_peak_tflops(torch.device("cpu"), torch.float32) == (None, "cpu")
    base = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1", "--seq-length", "8",
            "--train-iters", "1", "--lr", "1"]
    p = build_parser()
    assert p.parse_args(base).check_for_nan_in_loss_and_grad is True
    # a sparse run is checked on the weight matmuls only: 6 N T, N = L (4 h^2 + 2 h ffn) + h V here
    from types import SimpleNamespace

    from megatron_mtraining.training.build import flops_per_iteration

    a = SimpleNamespace(hidden_size=8, num_layers=2, seq_length=16, num_attention_heads=2, kv_channels=4,
                        num_query_groups=2, ffn_hidden_size=32, swiglu=False, global_batch_size=3)
    n = 2 * (4 * 8 * 8 + 2 * 8 * 32) + 8 * 100
    assert flops_per_iteration(a, 100, attention=False) == 6.0 * n * 3 * 16
    assert flops_per_iteration(a, 100) == 6.0 * n * 3 * 16 + 6.0 * 2 * 16 * 8 * 3 * 16
    assert p.parse_args(base + ["--no-check-for-nan-in-loss-and-grad"]).check_for_nan_in_loss_and_grad is False


# --------------------------------------------------------------------- bad data, before training
def _copy_data(tiny, d: Path) -> str:
    d.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copy(tiny[0] + ext, d / ("data" + ext))
    return str(d / "data")


def _write_dataset(prefix: str, docs: list[list[int]]) -> None:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for ids in docs:
        b.add_document(ids, [len(ids)])
    b.finalize(prefix + ".idx")


def test_indexed_dataset_checks(tiny, tmp_path):
    """:func:`check_indexed_dataset` on a sound dataset and on each kind of damage."""
    import os

    from megatron_mtraining.training.data import check_indexed_dataset

    assert check_indexed_dataset(tiny[0], 128) is None
    p = _copy_data(tiny, tmp_path / "bin_cut")
    os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 6)
    assert "truncated" in check_indexed_dataset(p, 128) and ".bin" in check_indexed_dataset(p, 128)
    p = _copy_data(tiny, tmp_path / "idx_cut")
    os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8)
    assert ".idx" in check_indexed_dataset(p, 128) and "truncated or corrupt" in check_indexed_dataset(p, 128)
    p = _copy_data(tiny, tmp_path / "idx_header")
    raw = bytearray(Path(p + ".idx").read_bytes())
    raw[0:4] = b"JUNK"
    Path(p + ".idx").write_bytes(bytes(raw))
    assert "not a readable megatron indexed-dataset index" in check_indexed_dataset(p, 128)
    p = _copy_data(tiny, tmp_path / "idx_lengths")
    raw = bytearray(Path(p + ".idx").read_bytes())
    raw[34:38] = (7).to_bytes(4, "little")           # first sequence length no longer matches the pointers
    Path(p + ".idx").write_bytes(bytes(raw))
    assert check_indexed_dataset(p, 128) is not None
    p = str(tmp_path / "big_ids")
    _write_dataset(p, [[1, 2, 3], [4, 300, 5]])
    msg = check_indexed_dataset(p, 128)
    assert "token id 300 (token 4)" in msg and "[0, 128)" in msg
    assert check_indexed_dataset(p, 301) is None       # negative control: a vocabulary that holds 300


@pytest.mark.slow
@pytest.mark.parametrize("damage,needle", [("bin", ".bin: "), ("idx", ".idx: not a readable megatron indexed-dataset index")],
                         ids=["bin_cut", "idx_header"])
def test_truncated_or_corrupt_files_are_an_error_before_training(tiny, tmp_path, damage, needle):
    """A ``.bin`` cut in half, an ``.idx`` with a corrupt header: exit status 1 naming the file."""
    import os

    p = _copy_data(tiny, tmp_path / "d")
    if damage == "bin":
        os.truncate(p + ".bin", os.path.getsize(p + ".bin") // 2)
    else:
        raw = bytearray(Path(p + ".idx").read_bytes())
        raw[0:4] = b"JUNK"
        Path(p + ".idx").write_bytes(bytes(raw))
    r = run_python(SCRIPT, _argv(tiny, tmp_path, **{"--data-path": p, "--train-iters": 1, "--lr-warmup-iters": 0}), timeout=300)
    assert r.returncode == 1, r.tail()
    assert f"pretrain_gpt.py: error: --data-path {p}: {p}{needle}" in r.stderr, r.tail()
    assert "truncated" in r.stderr and "iteration" not in r.stdout, r.tail()


@pytest.mark.slow
def test_data_from_another_tokenizer_stops_every_rank_before_training(tiny, tmp_path):
    """Token ids >= the tokenizer's vocabulary (data made with another tokenizer): both CP ranks
    stop with the same message before the first iteration."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = IndexedDataset(tiny[0], mmap=True)
    docs = [[int(t) for t in src[i]] for i in range(len(src))]
    docs[3][5] = 1000                                  # vocabulary of tok.model: 128
    p = str(tmp_path / "other_tok")
    _write_dataset(p, docs)
    r = run_reaped(SCRIPT, _argv(tiny, tmp_path, **{"--data-path": p, "--context-parallel-size": 2,
                                                    "--train-iters": 1, "--lr-warmup-iters": 0}), nproc=2,
                         timeout=300)
    assert not r.timed_out and r.returncode not in (0, None), r.tail()
    needle = f"pretrain_gpt.py: error: --data-path {p}: {p}.bin: token id 1000"
    assert r.output.count(needle) == 2, r.tail()
    assert "another tokenizer than --tokenizer-model" in r.output
    assert "iteration" not in r.stdout


@pytest.mark.slow
def test_load_of_another_network_names_the_flags_before_training(tiny, reference, tmp_path):
    _, ckpt = reference
    r = run_python(SCRIPT, _argv(tiny, tmp_path, **{"--load": ckpt, "--hidden-size": 32, "--num-layers": 3,
                                                    "--num-attention-heads": 2}), timeout=300)
    assert r.returncode == 1, r.tail()
    err = r.stderr
    assert f"pretrain_gpt.py: error: --load {ckpt}: {ckpt}/iter_0000008 holds a different network" in err, r.tail()
    for flag in ("--num-layers 3 (checkpoint: 2)", "--hidden-size 32 (checkpoint: 64)",
                 "--num-attention-heads 2 (checkpoint: 4)"):
        assert flag in err, r.tail()
    assert "iteration        1/" not in r.stdout

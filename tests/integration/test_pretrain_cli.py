"""examples/pretrain_gpt.py: argument validation and end-to-end CP=1 vs CP=2 training on CPU.

* Bad command lines fail before training starts (exit status != 0, message names the flag).
* CP=2 (striped ring attention, 2 gloo ranks) reproduces CP=1 loss and grad norm for every
  iteration (Adam updates included), with EOD loss masking so the loss mask is uneven across
  CP ranks; a dist_checkpointing checkpoint written at CP=2 resumes at CP=1 and reproduces the
  next iteration.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args
from tests.helpers.dist import run_python, run_torchrun
from tests.helpers.tiny_data import make_tiny_dataset

SCRIPT = "examples/pretrain_gpt.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("tiny_data"))


def _argv(prefix: str, tok: str, **over) -> list[str]:
    over = {k: (v if not isinstance(v, str) or " " not in v else v.split()) for k, v in over.items()}
    opts = {
        "--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--group-query-attention": None,
        "--num-query-groups": 2, "--seq-length": 256, "--position-embedding-type": "rope",
        "--normalization": "RMSNorm", "--swiglu": None, "--untie-embeddings-and-output-weights": None,
        "--micro-batch-size": 2, "--global-batch-size": 4, "--train-iters": 3, "--lr": 3e-3,
        "--lr-warmup-iters": 1, "--lr-decay-style": "cosine", "--min-lr": 1e-4, "--clip-grad": 1.0,
        "--data-path": prefix, "--split": "90,10,0", "--tokenizer-model": tok, "--cp-granularity": 32,
        "--eod-mask-loss": None, "--log-interval": 1, "--eval-iters": 0, "--seed": 7,
    }
    if "--mtraining-config" in over:
        opts["--cp-granularity"] = False      # a config fixes the layout (an explicit, different flag is an error)
    opts.update(over)
    argv: list[str] = []
    for k, v in opts.items():
        if v is False:
            continue
        argv += [k] if v is None else [k, *map(str, v)] if isinstance(v, list) else [k, str(v)]
    return argv


# ------------------------------------------------------------------ errors before training starts
def _fails(res, *needles):
    assert res.returncode not in (0, None), res.tail()
    for n in needles:
        assert n in res.stderr, res.tail()
    assert "iteration" not in res.stdout  # nothing trained


def test_seq_length_the_layout_cannot_split(tiny):
    res = run_torchrun(SCRIPT, _argv(*tiny, **{"--seq-length": 200, "--context-parallel-size": 2}),
                       nproc=2, timeout=120)
    _fails(res, "--seq-length 200", "divisible by cp_size*granularity")


def test_unknown_cp_attention_value(tiny):
    res = run_python(SCRIPT, _argv(*tiny, **{"--cp-attention": "flash"}), timeout=60)
    _fails(res, "argument --cp-attention: invalid choice: 'flash'")


def test_missing_tokenizer_file(tiny, tmp_path):
    missing = tmp_path / "nope.model"
    res = run_python(SCRIPT, _argv(tiny[0], str(missing)), timeout=60)
    _fails(res, "--tokenizer-model", str(missing))


def test_unreadable_tokenizer_and_cuda_graphs_on_cpu_name_the_setting(tiny, tmp_path):
    """A tokenizer file that does not load names --tokenizer-model and the type (not the loader's bare
    error); cuda_graphs: true on a run without CUDA is refused where the run starts, not at the first
    forward, while the arguments still validate (a Slurm dry run checks them on a login node)."""
    from types import SimpleNamespace

    from megatron_mtraining.training.build import build_tokenizer

    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    for kind in ("SentencePieceTokenizer", "HuggingFaceTokenizer"):
        with pytest.raises(ValueError, match=rf"--tokenizer-model {re.escape(str(bad))}: cannot be loaded as .*"
                                             rf"--tokenizer-type {kind}"):
            build_tokenizer(SimpleNamespace(tokenizer_type=kind, tokenizer_model=str(bad)))
    assert build_tokenizer(SimpleNamespace(tokenizer_type="SentencePieceTokenizer", tokenizer_model=tiny[1])).vocab_size
    import torch

    if not torch.cuda.is_available():
        cfg = tmp_path / "graphs.yaml"
        cfg.write_text("pattern: vertical_slash\ncuda_graphs: true\n")
        assert _validate(tiny, **{"--mtraining-config": str(cfg)}).mtraining.cuda_graphs
        res = run_python(SCRIPT, _argv(*tiny, **{"--mtraining-config": str(cfg)}), timeout=120)
        _fails(res, "'cuda_graphs: true' captures CUDA graphs, and this run is on the cpu; set cuda_graphs: false")


def test_help_does_not_import_torch():
    """``--help`` (the Slurm scripts probe it on every launch) prints the flags without importing torch."""
    code = ("import runpy, sys; sys.argv = ['pretrain_gpt.py', '--help']\n"
            "try:\n    runpy.run_path('examples/pretrain_gpt.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])     # a fresh interpreter (not the fork server)
    assert res.returncode == 0 and "--override-opt_param-scheduler" in res.stdout, res.stdout + res.stderr


def test_unknown_flag(tiny):
    res = run_python(SCRIPT, _argv(*tiny) + ["--no-such-flag", "1"], timeout=60)
    _fails(res, "unrecognized arguments: --no-such-flag")


def _validate(tiny, world_size=1, te=False, **over):
    args = build_parser().parse_args(_argv(*tiny, **over))
    return validate_args(args, world_size=world_size, te_importable=te)


@pytest.mark.parametrize("over,world,needle", [
    ({"--global-batch-size": 6, "--micro-batch-size": 4}, 1, "--global-batch-size (6)"),
    ({"--global-batch-size": 2, "--micro-batch-size": 2}, 4, "data-parallel size (4 = world 4"),
    ({"--num-query-groups": 3}, 1, "--num-query-groups (3)"),
    ({"--num-attention-heads": 3, "--group-query-attention": False}, 1, "--hidden-size (64)"),
    ({"--cp-attention": "te", "--context-parallel-size": 2, "--cp-granularity": False}, 2, "requires Transformer Engine"),
    ({"--cp-attention": "te", "--cp-layout": "striped"}, 1, "zigzag"),
    ({"--context-parallel-size": 2}, 3, "world size 3"),
    ({"--data-path": "/nonexistent/prefix"}, 1, "--data-path"),
    ({"--attention-dropout": 0.1}, 1, "--attention-dropout"),
    ({"--bf16": None, "--fp16": None}, 1, "mutually exclusive"),
    ({"--fp16": None, "--initial-loss-scale": 0}, 1, "--initial-loss-scale must be a positive finite number"),
    ({"--fp16": None, "--loss-scale": "inf"}, 1, "--loss-scale must be a positive finite number, got inf"),
    ({"--fp16": None, "--min-loss-scale": 1024, "--initial-loss-scale": 512}, 1,
     "--min-loss-scale (1024.0) must not exceed --initial-loss-scale (512.0)"),
    ({"--fp16": None, "--hysteresis": 0}, 1, "--hysteresis must be a whole number >= 1, got 0"),
    ({"--fp16": None, "--loss-scale-window": 0.5}, 1, "--loss-scale-window must be a whole number >= 1, got 0.5"),
    ({"--fp16": None, "--loss-scale-window": 2.5}, 1, "--loss-scale-window must be a whole number >= 1, got 2.5"),
    ({"--split": "a,b"}, 1, "--split"),
    ({"--seq-length": 256, "--context-parallel-size": 4, "--cp-granularity": 128}, 4, "cp_size*granularity"),
    ({"--context-parallel-size": 4, "--hierarchical-context-parallel-sizes": "2 1"}, 4, "INNER*OUTER"),
    ({"--context-parallel-size": 4, "--hierarchical-context-parallel-sizes": "2 2",
      "--mtraining-config": "configs/demo.yaml"}, 4, "flat ring"),
    ({"--mtraining-config": "configs/no_such.yaml"}, 1, "no_such.yaml"),
    ({"--mtraining-config": ""}, 1, "--mtraining-config: mtraining config: the path is empty"),
    ({"--mtraining-config": "configs/demo_sparse.yaml", "--seq-length": 32}, 1, "'granularity'"),
    ({"--exit-duration-in-mins": 0}, 1, "--exit-duration-in-mins must be > 0"),
    ({"--exit-interval": 0}, 1, "--exit-interval must be >= 1"),
    ({"--distributed-timeout-minutes": 0}, 1, "--distributed-timeout-minutes must be >= 1"),
    ({"--recompute-granularity": "full"}, 1, "--recompute-method"),
    ({"--lr-warmup-iters": 3}, 1, "--lr-warmup-iters (3) must be < --lr-decay-iters (3"),
    ({"--lr-warmup-iters": 2, "--lr-decay-iters": 2}, 1, "--lr-warmup-iters (2) must be < --lr-decay-iters (2)"),
    ({"--lr-warmup-iters": 0, "--lr-decay-iters": 0}, 1, "--lr-decay-iters must be >= 1, got 0"),
    ({"--override-opt_param-scheduler": None, "--use-checkpoint-opt_param-scheduler": None}, 1,
     "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each other"),
    # a config fixes the layout: an explicit, different --cp-layout / --cp-granularity is an error
    ({"--context-parallel-size": 2, "--mtraining-config": "configs/zigzag_sparse.yaml", "--cp-layout": "striped"},
     2, "--cp-layout striped disagrees with configs/zigzag_sparse.yaml"),
    ({"--mtraining-config": "configs/demo_sparse.yaml", "--cp-granularity": 128}, 1,
     "--cp-granularity 128 disagrees with configs/demo_sparse.yaml"),
    # the zigzag layout has no granularity: the flag is refused, not ignored
    ({"--cp-layout": "zigzag"}, 1, "--cp-granularity 32 applies to the striped layout only; --cp-layout zigzag"),
    ({"--context-parallel-size": 2, "--mtraining-config": "configs/zigzag_sparse.yaml", "--cp-granularity": 64},
     2, "--cp-granularity 64 applies to the striped layout only; configs/zigzag_sparse.yaml (zigzag layout)"),
    ({"--cp-attention": "te"}, 1, "--cp-granularity 32 applies to --cp-attention mtraining's striped layout only"),
])
def test_validation_errors_name_the_flag(tiny, over, world, needle):
    with pytest.raises(ArgumentValidationError) as e:
        _validate(tiny, world_size=world, **over)
    assert needle in str(e.value)


def test_validation_fills_derived_values(tiny):
    a = _validate(tiny, world_size=4, **{"--context-parallel-size": 2, "--micro-batch-size": 1,
                                         "--global-batch-size": 8})
    assert (a.data_parallel_size, a.num_microbatches, a.cp_layout, a.kv_channels) == (2, 4, "striped", 16)
    assert a.ffn_hidden_size == 128  # swiglu: 8/3 * 64 rounded down to a multiple of 64
    assert a.lr_decay_iters == 3 and a.max_position_embeddings == 256
    assert _validate(tiny, te=True, **{"--cp-attention": "te", "--cp-granularity": False}).cp_layout == "zigzag"
    assert _validate(tiny, **{"--cp-layout": "zigzag", "--cp-granularity": False}).cp_layout == "zigzag"
    # flags that agree with the config are accepted; the config sets them when not given
    a = _validate(tiny, **{"--mtraining-config": "configs/demo_sparse.yaml", "--cp-layout": "striped",
                           "--cp-granularity": 64})
    assert (a.cp_layout, a.cp_granularity) == ("striped", 64)
    a = _validate(tiny, world_size=2, **{"--context-parallel-size": 2, "--mtraining-config": "configs/zigzag_sparse.yaml"})
    assert a.cp_layout == "zigzag"
    # the dynamic loss-scale flags are checked only where they drive the scale (--fp16 without --loss-scale)
    for over in ({"--initial-loss-scale": 0.5}, {"--bf16": None, "--hysteresis": 0},
                 {"--fp16": None, "--loss-scale": 1024, "--initial-loss-scale": 0.5}):
        _validate(tiny, **over)
    assert _validate(tiny, **{"--fp16": None, "--loss-scale-window": "1000.0"}).loss_scale_window == 1000.0


def test_resume_schedule_check_and_the_flags_that_choose_a_side():
    """Another schedule on --load is an error naming the flag, unless --override-opt_param-scheduler or
    --use-checkpoint-opt_param-scheduler says which schedule wins (megatron-core then applies it); another
    --global-batch-size is an error in every case (the data would skip or repeat samples)."""
    from types import SimpleNamespace

    from megatron_mtraining.training.checkpoint import (check_resume_optimizer, check_resume_position,
                                                        check_resume_schedule)

    saved = {"wd_incr_steps": 16, "lr_decay_steps": 16, "max_lr": 3e-3}
    sched = SimpleNamespace(state_dict=lambda: {**saved, "wd_incr_steps": 24, "lr_decay_steps": 24})
    args = SimpleNamespace(load="ckpt", override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(SystemExit, match=r"--train-iters \(run: 24, checkpoint: 16\)"):
        check_resume_schedule(args, sched, saved, "ckpt/iter_0000004")
    check_resume_schedule(args, SimpleNamespace(state_dict=lambda: dict(saved)), saved, "ckpt/iter_0000004")
    for flag in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        check_resume_schedule(SimpleNamespace(**{**vars(args), flag: True}), sched, saved, "ckpt/iter_0000004")
    # the data position (iterations x --global-batch-size) must be the saving run's, whichever schedule
    # wins; a checkpoint without saved arguments is not checked
    check_resume_position(SimpleNamespace(load="ckpt", global_batch_size=4), {"global_batch_size": 4}, 4, "ckpt/i")
    check_resume_position(SimpleNamespace(load="ckpt", global_batch_size=8), {}, 4, "ckpt/i")
    with pytest.raises(SystemExit, match=r"saved by a run with --global-batch-size 4; .* so 8 would read from sample "
                                         r"32 instead of 16 .* resume with --global-batch-size 4"):
        check_resume_position(SimpleNamespace(load="ckpt", global_batch_size=8), {"global_batch_size": 4}, 4, "ckpt/i")
    # the optimizer state belongs to the saving run's --optimizer
    check_resume_optimizer(SimpleNamespace(load="ckpt", optimizer="sgd"), {"optimizer": "sgd"}, "ckpt/i")
    check_resume_optimizer(SimpleNamespace(load="ckpt", optimizer="sgd"), {}, "ckpt/i")
    with pytest.raises(SystemExit, match=r"saved by a run with --optimizer adam, whose state cannot continue as "
                                         r"--optimizer sgd: resume with --optimizer adam"):
        check_resume_optimizer(SimpleNamespace(load="ckpt", optimizer="sgd"), {"optimizer": "adam"}, "ckpt/i")


# ------------------------------------------------------------------------------ end to end
def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_cp2_training_matches_cp1_and_checkpoint_resumes_at_cp1(tiny, tmp_path):
    common = {"--data-cache-path": tmp_path / "cache"}
    # CP=1 reference (3 iterations)
    m1 = tmp_path / "cp1.jsonl"
    r1 = run_python(SCRIPT, _argv(*tiny, **common, **{"--metrics-file": m1}), timeout=240)
    assert r1.returncode == 0, r1.tail()
    # CP=2 with a checkpoint at iteration 2 and at the end
    m2, ckpt = tmp_path / "cp2.jsonl", tmp_path / "ckpt"
    r2 = run_torchrun(SCRIPT, _argv(*tiny, **common, **{"--metrics-file": m2, "--context-parallel-size": 2,
                                                       "--save": ckpt, "--save-interval": 2}),
                      nproc=2, timeout=240)
    assert r2.returncode == 0, r2.tail()
    a, b = _metrics(m1), _metrics(m2)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"] and x["lr"] == pytest.approx(y["lr"], rel=1e-12)
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, y)
    assert a[-1]["lm_loss"] < a[0]["lm_loss"]
    assert any(x["tokens"] < 4 * 256 for x in a)  # --eod-mask-loss really masks tokens
    # Megatron-style iteration lines from rank 0 only
    lines = [ln for ln in r2.stdout.splitlines() if ln.startswith(" [") and "iteration" in ln]
    assert len(lines) == 3 and "| lm loss: " in lines[0] and "TFLOP/s/GPU" in lines[0], r2.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (ckpt / "iter_0000002" / "metadata.json").is_file()
    # resume the CP=2 checkpoint of iteration 2 at CP=1: iteration 3 must be reproduced
    resume = tmp_path / "resume"
    resume.mkdir()
    shutil.copytree(ckpt / "iter_0000002", resume / "iter_0000002")
    (resume / "latest_checkpointed_iteration.txt").write_text("2")
    m3 = tmp_path / "resume.jsonl"
    r3 = run_python(SCRIPT, _argv(*tiny, **common, **{"--metrics-file": m3, "--load": resume}), timeout=240)
    assert r3.returncode == 0, r3.tail()
    c = _metrics(m3)
    assert [x["iteration"] for x in c] == [3]
    assert c[0]["lm_loss"] == pytest.approx(a[2]["lm_loss"], rel=1e-5)
    assert c[0]["grad_norm"] == pytest.approx(a[2]["grad_norm"], rel=1e-5)


def _train(tiny, tmp_path, name, nproc, **over):
    m = tmp_path / f"{name}.jsonl"
    opts = {"--data-cache-path": tmp_path / "cache", "--metrics-file": m, **over}
    if nproc == 1:
        r = run_python(SCRIPT, _argv(*tiny, **opts), timeout=300)
    else:
        r = run_torchrun(SCRIPT, _argv(*tiny, **opts, **{"--context-parallel-size": nproc}), nproc=nproc, timeout=300)
    assert r.returncode == 0, r.tail()
    return _metrics(m), r.stdout


def _full_run_and_one_saved_after_iteration_1(tiny, tmp_path, common: dict):
    """The run of ``common`` uninterrupted (metrics ``full.jsonl``) and the same run stopped by
    --exit-interval 1, saved to ``ckpt`` (metrics ``p1.jsonl``); returns the two metrics paths, the
    checkpoint directory and the second run's result."""
    full, part, ckpt = tmp_path / "full.jsonl", tmp_path / "p1.jsonl", tmp_path / "ckpt"
    r = run_python(SCRIPT, _argv(*tiny, **common, **{"--metrics-file": full}), timeout=240)
    assert r.returncode == 0, r.tail()
    r = run_python(SCRIPT, _argv(*tiny, **common, **{"--metrics-file": part, "--save": ckpt,
                                                     "--exit-interval": 1}), timeout=240)
    assert r.returncode == 0, r.tail()
    return full, part, ckpt, r


def test_exit_interval_and_duration_save_and_resume_exactly(tiny, tmp_path):
    """Megatron-LM's --exit-interval / --exit-duration-in-mins: the run stops after that iteration and
    saves; resuming with the same --train-iters continues the uninterrupted run (schedule, data, SGD's
    momentum buffers), and so does a resume with --use-checkpoint-opt_param-scheduler and other --lr /
    --weight-decay flags. (Adam's resume: the CP=2 -> CP=1 test and the fault tests.)"""
    common = {"--data-cache-path": tmp_path / "cache", "--train-iters": 4, "--optimizer": "sgd"}
    full, part1, ckpt, r = _full_run_and_one_saved_after_iteration_1(tiny, tmp_path, common)
    assert "exiting after iteration 1 (--exit-interval 1)" in r.stdout, r.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    part2 = tmp_path / "p2.jsonl"          # a tiny duration: stops after its first iteration (2)
    r = run_python(SCRIPT, _argv(*tiny, **common, **{"--metrics-file": part2, "--save": ckpt, "--load": ckpt,
                                                     "--exit-duration-in-mins": 1e-6}), timeout=240)
    assert r.returncode == 0, r.tail()
    assert "exiting after iteration 2 (--exit-duration-in-mins" in r.stdout, r.stdout
    # iterations 3 and 4 on the checkpoint's schedule whatever the schedule flags say: the loss of 4 shows
    # the first update after the resume (weight decay included)
    part3 = tmp_path / "p3.jsonl"
    r = run_python(SCRIPT, _argv(*tiny, **common, **{"--metrics-file": part3, "--save": ckpt, "--load": ckpt,
                                                     "--use-checkpoint-opt_param-scheduler": None,
                                                     "--lr": 1e-2, "--weight-decay": 0.5}), timeout=240)
    assert r.returncode == 0, r.tail()
    a = _metrics(full)
    b = _metrics(part1) + _metrics(part2) + _metrics(part3)
    assert [x["iteration"] for x in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert y["lr"] == pytest.approx(x["lr"], rel=1e-12)
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-6), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-6), (x, y)



@pytest.mark.slow
def test_fp16_saved_before_the_first_update_resumes_exactly(tiny, tmp_path):
    """An fp16 run whose first update is skipped for gradient overflow (the dynamic loss scale starts
    too high) saves a checkpoint that holds no Adam moments; resuming it continues the uninterrupted
    run: loss, grad norm, LR, loss scale and skipped updates of every later iteration."""
    from megatron_mtraining.training.checkpoint import optimizer_state_saved

    # 2^18 overflows these gradients in fp16 and 2^17 does not: iteration 1 is skipped, 2-4 update
    common = {"--data-cache-path": tmp_path / "cache", "--train-iters": 4, "--fp16": None,
              "--initial-loss-scale": 2 ** 18, "--hysteresis": 1}
    full, part, ckpt, r = _full_run_and_one_saved_after_iteration_1(tiny, tmp_path, common)
    assert "number of skipped iterations:   1" in r.stdout, r.stdout
    assert not optimizer_state_saved(ckpt / "iter_0000001")       # the case under test: no moments saved
    r = run_python(SCRIPT, _argv(*tiny, **common, **{"--metrics-file": part, "--load": ckpt}), timeout=240)
    assert r.returncode == 0, r.tail()
    a, b = _metrics(full), _metrics(part)
    assert [x["iteration"] for x in b] == [1, 2, 3, 4]
    assert [x["skipped"] for x in a] == [True, False, False, False]
    for x, y in zip(a, b):
        assert (y["skipped"], y["loss_scale"], y["lr"]) == (x["skipped"], x["loss_scale"], x["lr"]), (x, y)
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-6), (x, y)
        assert (y["grad_norm"] is None) == x["skipped"], (x, y)                  # no norm for a skipped update
        assert y["grad_norm"] == (None if x["skipped"] else pytest.approx(x["grad_norm"], rel=1e-6)), (x, y)
    assert a[3]["lm_loss"] != pytest.approx(a[0]["lm_loss"], rel=1e-3)          # the updates changed the model


def _cosine_lr(it: int, train_iters: int, gbs: int = 4, warmup: int = 1, lr: float = 3e-3, min_lr: float = 1e-4):
    """Megatron's warm-up + cosine LR (steps = samples) logged with iteration ``it``: after ``it - 1``
    steps of ``gbs`` samples, decaying over ``train_iters`` (the default --lr-decay-iters); the
    flags of :func:`_argv`."""
    import math

    step, w, d = (it - 1) * gbs, warmup * gbs, train_iters * gbs
    if step <= w:
        return lr * step / w
    if step > d:
        return min_lr
    return min_lr + 0.5 * (math.cos(math.pi * (step - w) / (d - w)) + 1) * (lr - min_lr)


def test_exit_on_a_save_interval_saves_once_and_resume_needs_the_same_schedule(tiny, tmp_path):
    """--exit-interval on a --save-interval iteration writes that checkpoint once (not a second
    overwrite); resuming it with another --train-iters (a different LR/weight-decay schedule and data
    order) is a clear error naming the flag, not a silent switch to the checkpoint's schedule.
    Megatron-LM's --override-opt_param-scheduler extends the run on the new schedule (the LR of the
    added iterations follows --train-iters 6 from the checkpoint's step count)."""
    common = {"--data-cache-path": tmp_path / "cache", "--train-iters": 4, "--save": tmp_path / "ckpt"}
    m1 = tmp_path / "m1.jsonl"
    r = run_python(SCRIPT, _argv(*tiny, **common, **{"--save-interval": 2, "--exit-interval": 2,
                                                     "--metrics-file": m1}), timeout=240)
    assert r.returncode == 0, r.tail()
    assert r.stdout.count("saved checkpoint") == 1, r.stdout
    assert "Overwriting" not in r.output, r.output
    # the formula is the one the run used (negative control for the extension below)
    assert [x["lr"] for x in _metrics(m1)] == pytest.approx([_cosine_lr(i, 4) for i in (1, 2)], rel=1e-12)
    longer = {**common, "--train-iters": 6, "--load": tmp_path / "ckpt"}
    r = run_python(SCRIPT, _argv(*tiny, **longer), timeout=240)
    _fails(r, "--train-iters", "--load", "--override-opt_param-scheduler")
    r = run_python(SCRIPT, _argv(*tiny, **longer, **{"--override-opt_param-scheduler": None,
                                                     "--global-batch-size": 8}), timeout=240)
    _fails(r, "saved by a run with --global-batch-size 4", "resume with --global-batch-size 4")
    r = run_python(SCRIPT, _argv(*tiny, **common, **{"--load": tmp_path / "ckpt", "--optimizer": "sgd"}), timeout=240)
    _fails(r, "saved by a run with --optimizer adam", "resume with --optimizer adam")
    m2 = tmp_path / "m2.jsonl"
    r = run_python(SCRIPT, _argv(*tiny, **longer, **{"--override-opt_param-scheduler": None,
                                                     "--metrics-file": m2}), timeout=240)
    assert r.returncode == 0, r.tail()
    assert "loaded checkpoint" in r.stdout and "(iteration 2)" in r.stdout, r.stdout
    rows = _metrics(m2)
    assert [x["iteration"] for x in rows] == [3, 4, 5, 6]
    lrs = [x["lr"] for x in rows]
    assert lrs == pytest.approx([_cosine_lr(i, 6) for i in (3, 4, 5, 6)], rel=1e-12)
    assert lrs != pytest.approx([_cosine_lr(i, 4) for i in (3, 4, 5, 6)], rel=1e-3)    # not the old schedule
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "6"


@pytest.mark.slow
def test_sparse_config_cp2_matches_cp1(tiny, tmp_path):
    """``--mtraining-config configs/demo_sparse.yaml``: the vertical-slash pattern is estimated online
    every forward; it is a property of the sequence, so CP=2 trains exactly like CP=1."""
    cfg = {"--mtraining-config": "configs/demo_sparse.yaml"}
    tb_dir = tmp_path / "tb"
    a, out1 = _train(tiny, tmp_path, "sparse_cp1", 1, **cfg, **{"--tensorboard-dir": tb_dir, "--eval-iters": 1,
                                                                "--eval-interval": 3})
    # tensorboard scalars (Megatron-LM's names) and the evaluation on the held-out split
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tb_dir))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "throughput/tokens-per-sec-per-gpu"} <= tags, tags
    assert [e.step for e in ev.Scalars("lm loss")] == [1, 2, 3]
    assert ev.Scalars("lm loss")[0].value == pytest.approx(a[0]["lm_loss"], rel=1e-6)
    if "validation loss at iteration 3" in out1:
        assert "lm loss validation" in tags
    # CP=2 with the vertical columns computed outside the ring (gathered once): same losses and grads
    oor = tmp_path / "demo_sparse_out_of_ring.yaml"
    oor.write_text((Path(__file__).resolve().parents[2] / "configs" / "demo_sparse.yaml").read_text()
                   + "columns: out_of_ring\n")
    b, out = _train(tiny, tmp_path, "sparse_cp2", 2, **{"--mtraining-config": oor})
    assert "pattern vertical_slash, columns out_of_ring" in out, out
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, y)


@pytest.mark.slow
def test_hierarchical_cp4_matches_cp1(tiny, tmp_path):
    """``--hierarchical-context-parallel-sizes 2 2``: the two-level ring (Megatron's hierarchical CP
    groups) trains exactly like CP=1."""
    a, _ = _train(tiny, tmp_path, "h_cp1", 1)
    b, out = _train(tiny, tmp_path, "h_cp4", 4, **{"--hierarchical-context-parallel-sizes": "2 2"})
    assert "implementation hierarchical" in out, out
    for x, y in zip(a, b):
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, y)


@pytest.mark.slow
def test_packed_documents_cp2_and_hierarchical_cp4_match_cp1(tiny, tmp_path):
    """``--reset-position-ids --reset-attention-mask --eod-mask-loss``: documents end at EOD tokens,
    attention stays inside each document and RoPE positions restart; CP=2 (flat ring) and CP=4 (2 x 2
    hierarchical ring) train exactly like CP=1, and the packed run differs from the unpacked one."""
    packed = {"--reset-position-ids": None, "--reset-attention-mask": None}
    a, _ = _train(tiny, tmp_path, "packed_cp1", 1, **packed)
    b, _ = _train(tiny, tmp_path, "packed_cp2", 2, **packed)
    c, out = _train(tiny, tmp_path, "packed_cp4", 4, **packed, **{"--hierarchical-context-parallel-sizes": "2 2"})
    assert "implementation hierarchical" in out, out
    assert len(a) == len(b) == len(c) == 3
    for x, y, z in zip(a, b, c):
        for got in (y, z):
            assert got["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5), (x, got)
            assert got["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, got)
    plain, _ = _train(tiny, tmp_path, "unpacked_cp1", 1)
    assert abs(plain[0]["lm_loss"] - a[0]["lm_loss"]) > 1e-4 or abs(plain[0]["grad_norm"] - a[0]["grad_norm"]) > 1e-4


@pytest.mark.slow
def test_packed_documents_sparse_cp2_matches_cp1(tiny, tmp_path):
    """``--reset-attention-mask`` with ``configs/demo_sparse.yaml``: vertical-slash attention over the
    documents (pattern ∧ causal ∧ same document, torch sparse kernels) trains at CP=2 exactly like
    CP=1, and differs from the unpacked sparse run."""
    packed = {"--reset-position-ids": None, "--reset-attention-mask": None,
              "--mtraining-config": "configs/demo_sparse.yaml"}
    a, _ = _train(tiny, tmp_path, "packed_sparse_cp1", 1, **packed)
    b, _ = _train(tiny, tmp_path, "packed_sparse_cp2", 2, **packed)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, y)
    plain, _ = _train(tiny, tmp_path, "unpacked_sparse_cp1", 1, **{"--mtraining-config": "configs/demo_sparse.yaml"})
    assert abs(plain[0]["lm_loss"] - a[0]["lm_loss"]) > 1e-4 or abs(plain[0]["grad_norm"] - a[0]["grad_norm"]) > 1e-4


@pytest.mark.slow
def test_packed_documents_per_document_probes_cp2_matches_cp1(tiny, tmp_path):
    """``vertical_slash.probes: document`` from a YAML config through the trainer: every document's last
    queries probe the pattern (their rows gathered across the CP group), CP=2 trains exactly like CP=1,
    and the run differs from the same config with the stream's probes (small floors and caps, so that
    the pattern is not the whole of each short document)."""
    def config(probes):
        path = tmp_path / f"probes_{probes}.yaml"
        path.write_text("implementation: striped\ngranularity: 32\npattern: vertical_slash\nvertical_slash:\n"
                        "  recall: 0.5\n  last_q: 16\n  block_size: 32\n  sink_tokens: 2\n  local_blocks: 1\n"
                        f"  max_vertical: 8\n  max_slash: 2\n  probes: {probes}\n")
        return {"--reset-position-ids": None, "--reset-attention-mask": None, "--mtraining-config": str(path)}

    a, _ = _train(tiny, tmp_path, "packed_docprobes_cp1", 1, **config("document"))
    b, _ = _train(tiny, tmp_path, "packed_docprobes_cp2", 2, **config("document"))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, y)
    stream, _ = _train(tiny, tmp_path, "packed_stream_cp1", 1, **config("stream"))
    assert any(abs(s["lm_loss"] - x["lm_loss"]) > 1e-6 or abs(s["grad_norm"] - x["grad_norm"]) > 1e-6
               for s, x in zip(stream, a)), (stream, a)

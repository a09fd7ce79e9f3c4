"""Pipeline parallelism with context and data parallelism in the example trainer, on CPU (gloo).

PP=2 x CP=2 (4 ranks, megatron-core's 1F1B schedule, 2 micro-batches per iteration) and PP=2 x
DP=2 (1 micro-batch per DP rank) are compared with the one-rank run (PP=1, CP=1) of the same
global batch. Each pipeline stage initialises its own layers, so the 4-rank run starts from the
one-rank run's initial weights (tests/workers/trainer_parity_worker.py with
``MTRAINING_PARITY_INIT``, by global layer number). Loss and grad norm per iteration (the
trainer's ``--metrics-file``) and every parameter's gradient after each gradient reduction (stages
merged by global layer number) must agree at 1e-5 relative (fp32; largest absolute difference over
the tensor's largest magnitude), 2 iterations, dense and vertical-slash attention, untied and tied
embeddings, and the validation loss (forward-only schedule). ``--adam-eps 1e-3`` as in
tests/integration/test_parallel_combos.py (the second iteration runs on updated weights).

Also: a ``torch_dist`` checkpoint of PP=2 x CP=2 resumed at PP=2 x CP=2 and at one rank; the NaN
check's verdict across stages; bad combinations refused naming the rule, on every rank.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_python, run_ranks, run_torchrun
from tests.helpers.tiny_data import make_tiny_dataset
from tests.integration.test_parallel_combos import SCRIPT, WORKER, _argv, _assert_metrics_match, _rel

RTOL = 1e-5                                 # fp32
LAYERS = {"--num-layers": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("tiny_data_pp"))


def _run(tiny, tmp: Path, name: str, nproc: int, init: Path | None = None, **over) -> dict:
    out, metrics = tmp / name, tmp / f"{name}.jsonl"
    argv = [str(out)] + _argv(*tiny, **{**LAYERS, "--data-cache-path": tmp / "cache", "--metrics-file": metrics,
                                        **over})
    env = {"MTRAINING_PARITY_INIT": str(init)} if init else None
    res = (run_python(WORKER, argv, timeout=120, env=env) if nproc == 1
           else run_torchrun(WORKER, argv, nproc=nproc, timeout=180, env=env))
    assert res.returncode == 0, res.tail()
    ranks = [torch.load(f"{out}.rank{r}.pt") for r in range(nproc)]
    return {"metrics": [json.loads(x) for x in metrics.read_text().splitlines()], "ranks": ranks,
            "stdout": res.stdout, "file0": Path(f"{out}.rank0.pt")}


def _merged(run: dict, index: int) -> dict[str, torch.Tensor]:
    """Iteration ``index``'s gradients of the first CP/DP rank of every pipeline stage, merged by
    global name; a tied output weight (the last stage's copy of the word embedding) must equal the
    first stage's embedding gradient and is left out."""
    ranks = sorted((r for r in run["ranks"] if r["cp_rank"] == 0 and r["dp_rank"] == 0), key=lambda r: r["pp_rank"])
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        for name, g in r["grads"][index].items():
            assert name not in out, f"{name} on two pipeline stages"
            out[name] = g
    if run.get("tied") and "output_layer.weight" in out:
        tied = out.pop("output_layer.weight")
        assert _rel(tied, out["embedding.word_embeddings.weight"]) <= RTOL
    return out


def _assert_grads_match(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    for name in ref:
        assert got[name].shape == ref[name].shape, (name, got[name].shape, ref[name].shape)
        err = _rel(got[name], ref[name])
        assert err <= RTOL, f"{what} {name}: relative error {err:.3g} > {RTOL}"


def _valid_losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"validation loss at iteration \d+ \| lm loss value: (\S+)", stdout)]


PP2_CP2 = {"--pipeline-model-parallel-size": 2, "--context-parallel-size": 2}
_CASES = {   # name: (parallel flags, the trainer's layout line, model / config flags)
    "dense": (PP2_CP2, "TP 1 x CP 2 x DP 1 x PP 2",
              {"--eval-iters": 1, "--eval-interval": 1}),          # and the forward-only schedule
    "vertical_slash": (PP2_CP2, "TP 1 x CP 2 x DP 1 x PP 2", {"--mtraining-config": "configs/demo_sparse.yaml"}),
    "dense_tied": (PP2_CP2, "TP 1 x CP 2 x DP 1 x PP 2", {"--untie-embeddings-and-output-weights": False}),
    "dense_dp2": ({"--pipeline-model-parallel-size": 2}, "TP 1 x CP 1 x DP 2 x PP 2", {}),
}


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(_CASES))
def test_pp2_matches_one_rank(tiny, tmp_path, case):
    par, layout, over = _CASES[case]
    ref = _run(tiny, tmp_path, f"ref_{case}", 1, **over)
    got = _run(tiny, tmp_path, f"pp2_{case}", 4, init=ref["file0"], **{**over, **par})
    got["tied"] = case.endswith("tied")
    assert layout in got["stdout"], got["stdout"][-2000:]
    assert sorted(r["pp_rank"] for r in got["ranks"]) == [0, 0, 1, 1]
    _assert_metrics_match(got, ref)
    if case == "vertical_slash":     # the kept work covers the sparse layers of both stages
        for x, y in zip(ref["metrics"], got["metrics"]):
            assert x["attention_kept_layers"] == y["attention_kept_layers"] == 4, (x, y)
            assert y["attention_kept"] == pytest.approx(x["attention_kept"], rel=1e-9), (x, y)
            assert y["attention_kept_min"] == pytest.approx(x["attention_kept_min"], rel=1e-9), (x, y)
    valid = [_valid_losses(r["stdout"]) for r in (ref, got)]
    assert len(valid[0]) == (2 if "--eval-iters" in over else 0)
    assert valid[1] == pytest.approx(valid[0], rel=RTOL)
    for it in range(2):
        _assert_grads_match(_merged(got, it), _merged(ref, it), f"iteration {it + 1} gradient of")
    # negative controls: the last stage's layers are global layers 2 and 3 (numbered from 0 they
    # would be compared with the wrong layer), and the second iteration saw updated weights
    name = "mlp.linear_fc1.weight"
    assert _rel(_merged(got, 0)[f"decoder.layers.2.{name}"], _merged(ref, 0)[f"decoder.layers.0.{name}"]) > 1e-2
    assert _rel(_merged(ref, 1)[f"decoder.layers.3.{name}"], _merged(ref, 0)[f"decoder.layers.3.{name}"]) > 1e-3


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("over,world,needle", [
    ({"--pipeline-model-parallel-size": 3}, 3,
     "--num-layers (4) must be divisible by --pipeline-model-parallel-size (3)"),
    ({"--pipeline-model-parallel-size": 2, "--context-parallel-size": 2}, 6,
     "world size 6 is not divisible by --tensor-model-parallel-size (1) x --context-parallel-size (2) x "
     "--pipeline-model-parallel-size (2)"),
    ({"--pipeline-model-parallel-size": 0}, 1, "--pipeline-model-parallel-size must be >= 1, got 0"),
    ({"--pipeline-model-parallel-size": 2, "--save": "/tmp/ckpt", "--ckpt-format": "torch"}, 2,
     "--save with --pipeline-model-parallel-size 2 needs --ckpt-format torch_dist"),
    ({"--pipeline-model-parallel-size": 2, "--load": "/tmp/ckpt", "--ckpt-format": "torch"}, 2,
     "--load with --pipeline-model-parallel-size 2 needs --ckpt-format torch_dist"),
])
def test_validation_names_the_rule(tiny, over, world, needle):
    from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args

    args = build_parser().parse_args(_argv(*tiny, **{**LAYERS, **over}))
    with pytest.raises(ArgumentValidationError) as e:
        validate_args(args, world_size=world, te_importable=False)
    assert needle in str(e.value)


def test_micro_batches_from_global_batch(tiny):
    from megatron_mtraining.megatron.args import build_parser, validate_args

    argv = _argv(*tiny, **{**LAYERS, "--pipeline-model-parallel-size": 2, "--global-batch-size": 8})
    args = validate_args(build_parser().parse_args(argv), world_size=4)
    assert (args.data_parallel_size, args.num_microbatches) == (2, 2)        # 8 / (2 x DP 2)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bad_pipeline_split_fails_on_every_rank(tiny, tmp_path):
    needle = "--num-layers (3) must be divisible by --pipeline-model-parallel-size (2)"
    # ranks started on their own (not torchrun, which stops the others as soon as one exits)
    ranks = run_ranks(SCRIPT, _argv(*tiny, **{"--num-layers": 3, "--pipeline-model-parallel-size": 2,
                                              "--data-cache-path": tmp_path / "cache"}), nproc=2, timeout=120)
    for r in ranks:
        assert r.returncode not in (0, None), r.tail()
        assert needle in r.stderr, r.tail()                 # every rank says why
        assert "iteration" not in r.stdout, r.tail()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_nan_gradient_on_the_last_stage_is_named_on_every_rank(tiny, tmp_path):
    """The NaN check's verdict over pipeline stages: stage 1 (rank 1 of PP=2) gets a NaN in its
    first layer's gradient; both stages stop at iteration 1 naming it by global layer number and
    stage. Without a fault the PP runs above pass the check (no stage reports another's index)."""
    from tests.helpers.dist import run_reaped

    argv = _argv(*tiny, **{**LAYERS, "--pipeline-model-parallel-size": 2, "--data-cache-path": tmp_path / "cache"})
    r = run_reaped("tests/workers/fault_worker.py", ["nan_grad:1:1:decoder.layers.0.mlp.linear_fc2.weight", "--",
                                                     *argv], nproc=2, timeout=150)
    assert not r.timed_out and r.returncode not in (0, None), r.tail()
    msg = ("pretrain_gpt.py: error: iteration 1: non-finite (NaN/Inf) gradient in parameter "
           "'decoder.layers.2.mlp.linear_fc2.weight' (pipeline stage 1) (the first in model order)")
    assert (r.stdout + r.stderr).count(msg) == 2, r.tail()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pp2_cp2_checkpoint_resumes_at_pp2_and_reshards_to_one_rank(tiny, tmp_path):
    """PP=2 x CP=2 saves after iterations 1 and 2 (``torch_dist``); with iteration 2's checkpoint
    removed, resuming from iteration 1 at PP=2 x CP=2 and at PP=1 x CP=1 (megatron-core's
    dist_checkpointing reshards the stages by global layer number) gives iteration 2 of the
    uninterrupted run: loss and grad norm at 1e-5 relative."""
    import shutil

    ckpt = tmp_path / "ckpt"
    save = {"--save": ckpt, "--save-interval": 1}
    full = _run(tiny, tmp_path, "full", 4, **{**save, **PP2_CP2})
    assert [m["iteration"] for m in full["metrics"]] == [1, 2]
    shutil.rmtree(ckpt / "iter_0000002")                   # the tracker's checkpoint is gone: resume from 1
    for name, nproc, over in (("pp2", 4, PP2_CP2), ("pp1", 1, {})):
        res = _run(tiny, tmp_path, f"resumed_{name}", nproc, **{"--load": ckpt, **over})
        assert "loaded checkpoint" in res["stdout"] and "iteration 1)" in res["stdout"], res["stdout"][-2000:]
        (got,) = res["metrics"]
        want = full["metrics"][1]
        assert got["iteration"] == 2 and got["tokens"] == want["tokens"]
        assert got["lm_loss"] == pytest.approx(want["lm_loss"], rel=RTOL), (name, got, want)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), (name, got, want)
    # negative control: iteration 2 differs from iteration 1 (the resumed runs did not restart)
    assert abs(full["metrics"][1]["lm_loss"] - full["metrics"][0]["lm_loss"]) > 1e-3

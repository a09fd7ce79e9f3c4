"""The example trainer with the parallelisms users combine with context parallelism, on CPU (gloo).

Each multi-rank run is compared with the one-rank run of the same global batch (CP=1, TP=1, DP=1,
no recomputation) on the same weights: the trainer's own ``--metrics-file`` gives loss and grad
norm per iteration; tests/workers/trainer_parity_worker.py records every rank's gradients after
each gradient reduction and its parameters at the end, and the test reassembles tensor-parallel
shards into full tensors. fp32 throughout, every comparison at 1e-5 relative (largest absolute
difference over the tensor's largest magnitude).

Adam's first steps are ``lr * g / (|g| + eps)``: with the default ``eps`` of 1e-8 a gradient
element of order ``eps`` (a bias, a rare token's embedding row) turns a 1e-7 rounding difference
into an update difference of order ``lr``, so the runs use ``--adam-eps 1e-3``, which keeps the
update a smooth function of the gradient (the optimizer code path, sharded states included, is
unchanged).

* TP=2 x CP=2 (4 ranks), dense with the LM-head loss in chunks, and vertical-slash with sequence
  parallelism: loss, grad norm and every parameter's gradient, 2 iterations.
* The distributed optimizer, DP=2 x CP=2 (4 ranks): loss, grad norm and every parameter after
  2 optimizer steps.
* Activation recomputation, selective and full (uniform), at CP=2: gradients equal to the run
  without recomputation, and the core attention really runs again.
* Combinations that cannot work are refused from the command line, on every rank, naming the rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_python, run_ranks, run_torchrun
from tests.helpers.tiny_data import make_tiny_dataset

SCRIPT = "examples/pretrain_gpt.py"
WORKER = "tests/workers/trainer_parity_worker.py"
RTOL = 1e-5                                 # fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_dataset(tmp_path_factory.mktemp("tiny_data"))


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The one-rank run (CP=1, TP=1) that every parallel run is compared with."""
    return _run(tiny, tmp_path_factory.mktemp("ref"), "ref", 1)


@pytest.fixture(scope="module")
def cp2_reference(tiny, tmp_path_factory):
    """CP=2 without recomputation."""
    return _run(tiny, tmp_path_factory.mktemp("cp2"), "cp2", 2, **{"--context-parallel-size": 2})


@pytest.fixture(scope="module")
def sparse_reference(tiny, tmp_path_factory):
    return _run(tiny, tmp_path_factory.mktemp("ref_sparse"), "ref_sparse", 1,
                **{"--mtraining-config": "configs/demo_sparse.yaml"})


def _argv(prefix: str, tok: str, **over) -> list[str]:
    opts = {
        "--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--group-query-attention": None,
        "--num-query-groups": 2, "--seq-length": 256, "--position-embedding-type": "rope",
        "--normalization": "RMSNorm", "--swiglu": None, "--untie-embeddings-and-output-weights": None,
        "--micro-batch-size": 2, "--global-batch-size": 4, "--train-iters": 2, "--lr": 3e-3,
        "--lr-warmup-iters": 0, "--adam-eps": 1e-3, "--lr-decay-style": "cosine", "--min-lr": 1e-4, "--clip-grad": 1.0,
        "--data-path": prefix, "--split": "90,10,0", "--tokenizer-model": tok, "--cp-granularity": 32,
        "--eod-mask-loss": None, "--log-interval": 1, "--eval-iters": 0, "--seed": 7,
        # the vocabulary padded to the same 256 rows at TP=1 and TP=2 (multiple of 128 x TP)
        "--make-vocab-size-divisible-by": 256 // int(over.get("--tensor-model-parallel-size", 1)),
    }
    if "--mtraining-config" in over:
        opts["--cp-granularity"] = False      # a config fixes the layout (an explicit, different flag is an error)
    opts.update(over)
    argv: list[str] = []
    for k, v in opts.items():
        if v is False:
            continue
        argv += [k] if v is None else [k, *v.split()] if isinstance(v, str) and " " in v else [k, str(v)]
    return argv


def _run(tiny, tmp: Path, name: str, nproc: int, **over) -> dict:
    out, metrics = tmp / name, tmp / f"{name}.jsonl"
    argv = [str(out)] + _argv(*tiny, **{"--data-cache-path": tmp / "cache", "--metrics-file": metrics, **over})
    res = (run_python(WORKER, argv, timeout=120) if nproc == 1
           else run_torchrun(WORKER, argv, nproc=nproc, timeout=180))
    assert res.returncode == 0, res.tail()
    ranks = [torch.load(f"{out}.rank{r}.pt") for r in range(nproc)]
    return {"metrics": [json.loads(x) for x in metrics.read_text().splitlines()], "ranks": ranks,
            "stdout": res.stdout}


def _full(run: dict, what: str, index: int | None = None) -> dict[str, torch.Tensor]:
    """Full tensors (``what``: "grads" of iteration ``index``, or "params"): the TP shards of the
    first CP/DP rank put back together along their partition dim (megatron's partition stride
    respected); replicated tensors must be equal on every TP rank."""
    ranks = sorted((r for r in run["ranks"] if r["cp_rank"] == 0 and r["dp_rank"] == 0), key=lambda r: r["tp_rank"])
    assert [r["tp_rank"] for r in ranks] == list(range(ranks[0]["tp_size"]))
    pick = (lambda r: r[what][index]) if what == "grads" else (lambda r: r[what])
    out = {}
    for name in pick(ranks[0]):
        parts = [pick(r)[name] for r in ranks]
        split, dim, stride = ranks[0]["meta"][name]
        if split and len(parts) > 1:
            # megatron's strided split (SwiGLU's fc1: stride 2): the full tensor is ``stride`` blocks,
            # each split over the TP ranks; rank r holds piece r of every block
            pieces = [p.chunk(stride, dim=dim) for p in parts]
            out[name] = torch.cat([pieces[r][s] for s in range(stride) for r in range(len(parts))], dim=dim)
        else:
            for p in parts[1:]:
                torch.testing.assert_close(p, parts[0], rtol=0, atol=0, msg=f"{name} differs across TP ranks")
            out[name] = parts[0]
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30)).item()


def _assert_tensors_match(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys()
    for name in ref:
        assert got[name].shape == ref[name].shape, (name, got[name].shape, ref[name].shape)
        err = _rel(got[name], ref[name])
        assert err <= RTOL, f"{what} {name}: relative error {err:.3g} > {RTOL}"


def _assert_metrics_match(got: dict, ref: dict) -> None:
    a, b = ref["metrics"], got["metrics"]
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"]
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=RTOL), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=RTOL), (x, y)


# ------------------------------------------------------------- TP + sequence parallelism x CP
@pytest.mark.slow
@pytest.mark.parametrize("config", ["dense", "vertical_slash"])
def test_tp2_cp2_matches_one_rank(tiny, tmp_path, reference, sparse_reference, config):
    """dense: TP=2 x CP=2 with the LM-head loss in chunks of 64 positions (vocabulary-parallel); the
    reference computes it unchunked. vertical_slash: TP=2 with sequence parallelism x CP=2."""
    over = {"--tensor-model-parallel-size": 2, "--context-parallel-size": 2}
    ref = reference
    if config == "dense":
        over["--cross-entropy-chunk-tokens"] = 64
    else:
        over["--sequence-parallel"] = None
        over["--mtraining-config"] = "configs/demo_sparse.yaml"
        ref = sparse_reference
    got = _run(tiny, tmp_path, f"tp2_cp2_{config}", 4, **over)
    assert "TP 2 x CP 2 x DP 1" in got["stdout"], got["stdout"][-2000:]
    _assert_metrics_match(got, ref)
    for it in range(2):
        full = _full(got, "grads", it)
        _assert_tensors_match(full, _full(ref, "grads", it), f"iteration {it + 1} gradient of")
    # negative control: the shards really are different halves (reassembled backwards they fail)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    shards = [r["grads"][0][name] for r in got["ranks"] if r["cp_rank"] == 0]
    assert _rel(torch.cat(shards[::-1], 0), _full(ref, "grads", 0)[name]) > 1e-2
    # the second iteration saw updated weights (the comparison is not of one state twice)
    assert _rel(_full(ref, "grads", 1)[name], _full(ref, "grads", 0)[name]) > 1e-3


# ------------------------------------------------------------------- distributed optimizer x CP
@pytest.mark.slow
def test_distributed_optimizer_dp2_cp2_matches_one_rank(tiny, tmp_path, reference):
    got = _run(tiny, tmp_path, "distopt_dp2_cp2", 4,
               **{"--use-distributed-optimizer": None, "--context-parallel-size": 2})
    assert "TP 1 x CP 2 x DP 2" in got["stdout"], got["stdout"][-2000:]
    _assert_metrics_match(got, reference)
    ref_params = _full(reference, "params")
    for r in got["ranks"]:                   # every rank holds the whole, updated model after the gather
        _assert_tensors_match(r["params"], ref_params, f"rank {r['dp_rank']}/{r['cp_rank']} parameter")
    # negative control: the 2 steps moved every weight matrix well beyond the tolerance
    start = reference["ranks"][0]["params_start"]
    for name in ("embedding.word_embeddings.weight", "decoder.layers.1.mlp.linear_fc1.weight", "output_layer.weight"):
        assert _rel(ref_params[name], start[name]) > 1e-3, name


# --------------------------------------------------------------------- recomputation x CP
@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", "full --recompute-method uniform --recompute-num-layers 1"])
def test_recompute_cp2_matches_no_recompute(tiny, tmp_path, reference, cp2_reference, recompute):
    plain = cp2_reference
    got = _run(tiny, tmp_path, "cp2_recompute", 2, **{"--context-parallel-size": 2,
                                                       "--recompute-granularity": recompute})
    _assert_metrics_match(got, plain)
    _assert_metrics_match(got, reference)
    for it in range(2):
        _assert_tensors_match(_full(got, "grads", it), _full(plain, "grads", it), f"iteration {it + 1} gradient of")
    # the recomputation happened: 2 iterations x 2 micro-batches x 2 layers forward, then again in backward
    assert plain["ranks"][0]["attention_calls"] == 8
    assert got["ranks"][0]["attention_calls"] == 16


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("over,world,needle", [
    ({"--sequence-parallel": None}, 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    ({"--use-distributed-optimizer": None, "--save": "/tmp/ckpt"}, 2, "--save with --use-distributed-optimizer"),
    ({"--tensor-model-parallel-size": 2, "--ffn-hidden-size": 99}, 2,
     "--ffn-hidden-size (99) must be divisible by --tensor-model-parallel-size (2)"),
    ({"--tensor-model-parallel-size": 2, "--sequence-parallel": None, "--context-parallel-size": 2,
      "--seq-length": 258, "--cp-granularity": 1}, 4, "the 129 tokens of each CP rank"),
    ({"--recompute-granularity": "full", "--recompute-method": "uniform"}, 1, "--recompute-num-layers"),
    ({"--tensor-model-parallel-size": 2, "--sequence-parallel": None, "--cross-entropy-chunk-tokens": 64}, 2,
     "--cross-entropy-chunk-tokens 64 with --sequence-parallel"),
    ({"--tensor-model-parallel-size": 2, "--lm-loss": "liger"}, 2,
     "--lm-loss liger with --tensor-model-parallel-size 2"),
    ({"--lm-loss": "liger", "--cross-entropy-chunk-tokens": 64}, 1,
     "--cross-entropy-chunk-tokens 64 with --lm-loss liger"),
])
def test_validation_names_the_rule(tiny, over, world, needle):
    from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args

    args = build_parser().parse_args(_argv(*tiny, **over))
    with pytest.raises(ArgumentValidationError) as e:
        validate_args(args, world_size=world, te_importable=False)
    assert needle in str(e.value)


def test_recompute_is_accepted_without_cuda(tiny):
    from megatron_mtraining.megatron.args import build_parser, validate_args

    for rc in ("selective", "full --recompute-method block --recompute-num-layers 2"):
        args = validate_args(build_parser().parse_args(_argv(*tiny, **{"--recompute-granularity": rc})), world_size=1)
        assert args.recompute_granularity == rc.split()[0]


@pytest.mark.slow
@pytest.mark.parametrize("over,nproc,needle", [
    ({"--sequence-parallel": None, "--context-parallel-size": 2}, 2,
     "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    ({"--tensor-model-parallel-size": 3}, 3,
     "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (3)"),
    ({"--tensor-model-parallel-size": 2, "--sequence-parallel": None, "--seq-length": 255, "--cp-granularity": 1},
     2, "--sequence-parallel: the 255 tokens of each CP rank"),
])
def test_bad_combinations_fail_on_every_rank(tiny, tmp_path, over, nproc, needle):
    # ranks started on their own (not torchrun, which stops the others as soon as one exits)
    ranks = run_ranks(SCRIPT, _argv(*tiny, **{"--data-cache-path": tmp_path / "cache", **over}),
                      nproc=nproc, timeout=120)
    for r in ranks:
        assert r.returncode not in (0, None), r.tail()
        assert needle in r.stderr, r.tail()                     # every rank says why
        assert "iteration" not in r.stdout, r.tail()


# ---------------------------------------------------------------------------- the norm spec
def test_local_block_spec_uses_sequence_parallel_torch_norms():
    from types import SimpleNamespace

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_mtraining.config import MTrainingConfig
    from megatron_mtraining.megatron.spec import TorchNorm, get_gpt_layer_spec_with_mtraining, local_block_spec

    layer = get_gpt_layer_spec_with_mtraining(use_te=False, mtraining_config=MTrainingConfig(), normalization="RMSNorm")
    block = local_block_spec(layer, 3)
    assert len(block.layer_specs) == 3 and block.layer_norm is TorchNorm
    sub = block.layer_specs[0].submodules
    assert sub.input_layernorm is TorchNorm and sub.pre_mlp_layernorm is TorchNorm
    assert sub.self_attention.submodules.core_attention.module is layer.submodules.self_attention.submodules.core_attention.module
    assert layer.submodules.input_layernorm is WrappedTorchNorm          # the given spec is not modified
    cfg = SimpleNamespace(normalization="RMSNorm", sequence_parallel=True)
    norm = TorchNorm(cfg, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    assert TorchNorm(SimpleNamespace(normalization="LayerNorm", sequence_parallel=False), 8).bias.sequence_parallel is False
    with pytest.raises(ValueError, match="L2Norm"):
        TorchNorm(SimpleNamespace(normalization="L2Norm", sequence_parallel=False), 8)

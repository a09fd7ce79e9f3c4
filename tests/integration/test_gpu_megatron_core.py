"""The Megatron-Core adapter and the example trainer on one CUDA GPU, for whichever megatron-core is
installed (CI covers 0.16.1 on CPU; run these with `pytest -m gpu` to check another release).

* ``MTrainingAttention`` (dense ring at CP=1) in a bf16 GPTModel against megatron-core's stock
  ``DotProductAttention`` in the same model: per-token losses and every parameter gradient, each
  compared with an fp32 model of the stock attention; the bf16 MTraining error must stay within 2x
  the error of the bf16 stock model. A negative control (a wrong softmax scale) must fail it.
* ``examples/pretrain_gpt.py`` trains a few iterations with ``--bf16`` and ``--cp-attention
  mtraining``, dense and vertical-slash, on one GPU: finite losses that fall, and Megatron-style log
  lines.
* Activation recomputation (``--recompute-granularity selective``, and ``full`` with the uniform
  method) in the example trainer on one GPU in bf16, CP=1: the same losses and gradients as the
  run without recomputation, and the core attention really runs again in the backward pass.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.dist import one_rank_megatron, run_torchrun
from tests.helpers.tiny_data import make_tiny_dataset

pytestmark = pytest.mark.gpu

SEQ, BATCH, VOCAB = 1024, 2, 512


@pytest.fixture(scope="module")
def world1():
    torch.cuda.set_device(0)
    with one_rank_megatron("nccl"):
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
        yield


def _model(kind: str, dtype, state=None, softmax_scale=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.config import MTrainingConfig
    from megatron_mtraining.megatron.rope import install_layout_rope
    from megatron_mtraining.megatron.spec import get_gpt_layer_spec_with_mtraining
    from megatron_mtraining.layout import Layout

    config = TransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=512,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", calculate_per_token_loss=True, softmax_scale=softmax_scale,
    )
    if kind == "local":
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    else:
        spec = get_gpt_layer_spec_with_mtraining(use_te=False, normalization="RMSNorm",
                                                 mtraining_config=MTrainingConfig(granularity=64))
    torch.manual_seed(1234)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope").cuda()
    if state is not None:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if kind != "local":
        install_layout_rope(model, Layout("striped", cp_size=1, granularity=64))
    return model


def _loss_and_grads(model, toks):
    tokens, labels = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
    pos = torch.arange(SEQ, device="cuda").expand(BATCH, -1)
    model.zero_grad(set_to_none=True)
    per_token = model(tokens, pos, None, labels=labels)
    per_token.float().mean().backward()
    return per_token.detach().double(), {n: p.grad.detach().double() for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_mtraining_attention_matches_stock_attention_in_bf16(world1):
    import megatron.core

    print(f"megatron-core {megatron.core.__version__}")
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).cuda()
    ref = _model("local", torch.float32)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items() if v is not None and torch.is_tensor(v)}
    loss32, grads32 = _loss_and_grads(ref, toks)
    loss_stock, grads_stock = _loss_and_grads(_model("local", torch.bfloat16, state), toks)
    loss_ours, grads_ours = _loss_and_grads(_model("mtraining", torch.bfloat16, state), toks)
    err, err16 = _rel(loss_ours, loss32), _rel(loss_stock, loss32)
    assert err <= 2 * err16 + 1e-6, f"per-token loss: MTraining {err:.2e} vs stock bf16 {err16:.2e}"
    for name, g32 in grads32.items():
        e, e16 = _rel(grads_ours[name], g32), _rel(grads_stock[name], g32)
        assert e <= 2 * e16 + 1e-6, f"grad {name}: MTraining {e:.2e} vs stock bf16 {e16:.2e}"
    # negative control: the same comparison catches a wrong softmax scale
    bad, _ = _loss_and_grads(_model("mtraining", torch.bfloat16, state, softmax_scale=0.5), toks)
    assert _rel(bad, loss32) > 2 * err16 + 1e-6


def _trainer_argv(tmp_path, prefix, tok, *, train_iters: int, micro_batch: int = 2, global_batch: int = 4,
                  extra=()) -> list:
    """examples/pretrain_gpt.py flags of the tiny bf16 GQA model these tests train (2 layers, hidden 128, 1024
    tokens, --cp-attention mtraining, tiny data), plus ``extra``."""
    return ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--seq-length", "1024", "--position-embedding-type", "rope",
            "--normalization", "RMSNorm", "--swiglu", "--micro-batch-size", str(micro_batch),
            "--global-batch-size", str(global_batch), "--train-iters", str(train_iters), "--lr", "3e-3", "--bf16",
            "--cp-attention", "mtraining", "--data-path", prefix, "--split", "100,0,0", "--tokenizer-model", tok,
            "--eval-iters", "0", "--log-interval", "1", "--data-cache-path", str(tmp_path / "cache"), *extra]


@pytest.mark.parametrize("config", ["configs/demo.yaml", "configs/demo_sparse.yaml"])
def test_example_trainer_trains_on_one_gpu(tmp_path, config):
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    argv = _trainer_argv(tmp_path, prefix, tok, train_iters=8,
                         extra=["--lr-warmup-iters", "2", "--mtraining-config", config])
    r = run_torchrun("examples/pretrain_gpt.py", argv, nproc=1, timeout=300)
    assert r.returncode == 0, r.tail()
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", r.stdout)]
    assert len(losses) == 8, r.tail()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_example_trainer_measures_its_layers_on_one_gpu(tmp_path):
    """dense_layers: auto on the GPU (bf16, the Triton or FA4 kernels auto picks), under full recomputation (the
    first forward of each layer runs without gradients): every layer is measured once, the log names the
    decisions with their CUDA-event times, and training goes on with finite, falling losses."""
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    cfg = tmp_path / "auto.yaml"
    cfg.write_text("pattern: vertical_slash\nvertical_slash: {recall: 0.9, max_slash: 8}\ndense_layers: auto\n")
    argv = _trainer_argv(tmp_path, prefix, tok, train_iters=6,
                         extra=["--lr-warmup-iters", "2", "--mtraining-config", str(cfg), "--recompute-granularity",
                                "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    r = run_torchrun("examples/pretrain_gpt.py", argv, nproc=1, timeout=300)
    assert r.returncode == 0, r.tail()
    lines = re.findall(r"dense_layers: auto at 1024 tokens, CP=1: dense ([0-9,-]+|none); sparse ([0-9,-]+|none) "
                       r"\| fwd\+bwd ms sparse/dense: 1: ([0-9.]+)/([0-9.]+), 2: ([0-9.]+)/([0-9.]+)", r.stdout)
    assert len(lines) == 1, r.stdout[-3000:]
    assert all(float(t) > 0 for t in lines[0][2:]), lines
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", r.stdout)]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("recompute", ["selective", "full --recompute-method uniform --recompute-num-layers 1"])
def test_recompute_matches_no_recompute_on_one_gpu_bf16(tmp_path, recompute):
    """bf16, deterministic kernels: recomputing replays the same forward, so the first iteration's loss
    is identical and every gradient agrees to 2 bf16 ulps (2**-7 relative, largest difference over
    the largest magnitude); the attention runs twice as often."""
    import json

    prefix, tok = make_tiny_dataset(tmp_path / "data")
    cfg = tmp_path / "dense_deterministic.yaml"
    cfg.write_text("implementation: striped\ngranularity: 64\npattern: dense\ndeterministic: true\n")
    argv = _trainer_argv(tmp_path, prefix, tok, train_iters=2, extra=["--adam-eps", "1e-3", "--mtraining-config", str(cfg)])
    runs = {}
    for name, extra in (("plain", []), ("recompute", ["--recompute-granularity", *recompute.split()])):
        out, metrics = tmp_path / name, tmp_path / f"{name}.jsonl"
        r = run_torchrun("tests/workers/trainer_parity_worker.py", [str(out), *argv, "--metrics-file", str(metrics),
                                                                     *extra], nproc=1, timeout=300)
        assert r.returncode == 0, r.tail()
        runs[name] = (torch.load(f"{out}.rank0.pt"), [json.loads(x) for x in metrics.read_text().splitlines()])
    (plain, m_plain), (rec, m_rec) = runs["plain"], runs["recompute"]
    assert m_rec[0]["lm_loss"] == m_plain[0]["lm_loss"], (m_plain, m_rec)
    for x, y in zip(m_plain, m_rec):
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=2 ** -7) and y["grad_norm"] == pytest.approx(
            x["grad_norm"], rel=2 ** -7), (x, y)
    for it in range(2):
        for name, g in plain["grads"][it].items():
            got = rec["grads"][it][name]
            err = float((got - g).abs().max() / g.abs().max().clamp_min(1e-30))
            assert err <= 2 ** -7, f"iteration {it + 1} gradient {name}: {err:.3g}"
    assert rec["attention_calls"] == 2 * plain["attention_calls"] == 16


@pytest.mark.parametrize("recompute", [None, "selective"])
def test_cuda_graphs_match_eager_in_the_trainer(tmp_path, recompute):
    """``cuda_graphs: true`` in the example trainer (vertical-slash, deterministic kernels, bf16, CP=1, two
    micro-batches per iteration): the graphs replay the eager kernels, so every loss and gradient is bitwise
    the eager run's, with and without recomputing the core attention."""
    import json

    prefix, tok = make_tiny_dataset(tmp_path / "data")
    base = ("implementation: striped\ngranularity: 64\npattern: vertical_slash\ndeterministic: true\n"
            "vertical_slash: {recall: 0.9, max_vertical: 256, max_slash: 4}\n")
    argv = _trainer_argv(tmp_path, prefix, tok, train_iters=2, micro_batch=1, global_batch=2,
                         extra=["--adam-eps", "1e-3"])
    if recompute:
        argv += ["--recompute-granularity", recompute]
    runs = {}
    for name, graphs in (("eager", "false"), ("graphs", "true")):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(base + f"cuda_graphs: {graphs}\n")
        out, metrics = tmp_path / name, tmp_path / f"{name}.jsonl"
        r = run_torchrun("tests/workers/trainer_parity_worker.py", [str(out), *argv, "--mtraining-config", str(cfg),
                                                                     "--metrics-file", str(metrics)],
                         nproc=1, timeout=300)
        assert r.returncode == 0, r.tail()
        runs[name] = (torch.load(f"{out}.rank0.pt"), [json.loads(x) for x in metrics.read_text().splitlines()],
                      r.output)
    (eager, m_eager, _), (graphed, m_graphed, log) = runs["eager"], runs["graphs"]
    assert "CUDA graphs: sparse layers" in log, log[-2000:]
    assert "still referenced past its backward" not in log, log[-2000:]   # the trainer keeps no output: replays
    assert [m["lm_loss"] for m in m_graphed] == [m["lm_loss"] for m in m_eager]
    for it in range(2):
        for name, g in eager["grads"][it].items():
            assert torch.equal(graphed["grads"][it][name], g), f"iteration {it + 1} gradient {name}"

"""The chunked LM-head loss (megatron_mtraining/megatron/lm_loss.py) against megatron-core's own
unchunked output layer + cross entropy, on CPU in fp32: per-token losses and every parameter
gradient (relative error <= 1e-5), the logits path without labels, the refusals, the ``auto`` rule,
and the trainer flag end to end."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_mtraining.megatron.lm_loss import auto_chunk_tokens, install_chunked_lm_loss
from tests.helpers.dist import one_rank_megatron, run_torchrun
from tests.helpers.tiny_data import make_tiny_dataset

SEQ, BATCH, VOCAB = 200, 2, 384


@pytest.fixture(scope="module")
def world1():
    from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches

    apply_cpu_patches()
    with one_rank_megatron("gloo"):
        yield


def _model(tied: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.megatron.cpu_compat import cpu_seed, cpu_transformer_config_kwargs

    cpu_seed(1234)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                               calculate_per_token_loss=True, **cpu_transformer_config_kwargs())
    torch.manual_seed(0)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)


def _run(model, toks, labels=True):
    tokens, lab = toks[:, :-1], toks[:, 1:]
    pos = torch.arange(SEQ).expand(BATCH, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]
    model.zero_grad(set_to_none=True)
    out = model(tokens, pos, mask, labels=lab if labels else None)
    if not labels:
        return out.detach()
    out.sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk", [48, 64, 1000])
def test_chunked_loss_equals_megatron_loss(world1, tied, chunk):
    toks = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    ref = _model(tied)
    want, want_g = _run(ref, toks)
    ours = _model(tied)
    ours.load_state_dict(ref.state_dict())
    install_chunked_lm_loss(ours, chunk)
    got, got_g = _run(ours, toks)
    assert got.shape == want.shape == (BATCH, SEQ) and got.dtype == want.dtype
    assert _rel(got, want) <= 1e-5
    assert set(got_g) == set(want_g)
    for name in want_g:
        assert _rel(got_g[name], want_g[name]) <= 1e-5, name
    # without labels the model still returns the full logits, unchanged
    assert torch.equal(_run(ours, toks, labels=False), _run(ref, toks, labels=False))
    # negative control: the comparison sees a shifted target
    bad = _model(tied)
    bad.load_state_dict(ref.state_dict())
    install_chunked_lm_loss(bad, chunk)
    shifted = toks.clone()
    shifted[:, 1:] = (toks[:, 1:] + 1) % VOCAB
    assert _rel(_run(bad, shifted)[0], want) > 1e-3


def test_chunked_loss_refusals(world1):
    m = _model(True)
    with pytest.raises(ValueError, match=">= 1"):
        install_chunked_lm_loss(m, 0)
    m.output_layer.sequence_parallel = True
    with pytest.raises(ValueError, match="sequence parallelism on the output layer"):
        install_chunked_lm_loss(m, 64)


def test_auto_chunk_rule():
    assert auto_chunk_tokens(4096, 1, 32000) == 0                      # 0.5 GiB of fp32 logits
    n = auto_chunk_tokens(262144, 1, 32000)                            # 31 GiB: chunk
    assert n % 64 == 0 and n * 32000 * 4 <= (1 << 30) // 4 and (n + 64) * 32000 * 4 > (1 << 30) // 4
    assert auto_chunk_tokens(1 << 20, 8, 1 << 20) == 64                # never below 64 positions


@pytest.mark.slow
def test_trainer_flag_gives_the_same_losses(tmp_path):
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--data-path", prefix,
            "--split", "100,0,0", "--tokenizer-model", tok, "--eval-iters", "0", "--log-interval", "1",
            "--data-cache-path", str(tmp_path / "cache")]
    losses = {}
    for chunk in ("0", "48"):
        r = run_torchrun("examples/pretrain_gpt.py", base + ["--cross-entropy-chunk-tokens", chunk], nproc=1,
                         timeout=240)
        assert r.returncode == 0, r.tail()
        losses[chunk] = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", r.stdout)]
        assert len(losses[chunk]) == 3, r.tail()
    for a, b in zip(losses["48"], losses["0"]):
        assert abs(a - b) <= 1e-5 * abs(b), losses
    r = run_torchrun("examples/pretrain_gpt.py", base + ["--cross-entropy-chunk-tokens", "-3"], nproc=1, timeout=60)
    assert r.returncode != 0 and "--cross-entropy-chunk-tokens" in r.output

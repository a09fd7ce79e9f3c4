"""The chunked and the fused LM-head losses (megatron_mtraining/megatron/lm_loss.py) against
megatron-core's own unchunked output layer + cross entropy, on CPU in fp32: per-token losses and
every parameter gradient (relative error <= 1e-5), the fused loss also against fp64 (loss, d hidden,
d weight), the logits path without labels, the refusals, the ``auto`` rule, and the trainer flags end
to end. The fused loss (Liger-Kernel) runs its Triton kernels in the interpreter here; its bf16 check
on CUDA is ``test_lm_losses_bf16_gpu``; the chunked loss's bf16 weight gradient is checked on CPU too."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_mtraining.megatron.lm_loss import (auto_chunk_tokens, chunked_lm_loss, fused_lm_loss,
                                                 install_chunked_lm_loss, install_fused_lm_loss)
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
    # per-token upstream gradients as a loss mask gives them: not uniform, some zero
    g = torch.Generator().manual_seed(7)
    (out * (torch.rand(out.shape, generator=g) * (torch.rand(out.shape, generator=g) > 0.2))).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


_INSTALLS = {"chunk48": lambda m: install_chunked_lm_loss(m, 48), "chunk64": lambda m: install_chunked_lm_loss(m, 64),
             "chunk1000": lambda m: install_chunked_lm_loss(m, 1000), "fused": install_fused_lm_loss}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("loss", sorted(_INSTALLS))
def test_lm_loss_equals_megatron_loss(world1, tied, loss):
    install = _INSTALLS[loss]
    toks = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    ref = _model(tied)
    want, want_g = _run(ref, toks)
    ours = _model(tied)
    ours.load_state_dict(ref.state_dict())
    install(ours)
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
    install(bad)
    shifted = toks.clone()
    shifted[:, 1:] = (toks[:, 1:] + 1) % VOCAB
    assert _rel(_run(bad, shifted)[0], want) > 1e-3
    # a later install (of the other loss) replaces the loss and gives the same values
    (install_chunked_lm_loss(ours, 64) if loss == "fused" else install_fused_lm_loss(ours))
    assert _rel(_run(ours, toks)[0], want) <= 1e-5


def _fp64_loss(hidden, weight, labels, grad):
    """fp64 per-token loss [b, s] and its gradients for the upstream gradient ``grad`` [b, s]."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = torch.einsum("sbh,vh->bsv", h, w)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    loss = loss.view(labels.shape)
    (loss * grad.double()).sum().backward()
    return loss.detach(), h.grad, w.grad


def test_fused_loss_matches_fp64():
    g = torch.Generator().manual_seed(3)
    s, b, hd, v = 70, 2, 24, 33000          # past Liger's 32768-wide vocabulary block
    hidden = torch.randn(s, b, hd, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(v, hd, generator=g)).requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=g)
    grad = torch.rand(b, s, generator=g) * (torch.rand(b, s, generator=g) > 0.2)   # a loss mask with zeros
    loss = fused_lm_loss(hidden, weight, labels)
    (loss * grad).sum().backward()
    want, want_dh, want_dw = _fp64_loss(hidden, weight, labels, grad)
    assert loss.shape == (b, s) and loss.dtype == torch.float32
    assert _rel(loss, want) <= 1e-5
    assert _rel(hidden.grad, want_dh) <= 1e-5
    assert _rel(weight.grad, want_dw) <= 1e-5
    # negative control: another upstream gradient gives other input gradients
    _, other_dh, other_dw = _fp64_loss(hidden, weight, labels, torch.ones_like(grad))
    assert _rel(hidden.grad, other_dh) > 1e-2 and _rel(weight.grad, other_dw) > 1e-2
    with pytest.raises(ValueError, match=r"labels \[b, s\]"):
        fused_lm_loss(hidden, weight, labels.t())
    with pytest.raises(ValueError, match="must have one dtype"):
        fused_lm_loss(hidden, weight.double(), labels)
    h0, w0 = hidden.detach()[:0].requires_grad_(), weight.detach().clone().requires_grad_()
    empty = fused_lm_loss(h0, w0, labels[:, :0])                         # no tokens: an empty loss, no error
    assert empty.shape == (b, 0) and empty.dtype == torch.float32
    empty.sum().backward()                                               # zero gradients for both, as megatron's
    assert h0.grad.shape == h0.shape and torch.equal(w0.grad, torch.zeros_like(w0))
    for bad, where in ((-1, "from -1 "), (v, f"to {v}")):
        with pytest.raises(ValueError, match=rf"labels must be token ids in \[0, {v}\).*{where}"):
            fused_lm_loss(hidden, weight, labels.index_fill(1, torch.tensor([5]), bad))


def _bf16_errors(device, losses, s, hd, v):
    """Relative errors against fp64 of (loss, d hidden, d weight) for each bf16 loss in ``losses``
    (name -> fn(hidden, weight, labels)) and for megatron-core's unchunked bf16 loss at TP 1 (bf16 logits
    upcast to fp32 for the softmax, written with torch ops here), under a loss mask's upstream gradients."""
    g = torch.Generator(device=device).manual_seed(5)
    hidden = torch.randn(s, 1, hd, device=device, generator=g).bfloat16()
    weight = (0.05 * torch.randn(v, hd, device=device, generator=g)).bfloat16()
    labels = torch.randint(0, v, (1, s), device=device, generator=g)
    grad = torch.rand(1, s, device=device, generator=g) * (torch.rand(1, s, device=device, generator=g) > 0.2)
    want = _fp64_loss(hidden, weight, labels, grad)

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w, labels)
        (loss * grad).sum().backward()
        return tuple(_rel(o, x) for o, x in zip((loss.detach(), h.grad, w.grad), want))

    ref = run(lambda h, w, y: torch.nn.functional.cross_entropy(
        torch.einsum("sbh,vh->bsv", h, w).float().flatten(0, 1), y.flatten(), reduction="none").view(1, s))
    return ref, {name: run(fn) for name, fn in losses.items()}


def _chunks_summed_in_bf16(h, w, y, chunk_tokens=64):
    """The chunked loss with the output-weight gradient summed over the chunks in bf16 (autograd's sum
    of one tensor's gradients from many uses): the negative control of the bf16 tests."""
    from torch.utils.checkpoint import checkpoint

    from megatron_mtraining.megatron.lm_loss import _chunk_loss

    return torch.cat([checkpoint(_chunk_loss, h[lo:lo + chunk_tokens], w, y.t()[lo:lo + chunk_tokens],
                                 use_reentrant=False) for lo in range(0, h.shape[0], chunk_tokens)], 0).t()


def test_chunked_loss_bf16_weight_gradient(world1):
    """bf16, 64 chunks: the chunked loss's error against fp64 (loss, d hidden, d weight, each) is at most
    2x that of megatron-core's unchunked bf16 loss; summing the chunks' weight gradients in bf16 is not."""
    ref, got = _bf16_errors("cpu", {"chunked": lambda h, w, y: chunked_lm_loss(h, w, y, 64),
                                    "bf16 sum": _chunks_summed_in_bf16}, 4096, 64, 2048)
    for name, o, r in zip(("loss", "d hidden", "d weight"), got["chunked"], ref):
        assert o <= 2 * r, (name, o, r)
    assert got["bf16 sum"][2] > 2 * ref[2], (got["bf16 sum"], ref)


def test_chunked_loss_edges(world1):
    """fp32 against fp64: a frozen input (only the other gets a gradient), no tokens, a forward without
    grad, a partial last chunk with batch 2; and a clear error for a second derivative."""
    g = torch.Generator().manual_seed(11)
    s, b, hd, v = 70, 2, 16, 300
    hidden, weight = torch.randn(s, b, hd, generator=g), torch.randn(v, hd, generator=g)
    labels, grad = torch.randint(0, v, (b, s), generator=g), torch.rand(b, s, generator=g)
    want, want_dh, want_dw = _fp64_loss(hidden, weight, labels, grad)
    for h_grad, w_grad in ((True, True), (True, False), (False, True)):
        h, w = hidden.clone().requires_grad_(h_grad), weight.clone().requires_grad_(w_grad)
        loss = chunked_lm_loss(h, w, labels, 32)                 # chunks of 32, 32 and 6 positions
        (loss * grad).sum().backward()
        assert _rel(loss, want) <= 1e-5
        assert (h.grad is None) != h_grad and (w.grad is None) != w_grad
        assert not h_grad or _rel(h.grad, want_dh) <= 1e-5
        assert not w_grad or _rel(w.grad, want_dw) <= 1e-5
    with torch.no_grad():
        assert _rel(chunked_lm_loss(hidden, weight, labels, 32), want) <= 1e-5
    h0, w0 = hidden[:0].clone().requires_grad_(), weight.clone().requires_grad_()
    empty = chunked_lm_loss(h0, w0, labels[:, :0], 32)
    assert empty.shape == (b, 0)
    empty.sum().backward()
    assert torch.equal(w0.grad, torch.zeros_like(w0))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (dh,) = torch.autograd.grad(chunked_lm_loss(h, w, labels, 32).sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match=r"chunked LM-head loss .*: double backward .* is not supported"):
        dh.sum().backward()


@pytest.mark.gpu
def test_lm_losses_bf16_gpu(world1):
    """bf16 on CUDA at SmolLM2-135M's LM head: the fused loss's and the chunked loss's errors against fp64
    (loss, d hidden, d weight, each) are at most 2x that of megatron-core's unchunked bf16 loss."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ref, got = _bf16_errors("cuda", {"fused": fused_lm_loss,
                                     "chunked": lambda h, w, y: chunked_lm_loss(h, w, y, 1024),
                                     "bf16 sum": lambda h, w, y: _chunks_summed_in_bf16(h, w, y, 1024)},
                              32768, 576, 49152)
    for loss in ("fused", "chunked"):
        for name, o, r in zip(("loss", "d hidden", "d weight"), got[loss], ref):
            assert o <= 2 * r, (loss, name, o, r)
    assert got["bf16 sum"][2] > 2 * ref[2], (got["bf16 sum"], ref)      # negative control


def test_chunked_loss_refusals(world1):
    m = _model(True)
    with pytest.raises(ValueError, match=">= 1"):
        install_chunked_lm_loss(m, 0)
    m.output_layer.sequence_parallel = True
    with pytest.raises(ValueError, match="sequence parallelism on the output layer"):
        install_chunked_lm_loss(m, 64)
    m = _model(True)

    class TP2:
        def size(self):
            return 2

    m.output_layer.tp_group = TP2()
    with pytest.raises(ValueError, match="tensor-parallel output layer"):
        install_fused_lm_loss(m)
    install_chunked_lm_loss(m, 64)          # the chunked loss is vocabulary-parallel


def test_fused_loss_without_a_usable_liger(world1, monkeypatch):
    import importlib.metadata
    import importlib.util
    import sys

    from megatron_mtraining.megatron import lm_loss

    assert lm_loss.liger_problem() is None and lm_loss.liger_problem("cpu") is None   # TRITON_INTERPRET=1 here
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")
        assert "cannot run on cpu" in lm_loss.liger_problem("cpu")
    with monkeypatch.context() as m:      # older releases scale every token's gradient by the first token's
        m.setattr(importlib.metadata, "version", lambda name: "0.8.1")
        with pytest.raises(ValueError, match=r"Liger-Kernel >= 0\.8\.5 .* found 0\.8\.1"):
            install_fused_lm_loss(_model(True))
    with monkeypatch.context() as m:      # a nightly build: the version of the distribution providing liger_kernel
        m.setattr(importlib.metadata, "packages_distributions", lambda: {"liger_kernel": ["liger-kernel-nightly"]})
        m.setattr(importlib.metadata, "version",
                  lambda name: "0.8.6.dev20261201" if name == "liger-kernel-nightly" else "0.0")
        assert lm_loss.liger_problem() is None
    with monkeypatch.context() as m:
        m.setattr(importlib.util, "find_spec", lambda name, *a: None)
        with pytest.raises(ValueError, match="needs Liger-Kernel, which is not installed"):
            install_fused_lm_loss(_model(True))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_linear_cross_entropy", None)
    with pytest.raises(ValueError, match="--lm-loss liger needs Liger-Kernel, which does not import"):
        install_fused_lm_loss(_model(True))


def test_the_argument_check_refuses_an_old_liger_without_importing_torch(monkeypatch):
    import importlib.metadata
    import subprocess
    import sys

    from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args

    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--lm-loss", "liger"]
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.8.1")
    with pytest.raises(ArgumentValidationError, match=r"needs Liger-Kernel >= 0\.8\.5 .* found 0\.8\.1"):
        validate_args(build_parser().parse_args(argv), world_size=1, check_files=False)
    # --help and the argument check stay light: building the parser imports neither torch nor megatron.core
    code = ("import sys; from megatron_mtraining.megatron.args import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_auto_chunk_rule():
    assert auto_chunk_tokens(4096, 1, 32000) == 0                      # 0.5 GiB of fp32 logits
    n = auto_chunk_tokens(262144, 1, 32000)                            # 31 GiB: chunk
    assert n % 64 == 0 and n * 32000 * 4 <= (1 << 30) // 4 and (n + 64) * 32000 * 4 > (1 << 30) // 4
    assert auto_chunk_tokens(1 << 20, 8, 1 << 20) == 64                # never below 64 positions


@pytest.mark.slow
def test_trainer_flags_give_the_same_losses(tmp_path):
    prefix, tok = make_tiny_dataset(tmp_path / "data")
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "256",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--data-path", prefix,
            "--split", "100,0,0", "--tokenizer-model", tok, "--eval-iters", "0", "--log-interval", "1",
            "--data-cache-path", str(tmp_path / "cache"), "--eod-mask-loss"]   # a loss mask with zeros
    losses = {}
    for name, flags in (("0", ["--cross-entropy-chunk-tokens", "0"]), ("48", ["--cross-entropy-chunk-tokens", "48"]),
                        ("liger", ["--lm-loss", "liger"])):
        r = run_torchrun("examples/pretrain_gpt.py", base + flags, nproc=1, timeout=240)
        assert r.returncode == 0, r.tail()
        losses[name] = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", r.stdout)]
        assert len(losses[name]) == 3, r.tail()
    for name in ("48", "liger"):
        for a, b in zip(losses[name], losses["0"]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, losses)
    r = run_torchrun("examples/pretrain_gpt.py", base + ["--cross-entropy-chunk-tokens", "-3"], nproc=1, timeout=60)
    assert r.returncode != 0 and "--cross-entropy-chunk-tokens" in r.output
    # where the run starts, on every rank: the fused loss's Triton kernels cannot run on this CPU
    r = run_torchrun("examples/pretrain_gpt.py", base + ["--lm-loss", "liger"], nproc=1, timeout=60,
                     env={"TRITON_INTERPRET": "0"})
    assert r.returncode != 0 and "pretrain_gpt.py: error: --lm-loss liger runs Triton kernels" in r.output, r.tail()
    assert "[rank0]: Traceback" not in r.output, r.tail()          # a clean exit, not a crash of the rank

"""Per-layer sparse policy (``dense_layers``, ``layer_overrides``) through megatron-core.

* A tiny 2-layer GPTModel with ``dense_layers: [1]``: layer 1's core attention returns exactly what
  the dense ring returns for its q/k/v (and matches an fp64 causal reference), layer 2's exactly what
  the sparse ring returns with the config's budgets, and the two differ (negative control: the
  sparse budgets drop attention mass here).
* ``layer_overrides`` reach the sparse ring of their layer only.
* Layer numbers past ``TransformerConfig.num_layers`` / ``--num-layers`` are errors naming the key,
  from the direct API (core attention, ``resolve``) and the example trainer's command line; the
  trainer trains with a per-layer policy.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

warnings.filterwarnings("ignore")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_mtraining.config import MTrainingConfig  # noqa: E402
from megatron_mtraining.megatron.attention import MTrainingAttention  # noqa: E402
from megatron_mtraining.megatron.cpu_compat import apply_cpu_patches, cpu_transformer_config_kwargs  # noqa: E402
from megatron_mtraining.patterns.estimator import VerticalSlashConfig  # noqa: E402
from megatron_mtraining.plan import resolve  # noqa: E402
from megatron_mtraining.ring import ring_attention  # noqa: E402
from megatron_mtraining.ring.sparse import sparse_ring_attention  # noqa: E402
from tests.helpers.dist import one_rank_megatron, run_python  # noqa: E402
from tests.helpers.tiny_data import make_tiny_dataset  # noqa: E402

SEQ, VOCAB = 512, 256
# budgets that drop attention mass at 512 tokens (8 blocks): at most 2 block diagonals, 64 columns
SPARSE = dict(recall=0.5, last_q=64, block_size=64, sink_tokens=0, local_blocks=1, max_vertical=64, max_slash=2)


def _gpt_core_attention_io(cfg: MTrainingConfig, num_layers: int = 2, track_kept: bool = False):
    """Run a tiny fp32 GPTModel whose layers use ``cfg``; returns per layer ``(q, k, v, out)`` of the
    core attention in [b, s, h, d] (q/k/v) and [s, b, h*d] (out), plus the plan."""
    from megatron.core.models.gpt import GPTModel

    from megatron_mtraining.megatron.spec import get_gpt_layer_spec_with_mtraining

    apply_cpu_patches()
    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=128, params_dtype=torch.float32, hidden_dropout=0.0,
                               attention_dropout=0.0, normalization="RMSNorm", **cpu_transformer_config_kwargs())
    plan = resolve(cfg, cp_group=None, seq_len=SEQ, num_layers=num_layers)
    plan.track_kept_fraction(track_kept)
    spec = get_gpt_layer_spec_with_mtraining(use_te=False, normalization="RMSNorm", mtraining_config=plan)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope").eval()
    io = {}

    def grab(mod, args, kwargs, out):
        q, k, v = (tuple(args) + tuple(kwargs.get(n) for n in ("query", "key", "value")))[:3]
        io[mod.layer_number] = tuple(t.detach().transpose(0, 1).contiguous() for t in (q, k, v)) + (out.detach(),)

    for layer in model.decoder.layers:
        layer.self_attention.core_attention.register_forward_hook(grab, with_kwargs=True)
    toks = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(toks, torch.arange(SEQ).expand(2, -1), None)
    return io, plan, model


def _sbhd(out):                           # ring output [b, s, h, d] -> core attention's [s, b, h*d]
    b, s, h, d = out.shape
    return out.transpose(0, 1).reshape(s, b, h * d)


def _fp64_causal(q, k, v):
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    sc = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    s = q.shape[1]
    sc = sc.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("bhst,bthd->bshd", sc.softmax(-1), v)


def test_dense_layer_is_the_dense_ring_and_the_other_layer_is_sparse():
    cfg = MTrainingConfig(pattern="vertical_slash", vertical_slash=VerticalSlashConfig(**SPARSE), dense_layers=[1],
                          kernel_backend="torch")
    with one_rank_megatron():
        io, plan, model = _gpt_core_attention_io(cfg, track_kept=True)
        layers = [layer.self_attention.core_attention for layer in model.decoder.layers]
        assert [a.layer_number for a in layers] == [1, 2]
        assert layers[0].plan.pattern is None and layers[1].plan.pattern == cfg.vertical_slash
        # one plan: the views share the input-check cache (one cross-rank check per shape for the model)
        assert layers[0].plan._checked is layers[1].plan._checked is plan._checked and len(plan._checked) == 1
        layout = plan.layout
        q1, k1, v1, out1 = io[1]
        dense = ring_attention(q1, k1, v1, layout=layout, group=None, causal=True)
        assert torch.equal(out1, _sbhd(dense))
        torch.testing.assert_close(out1.double(), _sbhd(_fp64_causal(q1, k1, v1)), rtol=1e-5, atol=1e-5)
        q2, k2, v2, out2 = io[2]
        sparse, pattern = sparse_ring_attention(q2, k2, v2, layout=layout, group=None, config=cfg.vertical_slash,
                                                return_pattern=True)
        assert torch.equal(out2, _sbhd(sparse))
        # the kept share of causal work is recorded for the sparse layer only, read once
        kept = plan.take_kept_fraction()
        assert kept["layers"] == 1 and kept["mean"] == kept["min"] == kept["max"]
        assert kept["mean"] == pytest.approx(float(pattern.kept_fraction().mean()), rel=1e-12)
        assert 0 < kept["mean"] < 1 and plan.take_kept_fraction() is None
        # negative control: the sparse budgets change layer 2's output (so the check above can fail)
        gap = (out2.double() - _sbhd(_fp64_causal(q2, k2, v2))).abs().max().item()
        assert gap > 1e-3, gap


def test_layer_override_reaches_its_layer_only():
    cfg = MTrainingConfig(pattern="vertical_slash", vertical_slash=VerticalSlashConfig(**SPARSE),
                          layer_overrides={"2": {"recall": 1.0, "max_slash": 8, "max_vertical": 512}},
                          kernel_backend="torch")
    with one_rank_megatron():
        io, plan, model = _gpt_core_attention_io(cfg)
        want = {1: cfg.vertical_slash,
                2: VerticalSlashConfig(**{**SPARSE, "recall": 1.0, "max_slash": 8, "max_vertical": 512})}
        for n, (q, k, v, out) in io.items():
            assert plan.for_layer(n).pattern == want[n]
            expect = sparse_ring_attention(q, k, v, layout=plan.layout, group=None, config=want[n])
            assert torch.equal(out, _sbhd(expect)), n
        assert plan.take_kept_fraction() is None            # nothing recorded unless asked for
        # recall 1.0 with caps covering every line: layer 2 is the dense causal attention
        q, k, v, out = io[2]
        torch.testing.assert_close(out.double(), _sbhd(_fp64_causal(q, k, v)), rtol=1e-5, atol=1e-5)


def _attn(num_layers, layer_number, cfg):
    config = TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, hidden_dropout=0.0, **cpu_transformer_config_kwargs())
    return MTrainingAttention(config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
                              attention_type="self", mtraining_config=cfg)


def test_layer_numbers_past_num_layers_are_errors_naming_the_key():
    sparse = dict(pattern="vertical_slash")
    with pytest.raises(ValueError, match=r"'dense_layers' names layer 3, but the model has layers 1\.\.2"):
        _attn(2, 1, MTrainingConfig(**sparse, dense_layers=[3]))
    with pytest.raises(ValueError, match=r"'layer_overrides' range '2-5' names layer 5"):
        _attn(4, 1, MTrainingConfig(**sparse, layer_overrides={"2-5": {"recall": 0.9}}))
    with pytest.raises(ValueError, match=r"layer_number 3 > num_layers=2"):
        _attn(2, 3, MTrainingConfig(**sparse))
    with pytest.raises(ValueError, match="'dense_layers' names layer 9"):
        resolve(MTrainingConfig(**sparse, dense_layers=["8-9"]), cp_group=None, num_layers=8)
    # in range: fine, and the layer's view is dense / sparse as configured
    a = _attn(4, 4, MTrainingConfig(**sparse, dense_layers=["3-4"]))
    assert a.plan.pattern is None and a.plan.layer_number == 4


# ------------------------------------------------------------------------------ the example trainer
SCRIPT = "examples/pretrain_gpt.py"


def _argv(prefix, tok, config, **over):
    opts = {"--num-layers": 2, "--hidden-size": 64, "--num-attention-heads": 4, "--group-query-attention": None,
            "--num-query-groups": 2, "--seq-length": 256, "--position-embedding-type": "rope",
            "--normalization": "RMSNorm", "--micro-batch-size": 1, "--global-batch-size": 1, "--train-iters": 2,
            "--lr": 1e-3, "--data-path": prefix, "--split": "100,0,0", "--tokenizer-model": tok,
            "--eval-iters": 0, "--log-interval": 1, "--seed": 7, "--mtraining-config": config, **over}
    argv = []
    for k, v in opts.items():
        argv += [k] if v is None else [k, str(v)]
    return argv


def test_trainer_flag_errors_name_num_layers(tmp_path):
    from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args

    prefix, tok = make_tiny_dataset(tmp_path / "data")
    cfg = tmp_path / "policy.yaml"
    cfg.write_text("pattern: vertical_slash\ndense_layers: [1, 3]\n")
    with pytest.raises(ArgumentValidationError, match=r"--num-layers 2: mtraining config 'dense_layers' names layer 3"):
        validate_args(build_parser().parse_args(_argv(prefix, tok, cfg)), world_size=1, te_importable=False)
    cfg.write_text("pattern: vertical_slash\nlayer_overrides: {'1-2': {recall: 0.9}, '2': {recall: 0.8}}\n")
    with pytest.raises(ArgumentValidationError, match=r"ranges '1-2' and '2' overlap"):
        validate_args(build_parser().parse_args(_argv(prefix, tok, cfg)), world_size=1, te_importable=False)


@pytest.mark.slow
def test_trainer_trains_with_a_layer_policy_and_cp2_matches_cp1(tmp_path):
    """The example trainer with dense_layers and layer_overrides: CP=2 trains exactly like CP=1
    (the policy is the same on every rank and per layer, not per rank)."""
    import json

    from tests.helpers.dist import run_torchrun

    prefix, tok = make_tiny_dataset(tmp_path / "data")
    cfg = tmp_path / "policy.yaml"
    cfg.write_text("pattern: vertical_slash\nvertical_slash: {recall: 0.9, max_slash: 4}\ndense_layers: [1]\n"
                   "layer_overrides: {'2': {recall: 0.95}}\n")
    runs = []
    for cp in (1, 2):
        m = tmp_path / f"m{cp}.jsonl"
        argv = _argv(prefix, tok, cfg, **{"--metrics-file": m, "--data-cache-path": tmp_path / "c",
                                          "--context-parallel-size": cp})
        r = run_python(SCRIPT, argv, timeout=300) if cp == 1 else run_torchrun(SCRIPT, argv, nproc=2, timeout=300)
        assert r.returncode == 0, r.tail()
        assert "dense 1; layers 2: recall=0.95" in r.stdout, r.stdout
        runs.append([json.loads(line) for line in m.read_text().splitlines()])
    a, b = runs
    assert [x["iteration"] for x in a] == [x["iteration"] for x in b] == [1, 2]
    for x, y in zip(a, b):
        assert math.isfinite(x["lm_loss"])
        assert 0 < x["attention_kept_min"] <= x["attention_kept"] <= x["attention_kept_max"] <= 1, x
        assert y["attention_kept"] == pytest.approx(x["attention_kept"], rel=1e-9), (x, y)
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=1e-5), (x, y)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), (x, y)


def test_pipeline_stage_layers_take_their_global_layer_number(monkeypatch):
    """With pipeline parallelism megatron-core adds the stage's offset to layer_number before it reaches
    the core attention; the policy is keyed by that global number (a stage holding layers 3-4 of 4)."""
    import megatron.core.transformer.transformer_layer as tl
    from megatron.core.transformer.spec_utils import build_module

    from megatron_mtraining.megatron.spec import get_gpt_layer_spec_with_mtraining

    cfg = MTrainingConfig(pattern="vertical_slash", dense_layers=[3], layer_overrides={"4": {"recall": 0.99}})
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, hidden_dropout=0.0, **cpu_transformer_config_kwargs())
    with one_rank_megatron():
        apply_cpu_patches()
        plan = resolve(cfg, cp_group=None, num_layers=4)
        spec = get_gpt_layer_spec_with_mtraining(use_te=False, mtraining_config=plan)
        monkeypatch.setattr(tl, "get_transformer_layer_offset", lambda *a, **k: 2)     # the second of two stages
        stage = [build_module(spec, config=config, layer_number=n) for n in (1, 2)]
        core = [layer.self_attention.core_attention for layer in stage]
        assert [a.layer_number for a in core] == [3, 4]
        assert core[0].plan.pattern is None and core[1].plan.pattern.recall == 0.99

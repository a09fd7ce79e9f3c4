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


# ------------------------------------------------------------------------------ dense_layers: auto
AUTO = dict(pattern="vertical_slash", vertical_slash=VerticalSlashConfig(**SPARSE), dense_layers="auto",
            kernel_backend="torch")


def _fake_timer(times: dict, log: list):
    """A timer that runs the attention once (as the real one does) and returns the given times:
    ``times[layer] = (sparse_ms, dense_ms)``, in the runner's order (sparse first)."""
    def timer_for(layer):
        def timer(attention, q, k, v):
            log.append((layer, torch.is_grad_enabled()))
            attention(q, k, v)
            n = sum(1 for entry in log if entry[0] == layer)
            return times[layer][(n - 1) % 2]
        return timer
    return timer_for


def test_auto_policy_runs_the_measured_attention_and_restores_it():
    from megatron_mtraining.layer_policy import layer_decision_lines

    plan = resolve(MTrainingConfig(**AUTO), cp_group=None, seq_len=SEQ, num_layers=2)
    plan.track_kept_fraction(True)
    log: list = []
    timer_for = _fake_timer({1: (2.0, 1.0), 2: (1.0, 2.0)}, log)     # layer 1: dense is faster; layer 2: sparse
    runners = {}
    for n in (1, 2):
        runners[n] = plan.for_layer(n).attention_runner()
        runners[n].timer = timer_for(n)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, SEQ, h, 16, generator=g) for h in (4, 2, 2))
    rng = torch.get_rng_state()
    with torch.inference_mode():                 # as an inference engine (and recomputation's first forward)
        out = {n: runners[n](q, k, v, softmax_scale=0.25) for n in (1, 2)}
    assert log == [(1, True), (1, True), (2, True), (2, True)]       # measured with autograd on, once each
    assert torch.equal(torch.get_rng_state(), rng)
    dense = ring_attention(q, k, v, layout=plan.layout, group=None, softmax_scale=0.25, causal=True)
    sparse = sparse_ring_attention(q, k, v, layout=plan.layout, group=None, config=AUTO["vertical_slash"],
                                   softmax_scale=0.25)
    assert torch.equal(out[1], dense) and torch.equal(out[2], sparse)
    assert (dense - sparse).abs().max() > 1e-3                 # negative control: the two attentions differ
    # the kept work counts the sparse layer's own call only (not the timing calls, not the dense layer)
    kept = plan.take_kept_fraction()
    assert kept["layers"] == 1 and plan.take_kept_fraction() is None
    # later calls follow the decision without measuring, at other lengths too (packed streams, evaluation)
    assert torch.equal(runners[1](q, k, v, softmax_scale=0.25), dense) and len(log) == 4
    half = tuple(t[:, :SEQ // 2].contiguous() for t in (q, k, v))
    half_dense = ring_attention(*half, layout=plan.layout, group=None, softmax_scale=0.25, causal=True)
    assert torch.equal(runners[1](*half, softmax_scale=0.25), half_dense) and len(log) == 4
    decisions = plan.layer_decisions()
    assert [(d.layer_number, d.seq_len, d.cp_size, d.dense) for d in decisions] == [(1, SEQ, 1, True),
                                                                                    (2, SEQ, 1, False)]
    assert decisions[0].sparse_ms == 2.0 and decisions[0].dense_ms == 1.0 and decisions[0].ranks == 1
    lines = layer_decision_lines(plan.take_new_layer_decisions())
    assert lines == [f"dense_layers: auto at {SEQ} tokens, CP=1: dense 1; sparse 2 | fwd+bwd ms sparse/dense: "
                     "1: 2.00/1.00, 2: 1.00/2.00"]
    assert plan.take_new_layer_decisions() == []
    # a new run restores them (a checkpoint's records): nothing is measured, the same attention runs
    records = [d.to_dict() for d in decisions]
    again = resolve(MTrainingConfig(**AUTO), cp_group=None, seq_len=SEQ, num_layers=2)
    assert again.restore_layer_decisions(records) == decisions
    log.clear()
    runner = again.for_layer(1).attention_runner()
    runner.timer = timer_for(1)
    assert torch.equal(runner(q, k, v, softmax_scale=0.25), dense) and log == []
    assert again.take_new_layer_decisions() == []
    # a run at another sequence length keeps the records but measures its own
    other = resolve(MTrainingConfig(**AUTO), cp_group=None, seq_len=SEQ // 2, num_layers=2)
    assert other.restore_layer_decisions(records) == [] and len(other.layer_decisions()) == 2
    runner = other.for_layer(1).attention_runner()
    runner.timer = timer_for(1)
    runner(*half, softmax_scale=0.25)
    assert len(log) == 2 and len(other.layer_decisions()) == 3
    with pytest.raises(ValueError, match="needs layer_number, seq_len, cp_size and dense"):
        again.restore_layer_decisions([{"layer_number": 1}])


def test_tools_time_the_sparse_attention_of_an_auto_config_and_write_a_fixed_list():
    """pattern_recall's speed policy and bench_layer time a layer's sparse attention, not the measured policy's
    choice; a policy written from an auto config is a fixed list (the Megatron-LM patch takes it)."""
    cfg = MTrainingConfig(**AUTO)
    view = resolve(cfg, cp_group=None, seq_len=SEQ, num_layers=2).for_layer(1)
    assert view.fixed_attention_runner() == view.attention
    fixed = cfg.with_dense_layers([])
    assert not fixed.auto_dense_layers and fixed.dense_layers is None and fixed.sparse


def test_auto_policy_through_megatron_core_matches_the_fixed_policy_it_chose(monkeypatch):
    """A GPTModel with dense_layers: auto whose measurement picks dense for layer 1 and sparse for layer 2
    computes exactly what dense_layers: [1] computes; the real timer measures with autograd on."""
    import megatron_mtraining.layer_policy as lp

    log: list = []
    timer_for = _fake_timer({1: (2.0, 1.0), 2: (1.0, 2.0)}, log)
    real_timer = lp._time_fwd_bwd
    monkeypatch.setattr(lp, "_time_fwd_bwd", lambda attention, q, k, v: timer_for(len(log) // 2 + 1)(attention, q, k, v))
    with one_rank_megatron():
        auto_io, plan, _ = _gpt_core_attention_io(MTrainingConfig(**AUTO))
        fixed_io, _, _ = _gpt_core_attention_io(MTrainingConfig(**{**AUTO, "dense_layers": [1]}))
    assert [(d.layer_number, d.dense) for d in plan.layer_decisions()] == [(1, True), (2, False)]
    for n in (1, 2):
        assert torch.equal(auto_io[n][3], fixed_io[n][3]), n
    # the real timer: a positive time of a forward and backward, with the caller's tensors untouched
    q, k, v = (t.clone() for t in auto_io[2][:3])
    ms = real_timer(lambda a, b, c: plan.for_layer(2).attention(a, b, c, softmax_scale=0.25), q, k, v)
    assert ms > 0 and not q.requires_grad and torch.equal(q, auto_io[2][0])


def test_megatron_lm_patch_refuses_dense_layers_auto(tmp_path):
    from types import SimpleNamespace

    from megatron_mtraining.megatron import megatron_lm

    cfg = tmp_path / "auto.yaml"
    cfg.write_text("pattern: vertical_slash\ndense_layers: auto\n")
    args = SimpleNamespace(mtraining_config=str(cfg), context_parallel_size=1, seq_length=256, num_layers=2)
    with pytest.raises(ValueError, match="'dense_layers: auto' is not supported through the Megatron-LM patch"):
        megatron_lm.mtraining_config_from_args(args)


@pytest.mark.slow
def test_trainer_logs_the_measured_layers_and_resumes_with_the_saved_decisions(tmp_path):
    """The example trainer with dense_layers: auto: the log names the layers that run dense, the checkpoint
    keeps the decisions, and a run resumed from iteration 1 takes them (it measures nothing) and trains
    iteration 2 exactly as the uninterrupted run did."""
    import json
    import shutil

    prefix, tok = make_tiny_dataset(tmp_path / "data")
    cfg = tmp_path / "auto.yaml"
    cfg.write_text("pattern: vertical_slash\nvertical_slash: {recall: 0.9, max_slash: 4}\ndense_layers: auto\n")
    m1, m2 = tmp_path / "m1.jsonl", tmp_path / "m2.jsonl"
    first = run_python(SCRIPT, _argv(prefix, tok, cfg, **{"--data-cache-path": tmp_path / "c", "--save-interval": 1,
                                                          "--save": tmp_path / "ckpt", "--metrics-file": m1}),
                       timeout=300)
    assert first.returncode == 0, first.tail()
    assert first.stdout.count("dense_layers: auto at 256 tokens, CP=1: dense ") == 1, first.stdout
    assert "fwd+bwd ms sparse/dense: 1: " in first.stdout and ", 2: " in first.stdout
    resume = tmp_path / "resume"                      # the iteration-1 checkpoint on its own
    shutil.copytree(tmp_path / "ckpt" / "iter_0000001", resume / "iter_0000001")
    (resume / "latest_checkpointed_iteration.txt").write_text("1")
    rest = run_python(SCRIPT, _argv(prefix, tok, cfg, **{"--data-cache-path": tmp_path / "c", "--load": resume,
                                                         "--metrics-file": m2}), timeout=300)
    assert rest.returncode == 0, rest.tail()
    assert "dense_layers: auto: 2 measured layer decisions restored from the checkpoint" in rest.stdout, rest.stdout
    restored = [line for line in rest.stdout.splitlines() if "dense_layers: auto at" in line]
    assert len(restored) == 1 and restored[0].endswith("(restored)"), restored       # nothing measured again
    a = [json.loads(line) for line in m1.read_text().splitlines()]
    b = [json.loads(line) for line in m2.read_text().splitlines()]
    assert [r["iteration"] for r in a] == [1, 2] and [r["iteration"] for r in b] == [2]
    assert b[0]["lm_loss"] == a[1]["lm_loss"] and b[0]["grad_norm"] == a[1]["grad_norm"], (a, b)

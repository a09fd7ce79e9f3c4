"""The CP plan (megatron_mtraining/plan.py) and the one set of front-door rules.

In-process, no process group (CP size 1). The multi-rank halves (agreement, once per shape, group
numbering) are in tests/distributed/test_agreement.py.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_mtraining.config import MTrainingConfig, config_for_run, load_mtraining_config
from megatron_mtraining.layout import Layout
from megatron_mtraining.plan import CPPlan, config_from_args, resolve
from megatron_mtraining.ring import ring_attention

ROOT = Path(__file__).resolve().parents[2]


def test_resolve_fixes_layout_pattern_schedule_and_backend():
    plan = resolve(ROOT / "configs" / "demo_sparse.yaml", cp_group=None, seq_len=1024,
                   device="cpu", dtype=torch.float32)
    assert isinstance(plan, CPPlan)
    assert (plan.cp_size, plan.cp_rank, plan.layout) == (1, 0, Layout("striped", 1, 64))
    assert plan.sparse and plan.pattern.recall == 0.9 and plan.columns == plan.config.columns
    assert plan.kernel_backend == "auto" and plan.hierarchical_groups is None and plan.hierarchical_sizes is None
    assert plan.device == torch.device("cpu") and plan.dtype == torch.float32
    dense = resolve(None, cp_group=None)
    assert not dense.sparse and dense.config == MTrainingConfig()
    with pytest.raises(ValueError, match="'granularity'"):
        resolve(None, cp_group=None, seq_len=100)


def test_kernel_backend_key():
    assert load_mtraining_config({"kernel_backend": "triton"}).kernel_backend == "triton"
    with pytest.raises(ValueError, match="'kernel_backend' must be one of auto, torch, triton, sdpa"):
        load_mtraining_config({"kernel_backend": "cudnn"})
    cfg = load_mtraining_config({"kernel_backend": "sdpa"})
    assert load_mtraining_config(cfg.to_dict()) == cfg
    plan = resolve(cfg, cp_group=None)
    if importlib.util.find_spec("megatron_mtraining.ops.backends") is None:
        with pytest.raises(NotImplementedError, match="kernel_backend: sdpa"):   # never silently replaced
            plan.select_backend(device=torch.device("cpu"), dtype=torch.float32, head_dim=64)
        assert resolve(None, cp_group=None).select_backend(device=torch.device("cpu"), dtype=torch.float32,
                                                           head_dim=64) is None


def test_hierarchical_is_never_silently_lost():
    hier = load_mtraining_config({"implementation": "hierarchical"})
    with pytest.raises(ValueError, match="implementation 'hierarchical' needs"):
        hier.attention_kwargs()                                     # used to return a flat-ring kwargs set
    with pytest.raises(ValueError, match="--hierarchical-context-parallel-sizes"):
        config_for_run(hier, cp_size=4, seq_len=1024)
    assert config_for_run(hier, cp_size=4, megatron_hierarchical_sizes=[2, 2]).attention_kwargs()["hierarchical"] \
        == (2, 2)
    with pytest.raises(ValueError, match="hierarchical_groups=\\(inner, outer\\)"):
        resolve(hier, cp_group=None)
    with pytest.raises(ValueError, match="the run would use a flat ring"):
        config_for_run(ROOT / "configs" / "demo.yaml", cp_size=4, megatron_hierarchical_sizes=[2, 2])
    implied = config_for_run(None, cp_size=4, megatron_hierarchical_sizes=[2, 2])
    assert implied.implementation == "hierarchical" and implied.hierarchical.sizes == (2, 2)
    with pytest.raises(ValueError, match="groups would be ignored"):
        resolve(MTrainingConfig(), cp_group=None, hierarchical_groups=(None, None))


def test_integer_qkv_refused():
    q = torch.arange(2 * 64 * 2 * 8).reshape(2, 64, 2, 8)
    with pytest.raises(ValueError, match="dtype torch.int64 is not supported: attention needs floating-point"):
        ring_attention(q, q, q, layout=Layout("striped", 1, 64))
    plan = resolve(None, cp_group=None)
    with pytest.raises(ValueError, match="floating-point"):
        plan.check_inputs(q, q, q, softmax_scale=0.5)
    f = q.double()
    plan.check_inputs(f, f, f, softmax_scale=0.5)
    plan.check_inputs(f, f, f, softmax_scale=0.5)
    assert len(plan._checked) == 1


# ------------------------------------------------------------------ the two front doors agree
def _mlm(**kw):
    base = dict(cp_attention="mtraining", mtraining_config=None, context_parallel_size=4,
                hierarchical_context_parallel_sizes=None, seq_length=1024, attention_dropout=0.0,
                reset_attention_mask=False, reset_position_ids=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _pretrain(tmp_path, **kw):
    from megatron_mtraining.megatron.args import ArgumentValidationError, build_parser, validate_args

    prefix = tmp_path / "data"
    for ext in (".bin", ".idx"):
        (tmp_path / f"data{ext}").write_bytes(b"")
    (tmp_path / "tok.model").write_bytes(b"")
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "1024",
            "--train-iters", "1", "--lr", "1e-3", "--data-path", str(prefix), "--tokenizer-model",
            str(tmp_path / "tok.model"), "--context-parallel-size", "4"]
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is not None and v is not False:
            argv += [flag, *map(str, v if isinstance(v, list) else [v])]
    args = build_parser().parse_args(argv)
    try:
        validate_args(args, world_size=4, te_importable=False)
    except ArgumentValidationError as e:
        return str(e)
    return args


@pytest.mark.parametrize("kw, needle", [
    (dict(attention_dropout=0.1), "--attention-dropout 0.1"),
    (dict(mtraining_config=str(ROOT / "configs" / "demo.yaml"), hierarchical_context_parallel_sizes=[2, 2]),
     "the run would use a flat ring"),
    (dict(mtraining_config=str(ROOT / "configs" / "hierarchical.yaml")), "inner*outer = 8*4 != context-parallel"),
])
def test_front_doors_give_the_same_verdict(tmp_path, kw, needle):
    from megatron_mtraining.megatron import megatron_lm

    with pytest.raises(ValueError) as ei:
        config_from_args(_mlm(**kw))
    assert needle in str(ei.value)
    with pytest.raises(ValueError) as ei:
        megatron_lm.mtraining_config_from_args(_mlm(**kw))
    assert needle in str(ei.value)
    got = _pretrain(tmp_path, **kw)
    assert isinstance(got, str) and needle in got, got


@pytest.mark.parametrize("kw", [dict(reset_attention_mask=True), dict(reset_position_ids=True),
                                dict(reset_attention_mask=True, reset_position_ids=True)])
def test_front_doors_accept_packed_documents_with_the_dense_pattern(tmp_path, kw):
    from megatron_mtraining.megatron import megatron_lm
    from megatron_mtraining.plan import DocumentPacking, packing_from_args, resolve

    assert not config_from_args(_mlm(**kw)).sparse
    assert not isinstance(_pretrain(tmp_path, **kw), str)
    # the Megatron-LM patches hand the documents to the model: accepted there too
    assert megatron_lm.mtraining_config_from_args(_mlm(**kw)) == config_from_args(_mlm(**kw))
    sparse = dict(kw, mtraining_config=str(ROOT / "configs" / "demo_sparse.yaml"))
    assert config_from_args(_mlm(**sparse)).sparse          # vertical-slash over documents
    assert not isinstance(_pretrain(tmp_path, **sparse), str)
    if kw.get("reset_attention_mask"):
        oor = tmp_path / "oor.yaml"
        oor.write_text((ROOT / "configs" / "demo_sparse.yaml").read_text() + "columns: out_of_ring\n")
        needle = ("--reset-attention-mask: packed documents (document masks) with pattern: vertical_slash "
                  "need columns: in_ring")
        with pytest.raises(ValueError, match=re.escape(needle)):
            config_from_args(_mlm(**dict(kw, mtraining_config=str(oor))))
        assert needle in _pretrain(tmp_path, **dict(kw, mtraining_config=str(oor)))
    packing = packing_from_args(_mlm(**kw), eod_token=2)
    assert packing == DocumentPacking(kw.get("reset_attention_mask", False), kw.get("reset_position_ids", False), 2)
    assert resolve(None, cp_group=None, packing=packing).document_mask == bool(kw.get("reset_attention_mask"))
    if kw.get("reset_attention_mask"):
        with pytest.raises(ValueError, match="needs the tokenizer's EOD token"):
            packing_from_args(_mlm(**kw))
        assert resolve({"pattern": "vertical_slash"}, cp_group=None, packing=packing).config.sparse
        assert resolve({"pattern": "vertical_slash", "kernel_backend": "triton"}, cp_group=None,
                       packing=packing).config.sparse           # the Triton sparse kernels have a document mask
        with pytest.raises(ValueError, match="kernel_backend: fa4 has no sparse kernel with a document mask"):
            resolve({"pattern": "vertical_slash", "kernel_backend": "fa4"}, cp_group=None, packing=packing)
    from megatron_mtraining.megatron.args import ArgumentValidationError, apply_mtraining_config

    te = SimpleNamespace(context_parallel_size=1, hierarchical_context_parallel_sizes=None, cp_attention="te",
                         mtraining_config=None, **kw)
    with pytest.raises(ArgumentValidationError, match="packed documents need --cp-attention mtraining"):
        apply_mtraining_config(te)


def test_front_doors_agree_on_implied_hierarchical_ring(tmp_path):
    from megatron_mtraining.megatron import megatron_lm

    kw = dict(hierarchical_context_parallel_sizes=[2, 2])
    a = megatron_lm.mtraining_config_from_args(_mlm(**kw))
    b = _pretrain(tmp_path, **kw).mtraining
    assert a == b and a.implementation == "hierarchical" and a.hierarchical.sizes == (2, 2)


# ------------------------------------------------------------------------------ per-layer policy
def test_layer_views_share_the_plan_and_agree_on_the_whole_policy():
    cfg = {"pattern": "vertical_slash", "dense_layers": [1], "layer_overrides": {"3": {"recall": 0.99}}}
    plan = resolve(cfg, cp_group=None, seq_len=256, num_layers=3)
    views = [plan.for_layer(n) for n in (1, 2, 3)]
    assert [v.sparse for v in views] == [False, True, True] and plan.sparse
    assert views[2].pattern.recall == 0.99 and views[1].pattern == plan.pattern
    assert plan.for_layer(2) is views[1] and views[1].for_layer(3) is views[2]     # cached, one per layer
    assert all(v._checked is plan._checked and v._backends is plan._backends for v in views)
    assert all(v.layout == plan.layout and v.cp_group is plan.cp_group for v in views)
    fields = {v.layer_number: v.agreement_fields(0.25) for v in views}
    assert fields[1] == fields[2] == fields[3] == plan.agreement_fields(0.25)
    assert fields[1]["layer_policy"] == "dense 1; layers 3: recall=0.99"
    other = resolve({**cfg, "dense_layers": [2]}, cp_group=None).for_layer(1)
    assert other.agreement_fields(0.25)["layer_policy"] != fields[1]["layer_policy"]   # a rank with another policy
    # a dense layer of a sparse config picks the dense kernels; a sparse layer the sparse ones
    q = torch.zeros(1, 256, 2, 16)
    b1 = views[0].select_backend(device=q.device, dtype=q.dtype, head_dim=16, seq_len_local=256)
    b2 = views[1].select_backend(device=q.device, dtype=q.dtype, head_dim=16, seq_len_local=256)
    assert len(plan._backends) == 2, (b1, b2)
    with pytest.raises(ValueError, match="layer_number 4 > num_layers=3"):
        plan.for_layer(4)
    with pytest.raises(ValueError, match="'dense_layers' names layer 1, but the model has layers 1..0"):
        resolve(cfg, cp_group=None, num_layers=0)


def test_config_from_args_checks_num_layers():
    args = SimpleNamespace(mtraining_config=None, context_parallel_size=1, seq_length=256, num_layers=2)
    assert config_from_args(args).pattern == "dense"
    args.mtraining_config = {"pattern": "vertical_slash", "dense_layers": ["2-3"]}
    with pytest.raises(ValueError, match=r"^--num-layers 2: mtraining config 'dense_layers' names layer 3"):
        config_from_args(args)


def test_kernel_summary_names_the_chosen_kernels_once():
    plan = resolve(ROOT / "configs" / "demo_sparse.yaml", cp_group=None, seq_len=1024, device="cpu",
                   dtype=torch.float32)
    assert plan.kernel_summary() == ""                      # nothing chosen before the first forward
    for _ in range(2):
        plan.select_backend(device=torch.device("cpu"), dtype=torch.float32, head_dim=64, seq_len_local=1024)
    assert plan.kernel_summary() == "sparse: torch"
    dense = resolve(None, cp_group=None, seq_len=1024, device="cpu", dtype=torch.float32)
    dense.select_backend(device=torch.device("cpu"), dtype=torch.float32, head_dim=64, seq_len_local=1024)
    assert dense.kernel_summary() == "dense: torch"         # the CPU has no CP=1 SDPA/FA4 function
    sdpa = resolve(load_mtraining_config({"kernel_backend": "sdpa"}), cp_group=None)
    sdpa.select_backend(device=torch.device("cpu"), dtype=torch.bfloat16, head_dim=64, seq_len_local=1024)
    assert sdpa.kernel_summary() == "dense: sdpa (CP=1 sdpa_causal)"
    policy = resolve(load_mtraining_config({"pattern": "vertical_slash", "dense_layers": [1]}), cp_group=None)
    assert policy.kernel_summary() == ""
    policy.for_layer(1).select_backend(device=torch.device("cpu"), dtype=torch.float32, head_dim=64,
                                       seq_len_local=1024)
    assert policy.kernel_summary() == "dense: torch; layer policy: dense 1"


def test_cuda_graphs_rules_on_every_path():
    """``cuda_graphs: true``: a bool; refused at cp_size > 1, with document masks, with pipeline parallelism and
    with Megatron's offloading of the attention output (config, resolve, the front door), and at call time for CPU
    inputs and packed documents (CUDA capture and replay: tests/kernels/test_gpu_graphs.py)."""
    from megatron_mtraining.plan import DocumentPacking

    sparse = {"pattern": "vertical_slash", "cuda_graphs": True}
    cfg = load_mtraining_config(sparse)
    assert cfg.cuda_graphs and load_mtraining_config(cfg.to_dict()) == cfg
    assert "cuda_graphs" not in MTrainingConfig().to_dict()
    with pytest.raises(ValueError, match=r"'cuda_graphs' must be true or false, got 1"):
        load_mtraining_config({"cuda_graphs": 1})
    with pytest.raises(ValueError, match=r"'cuda_graphs: true' needs context-parallel size 1 .* got 2"):
        config_for_run(sparse, cp_size=2)
    with pytest.raises(ValueError, match=r"^--reset-attention-mask: .*cuda_graphs: true' cannot capture packed"):
        resolve(sparse, cp_group=None, packing=DocumentPacking(reset_attention_mask=True, eod_token=0))
    args = SimpleNamespace(mtraining_config=sparse, context_parallel_size=1, seq_length=256, num_layers=2,
                           pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"^--pipeline-model-parallel-size 2: .*forwards before their backwards"):
        config_from_args(args)
    args.pipeline_model_parallel_size, args.reset_attention_mask = 1, True
    with pytest.raises(ValueError, match=r"^--reset-attention-mask: .*cannot capture packed documents"):
        config_from_args(args)
    args.reset_attention_mask = False
    args.fine_grained_activation_offloading, args.offload_modules = True, ["core_attn", "attn_proj"]
    with pytest.raises(ValueError, match=r"^--fine-grained-activation-offloading --offload-modules attn_proj: .*"
                                         r"remove attn_proj"):
        config_from_args(args)
    args.offload_modules = ["core_attn"]          # its inputs are copied into the graph's buffers: fine
    assert config_from_args(args).cuda_graphs

    plan = resolve(sparse, cp_group=None, seq_len=256)
    assert plan.for_layer(1).attention_runner() is not plan.for_layer(1).attention_runner()   # one per layer module
    dense_view = resolve(dict(sparse, dense_layers=[1]), cp_group=None).for_layer(1)
    assert dense_view.attention_runner() == dense_view.attention              # dense layers: no graphs
    q = torch.randn(1, 256, 2, 16, requires_grad=True)
    with pytest.raises(ValueError, match=r"needs CUDA tensors, got q on cpu"):
        plan.for_layer(1).attention_runner()(q, q, q, softmax_scale=0.25)
    plan.select_backend(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, seq_len_local=256)
    assert plan.kernel_summary() == "sparse: torch; CUDA graphs: sparse layers"


def test_cuda_graphs_refusals_of_ignored_or_uncapturable_settings(tmp_path):
    """``cuda_graphs: true`` with the dense pattern (it would be ignored) or the torch kernels (host reads) is a
    config error; no-grad calls run eagerly wherever the plain attention runs (CPU included); the Megatron-LM
    glue re-checks pipeline parallelism when only that flag changes."""
    from megatron_mtraining.megatron import megatron_lm

    with pytest.raises(ValueError, match=r"'cuda_graphs: true' applies to the sparse pattern only"):
        load_mtraining_config({"cuda_graphs": True})
    with pytest.raises(ValueError, match=r"'cuda_graphs: true' needs the Triton sparse kernels"):
        load_mtraining_config({"pattern": "vertical_slash", "cuda_graphs": True, "kernel_backend": "torch"})
    plan = resolve({"pattern": "vertical_slash", "cuda_graphs": True}, cp_group=None, seq_len=256).for_layer(1)
    q = torch.randn(1, 256, 2, 16)
    with torch.no_grad():
        out = plan.attention_runner()(q, q, q, softmax_scale=0.25)
    assert torch.equal(out, plan.attention(q, q, q, softmax_scale=0.25))
    cfg = tmp_path / "graphs.yaml"
    cfg.write_text("pattern: vertical_slash\ncuda_graphs: true\n")
    args = SimpleNamespace(mtraining_config=str(cfg), context_parallel_size=1, seq_length=256, num_layers=2,
                           pipeline_model_parallel_size=1)
    assert megatron_lm.mtraining_config_from_args(args).cuda_graphs
    args.pipeline_model_parallel_size = 2
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 2"):
        megatron_lm.mtraining_config_from_args(args)


def test_resolve_refuses_arguments_of_the_wrong_kind():
    """A cp_group that is not a process group, packing that is not a DocumentPacking and hierarchical_groups
    that are not a pair are errors naming the argument (AttributeError / unpacking errors before)."""
    for kw, needle in ((dict(cp_group="world"), "cp_group must be a torch.distributed ProcessGroup or None"),
                       (dict(cp_group=None, packing={"reset_attention_mask": True}),
                        "packing must be a DocumentPacking or None, got dict"),
                       (dict(cp_group=None, hierarchical_groups=(None,)),
                        "hierarchical_groups must be (inner_group, outer_group)"),
                       (dict(cp_group=None, hierarchical_groups=("a", "b")),
                        "hierarchical_groups inner group must be a torch.distributed ProcessGroup")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            resolve(None, **kw)

"""Tests for megatron_mtraining/config.py and the shipped configs/*.yaml."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mtraining.config import (
    HierarchicalConfig,
    MTrainingConfig,
    VerticalSlashConfig,
    config_for_run,
    dump_mtraining_config,
    load_mtraining_config,
)
from megatron_mtraining.patterns import estimator

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
EXPECTED = {  # file -> (implementation, pattern, recall or None, granularity)
    "demo.yaml": ("striped", "dense", None, 64),
    "demo_sparse.yaml": ("striped", "vertical_slash", 0.9, 64),
    "qwen2.5-3b-512k.yaml": ("hierarchical", "vertical_slash", 0.9, 64),
    "qwen2.5-3b-512k-r095.yaml": ("hierarchical", "vertical_slash", 0.95, 64),
    "qwen2.5-0.5b.yaml": ("striped", "vertical_slash", 0.9, 64),
    "zigzag_sparse.yaml": ("zigzag", "vertical_slash", 0.9, 64),
    "hierarchical.yaml": ("hierarchical", "dense", None, 64),
    "e2e_sparse.yaml": ("striped", "vertical_slash", 0.95, 64),
    "long_context_r095.yaml": ("striped", "vertical_slash", 0.95, 64),
    "long_context_r098.yaml": ("striped", "vertical_slash", 0.98, 64),
    "long_context_r098_auto.yaml": ("striped", "vertical_slash", 0.98, 64),
    "long_context_r098_graphs.yaml": ("striped", "vertical_slash", 0.98, 64),
    "long_context_fa4_b128_graphs.yaml": ("striped", "vertical_slash", 0.98, 128),
    "fa4_128k.yaml": ("striped", "vertical_slash", 0.9, 128),
    "packed_documents_r090.yaml": ("striped", "vertical_slash", 0.9, 64),
}


def test_expected_configs_are_shipped():
    assert sorted(p.name for p in CONFIGS) == sorted(EXPECTED)


def test_only_the_packed_config_probes_every_document():
    configs = {p.name: load_mtraining_config(p) for p in CONFIGS}
    probes = {n: c.vertical_slash.probes for n, c in configs.items() if c.sparse}
    assert {n for n, v in probes.items() if v == "document"} == {"packed_documents_r090.yaml"}
    assert set(probes.values()) == {"stream", "document"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads_and_round_trips(path, tmp_path):
    cfg = load_mtraining_config(path)
    impl, pattern, recall, g = EXPECTED[path.name]
    assert (cfg.implementation, cfg.pattern, cfg.granularity) == (impl, pattern, g)
    assert cfg.sparse == (recall is not None)
    if recall is not None:
        assert cfg.vertical_slash.recall == recall
    # a comment header saying which run it mirrors
    head = path.read_text().splitlines()
    assert head[0].startswith("# MTraining config:"), head[0]
    assert any("Mirrors" in line for line in head[:6])
    # round trips: dict and YAML text
    assert load_mtraining_config(cfg.to_dict()) == cfg
    dump_mtraining_config(cfg, tmp_path / "again.yaml")
    assert load_mtraining_config(tmp_path / "again.yaml") == cfg


def test_the_auto_config_is_r098_with_the_measured_layer_policy():
    auto, fixed = (load_mtraining_config(ROOT / "configs" / n) for n in ("long_context_r098_auto.yaml",
                                                                         "long_context_r098.yaml"))
    assert auto.auto_dense_layers and dataclasses.replace(auto, auto_dense_layers=False) == fixed


def test_the_graphs_config_is_r098_with_cuda_graphs_on_the_triton_kernels():
    graphs, fixed = (load_mtraining_config(ROOT / "configs" / n) for n in ("long_context_r098_graphs.yaml",
                                                                           "long_context_r098.yaml"))
    assert graphs.cuda_graphs and graphs.kernel_backend == "triton"
    assert dataclasses.replace(graphs, cuda_graphs=False, kernel_backend="auto") == fixed


def test_the_fa4_graphs_config_is_the_graphs_config_at_128_token_blocks_on_fa4():
    fa4, graphs = (load_mtraining_config(ROOT / "configs" / n) for n in ("long_context_fa4_b128_graphs.yaml",
                                                                        "long_context_r098_graphs.yaml"))
    vs = dataclasses.replace(fa4.vertical_slash, block_size=64, local_blocks=2, max_slash=256)
    assert fa4.kernel_backend == "fa4" and fa4.cuda_graphs
    assert dataclasses.replace(fa4, granularity=64, vertical_slash=vs, kernel_backend="triton") == graphs


def test_paper_main_run_settings():
    """Qwen2.5-3B, 512K, 32 A100 = 4 nodes x 8: CP 32 = inner 8 x outer 4, from Megatron's sizes."""
    cfg = load_mtraining_config(ROOT / "configs" / "qwen2.5-3b-512k.yaml")
    assert cfg.hierarchical.sizes is None  # taken from --hierarchical-context-parallel-sizes
    assert cfg.hierarchical_sizes(32, [8, 4]) == (8, 4)
    cfg.check_run(cp_size=32, seq_len=512 * 1024, megatron_hierarchical_sizes=[8, 4])
    assert cfg.vertical_slash.max_vertical == 4096 and cfg.vertical_slash.last_q == 64
    hier = load_mtraining_config(ROOT / "configs" / "hierarchical.yaml")
    assert hier.hierarchical_sizes(32) == (8, 4)
    zz = load_mtraining_config(ROOT / "configs" / "zigzag_sparse.yaml")
    zz.check_run(cp_size=32, seq_len=512 * 1024)
    assert zz.make_layout(32).kind == "zigzag"


def test_defaults_none_and_empty_file(tmp_path):
    assert load_mtraining_config(None) == MTrainingConfig()
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    cfg = load_mtraining_config(tmp_path / "empty.yaml")
    assert cfg == MTrainingConfig() and cfg.implementation == "striped" and cfg.granularity == 64
    assert cfg.pattern == "dense" and cfg.deterministic is False
    assert load_mtraining_config(cfg) is cfg


def test_vertical_slash_section_reuses_the_estimator_dataclass():
    cfg = load_mtraining_config({"pattern": "vertical_slash", "vertical_slash": {"recall": 0.8}})
    assert type(cfg.vertical_slash) is estimator.VerticalSlashConfig
    assert VerticalSlashConfig is estimator.VerticalSlashConfig
    assert cfg.vertical_slash == estimator.VerticalSlashConfig(recall=0.8)
    # every estimator field is a legal key, and nothing else
    all_fields = {f.name: getattr(estimator.VerticalSlashConfig(), f.name)
                  for f in dataclasses.fields(estimator.VerticalSlashConfig)}
    assert load_mtraining_config({"pattern": "vertical_slash", "vertical_slash": all_fields}).sparse


@pytest.mark.parametrize("data, key", [
    ({"patern": "dense"}, "'patern'"),
    ({"implementation": "striped", "layout": "striped"}, "'layout'"),
    ({"pattern": "vertical_slash", "vertical_slash": {"recal": 0.9}}, "'vertical_slash.recal'"),
    ({"implementation": "hierarchical", "hierarchical": {"inner": 2, "outer": 2, "middle": 2}},
     "'hierarchical.middle'"),
])
def test_unknown_keys_are_errors_naming_the_key(data, key):
    with pytest.raises(ValueError, match=r"^mtraining config: unknown key ") as ei:
        load_mtraining_config(data)
    assert key in str(ei.value) and "allowed:" in str(ei.value)


@pytest.mark.parametrize("data, key", [
    ({"implementation": "ring"}, "'implementation'"),
    ({"granularity": 0}, "'granularity'"),
    ({"granularity": "64"}, "'granularity'"),
    ({"granularity": True}, "'granularity'"),
    ({"pattern": "sparse"}, "'pattern'"),
    ({"deterministic": "yes"}, "'deterministic'"),
    ({"pattern": "vertical_slash", "columns": "outside"}, "'columns' must be one of in_ring, out_of_ring"),
    ({"columns": "out_of_ring"}, "'columns: out_of_ring' applies to the sparse pattern only"),
    ({"pattern": "vertical_slash", "vertical_slash": {"recall": 0}}, "'vertical_slash.recall' must be a number in (0, 1]"),
    ({"pattern": "vertical_slash", "vertical_slash": {"recall": 1.5}}, "'vertical_slash.recall' must be a number in (0, 1]"),
    ({"pattern": "vertical_slash", "vertical_slash": {"last_q": 0}}, "'vertical_slash.last_q'"),
    ({"pattern": "vertical_slash", "vertical_slash": {"last_q": 6.5}}, "'vertical_slash.last_q'"),
    ({"pattern": "vertical_slash", "vertical_slash": {"local_blocks": 0}}, "'vertical_slash.local_blocks'"),
    ({"pattern": "vertical_slash", "vertical_slash": {"max_vertical": 8}}, "'vertical_slash.max_vertical'"),
    ({"pattern": "vertical_slash", "vertical_slash": {"max_slash": 1, "local_blocks": 2}}, "'vertical_slash.max_slash'"),
    ({"pattern": "vertical_slash", "vertical_slash": [0.9]}, "'vertical_slash' must be a mapping"),
    ({"pattern": "vertical_slash", "granularity": 32}, "'granularity' (32) must be a multiple of 'vertical_slash.block_size'"),
    ({"vertical_slash": {"recall": 0.9}}, "'vertical_slash' section given but 'pattern' is 'dense'"),
    ({"hierarchical": {"inner": 8, "outer": 4}}, "'hierarchical' section given but 'implementation' is 'striped'"),
    ({"implementation": "hierarchical", "hierarchical": {"inner": 8}}, "'hierarchical.inner' and 'hierarchical.outer'"),
    ({"implementation": "hierarchical", "hierarchical": {"inner": 1, "outer": 8}}, "'hierarchical.inner' must be an int >= 2"),
    ({"pattern": "vertical_slash", "kernel_backend": "sdpa"}, "'kernel_backend: sdpa' has no sparse kernels"),
    ({"pattern": "vertical_slash", "kernel_backend": "sdpa", "cuda_graphs": True}, "'kernel_backend: sdpa'"),
])
def test_bad_values_are_errors_naming_the_key(data, key):
    with pytest.raises(ValueError, match=r"^mtraining config: ") as ei:
        load_mtraining_config(data)
    assert key in str(ei.value)


def test_file_errors_name_the_file_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("implementation: striped\npatern: dense\n")
    with pytest.raises(ValueError, match=r"^mtraining config .*bad\.yaml: unknown key 'patern'"):
        load_mtraining_config(p)
    p.write_text("pattern: vertical_slash\nvertical_slash:\n  recall: 2\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: 'vertical_slash\.recall' must be a number in \(0, 1\]"):
        load_mtraining_config(str(p))
    p.write_text("granularity: 64\ngranularity: 128\n")
    with pytest.raises(ValueError, match=r"duplicate key 'granularity' \(line 2\)"):
        load_mtraining_config(p)
    p.write_text("pattern: [dense\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: invalid YAML"):
        load_mtraining_config(p)
    p.write_text("- striped\n")
    with pytest.raises(ValueError, match=r"top level must be a mapping"):
        load_mtraining_config(p)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_mtraining_config(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match=r"is a directory, not a YAML config file"):
        load_mtraining_config(tmp_path)
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"^mtraining config .*bad\.yaml: not UTF-8 text"):
        load_mtraining_config(p)
    with pytest.raises(ValueError, match=r"got bytes \(decode a bytes path first\)"):
        load_mtraining_config(b"configs/demo.yaml")


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    cfg = load_mtraining_config({"granularity": np.int64(128), "pattern": "vertical_slash",
                                 "vertical_slash": {"recall": np.float64(0.9), "max_slash": np.int32(64)}})
    assert (cfg.granularity, cfg.vertical_slash.recall, cfg.vertical_slash.max_slash) == (128, 0.9, 64)
    assert type(cfg.granularity) is int and type(cfg.vertical_slash.max_slash) is int
    with pytest.raises(ValueError, match="'granularity' must be an int >= 1"):
        load_mtraining_config({"granularity": np.float64(64.0)})


def test_hierarchical_sizes_resolution():
    flat = MTrainingConfig()
    assert flat.hierarchical_sizes(8, [4, 2]) is None
    h = load_mtraining_config({"implementation": "hierarchical"})
    assert h.hierarchical_sizes(8, [4, 2]) == (4, 2)
    with pytest.raises(ValueError, match="needs 'hierarchical.inner'/'outer' or --hierarchical-context-parallel-sizes"):
        h.hierarchical_sizes(8, None)
    with pytest.raises(ValueError, match=r"inner\*outer = 4\*2 != context-parallel size 16"):
        h.hierarchical_sizes(16, [4, 2])
    with pytest.raises(ValueError, match="exactly two"):
        h.hierarchical_sizes(8, [2, 2, 2])
    own = load_mtraining_config({"implementation": "hierarchical", "hierarchical": {"inner": 4, "outer": 2}})
    assert own.hierarchical_sizes(8) == (4, 2) == own.hierarchical_sizes(8, [4, 2])
    with pytest.raises(ValueError, match="disagree with --hierarchical-context-parallel-sizes 2 4"):
        own.hierarchical_sizes(8, [2, 4])
    with pytest.raises(ValueError, match="'hierarchical' sizes are set but 'implementation' is 'striped'"):
        MTrainingConfig(hierarchical=HierarchicalConfig(2, 2))


def test_check_run_names_the_rule():
    cfg = load_mtraining_config(ROOT / "configs" / "demo_sparse.yaml")
    cfg.check_run(cp_size=2, seq_len=4096)
    with pytest.raises(ValueError, match=r"'granularity': cannot split a sequence of 4000 tokens"):
        cfg.check_run(cp_size=2, seq_len=4000)
    zz = load_mtraining_config(ROOT / "configs" / "zigzag_sparse.yaml")
    with pytest.raises(ValueError, match=r"'vertical_slash.block_size' \(64\) must divide the zigzag chunk length 32"):
        zz.check_run(cp_size=2, seq_len=128)
    with pytest.raises(ValueError, match=r"'vertical_slash.last_q' \(64\) exceeds"):
        load_mtraining_config({"pattern": "vertical_slash", "vertical_slash": {"block_size": 16},
                               "granularity": 16}).check_run(cp_size=1, seq_len=32)
    for cp, seq in ((2, 4096.0), (2, 0), (0, 4096), (True, 4096)):
        with pytest.raises(ValueError, match=r"must be an int >= 1"):
            cfg.check_run(cp_size=cp, seq_len=seq)


def test_run_rule_layout_flags():
    """config_for_run: layout flags that disagree with a config are errors (the config fixes the layout)."""
    zz, sparse = ROOT / "configs" / "zigzag_sparse.yaml", ROOT / "configs" / "demo_sparse.yaml"
    assert config_for_run(zz, cp_size=2, cp_layout="zigzag").layout_kind == "zigzag"
    assert config_for_run(sparse, cp_size=2, cp_layout="striped", granularity=64).granularity == 64
    with pytest.raises(ValueError, match=r"--cp-layout striped disagrees with .*zigzag_sparse\.yaml"):
        config_for_run(zz, cp_size=2, cp_layout="striped")
    with pytest.raises(ValueError, match=r"--cp-granularity 128 disagrees with .*demo_sparse\.yaml \(granularity 64\)"):
        config_for_run(sparse, cp_size=2, granularity=128)
    # the zigzag layout has no granularity: an explicit one is refused, with a config or without
    for g in (64, 32):                # the config's value or another: the same rule, not "change the config"
        with pytest.raises(ValueError, match=rf"--cp-granularity {g} applies to the striped layout only; "
                                             r".*zigzag_sparse\.yaml \(zigzag layout\) .* drop the flag"):
            config_for_run(zz, cp_size=2, granularity=g)
    with pytest.raises(ValueError, match=r"--cp-granularity 64 applies to the striped layout only; --cp-layout zigzag"):
        config_for_run(None, cp_size=2, cp_layout="zigzag", granularity=64)
    assert config_for_run(None, cp_size=2, cp_layout="zigzag").layout_kind == "zigzag"


def test_zigzag_config_has_no_granularity(tmp_path):
    """A zigzag config file with a 'granularity' key (any value) and a zigzag MTrainingConfig with another
    granularity are errors naming the key, not silently ignored; a zigzag config's dict and YAML have no
    granularity and load back to an equal config."""
    for g in (64, 128):
        with pytest.raises(ValueError, match=rf"'granularity: {g}' applies to the striped layout only; "
                                             r"implementation: zigzag .* remove the key"):
            load_mtraining_config({"implementation": "zigzag", "granularity": g})
    with pytest.raises(ValueError, match=r"'granularity: 32' applies to the striped layout only"):
        MTrainingConfig(implementation="zigzag", granularity=32)
    zz = load_mtraining_config(ROOT / "configs" / "zigzag_sparse.yaml")
    assert "granularity" not in zz.to_dict() and "granularity" not in dump_mtraining_config(zz)
    assert load_mtraining_config(zz.to_dict()) == zz
    dump_mtraining_config(zz, tmp_path / "zz.yaml")
    assert load_mtraining_config(tmp_path / "zz.yaml") == zz
    assert load_mtraining_config({"granularity": 128}).to_dict()["granularity"] == 128    # striped keeps it
    (tmp_path / "zz.yaml").write_text("implementation: zigzag\ngranularity:\n")           # the key with no value
    with pytest.raises(ValueError, match=r"'granularity' applies to the striped layout only"):
        load_mtraining_config(tmp_path / "zz.yaml")


def test_triton_tile_rule_names_the_setting_and_a_way_out():
    """A slash block size below the Triton tile with a setting that needs the Triton kernels names that setting
    and an alternative that works; SDPA's own refusal (no sparse kernels) comes first."""
    sparse = {"pattern": "vertical_slash", "vertical_slash": {"block_size": 32, "last_q": 32}}
    for extra, needles in (({"kernel_backend": "triton"}, ("'kernel_backend: triton'", "use kernel_backend: torch")),
                           ({"kernel_backend": "fa4", "cuda_graphs": True},
                            ("'kernel_backend: fa4'", "cuda_graphs: false and kernel_backend: auto or torch")),
                           ({"cuda_graphs": True}, ("'cuda_graphs: true'", "cuda_graphs: false")),
                           ({"kernel_backend": "sdpa", "cuda_graphs": True}, ("'kernel_backend: sdpa' has no sparse",))):
        with pytest.raises(ValueError) as e:
            load_mtraining_config({**sparse, **extra})
        assert all(n in str(e.value) for n in needles), (extra, str(e.value))
    assert load_mtraining_config({**sparse, "kernel_backend": "torch"}).vertical_slash.block_size == 32


def test_yaml_shapes_paths_and_run_arguments_get_named_errors(tmp_path):
    """Inputs that used to hang, crash with a raw error or be read silently: a huge layer range (it was
    expanded layer by layer), a YAML sequence as a key, a key with no value next to an empty section, an
    empty path, a path that is not a regular file, and bad run arguments of config_for_run."""
    def write(text):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        return path

    with pytest.raises(ValueError, match=r"'dense_layers': layer numbers go up to 100000, got '1-100000000000'"):
        load_mtraining_config(write('pattern: vertical_slash\ndense_layers: ["1-100000000000"]\n'))
    with pytest.raises(ValueError, match=r"'layer_overrides' key .*layer numbers go up to 100000"):
        load_mtraining_config({"pattern": "vertical_slash", "layer_overrides": {"2-200000": {"recall": 0.9}}})
    with pytest.raises(ValueError, match=r"c\.yaml: a key must be a name or a number, got \[1, 2\] \(line 1\)"):
        load_mtraining_config(write("? [1, 2]\n: 3\n"))
    # a YAML merge key is YAML (the explicit key wins); a key with no value is the empty section
    cfg = load_mtraining_config(write('pattern: vertical_slash\nlayer_overrides:\n'
                                      '  "2": {<<: {recall: 0.9, last_q: 64}, last_q: 32}\n'))
    assert cfg.layer_overrides == (((2, 2), (("last_q", 32), ("recall", 0.9))),)
    assert load_mtraining_config(write("pattern: vertical_slash\nvertical_slash:\n")).vertical_slash == \
        VerticalSlashConfig()
    with pytest.raises(ValueError, match=r"'hierarchical' section given but 'implementation' is 'striped'"):
        load_mtraining_config(write("implementation: striped\nhierarchical:\n"))
    with pytest.raises(ValueError, match=r"the path is empty"):
        load_mtraining_config("")
    with pytest.raises(ValueError, match=r"/dev/null: not a regular file"):
        load_mtraining_config("/dev/null")
    for kw, needle in ((dict(cp_size=1, cp_layout="spiral"), "--cp-layout must be striped or zigzag, got 'spiral'"),
                       (dict(cp_size=-2), "cp_size must be an int >= 1, got -2"),
                       (dict(cp_size=2.5), "cp_size must be an int >= 1, got 2.5"),
                       (dict(cp_size=4, megatron_hierarchical_sizes=["a", "b"]), "must be two ints INNER OUTER")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            config_for_run(None, **kw)


def test_attention_kwargs():
    kw = load_mtraining_config(ROOT / "configs" / "zigzag_sparse.yaml").attention_kwargs()
    assert kw["layout"] == "zigzag" and kw["pattern"] == "vertical_slash"
    assert isinstance(kw["vertical_slash"], VerticalSlashConfig)
    kw = MTrainingConfig().attention_kwargs()
    assert kw == {"layout": "striped", "granularity": 64, "pattern": "dense", "vertical_slash": None,
                  "hierarchical": None, "columns": "in_ring", "deterministic": False,
                  "kernel_backend": "auto"}
    kw = load_mtraining_config({"pattern": "vertical_slash", "columns": "out_of_ring"}).attention_kwargs()
    assert kw["columns"] == "out_of_ring"


def test_config_module_does_not_import_megatron():
    code = ("import sys; import megatron_mtraining.config as c; c.load_mtraining_config(None); "
            "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cli_validates_files_and_prints_pretrain_flags(tmp_path, capsys):
    from megatron_mtraining.config import main

    assert main([str(p) for p in CONFIGS]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok (") == len(CONFIGS)
    assert main(["--pretrain-flags", str(ROOT / "configs" / "demo.yaml")]) == 0
    assert capsys.readouterr().out.strip() == "--cp-layout striped --cp-granularity 64"
    (tmp_path / "zz.yaml").write_text("implementation: zigzag\n")
    assert main(["--pretrain-flags", str(tmp_path / "zz.yaml")]) == 0
    assert capsys.readouterr().out.strip() == "--cp-layout zigzag"       # zigzag has no granularity
    assert main(["--pretrain-flags", str(ROOT / "configs" / "demo_sparse.yaml")]) == 1
    assert "needs --mtraining-config" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("patern: dense\n")
    assert main([str(tmp_path / "bad.yaml")]) == 1
    assert "unknown key 'patern'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ per-layer policy
SPARSE = {"pattern": "vertical_slash", "vertical_slash": {"recall": 0.9}}


def test_layer_policy_resolves_per_layer_and_round_trips(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("pattern: vertical_slash\nvertical_slash: {recall: 0.9}\ndense_layers: [1, '6-7']\n"
                    "layer_overrides:\n  2-4: {recall: 0.99}\n  5: {max_vertical: 128}\n")
    cfg = load_mtraining_config(path)
    assert cfg.dense_layers == (1, 6, 7)
    assert cfg.layer_overrides == (((2, 4), (("recall", 0.99),)), ((5, 5), (("max_vertical", 128),)))
    got = {n: cfg.layer_pattern(n) for n in range(1, 9)}
    assert [n for n, p in got.items() if p is None] == [1, 6, 7]
    assert {n: got[n].recall for n in (2, 3, 4, 5, 8)} == {2: 0.99, 3: 0.99, 4: 0.99, 5: 0.9, 8: 0.9}
    assert got[5].max_vertical == 128 and got[8] == cfg.vertical_slash and got[4].max_vertical == 4096
    assert load_mtraining_config(cfg.to_dict()) == cfg and hash(load_mtraining_config(cfg.to_dict())) == hash(cfg)
    assert load_mtraining_config(dump_mtraining_config(cfg, tmp_path / "o.yaml") and tmp_path / "o.yaml") == cfg
    assert dataclasses.replace(cfg, columns="out_of_ring").layer_overrides == cfg.layer_overrides
    assert cfg.layer_policy_text() == "dense 1,6,7; layers 2-4: recall=0.99; layers 5: max_vertical=128"
    # the direct API takes the same forms; no policy: every layer has the base budgets
    assert MTrainingConfig(pattern="vertical_slash", dense_layers=["6-7", 1],
                           layer_overrides={"5": {"max_vertical": 128}, 2: {"recall": 0.9}}).dense_layers == (1, 6, 7)
    plain = load_mtraining_config(SPARSE)
    assert not plain.has_layer_policy and plain.layer_pattern(3) == plain.vertical_slash
    assert MTrainingConfig().layer_pattern(1) is None and MTrainingConfig(dense_layers=[]).dense_layers is None


@pytest.mark.parametrize("extra, needle", [
    ({"pattern": "dense", "vertical_slash": None, "dense_layers": [1]}, "'dense_layers' applies to the sparse pattern only"),
    ({"pattern": "dense", "vertical_slash": None, "layer_overrides": {"1": {"recall": 0.9}}},
     "'layer_overrides' applies to the sparse pattern only"),
    ({"dense_layers": 2}, "write [2] for one layer"),
    ({"dense_layers": "Auto"}, "'dense_layers' must be 'auto' or a list of 1-based layer numbers or ranges"),
    ({"dense_layers": ["auto"]}, "write dense_layers: auto (no brackets)"),
    ({"dense_layers": True}, "'dense_layers' must be 'auto' or a list"),
    ({"pattern": "dense", "vertical_slash": None, "dense_layers": "auto"},
     "'dense_layers: auto' applies to the sparse pattern only"),
    ({"dense_layers": [0]}, "1-based"),
    ({"dense_layers": [True]}, "1-based layer number or a range"),
    ({"dense_layers": ["4-2"]}, "is empty (first > last)"),
    ({"dense_layers": [1, "1-3"]}, "layer 1 is listed twice"),
    ({"layer_overrides": [1]}, "'layer_overrides' must be a mapping"),
    ({"layer_overrides": {"a": {"recall": 0.9}}}, "'layer_overrides' key 'a'"),
    ({"layer_overrides": {"1-3": {"recall": 0.9}, "3": {"recall": 0.8}}}, "ranges '1-3' and '3' overlap"),
    ({"layer_overrides": {"2": {}}}, "'layer_overrides.2' must be a non-empty mapping"),
    ({"layer_overrides": {"2": {"recal": 0.9}}}, "unknown key 'layer_overrides.2.recal'"),
    ({"layer_overrides": {"2": {"block_size": 128}}}, "'block_size' cannot be set per layer"),
    ({"layer_overrides": {"2-3": {"recall": 1.5}}}, "'layer_overrides.2-3.recall' must be a number in (0, 1]"),
    ({"layer_overrides": {"2": {"max_vertical": 8}}}, "'layer_overrides.2.max_vertical' (8) must be >= sink_tokens"),
    ({"dense_layers": [3], "layer_overrides": {"2-4": {"recall": 0.9}}},
     "layer 3 is in 'dense_layers' and in 'layer_overrides' '2-4'"),
])
def test_layer_policy_errors_name_the_rule(extra, needle):
    data = {k: v for k, v in {**SPARSE, **extra}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        load_mtraining_config(data)
    assert str(e.value).startswith("mtraining config: ") and needle in str(e.value), str(e.value)
    with pytest.raises(ValueError):                                  # the direct API: the same rule
        MTrainingConfig(**{k: (load_mtraining_config(SPARSE).vertical_slash if k == "vertical_slash" else v)
                           for k, v in data.items()})


def test_dense_layers_auto_keeps_every_layer_sparse_in_the_config_and_round_trips(tmp_path):
    path = tmp_path / "auto.yaml"
    path.write_text("pattern: vertical_slash\ndense_layers: auto\nlayer_overrides: {2: {recall: 0.99}}\n")
    cfg = load_mtraining_config(path)
    assert cfg.auto_dense_layers and cfg.dense_layers is None and cfg.has_layer_policy
    assert cfg.layer_pattern(1) == cfg.vertical_slash and cfg.layer_pattern(2).recall == 0.99   # measured at run time
    assert cfg.to_dict()["dense_layers"] == "auto" and load_mtraining_config(cfg.to_dict()) == cfg
    assert load_mtraining_config(dump_mtraining_config(cfg, tmp_path / "o.yaml") and tmp_path / "o.yaml") == cfg
    assert cfg.layer_policy_text() == "dense auto (measured); layers 2: recall=0.99"
    assert MTrainingConfig(pattern="vertical_slash", dense_layers="auto") == load_mtraining_config(
        {"pattern": "vertical_slash", "dense_layers": "auto"})
    fixed = cfg.with_dense_layers([3])                  # a measured list replaces auto
    assert fixed.dense_layers == (3,) and not fixed.auto_dense_layers
    with pytest.raises(ValueError, match="either 'auto' or a list of layers"):
        MTrainingConfig(pattern="vertical_slash", dense_layers=[1], auto_dense_layers=True)
    with pytest.raises(ValueError, match="unknown key 'auto_dense_layers'"):      # a file says dense_layers: auto
        load_mtraining_config({"pattern": "vertical_slash", "auto_dense_layers": True})
    with pytest.raises(ValueError, match="'auto_dense_layers' must be true or false"):
        MTrainingConfig(pattern="vertical_slash", auto_dense_layers="yes")


def test_layer_numbers_are_checked_against_num_layers():
    cfg = load_mtraining_config({**SPARSE, "dense_layers": [1], "layer_overrides": {"3-4": {"recall": 0.99}}})
    cfg.check_layers(4)
    assert config_for_run(cfg, cp_size=1, seq_len=256, num_layers=4) == cfg
    with pytest.raises(ValueError, match=r"^--num-layers 3: mtraining config 'layer_overrides' range '3-4' names "
                                         r"layer 4, but the model has layers 1\.\.3"):
        config_for_run(cfg, cp_size=1, seq_len=256, num_layers=3)
    with pytest.raises(ValueError, match=r"^num_layers=0: mtraining config 'dense_layers' names layer 1"):
        cfg.check_layers(0)
    with pytest.raises(ValueError, match="'layer_overrides.3-4.last_q' \\(512\\) exceeds the sequence length 256"):
        load_mtraining_config({**SPARSE, "layer_overrides": {"3-4": {"last_q": 512}}}).check_run(1, 256)
    with pytest.raises(ValueError, match="layer numbers are 1-based"):
        cfg.layer_pattern(0)


def test_cli_prints_the_layer_policy(tmp_path, capsys):
    from megatron_mtraining.config import main

    path = tmp_path / "p.yaml"
    path.write_text("pattern: vertical_slash\ndense_layers: [1]\n")
    assert main([str(path)]) == 0
    assert "dense 1" in capsys.readouterr().out
    path.write_text("pattern: vertical_slash\ndense_layers: [1]\nlayer_overrides: {1: {recall: 0.9}}\n")
    assert main([str(path)]) == 1
    assert "layer 1 is in 'dense_layers'" in capsys.readouterr().err

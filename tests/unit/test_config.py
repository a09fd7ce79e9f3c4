"""Tests for megatron_mtraining/config.py and the shipped configs/*.yaml."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mtraining.config import (
    HierarchicalConfig,
    MTrainingConfig,
    VerticalSlashConfig,
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
    "fa4_128k.yaml": ("striped", "vertical_slash", 0.9, 128),
}


def test_expected_configs_are_shipped():
    assert sorted(p.name for p in CONFIGS) == sorted(EXPECTED)


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
    assert capsys.readouterr().out.strip() == "--cp-layout zigzag --cp-granularity 64"
    assert main(["--pretrain-flags", str(ROOT / "configs" / "demo_sparse.yaml")]) == 1
    assert "needs --mtraining-config" in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("patern: dense\n")
    assert main([str(tmp_path / "bad.yaml")]) == 1
    assert "unknown key 'patern'" in capsys.readouterr().err

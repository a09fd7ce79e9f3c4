"""Tests for the Megatron-LM patches (``patches/megatron-lm-core_v<line>.patch``, one per release
line), ``tools/check_patch.sh`` and the patches' glue (megatron_mtraining/megatron/megatron_lm.py,
megatron_mtraining/megatron/compat.py).

Always on (no Megatron-LM needed), for every line: the patch is a well-formed unified diff whose
hunk line counts add up and that applies to the preimage its hunks describe; it touches only the
expected files, keeps every Megatron-LM line it removes (in the ``te`` branch) except the
``extra_args_provider`` argument; every import of this package sits inside a block entered only
with ``--cp-attention mtraining``; the names it imports exist; its ``add_cp_attention_args``
defines the same flags as the glue; its header lists the tags of
:data:`~megatron_mtraining.megatron.compat.MEGATRON_LM_LINES`. ``tools/check_patch.sh`` picks
the patch by tag on small tagged git repositories and refuses an unsupported tag.

With ``MEGATRON_LM_DIR`` pointing to a Megatron-LM checkout (a supported tag; plain or already
patched) or ``MEGATRON_LM_ARCHIVE`` to a ``git archive`` tarball of one: ``tools/check_patch.sh``
reports OK or APPLIED; then the patched ``pretrain_gpt.py``/``gpt_builders.py`` (from a temporary
copy: the checkout is not modified) run on CPU with the checkout's own ``megatron.core``: the
default ``te`` path imports nothing of this package, and CP=2 (striped and zigzag configs) gives
the CP=1 per-token losses and gradients, also with packed documents (EOD resets, dense and
vertical-slash; from line 0.19 on the data set's THD ``cu_seqlens``; from 0.18 on SFTDataset's
offsets with ``--sft``), where the same data with the
documents dropped differs (negative control) and the vertical-slash run differs from the dense one
(its budgets drop attention inside the documents); CP=4 on the hierarchical ring (Megatron's 2 x 2
hierarchical CP groups) gives them too, dense without and with documents and vertical-slash with
documents. Megatron-LM ``main`` (line 0.20) is found by its
``megatron/core/package_info.py`` and runs with its own megatron-core 0.20. Line 0.19's ``megatron.training`` uses
``typing.override`` (Python 3.12); on 3.11 the worker stands in a no-op for it. The same run on
Python >= 3.12 with megatron-core 0.19 installed is marked ``gpu`` (for the GPU machine).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_mtraining.megatron import compat, megatron_lm

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check_patch.sh"
LINES = tuple(compat.MEGATRON_LM_LINES)
PATCHES = {line: ROOT / "patches" / compat.megatron_lm_patch_name(line) for line in LINES}
#: the tag each patch was made against, and its commit (NVIDIA/Megatron-LM)
MADE_AGAINST = {"0.16": ("core_v0.16.1", "55ac7082517c3878ae653c07c09c534b8aed49f6"),
                "0.17": ("core_v0.17.1", "266f1c97dca477ca8b92c16087506da2000b0b84"),
                "0.18": ("core_v0.18.2", "571370c829ca768fe37244f4e2e7f28d8accc4ab"),
                "0.19": ("core_v0.19.0", "5be9626709af2722333bf54797c954c09edeada3"),
                "0.20": ("main", "d98e8a64ddf34856e74b24714e3bedb2f5a39553")}
EXPECTED_FILES = {"0.16": {"pretrain_gpt.py", "gpt_builders.py"}, "0.17": {"pretrain_gpt.py", "gpt_builders.py"},
                  "0.18": {"pretrain_gpt.py", "gpt_builders.py"}, "0.19": {"pretrain_gpt.py"}, "0.20": {"pretrain_gpt.py"}}
PROVIDER_LINE = "        extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,"
MEGATRON_LM_FILES = ("pretrain_gpt.py", "gpt_builders.py")


# ------------------------------------------------------------------ the patch files themselves
def _parse_patch(text: str) -> dict[str, list[tuple[str, list[str]]]]:
    """{file: [(hunk header, body lines)]}; asserts unified-diff structure and hunk counts."""
    files: dict[str, list[tuple[str, list[str]]]] = {}
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    i = 0
    while i < len(lines) and not lines[i].startswith("diff --git "):
        i += 1  # free-text preamble (git apply ignores it)
    assert i < len(lines), "no 'diff --git' section"
    while i < len(lines):
        m = re.fullmatch(r"diff --git a/(\S+) b/(\S+)", lines[i])
        assert m and m.group(1) == m.group(2), lines[i]
        name = m.group(1)
        i += 1
        assert re.fullmatch(r"index [0-9a-f]+\.\.[0-9a-f]+ \d+", lines[i]), lines[i]
        assert lines[i + 1] == f"--- a/{name}" and lines[i + 2] == f"+++ b/{name}", lines[i:i + 3]
        i += 3
        hunks = files.setdefault(name, [])
        while i < len(lines) and not lines[i].startswith("diff --git "):
            h = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", lines[i])
            assert h, f"expected a hunk header, got {lines[i]!r}"
            old_n = int(h.group(2) or 1)
            new_n = int(h.group(4) or 1)
            body = []
            i += 1
            while i < len(lines) and (old_n > 0 or new_n > 0):
                line = lines[i]
                assert line[:1] in (" ", "+", "-") or line == "", f"bad hunk line {line!r}"
                if line.startswith("+"):
                    new_n -= 1
                elif line.startswith("-"):
                    old_n -= 1
                else:
                    old_n -= 1
                    new_n -= 1
                body.append(line)
                i += 1
            assert old_n == 0 and new_n == 0, f"hunk {h.group(0)} of {name}: line counts do not add up"
            hunks.append((h.group(0), body))
    return files


def _added(files) -> list[str]:
    return [ln[1:] for hunks in files.values() for _, body in hunks for ln in body if ln.startswith("+")]


def _removed(files) -> list[str]:
    return [ln[1:] for hunks in files.values() for _, body in hunks for ln in body if ln.startswith("-")]


def _write_preimage(patch: Path, where: Path) -> None:
    """The context lines of every hunk, stitched together: a file set the patch applies to."""
    for name, hunks in _parse_patch(patch.read_text()).items():
        pre: list[str] = []
        for header, body in hunks:
            start = int(re.match(r"@@ -(\d+)", header).group(1))
            pre += [""] * (start - 1 - len(pre))  # filler lines up to the hunk
            pre += [ln[1:] for ln in body if not ln.startswith("+")]
        (where / name).write_text("\n".join(pre) + "\n" * 10)


@pytest.mark.parametrize("line", LINES)
def test_patch_is_well_formed_and_small(line):
    text = PATCHES[line].read_text()
    files = _parse_patch(text)
    assert set(files) == EXPECTED_FILES[line]
    preamble = text.split("diff --git")[0]
    tag, commit = MADE_AGAINST[line]
    assert f"Made against {tag} (commit {commit})" in preamble
    assert re.search(r"^Tested tags: (.*)$", preamble, flags=re.M).group(1).split() == \
        list(compat.MEGATRON_LM_LINES[line])
    added, removed = _added(files), _removed(files)
    assert PROVIDER_LINE in removed and "        extra_args_provider=add_cp_attention_args," in added
    # every other removed line is kept (re-indented) in the branch taken with --cp-attention te
    kept = {ln.strip() for ln in added}
    assert [ln for ln in removed if ln != PROVIDER_LINE and ln.strip() not in kept] == []
    assert len(added) <= 55, f"patch grew to {len(added)} added lines; keep it small"
    # new lines stay short; Megatron-LM's own lines moved into the te branch keep their length
    assert all(len(ln) <= 120 for ln in added if ln.strip() not in {r.strip() for r in removed})
    assert not any("\t" in ln or ln != ln.rstrip() for ln in added), "tabs or trailing whitespace"


@pytest.mark.parametrize("line", LINES)
def test_patch_imports_this_package_only_on_the_mtraining_path(line):
    """Each import of megatron_mtraining is inside an ``if ... cp_attention ... == 'mtraining'``
    block or the ``--mtraining-config`` type function (argparse calls it only when the flag is
    given); nothing at module level."""
    files = _parse_patch(PATCHES[line].read_text())
    n_imports = 0
    for name, hunks in files.items():
        for _, body in hunks:
            new = [ln[1:] for ln in body if not ln.startswith("-")]
            for i, ln in enumerate(new):
                if "megatron_mtraining" not in ln or ln.lstrip().startswith("#") or "help=" in ln:
                    continue
                assert re.fullmatch(r"\s+from megatron_mtraining\.megatron\.megatron_lm import \w+", ln), (name, ln)
                n_imports += 1
                indent = len(ln) - len(ln.lstrip())
                opener = next(o for o in reversed(new[:i]) if o.strip() and len(o) - len(o.lstrip()) < indent)
                assert (re.match(r"\s*if .*cp_attention.*== 'mtraining'", opener)
                        or opener.startswith("def _mtraining_config_file(")), (name, ln, opener)
    assert n_imports >= 3


@pytest.mark.parametrize("line", LINES)
def test_patch_imports_exist_in_this_package(line):
    text = PATCHES[line].read_text()
    imports = re.findall(r"^\+\s*from (megatron_mtraining[\w.]*) import ([\w, ]+)$", text, flags=re.M)
    seen = set()
    for module, names in imports:
        mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(mod, name), f"{module}.{name} (imported by the patch) does not exist"
            seen.add(name)
    model = ({"mtraining_model_config"} if compat.parse_version(line) >= (0, 19, 0)
             else {"mtraining_layer_spec", "install_mtraining_rope"})
    if compat.parse_version(line) >= (0, 18, 0):  # forward_step builds the PackedSeqParams from get_batch's offsets
        model.add("mtraining_packed_seq_params")
    assert seen == {"mtraining_config_file", "mtraining_argument_error", "get_batch_on_this_cp_rank_mtraining"} | model


@pytest.mark.parametrize("line", LINES)
def test_patch_applies_to_its_own_preimage(tmp_path, line):
    """A cheap offline stand-in for the real check below (catches a hand-edited, broken diff)."""
    _write_preimage(PATCHES[line], tmp_path)
    r = subprocess.run(["git", "apply", "--check", str(PATCHES[line])], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _patch_provider(line: str):
    """The patch's ``add_cp_attention_args`` (and its ``--mtraining-config`` type), compiled from
    the added lines of pretrain_gpt.py, without ModelOpt."""
    body = [ln for _, b in _parse_patch(PATCHES[line].read_text())["pretrain_gpt.py"] for ln in b]
    added = [ln[1:] for ln in body if ln.startswith("+")]
    start = added.index("def add_cp_attention_args(parser):")
    end = next(i for i, ln in enumerate(added) if "return mtraining_config_file(path)" in ln) + 1
    ns: dict = {"has_nvidia_modelopt": False}
    exec(compile("\n".join(added[start:end]) + "\n", f"{PATCHES[line].name}:pretrain_gpt.py", "exec"), ns)
    return ns["add_cp_attention_args"]


@pytest.mark.parametrize("line", LINES)
def test_patch_flags_match_the_glue(line, tmp_path, capsys):
    provider = _patch_provider(line)
    ours = provider(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    glue = megatron_lm.add_mtraining_args(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    for dest in ("cp_attention", "mtraining_config"):
        a = next(x for x in ours._actions if x.dest == dest)
        b = next(x for x in glue._actions if x.dest == dest)
        assert (a.option_strings, list(a.choices or []), a.default) == (b.option_strings, list(b.choices or []),
                                                                         b.default)
    assert ours.parse_args([]).cp_attention == "te"
    args = ours.parse_args(["--cp-attention", "mtraining", "--mtraining-config", str(ROOT / "configs/demo.yaml")])
    assert megatron_lm.mtraining_enabled(args)
    bad = tmp_path / "bad.yaml"
    bad.write_text("implementation: striped\npatern: dense\n")
    with pytest.raises(SystemExit) as ei:  # the file is checked while parsing; the error names the key
        ours.parse_args(["--cp-attention", "mtraining", "--mtraining-config", str(bad)])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "argument --mtraining-config: mtraining config" in err and "patern" in err
    with pytest.raises(SystemExit):
        ours.parse_args(["--cp-attention", "flash"])


def test_compat_lines_and_versions():
    assert compat.megatron_lm_line("core_v0.16.1") == "0.16"
    assert compat.megatron_lm_line("core_v0.17.1-3-g0123abc") == "0.17"
    assert compat.megatron_lm_line("core_v0.19.0") == "0.19"
    assert compat.megatron_lm_line("core_v0.18.0") == "0.18"
    assert compat.megatron_lm_line("core_v0.20.0") == "0.20"  # the main line's patch, once main is tagged
    for tag in ("core_v0.21.0", "core_v0.15.0rc7-2333-gd98e8a64dd", "v1.0", ""):
        with pytest.raises(ValueError, match="is not supported; supported tags: core_v0.16.0, core_v0.16.1"):
            compat.megatron_lm_line(tag)
    assert compat.parse_version("0.17.0rc0") == (0, 17, 0)
    assert compat.check_megatron_core_version("0.16.1") == (0, 16, 1)
    assert compat.check_megatron_core_version("0.19.2") == (0, 19, 2)
    for bad in ("0.16.0", "0.20.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=r"needs megatron-core>=0\.16\.1,<0\.20"):
            compat.check_megatron_core_version(bad)
    assert compat.check_megatron_core_version() >= (0, 16, 1)  # the installed one is supported


def test_layer_spec_refuses_an_unsupported_megatron_core(monkeypatch):
    from megatron.core import package_info
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mtraining.megatron.spec import replace_core_attention

    base = get_gpt_layer_local_spec()
    assert replace_core_attention(base) is not base  # the installed version is fine
    monkeypatch.setattr(package_info, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.20\.0 is not supported .*>=0\.16\.1,<0\.20"):
        replace_core_attention(base)   # an installed 0.20 (none is released yet)
    monkeypatch.setattr(compat, "_imported_from_megatron_lm_checkout", lambda: True)
    assert replace_core_attention(base) is not base  # the 0.20 of a Megatron-LM main checkout
    monkeypatch.setattr(package_info, "__version__", "0.21.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.21\.0 is not supported"):
        replace_core_attention(base)


def test_pyproject_range_matches_compat():
    text = (ROOT / "pyproject.toml").read_text()
    lo, hi = ".".join(map(str, compat.MEGATRON_CORE_MIN)), ".".join(map(str, compat.MEGATRON_CORE_BELOW[:2]))
    assert f'"megatron-core>={lo},<{hi}"' in text


# ------------------------------------------------------------------ the glue
def test_args_provider_composes_with_an_existing_provider(tmp_path):
    calls = []

    def modelopt_like(parser):
        calls.append("modelopt")
        parser.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    parser = megatron_lm.mtraining_args_provider(modelopt_like)(argparse.ArgumentParser())
    assert calls == ["modelopt"]
    args = parser.parse_args(["--export-te-mcore-model"])
    assert args.cp_attention == "te" and args.mtraining_config is None  # default: Megatron-LM unchanged
    args = parser.parse_args(["--cp-attention", "mtraining", "--mtraining-config", str(ROOT / "configs/demo.yaml")])
    assert megatron_lm.mtraining_enabled(args)
    assert not megatron_lm.mtraining_enabled(SimpleNamespace())  # parsers without the flag
    plain = megatron_lm.mtraining_args_provider(None)(argparse.ArgumentParser())
    assert plain.parse_args([]).cp_attention == "te"


def _megatron_lm_parser() -> argparse.ArgumentParser:
    """The Megatron-LM flags the MTraining rules read, with Megatron-LM's defaults (attention dropout
    0.1, the dataloader attention mask on)."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--encoder-seq-length", type=int)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--kv-channels", type=int)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+")
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")
    p.add_argument("--reset-attention-mask", action="store_true")
    p.add_argument("--reset-position-ids", action="store_true")
    p.add_argument("--eod-mask-loss", action="store_true")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--position-embedding-type", default="learned_absolute")
    p.add_argument("--bf16", action="store_true")
    return p


#: vertical-slash with columns: out_of_ring (no document mask in the out-of-ring column phase)
OUT_OF_RING = os.path.join(tempfile.mkdtemp(prefix="mtraining-test-patch-"), "out_of_ring.yaml")
Path(OUT_OF_RING).write_text("implementation: striped\npattern: vertical_slash\ncolumns: out_of_ring\n")
OK_FLAGS = ["--seq-length", "256", "--attention-dropout", "0.0", "--no-create-attention-mask-in-dataloader"]


@pytest.mark.parametrize("line", LINES)
@pytest.mark.parametrize("argv, needle", [
    (["--mtraining-config", "configs/demo.yaml"] + OK_FLAGS, "--mtraining-config needs --cp-attention mtraining"),
    (["--cp-attention", "mtraining", "--seq-length", "256", "--no-create-attention-mask-in-dataloader"],
     "--attention-dropout 0.1"),
    (["--cp-attention", "mtraining", "--seq-length", "256", "--attention-dropout", "0.0"],
     "--no-create-attention-mask-in-dataloader"),
    (["--cp-attention", "mtraining", "--reset-attention-mask", "--mtraining-config", OUT_OF_RING] + OK_FLAGS,
     "--reset-attention-mask: packed documents (document masks) with pattern: vertical_slash need columns: in_ring"),
    (["--cp-attention", "mtraining", "--reset-position-ids", "--pipeline-model-parallel-size", "2"] + OK_FLAGS,
     "--reset-position-ids (packed documents) with --pipeline-model-parallel-size > 1 is not supported"),
    (["--cp-attention", "mtraining", "--context-parallel-size", "2", "--encoder-seq-length", "200",
      "--attention-dropout", "0.0", "--no-create-attention-mask-in-dataloader"], "cannot split a sequence of 200"),
])
def test_patch_checks_the_flags_while_parsing(line, argv, needle, capsys):
    """Every line's patch (0.16 to 0.18 as well as 0.19) refuses these flags while the command line is
    parsed, as an argparse error naming the flag (before: on 0.16 to 0.18 a traceback at model
    building after Megatron-LM's initialisation; --mtraining-config without --cp-attention mtraining
    was ignored)."""
    parser = _patch_provider(line)(_megatron_lm_parser())
    with pytest.raises(SystemExit) as ei:
        parser.parse_args(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "pretrain_gpt.py: error: " in err and needle in err, err


@pytest.mark.parametrize("line", LINES)
def test_patch_parse_time_check_passes_a_valid_command_line(line, monkeypatch, tmp_path, capsys):
    # negative control: valid flags parse (te path and mtraining path), and a kernel backend the
    # device cannot run is refused on the mtraining path only
    parser = _patch_provider(line)(_megatron_lm_parser())
    assert parser.parse_args([]).cp_attention == "te"
    args = parser.parse_args(["--cp-attention", "mtraining", "--mtraining-config", str(ROOT / "configs/demo.yaml")]
                             + OK_FLAGS)
    assert megatron_lm.mtraining_enabled(args)
    args = parser.parse_args(["--cp-attention", "mtraining", "--mtraining-config", str(ROOT / "configs/demo_sparse.yaml"),
                              "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"] + OK_FLAGS)
    assert args.reset_attention_mask and args.reset_position_ids  # packed documents: dense and vertical-slash
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    fa4 = tmp_path / "fa4.yaml"
    fa4.write_text("kernel_backend: fa4\n")
    with pytest.raises(SystemExit):
        parser.parse_args(["--cp-attention", "mtraining", "--mtraining-config", str(fa4), "--bf16"] + OK_FLAGS)
    assert "'kernel_backend' 'fa4' on this cpu run" in capsys.readouterr().err


def test_bad_config_is_an_argparse_error_at_parse_time(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("implementation: striped\npatern: dense\n")
    parser = megatron_lm.add_mtraining_args(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit) as ei:
        parser.parse_args(["--cp-attention", "mtraining", "--mtraining-config", str(bad)])
    assert ei.value.code == 2
    assert "argument --mtraining-config: mtraining config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--cp-attention", "flash"])


def _mlm_args(**kw):
    base = dict(cp_attention="mtraining", mtraining_config=str(ROOT / "configs/demo.yaml"),
                context_parallel_size=2, hierarchical_context_parallel_sizes=None, seq_length=4096,
                reset_attention_mask=False, reset_position_ids=False,
                attention_dropout=0.0, create_attention_mask_in_dataloader=False,
                position_embedding_type="rope", multi_latent_attention=False, mtp_num_layers=None,
                hybrid_context_parallel=False, sft=False, use_legacy_models=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_glue_layout_config_and_plan():
    from megatron_mtraining.config import load_mtraining_config
    from megatron_mtraining.plan import CPPlan

    args = _mlm_args()
    lay = megatron_lm.mtraining_layout(args)
    assert (lay.kind, lay.cp_size, lay.granularity) == ("striped", 2, 64)
    assert megatron_lm.mtraining_config_from_args(args) == load_mtraining_config(ROOT / "configs/demo.yaml")
    zz = _mlm_args(mtraining_config=None, context_parallel_size=4)
    assert megatron_lm.mtraining_layout(zz).kind == "striped"  # no file: defaults
    one = _mlm_args(context_parallel_size=1)
    plan = megatron_lm.mtraining_plan(one)            # no process group: CP size 1
    assert isinstance(plan, CPPlan) and plan.layout == megatron_lm.mtraining_layout(one)
    assert megatron_lm.mtraining_plan(one) is plan   # one plan per config and CP group
    with pytest.raises(ValueError, match="--context-parallel-size 2 but the CP group has 1 ranks"):
        megatron_lm.mtraining_plan(args)


@pytest.mark.parametrize("kw, msg", [
    (dict(attention_dropout=0.1), "--attention-dropout 0.1"),
    (dict(create_attention_mask_in_dataloader=True), "--no-create-attention-mask-in-dataloader"),
    (dict(position_embedding_type="mrope"), "--position-embedding-type mrope"),
    (dict(mtp_num_layers=1), "--mtp-num-layers"),
    (dict(multi_latent_attention=True), "--multi-latent-attention"),
    (dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
    (dict(reset_attention_mask=True, mtraining_config=OUT_OF_RING), "--reset-attention-mask: packed documents"),
    (dict(dataloader_inter_document_masking=True, mtraining_config=OUT_OF_RING),
     "--dataloader-inter-document-masking: packed documents (document masks) with pattern: vertical_slash"),
    (dict(reset_position_ids=True, pipeline_model_parallel_size=2), "with --pipeline-model-parallel-size > 1"),
    (dict(dataloader_inter_document_masking=True, micro_batch_size=2, apply_rope_fusion=True,
          position_embedding_type="rope"),
     "--dataloader-inter-document-masking (RoPE positions restart at every document) with --micro-batch-size 2 "
     "needs --no-rope-fusion"),
    (dict(seq_length=4000), "'granularity': cannot split a sequence of 4000 tokens"),
    (dict(mtraining_config=str(ROOT / "configs/hierarchical.yaml"), context_parallel_size=4),
     "inner*outer = 8*4 != context-parallel size 4"),
    (dict(mtraining_config=str(ROOT / "configs/hierarchical.yaml"), context_parallel_size=32),
     "pass --hierarchical-context-parallel-sizes 8 4"),
    (dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]), "the run would use a flat ring"),
])
def test_glue_rejects_what_the_backend_cannot_serve(kw, msg):
    with pytest.raises(ValueError) as ei:
        megatron_lm.mtraining_layout(_mlm_args(**kw))
    assert msg in str(ei.value)


def test_glue_takes_sft_from_line_018_on(monkeypatch):
    """--sft (SFTDataset's THD offsets) goes through the MTraining split from Megatron-LM 0.18 on; on
    0.16/0.17 Megatron-Core's get_batch splits those batches itself, so the flag is refused there,
    naming the EOD-reset flags to use instead. The offsets count as documents (sparse: in-ring columns)."""
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 17, 1))
    with pytest.raises(ValueError, match=r"--sft .* needs Megatron-LM 0.18 or later.*--reset-attention-mask"):
        megatron_lm.mtraining_layout(_mlm_args(sft=True))
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 18, 2))
    assert megatron_lm.mtraining_layout(_mlm_args(sft=True)).kind == "striped"
    with pytest.raises(ValueError, match=r"--sft with --micro-batch-size > 1 needs Megatron-LM 0.19"):
        megatron_lm.mtraining_layout(_mlm_args(sft=True, micro_batch_size=2))
    monkeypatch.setattr(compat, "megatron_core_version", lambda: (0, 19, 2))
    assert megatron_lm.mtraining_layout(_mlm_args(sft=True, micro_batch_size=2)).kind == "striped"
    with pytest.raises(ValueError, match="--sft: packed documents"):
        megatron_lm.mtraining_layout(_mlm_args(sft=True, mtraining_config=OUT_OF_RING))


def test_glue_keeps_sparse_and_hierarchical_configs(capsys):
    """The plan carries every config feature: nothing is dropped on the way to the attention."""
    args = _mlm_args(mtraining_config=str(ROOT / "configs/demo_sparse.yaml"), context_parallel_size=1)
    plan = megatron_lm.mtraining_plan(args)
    assert plan.sparse and plan.pattern.recall == 0.9
    logged = capsys.readouterr().out              # the plan's log line, once (rank 0)
    assert "> MTraining CP attention: striped over CP=1 (granularity 64), pattern vertical_slash" in logged
    assert "layer policy: " in logged
    megatron_lm.mtraining_plan(args)
    assert "MTraining CP attention" not in capsys.readouterr().out
    args = _mlm_args(mtraining_config=str(ROOT / "configs/qwen2.5-3b-512k.yaml"), context_parallel_size=32,
                     seq_length=512 * 1024, hierarchical_context_parallel_sizes=[8, 4])
    cfg = megatron_lm.mtraining_config_from_args(args)
    assert cfg.implementation == "hierarchical" and cfg.hierarchical.sizes == (8, 4) and cfg.sparse
    # no config + Megatron's hierarchical sizes: the dense hierarchical ring, as in examples/pretrain_gpt.py
    cfg = megatron_lm.mtraining_config_from_args(_mlm_args(mtraining_config=None, context_parallel_size=4,
                                                           hierarchical_context_parallel_sizes=[2, 2]))
    assert cfg.implementation == "hierarchical" and cfg.hierarchical.sizes == (2, 2)


# ------------------------------------------------------------------ against a real checkout


def test_model_config_route_for_line_019():
    """Line 0.19's GPTModelConfig: the layer spec the builder would use goes through the glue's
    transform, and the pre-wrap hook reaches every model chunk (no Megatron-LM needed)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnBackend

    base = get_gpt_layer_local_spec()
    seen, hooked = [], []
    for given, want in ((base, base), (lambda cfg, vp_stage=None: (cfg, vp_stage), ("CFG", 3)),
                        (lambda cfg: cfg, "CFG")):
        cfg = SimpleNamespace(transformer_layer_spec=given, pre_wrap_hooks=[print], attention_backend=AttnBackend.auto)
        out = compat.gpt_model_config_with_mtraining(cfg, lambda s: seen.append(s) or "SPEC", hooked.append)
        assert out is cfg and cfg.transformer_layer_spec("CFG", vp_stage=3) == "SPEC" and seen[-1] == want
        assert cfg.pre_wrap_hooks[0] is print and cfg.pre_wrap_hooks[-1](["m0", "m1"]) == ["m0", "m1"]
    assert hooked == ["m0", "m1"] * 3
    cfg = SimpleNamespace(transformer_layer_spec=None, pre_wrap_hooks=[], attention_backend=AttnBackend.local)
    with pytest.raises(ValueError, match="--attention-backend local is not supported"):
        compat.gpt_model_config_with_mtraining(cfg, lambda s: s, lambda m: None)


def test_mtraining_model_config_checks_the_flags_first():
    cfg = SimpleNamespace(transformer_layer_spec=None, pre_wrap_hooks=[])
    with pytest.raises(ValueError, match="--mtp-num-layers is not supported"):
        megatron_lm.mtraining_model_config(cfg, _mlm_args(mtp_num_layers=1))
    assert cfg.pre_wrap_hooks == []


def test_glue_checks_each_command_line_not_a_cached_one(tmp_path):
    """The config is read once per file, but every rule is checked against the flags of each call: a
    call without documents or with more layers does not let a later call with documents (out_of_ring
    columns) or fewer layers through."""
    plain = _mlm_args(mtraining_config=OUT_OF_RING, context_parallel_size=1, seq_length=256)
    assert megatron_lm.mtraining_argument_error(plain) is None
    docs = _mlm_args(mtraining_config=OUT_OF_RING, context_parallel_size=1, seq_length=256,
                     dataloader_inter_document_masking=True)
    assert "--dataloader-inter-document-masking: packed documents" in megatron_lm.mtraining_argument_error(docs)
    cfg = tmp_path / "dense8.yaml"
    cfg.write_text("pattern: vertical_slash\ndense_layers: [8]\n")
    assert megatron_lm.mtraining_argument_error(_mlm_args(mtraining_config=str(cfg), context_parallel_size=1,
                                                          seq_length=256, num_layers=8)) is None
    err = megatron_lm.mtraining_argument_error(_mlm_args(mtraining_config=str(cfg), context_parallel_size=1,
                                                         seq_length=256, num_layers=4))
    assert err and "--num-layers 4: mtraining config 'dense_layers' names layer 8" in err


def test_glue_refuses_offsets_that_do_not_cover_the_micro_batch(capsys):
    """The data loader's THD offsets must cover every token of the micro-batch: offsets that end early
    (or no documents at all) would turn the rest into padding that attends to nothing while its loss
    counts; float offsets would be truncated. Both entry points refuse them (get_batch, forward_step)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    args = _mlm_args(context_parallel_size=1, seq_length=256, dataloader_inter_document_masking=True)
    tok = torch.randint(1, 50, (1, 256))

    def get_batch(cu, tokens=tok):
        batch = dict(tokens=tokens, labels=tokens.clone(), loss_mask=torch.ones(tokens.shape),
                     position_ids=torch.arange(tokens.shape[1]).expand_as(tokens).clone(), attention_mask=None,
                     cu_seqlens=cu)
        return megatron_lm.get_batch_on_this_cp_rank_mtraining(batch, args)

    for cu, msg in (([[0, 100]], "cu_seqlens ends at token 100 but the micro-batch holds 256 tokens"),
                    ([[0]], "cu_seqlens ends at token 0 but the micro-batch holds 256 tokens"),
                    ([[0, 300]], "ends at token 300")):
        with pytest.raises(ValueError, match=msg):
            get_batch(torch.tensor(cu, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be an integer tensor"):
        get_batch(torch.tensor([[0.0, 100.5, 256.0]]))
    # negative control: covering offsets, trailing copies of the end as Megatron-LM's collate leaves them
    out = get_batch(torch.tensor([[0, 10, 256, 256]], dtype=torch.int32))
    assert out["cu_seqlens"].tolist() == [[0, 10, 256, 256]]
    short = torch.tensor([0, 100], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=short, cu_seqlens_kv=short, max_seqlen_q=100,
                             max_seqlen_kv=100)
    with pytest.raises(ValueError, match="cu_seqlens ends at token 100 but the micro-batch holds 256 tokens"):
        megatron_lm.mtraining_packed_seq_params(params, tok, args)
    capsys.readouterr()


# ------------------------------------------------------------------ tools/check_patch.sh
def test_check_patch_script_usage_errors(tmp_path):
    r = subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage:" in r.stderr and "core_v0.16.1" in r.stderr
    r = subprocess.run(["bash", str(CHECK), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "a Megatron-LM checkout" in r.stdout
    r = subprocess.run(["bash", str(CHECK), str(tmp_path), str(tmp_path / "none.patch")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "patch not found" in r.stderr
    # a directory that is not there, or a file: the usage line and an error line saying which
    (tmp_path / "file").write_text("")
    for arg, rule in ((tmp_path / "none", "directory not found"), (tmp_path / "file", "not a directory")):
        r = subprocess.run(["bash", str(CHECK), str(arg)], capture_output=True, text=True, timeout=60)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and r.stderr.startswith("usage:"), r.stderr
        assert last.startswith(f"check_patch.sh: error: MEGATRON_LM_DIR {arg}: {rule}"), r.stderr


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                   cwd=cwd, check=True, capture_output=True, timeout=60)


def _tagged_repo(tmp_path: Path, files_of: str, tag: str | None) -> Path:
    """A git repository holding the preimage of the ``files_of`` patch, committed and tagged."""
    d = tmp_path / f"mlm-{files_of}-{tag}"
    d.mkdir()
    _write_preimage(PATCHES[files_of], d)
    for f in MEGATRON_LM_FILES:
        if not (d / f).exists():
            (d / f).write_text("\n")
    _git(d, "init", "-q")
    _git(d, "add", ".")
    _git(d, "commit", "-q", "-m", "x")
    if tag:
        _git(d, "tag", tag)
    return d


def _check(d: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK), str(d), *extra], capture_output=True, text=True, timeout=60)


def _write_package_info(d: Path, line: str) -> None:
    major, minor = line.split(".")
    (d / "megatron" / "core").mkdir(parents=True)
    (d / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = 0\n")


@pytest.mark.parametrize("line", LINES)
def test_check_patch_picks_the_patch_by_tag(tmp_path, line):
    tag = compat.MEGATRON_LM_LINES[line][-1]
    main = tag == "main"   # Megatron-LM main: an old tag, megatron-core 0.20 in the tree
    d = _tagged_repo(tmp_path, line, "core_v0.15.0rc7" if main else tag)
    if main:
        _write_package_info(d, line)
        _git(d, "add", ".")
        _git(d, "commit", "-qm", "package_info")
        tag = "core_v0.15.0rc7"
    r = _check(d)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"at {tag}" in r.stdout and f"patch: {PATCHES[line].name} (tested tags: " in r.stdout
    if main:
        assert f"megatron-core {line} in the tree (megatron/core/package_info.py): Megatron-LM main" in r.stdout
        assert compat.megatron_lm_tree_line(d) == line
    assert f"OK: {PATCHES[line].name} applies cleanly" in r.stdout
    subprocess.run(["git", "apply", str(PATCHES[line])], cwd=d, check=True, timeout=60)
    r = _check(d)  # the user already applied it
    assert r.returncode == 0 and f"APPLIED: {PATCHES[line].name} is already applied" in r.stdout, r.stdout
    _git(d, "commit", "-qam", "local change")
    r = _check(d)
    assert r.returncode == 0 and "APPLIED" in r.stdout, r.stdout
    assert main or f"1 commits past {tag}" in r.stdout, r.stdout


def test_check_patch_refuses_unsupported_tags(tmp_path):
    supported = " ".join(t for tags in compat.MEGATRON_LM_LINES.values() for t in tags)
    for tag in ("core_v0.21.0", "core_v0.15.0rc7", None):
        d = _tagged_repo(tmp_path, "0.19", tag)
        r = _check(d)
        assert r.returncode == 1, r.stdout
        assert f"is not supported; supported tags: {supported}" in r.stdout, r.stdout
    # an explicit patch is tried anyway (e.g. the 0.19 patch on a main checkout)
    r = _check(d, str(PATCHES["0.19"]))
    assert r.returncode == 0 and "OK: megatron-lm-core_v0.19.patch" in r.stdout, r.stdout
    # the wrong line's patch on a tagged checkout fails with git's message
    d = _tagged_repo(tmp_path, "0.16", "core_v0.16.1")
    r = _check(d, str(PATCHES["0.19"]))
    assert r.returncode == 1 and "FAIL: megatron-lm-core_v0.19.patch does not apply" in r.stdout, r.stdout


# ------------------------------------------------------------------ against a real checkout
@pytest.fixture(scope="module")
def megatron_lm_checkout(tmp_path_factory):
    """``(directory, line)`` of the Megatron-LM checkout under test: ``MEGATRON_LM_DIR``, or
    ``MEGATRON_LM_ARCHIVE`` (a ``git archive`` .tar/.tar.gz of a tag) extracted to a temp dir."""
    d = os.environ.get("MEGATRON_LM_DIR")
    archive = os.environ.get("MEGATRON_LM_ARCHIVE")
    if not d and not archive:
        pytest.skip("MEGATRON_LM_DIR / MEGATRON_LM_ARCHIVE not set (point one to a Megatron-LM checkout or "
                    f"archive at one of {', '.join(t for ts in compat.MEGATRON_LM_LINES.values() for t in ts)})")
    if not d:
        d = tmp_path_factory.mktemp("megatron-lm")
        with tarfile.open(archive) as tar:
            tar.extractall(d, filter="data")
        tops = [p for p in d.iterdir() if p.is_dir()]
        d = tops[0] if len(tops) == 1 and not (d / "pretrain_gpt.py").exists() else d
    d = Path(d)
    r = subprocess.run(["git", "-C", str(d), "describe", "--tags"], capture_output=True, text=True, timeout=60)
    if (d / ".git").exists() and r.returncode == 0 and re.match(r"core_v\d+\.\d+", r.stdout):
        try:
            return d, compat.megatron_lm_line(r.stdout.strip())
        except ValueError:
            pass  # e.g. a main checkout, whose nearest tag is old: as without a tag
    tree = compat.megatron_lm_tree_line(d)  # megatron/core/package_info.py (main: 0.20, no tag)
    if tree is not None:
        return d, tree
    for line, patch in PATCHES.items():  # no usable tag and no package_info: the line whose patch fits
        for extra in ([], ["--reverse"]):
            if subprocess.run(["git", "apply", "--check", *extra, str(patch)], cwd=d, capture_output=True,
                              timeout=60).returncode == 0:
                return d, line
    pytest.fail(f"{d}: no patch applies (neither forwards nor reversed); not a supported Megatron-LM release")


def test_git_apply_check_on_megatron_lm_checkout(megatron_lm_checkout):
    d, line = megatron_lm_checkout
    r = subprocess.run(["git", "-C", str(d), "describe", "--tags"], capture_output=True, text=True, timeout=60)
    tagged = (d / ".git").exists() and r.stdout.startswith(tuple(compat.MEGATRON_LM_LINES[line]))
    r = _check(d, *([] if tagged else [str(PATCHES[line])]))
    print(r.stdout)
    assert r.returncode == 0 and ("OK:" in r.stdout or "APPLIED:" in r.stdout), r.stdout + r.stderr
    assert PATCHES[line].name in r.stdout


def _patched_copy(tmp_path: Path, d: Path, line: str) -> Path:
    """pretrain_gpt.py and gpt_builders.py of the checkout, patched, in a temp dir (the checkout
    itself is not modified; a checkout the user already patched is copied as it is). Put it before
    the checkout on PYTHONPATH."""
    out = tmp_path / "patched"
    out.mkdir()
    for f in (*MEGATRON_LM_FILES, "model_provider.py"):
        shutil.copy(d / f, out / f)
    already = subprocess.run(["git", "apply", "--check", "--reverse", str(PATCHES[line])], cwd=out,
                             capture_output=True, timeout=60).returncode == 0
    if not already:
        r = subprocess.run(["git", "apply", str(PATCHES[line])], cwd=out, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    return out


def _worker_env(patched: Path, d: Path | None) -> dict[str, str]:
    extra = os.pathsep.join([str(patched)] + ([str(d)] if d is not None else []) + [str(ROOT)] +
                            [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    # the ranks run on gloo on the CPU, also on a GPU machine (two ranks cannot share one GPU there)
    return {"PYTHONPATH": extra, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _require_megatron_training(env: dict[str, str], line: str) -> None:
    from tests.helpers.dist import worker_env

    # typing.override: as the worker does on Python 3.11 for line 0.19
    code = ("import typing; typing.override = getattr(typing, 'override', lambda f: f); "
            "import megatron.training.arguments, pretrain_gpt")
    probe = subprocess.run([sys.executable, "-c", code],
                           env=worker_env(env), capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.fail(f"Megatron-LM {line}'s megatron.training does not import: {probe.stderr[-2000:]}")


#: packed documents through the patch: EOD resets (Megatron-LM's three flags)
DOC_FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
#: the data loader's THD offsets (lines 0.19 on), two samples per micro-batch (0.19 flattens them)
THD_FLAGS = ["--dataloader-inter-document-masking", "--micro-batch-size", "2"]


#: vertical-slash budgets that drop attention inside the test's documents (DOC_LENGTHS, up to 170 tokens)
SPARSE_BUDGETS = "vertical_slash: {recall: 0.9, sink_tokens: 16, local_blocks: 1, max_vertical: 32, max_slash: 2}\n"
#: the hierarchical ring at CP=4: Megatron's inner/outer CP groups of 2 x 2
HIER_FLAGS = ["--hierarchical-context-parallel-sizes", "2", "2"]


def _hierarchical_cases(tmp_path: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    """(CP=4 cases on the hierarchical ring, [(CP=4 case, the CP=1 case it must equal)]): dense without
    and with documents, and the vertical-slash pattern with documents (one launch)."""
    hier, hier_sparse = str(tmp_path / "hier.yaml"), str(tmp_path / "hier_sparse.yaml")
    (tmp_path / "hier.yaml").write_text("implementation: hierarchical\ngranularity: 64\n"
                                        "hierarchical: {inner: 2, outer: 2}\n")
    (tmp_path / "hier_sparse.yaml").write_text("implementation: hierarchical\ngranularity: 64\n"
                                               "hierarchical: {inner: 2, outer: 2}\npattern: vertical_slash\n"
                                               + SPARSE_BUDGETS)
    cp4 = [dict(name="cp4_hier", config=hier, flags=HIER_FLAGS),
           dict(name="cp4_hier_docs", config=hier, flags=HIER_FLAGS + DOC_FLAGS, data="docs"),
           dict(name="cp4_hier_docs_sparse", config=hier_sparse, flags=HIER_FLAGS + DOC_FLAGS, data="docs")]
    pairs = [("cp4_hier", "cp1"), ("cp4_hier_docs", "cp1_docs"), ("cp4_hier_docs_sparse", "cp1_docs_sparse")]
    return cp4, pairs


def _patch_cases(tmp_path: Path, line: str) -> tuple[list[dict], list[dict], list[tuple[str, str]]]:
    """(CP=1 cases, CP=2 cases, [(CP=2 case, the CP=1 case it must equal)]); one launch per CP size."""
    demo, sparse = str(ROOT / "configs/demo.yaml"), str(tmp_path / "sparse.yaml")
    zigzag = str(tmp_path / "zigzag.yaml")
    (tmp_path / "zigzag.yaml").write_text("implementation: zigzag\n")
    # the vertical-slash pattern with documents (columns in the ring); budgets small enough that it drops
    # attention inside the documents (up to 170 tokens) at 512
    (tmp_path / "sparse.yaml").write_text("implementation: striped\ngranularity: 64\npattern: vertical_slash\n"
                                          + SPARSE_BUDGETS)
    cp1 = [dict(name="cp1", config=demo), dict(name="cp1_docs", config=demo, flags=DOC_FLAGS, data="docs"),
           dict(name="cp1_docs_sparse", config=sparse, flags=DOC_FLAGS, data="docs")]
    cp2 = [dict(name="cp2_striped", config=demo), dict(name="cp2_zigzag", config=zigzag),
           dict(name="cp2_docs_striped", config=demo, flags=DOC_FLAGS, data="docs"),
           dict(name="cp2_docs_zigzag", config=zigzag, flags=DOC_FLAGS, data="docs"),
           dict(name="cp2_docs_sparse", config=sparse, flags=DOC_FLAGS, data="docs"),
           # negative control: the same packed data without the flags (the documents are dropped)
           dict(name="cp2_docs_dropped", config=demo, flags=["--eod-mask-loss"], data="docs")]
    pairs = [("cp2_striped", "cp1"), ("cp2_zigzag", "cp1"), ("cp2_docs_striped", "cp1_docs"),
             ("cp2_docs_zigzag", "cp1_docs"), ("cp2_docs_sparse", "cp1_docs_sparse")]
    if compat.parse_version(line) >= (0, 19, 0):  # --dataloader-inter-document-masking: Megatron-LM 0.19 on
        cp1.append(dict(name="cp1_thd", config=demo, flags=THD_FLAGS, data="thd"))
        cp2 += [dict(name="cp2_thd_striped", config=demo, flags=THD_FLAGS, data="thd"),
                dict(name="cp2_thd_zigzag", config=zigzag, flags=THD_FLAGS, data="thd")]
        pairs += [("cp2_thd_striped", "cp1_thd"), ("cp2_thd_zigzag", "cp1_thd")]
    if compat.parse_version(line) >= (0, 18, 0):  # --sft: SFTDataset's THD offsets through get_batch, 0.18 on
        sparse_sft = dict(name="cp2_sft_sparse", config=sparse, flags=["--sft"], data="sft")
        cp1 += [dict(name="cp1_sft", config=demo, flags=["--sft"], data="sft"),
                dict(name="cp1_sft_sparse", config=sparse, flags=["--sft"], data="sft")]
        cp2 += [dict(name="cp2_sft_striped", config=demo, flags=["--sft"], data="sft"),
                dict(name="cp2_sft_zigzag", config=zigzag, flags=["--sft"], data="sft"), sparse_sft]
        pairs += [("cp2_sft_striped", "cp1_sft"), ("cp2_sft_zigzag", "cp1_sft"), ("cp2_sft_sparse", "cp1_sft_sparse")]
    return cp1, cp2, pairs


def _run_patched_cp2_vs_cp1(tmp_path: Path, d: Path, line: str, checkout_megatron: bool = True) -> None:
    """``checkout_megatron``: the checkout's ``megatron`` package first on the path; else only the
    patched top-level files come from the checkout and ``megatron.core``/``megatron.training`` are
    the installed megatron-core's (its wheels carry ``megatron/training`` from 0.17 on)."""
    import json

    import torch

    from tests.helpers.dist import run_torchrun

    patched = _patched_copy(tmp_path, d, line)
    env = _worker_env(patched, d if checkout_megatron else None)
    _require_megatron_training(env, line)
    worker = ROOT / "tests/helpers/megatron_lm_patch_worker.py"
    res = run_torchrun(worker, ["--check-te-path"], nproc=1, timeout=300, env=env)
    assert res.returncode == 0 and "TE_PATH_OK" in res.stdout, res.tail()
    out = tmp_path / "results"
    out.mkdir()
    cp1, cp2, pairs = _patch_cases(tmp_path, line)
    cp4, hier_pairs = _hierarchical_cases(tmp_path)
    pairs += hier_pairs
    for cp, cases, extra in ((1, cp1, []), (2, cp2, []), (4, cp4, ["--hierarchical", "2,2"])):
        res = run_torchrun(worker, ["--cases", json.dumps(cases), *extra], nproc=cp, timeout=600,
                           env={**env, "MTRAINING_RESULT_DIR": str(out)})
        assert res.returncode == 0, res.tail()
        print("\n".join(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")))
    results = {c["name"]: torch.load(out / f"{c['name']}.pt") for c in cp1 + cp2 + cp4}
    for name, ref_name in pairs:
        got, ref = results[name], results[ref_name]
        # fp32 model: the CP=2 ring and the CP=1 attention sum in different orders. Measured on
        # core_v0.16.1: ~7e-6 and ~1.5e-6; leaving out the layout RoPE hunk (negative control,
        # done by hand) gives 6.7 and 1.2.
        assert (got["per_token_loss"] - ref["per_token_loss"]).abs().max().item() < 1e-4, name
        rel = ((got["grads"] - ref["grads"]).norm() / ref["grads"].norm()).item()
        assert rel < 1e-4, (name, rel)
    # the documents change the result (else the checks above could not see them dropped): the same
    # packed data with the flags left out differs from the CP=1 run with documents
    dropped, docs = results["cp2_docs_dropped"], results["cp1_docs"]
    assert torch.equal(dropped["loss_mask"], docs["loss_mask"])  # --eod-mask-loss in both
    assert (dropped["per_token_loss"] - docs["per_token_loss"]).abs().max().item() > 1e-2
    assert not torch.equal(results["cp1_docs"]["per_token_loss"], results["cp1"]["per_token_loss"])
    # the pattern drops attention (else the sparse pairs could not tell it from the dense ring): its
    # budgets are below the documents' lengths. Measured on core_v0.16.1: 3.9 and 0.30 from the dense run.
    sparse, dense = results["cp1_docs_sparse"], results["cp1_docs"]
    assert (sparse["per_token_loss"] - dense["per_token_loss"]).abs().max().item() > 1e-1
    assert ((sparse["grads"] - dense["grads"]).norm() / dense["grads"].norm()).item() > 1e-2


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_patched_megatron_lm_cp2_matches_cp1_on_cpu(tmp_path, megatron_lm_checkout):
    """Every line; the checkout's own megatron.core comes first on the path."""
    d, line = megatron_lm_checkout
    _run_patched_cp2_vs_cp1(tmp_path, d, line)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_patched_megatron_lm_019_cp2_matches_cp1(tmp_path, megatron_lm_checkout):
    """Line 0.19 end to end where it is meant to run: Python >= 3.12 (no typing.override
    stand-in) with megatron-core 0.19 installed (the GPU machine; the ranks use gloo), whose
    ``megatron.core`` and ``megatron.training`` are used; only ``pretrain_gpt.py``,
    ``gpt_builders.py`` and ``model_provider.py`` come from the checkout."""
    d, line = megatron_lm_checkout
    if line != "0.19":
        pytest.skip(f"MEGATRON_LM_DIR is Megatron-LM {line}; this test is for line 0.19")
    assert sys.version_info >= (3, 12), "this test is for Python >= 3.12"
    assert compat.megatron_core_version() >= (0, 19, 0), "install megatron-core 0.19 for this test"
    _run_patched_cp2_vs_cp1(tmp_path, d, line, checkout_megatron=False)

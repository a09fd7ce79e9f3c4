"""The product documentation stays true to the code and free of development-history wording.

* The config reference table of ``docs/user_guide.md`` lists exactly the fields of
  :class:`megatron_mtraining.config.MTrainingConfig` and its nested dataclass sections (walked
  generically), each with its real default.
* ``docs/results.md`` is what ``tools/build_results_page.py`` generates from ``docs/results/*.json``.
* No tracked text file contains development-history wording (numbered work periods or runs,
  device-time accounting, issue numbers) or names the removed development-machine work-around.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from megatron_mtraining.config import MTrainingConfig

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "user_guide.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
SECTION = object()   # default marker of a nested dataclass section


# ----------------------------------------------------------------------------- config reference
def _dataclass_of(hint, default) -> type | None:
    """The dataclass type of a field, from its annotation (``Optional[...]`` unwrapped) or its default."""
    candidates = [hint] + list(typing.get_args(hint))
    for c in candidates:
        if isinstance(c, type) and dataclasses.is_dataclass(c):
            return c
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
        return type(default)
    return None


def config_fields(cls: type = MTrainingConfig, prefix: str = "") -> dict[str, object]:
    """Every key of the config tree as ``{"dotted.key": default}``; a nested dataclass is a section
    (its own key maps to :data:`SECTION`) followed by its fields."""
    hints = typing.get_type_hints(cls)
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("file_key", True):      # set through another key (dense_layers: auto)
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        key = prefix + f.name
        sub = _dataclass_of(hints.get(f.name), default)
        if sub is not None:
            out[key] = SECTION
            out.update(config_fields(sub, key + "."))
        else:
            out[key] = default
    return out


def documented_fields(text: str) -> dict[str, str]:
    """``{key: default cell}`` of the table between the config-reference markers."""
    assert START in text and END in text, f"{GUIDE.name}: config reference markers {START} / {END} not found"
    table = text[text.index(START) + len(START):text.index(END)]
    rows = {}
    for line in table.strip().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([\w.]+)`", cells[0])
        if not m:
            continue   # header and separator rows
        assert m.group(1) not in rows, f"{GUIDE.name}: config key {m.group(1)!r} documented twice"
        rows[m.group(1)] = cells[2]
    return rows


def _yaml_form(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def test_config_reference_lists_exactly_the_dataclass_fields():
    actual = config_fields()
    documented = documented_fields(GUIDE.read_text())
    missing = sorted(set(actual) - set(documented))
    unknown = sorted(set(documented) - set(actual))
    assert not missing and not unknown, (
        f"{GUIDE.relative_to(ROOT)} config reference is out of date: fields not documented {missing}; "
        f"documented keys that are not fields {unknown}")


def test_config_reference_defaults_match_the_dataclass():
    actual = config_fields()
    documented = documented_fields(GUIDE.read_text())
    wrong = []
    for key, default in actual.items():
        if key not in documented or default is SECTION:
            continue
        if documented[key] != f"`{_yaml_form(default)}`":
            wrong.append(f"{key}: documented {documented[key]}, dataclass default `{_yaml_form(default)}`")
    assert not wrong, f"{GUIDE.relative_to(ROOT)}: wrong defaults: " + "; ".join(wrong)


def test_config_walk_finds_nested_sections():
    # negative control for the walk itself: the nested sections and their leaves are found
    keys = config_fields()
    assert keys["vertical_slash"] is SECTION and keys["hierarchical"] is SECTION
    assert keys["vertical_slash.recall"] == 0.95 and keys["hierarchical.inner"] is None
    assert "implementation" in keys and "granularity" in keys


def test_documented_fields_rejects_a_table_with_an_extra_key():
    # negative control: a documented key that does not exist is reported
    text = GUIDE.read_text().replace(END, "| `no_such_key` | int | `1` | x | x |\n" + END)
    assert "no_such_key" in set(documented_fields(text)) - set(config_fields())


# ----------------------------------------------------------------------------- results page
def test_results_page_is_generated_from_the_records():
    """``--check``: the page is what the records give, and every table number of a record with raw files
    is found in (or recomputed from) those files (``unverified_numbers``)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "build_results_page.py"), "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_record_that_is_not_one_is_a_named_error(tmp_path):
    from tools import build_results_page as page

    for text, needle in (("", "01_x.json: not JSON"), ("[1, 2]", "01_x.json: a record is a JSON object, got list"),
                         ("{}", "01_x.json: missing required key")):
        (tmp_path / "01_x.json").write_text(text)
        with pytest.raises(ValueError, match=re.escape(needle)):
            page.load_records(tmp_path)


def _records():
    from tools import build_results_page as page

    return page, {r["id"]: r for r in page.load_records()}


def test_a_number_that_is_not_in_the_raw_files_is_reported():
    # negative control: one changed cell of a checked record is found
    import copy

    page, records = _records()
    rec = copy.deepcopy(records["dense_fa4"])
    row = rec["tables"][0]["rows"][0]
    j = next(i for i, c in enumerate(row) if isinstance(c, float))
    row[j] = round(row[j] * 1.37 + 0.123, 3)
    assert page.unverified_numbers(rec) == [f"{rec['tables'][0]['title']} / {rec['tables'][0]['columns'][j]}: {row[j]}"]


def test_records_without_raw_files_are_marked_and_kept_out_of_the_headlines(tmp_path):
    page, records = _records()
    unchecked = sorted(rid for rid, r in records.items() if not r["raw_files"])
    assert unchecked == ["end_to_end", "imbalance_gpu", "ring_glue_dkdv"]
    assert all(records[rid]["reproducible"] is False for rid in unchecked)
    readme = (ROOT / "README.md").read_text()
    # none of them is linked, and their headline claims (record 40: 2.31× end to end at 256K) are not made
    assert not any(f"results.md#{a})" in readme for a in ("end-to-end", "imbalance-gpu", "ring-glue-dkdv"))
    assert not any("2.31×" in line and ("256K" in line or "end to end" in line) for line in readme.splitlines())
    assert "2.2–2.7× faster than zigzag" not in readme
    assert "Not reproducible from this repository" in (ROOT / "docs" / "results.md").read_text()
    # negative control: a record without raw files that does not say so is refused
    bad = dict(records["end_to_end"])
    del bad["reproducible"]
    (tmp_path / "40_x.json").write_text(__import__("json").dumps(bad))
    with pytest.raises(ValueError, match="reproducible"):
        page.load_records(tmp_path)


# ----------------------------------------------------------------------------- wording
HISTORY_PATTERNS = [
    (r"\bsession ?[0-9]", "numbered work period"),
    (r"\bwork period", "work period"),
    (r"\bcalls? [0-9]+\b", "numbered run or call"),
    (r"\bissue ?#?[0-9]+", "issue number"),
    (r"(?<!PR )(?<![\w/.-])#[0-9]{1,4}\b(?![\w-])", "issue number"),
    (r"\bdevice[- ](tool|calls?|minutes?)\b", "device accounting"),
    (r"\bdevice[-]minutes\b", "device accounting"),
    (r"\bGPU[- ]minutes?\b", "GPU-time accounting"),
    (r"\bdevice_bundle\b", "development-machine work-around"),
    (r"\bcarry \[", "file-moving step"),
    (r"\bthis commit\b|\blater commits\b|\buncommitted\b", "lab-notebook commit reference"),
    (r"\blibrary of (?:commit )?[0-9a-f]{7}\b|\bcopied here unchanged\b", "lab-notebook wording"),
]
_WORDING = re.compile("|".join(f"(?:{p})" for p, _ in HISTORY_PATTERNS), re.IGNORECASE)
_TEXT_SUFFIXES = {".py", ".md", ".sh", ".sbatch", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".patch", ""}
_SKIP_DIRS = ("docs/results/raw/",)   # raw run output is kept as the runs wrote it


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e})")
    files = []
    for name in out.decode().split("\0"):
        if not name or name.startswith(_SKIP_DIRS):
            continue
        p = ROOT / name
        if p.suffix in _TEXT_SUFFIXES or p.name == "Makefile":
            files.append(p)
    return files


def find_history_wording(paths, root: Path = ROOT) -> list[str]:
    """``file:line: text`` for every line that matches a development-history pattern."""
    hits = []
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if _WORDING.search(line):
                hits.append(f"{p.relative_to(root)}:{i}: {line.strip()[:160]}")
    return hits


def test_no_development_history_wording():
    hits = [h for h in find_history_wording(_tracked_text_files()) if not h.startswith("tests/unit/test_docs.py:")]
    assert not hits, "development-history wording in tracked files:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", [
    # assembled here so that the repository's own text never contains these phrases
    "measured in session" + " 5 on the H200", "see call" + " 9's log", "fixes issue" + " #18", "as in issue" + " 11",
    "used 26.3 device" + "-minutes", "7.4 GPU" + " minutes", "the device" + " tool kind", "one work" + " period",
    "carry [data/x] first", "examples/long_context/device_bundle.sh pack",
    "dense, this" + " commit", "with the library of" + " cb2eb13", "its outputs were copied here" + " unchanged",
    "with the changes un" + "committed", "removed in later" + " commits",
])
def test_wording_patterns_catch_history(tmp_path, line):
    # negative controls: each kind of wording is found
    f = tmp_path / "x.md"
    f.write_text("fine line\n" + line + "\n")
    assert find_history_wording([f], root=tmp_path) == [f"x.md:2: {line}"]


@pytest.mark.parametrize("line", [
    "calls the kernel 3 times", "the session's process group", "#!/usr/bin/env bash", "color #fff",
    "a ring of 8 GPUs", "issue a warning", "Megatron-LM PR #7513", "the most device time", "GPU memory", "`recall: 0.9`",
    "the library measured is that of commit 32ee7b4", "committed as", "the MTraining library",
])
def test_wording_patterns_allow_product_text(tmp_path, line):
    f = tmp_path / "x.md"
    f.write_text(line + "\n")
    assert find_history_wording([f], root=tmp_path) == []


# ----------------------------------------------------------------------------- references
_DOC_PATH = re.compile(r"(?<![\w/.-])(docs/[\w/.-]+\.(?:md|png|jsonl|json|npz))\b")
_MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def find_dangling_references(paths, root: Path = ROOT) -> list[str]:
    """``file:line: path`` for every ``docs/...`` path named in a text file, and every relative
    Markdown link, that does not exist in the repository."""
    hits = []
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            missing = [m.group(1) for m in _DOC_PATH.finditer(line) if not (root / m.group(1)).exists()]
            if p.suffix == ".md":
                missing += [t for t in (m.group(1) for m in _MD_LINK.finditer(line))
                            if "://" not in t and not t.startswith("mailto:") and not (p.parent / t).exists()]
            for target in dict.fromkeys(missing):
                hits.append(f"{p.relative_to(root)}:{i}: {target}")
    return hits


def test_referenced_docs_exist():
    files = [p for p in _tracked_text_files() if p != Path(__file__).resolve()]
    hits = find_dangling_references(files)
    assert not hits, "references to files that are not in the repository:\n" + "\n".join(hits)


def test_dangling_reference_is_found(tmp_path):
    # negative control
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("x\n")
    f = tmp_path / "README.md"
    f.write_text("see docs/a.md and docs/gone.md, [a](docs/a.md#x), [b](docs/b.md), [w](https://x.org/y)\n")
    assert find_dangling_references([f], root=tmp_path) == ["README.md:1: docs/gone.md", "README.md:1: docs/b.md"]


# ----------------------------------------------------------------------------- repository paths
_TOP_DIRS = ("megatron_mtraining", "tools", "configs", "examples", "patches", "tests", "docs")
_PACKAGE_DIRS = ("layout", "patterns", "ops", "ring", "megatron", "training", "bench", "distributed", "data")
_REPO_PATH = re.compile(r"(?<![\w/.$~<-])((?:%s)/[\w./-]*[\w-])(.?)" % "|".join(_TOP_DIRS + _PACKAGE_DIRS))
_CONFIG_ARG = re.compile(r"(?:--mtraining-config[ =]|\bCONFIG=)([\w.-][\w./-]*\.ya?ml)\b")
_USER_DOCS = ("README.md", "tests/README.md", "docs/*.md")


def find_missing_repo_paths(paths, root: Path = ROOT) -> list[str]:
    """``file:line: path`` for every repository path named in the text that does not exist.

    A path is one that starts with a top-level folder of the repository (``tools/...``,
    ``configs/...``) or, for ``.py`` files, with a package folder (``ops/...`` is
    ``megatron_mtraining/ops/...``). It exists if it is a file or folder, or the start of the names of
    some (an output prefix such as ``--out docs/results/raw/x``). A path followed by ``<`` or ``*``
    is a pattern: something must match it."""
    hits = []
    for p in paths:
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            for m in _REPO_PATH.finditer(line):
                path, after = m.group(1).rstrip("."), m.group(2)
                first = path.split("/")[0]
                if first in _PACKAGE_DIRS:
                    if not path.endswith(".py"):
                        continue           # e.g. Megatron-LM's own megatron/core, or user data/ folders
                    base = root / "megatron_mtraining"
                else:
                    base = root
                target = base / path
                parent, stem = target.parent, target.name
                found = target.exists() or (parent.is_dir() and any(c.name.startswith(stem) for c in parent.iterdir()))
                if not found and after not in ("<", "*"):
                    hits.append(f"{p.relative_to(root)}:{i}: {path}")
                elif not found:
                    hits.append(f"{p.relative_to(root)}:{i}: {path}{after}... (matches nothing)")
            for m in _CONFIG_ARG.finditer(line):      # a config file given to a command: relative to the root
                if "/" not in m.group(1) and not (root / m.group(1)).exists():
                    hits.append(f"{p.relative_to(root)}:{i}: {m.group(1)}")
    return hits


def test_repository_paths_named_in_the_docs_exist():
    files = [f for pattern in _USER_DOCS for f in sorted(ROOT.glob(pattern))]
    assert len(files) >= 5
    hits = find_missing_repo_paths(files)
    assert not hits, "paths named in the documentation that are not in the repository:\n" + "\n".join(hits)


def test_missing_repository_path_is_found(tmp_path):
    # negative control: the design page's former reference and a config that is not in the repository
    (tmp_path / "megatron_mtraining" / "patterns" / "triton").mkdir(parents=True)
    (tmp_path / "megatron_mtraining" / "patterns" / "triton" / "estimator.py").write_text("")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text("")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "x.py").write_text("")
    f = tmp_path / "x.md"
    f.write_text("`ops/triton/estimator.py` and `patterns/triton/estimator.py`\n"
                 "configs/a.yaml, configs/r098_docprobes.yaml, configs/a*.yaml, the checkout's megatron/core\n"
                 "python tools/x.py --mtraining-config r098_docprobes.yaml --mtraining-config /tmp/x.yaml\n")
    assert find_missing_repo_paths([f], root=tmp_path) == ["x.md:1: ops/triton/estimator.py",
                                                           "x.md:2: configs/r098_docprobes.yaml",
                                                           "x.md:3: r098_docprobes.yaml"]


def test_support_matrix_cells_are_short():
    """The README's support matrix stays a matrix: details and numbers live in the user guide and the
    results page, which its cells link to (a cell had grown to 1,430 characters)."""
    text = (ROOT / "README.md").read_text()
    matrix = text[text.index("## Support matrix"):text.index("Not supported")]
    rows = [ln for ln in matrix.splitlines() if ln.startswith("| ") and not ln.startswith("| |")]
    assert len(rows) >= 10
    long = [ln.split("|")[1].strip() for ln in rows if max(len(c) for c in ln.split("|")) > 400]
    assert not long, f"support matrix cells over 400 characters: {long}"

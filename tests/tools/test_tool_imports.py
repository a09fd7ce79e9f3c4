"""Tools stand on the package: the shared modules stay below ring/megatron/training, and no tool edits
sys.path (the trainer is the package megatron_mtraining.training)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINER_LOADERS: set = set()


def sys_path_edits(source: str) -> list[int]:
    """Line numbers of ``sys.path.<insert|append|extend>(...)`` calls and ``sys.path`` assignments."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Attribute) and t.attr == "path":
                    target = t
        if (isinstance(target, ast.Attribute) and target.attr == "path" and isinstance(target.value, ast.Name)
                and target.value.id == "sys"):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_finds_sys_path_edits():          # negative control of the check below
    assert sys_path_edits("import sys\nsys.path.insert(0, 'x')\nsys.path += ['y']\nsys.path.append('z')\n") == [2, 3, 4]
    assert sys_path_edits("import sys\nprint(sys.path)\n") == []


def test_tools_do_not_edit_sys_path():
    found = {p.name: sys_path_edits(p.read_text()) for p in sorted((REPO / "tools").glob("*.py"))}
    assert {name: lines for name, lines in found.items() if lines and name not in TRAINER_LOADERS} == {}


def test_shared_modules_import_nothing_above_the_kernels():
    code = ("import sys, megatron_mtraining.bench, megatron_mtraining.patterns.io, megatron_mtraining.patterns.synthetic, "
            "megatron_mtraining.data.corpus\n"
            "bad = ('megatron_mtraining.ring', 'megatron_mtraining.megatron', 'megatron_mtraining.training', "
            "'megatron.core', 'matplotlib')\n"
            "print(sorted(m for m in sys.modules if m.startswith(bad)))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_pattern_modules_import_no_kernels_or_ring():
    for name in ("io.py", "synthetic.py"):
        tree = ast.parse((REPO / "megatron_mtraining" / "patterns" / name).read_text())
        mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in mods if m.lstrip(".").startswith(("ops", "ring")) or ".ops" in m or ".ring" in m], name

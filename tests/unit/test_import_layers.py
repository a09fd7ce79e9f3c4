"""The package's import graph (lazy imports inside functions included) is acyclic and points one way:

    common, layout, distributed (base utilities) -> patterns -> ops -> bench -> ring
    -> config / plan -> megatron -> training -> cli

A unit (top-level subpackage or module of ``megatron_mtraining``) may import units of a lower layer
or of its own; ``bench`` (benchmark utilities) may import nothing above ``ops``.
"""

import ast
import os
import textwrap

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "megatron_mtraining")

LAYERS = [
    ("common", "layout", "distributed"),
    ("patterns",),
    ("ops",),
    ("bench",),
    ("ring",),
    ("config", "plan", "layer_policy"),
    ("megatron",),
    ("training",),
    ("cli", "__main__"),
]
RANK = {unit: i for i, names in enumerate(LAYERS) for unit in names}


def _unit(modpath: str, pkg: str):
    parts = modpath.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == pkg else None


def import_edges(root: str) -> dict:
    """``{unit: {(imported unit, file), ...}}`` over every module under ``root`` (a package directory)."""
    pkg = os.path.basename(root)
    edges: dict = {}
    for dp, _, fs in os.walk(root):
        for f in fs:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dp, f)
            rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
            if rel.endswith(".__init__"):
                rel = rel[: -len(".__init__")]
            src = _unit(rel, pkg)
            if src is None:
                continue
            here = rel.split(".") if f == "__init__.py" else rel.split(".")[:-1]
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = here[: len(here) - node.level + 1]
                        mod = ".".join(base + ([node.module] if node.module else []))
                        names = [mod] + ([mod + "." + a.name for a in node.names] if not node.module else [])
                    else:
                        names = [node.module or ""]
                for name in names:
                    dst = _unit(name, pkg)
                    if dst is not None and dst != src:
                        edges.setdefault(src, set()).add((dst, os.path.relpath(path, os.path.dirname(root))))
    return edges


def cycles(edges: dict) -> list:
    graph = {u: {d for d, _ in targets} for u, targets in edges.items()}
    found, state = [], {}

    def visit(u, path):
        state[u] = "open"
        for v in sorted(graph.get(u, ())):
            if state.get(v) == "open":
                found.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path + [v])
        state[u] = "done"

    for u in sorted(graph):
        if u not in state:
            visit(u, [u])
    return found


def violations(edges: dict) -> list:
    bad = []
    for src, targets in sorted(edges.items()):
        for dst, path in sorted(targets):
            for unit in (src, dst):
                if unit not in RANK:
                    bad.append(f"{path}: unit {unit!r} has no layer: add it to LAYERS in {__file__}")
            if src in RANK and dst in RANK and RANK[dst] > RANK[src]:
                bad.append(f"{path}: {src} imports {dst}, a higher layer")
    return sorted(set(bad))


def test_import_graph_is_acyclic_and_points_down():
    edges = import_edges(ROOT)
    assert edges, "no imports found: wrong package path?"
    assert cycles(edges) == []
    assert violations(edges) == []


def test_checker_finds_upward_and_lazy_imports(tmp_path):
    """Negative control: a kernel module importing the ring inside a function, and a cycle."""
    pkg = tmp_path / "megatron_mtraining"
    for sub in ("ops", "ring"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "ops" / "k.py").write_text(textwrap.dedent("""
        def f():
            from ..ring import g
    """))
    (pkg / "ring" / "r.py").write_text("from megatron_mtraining.ops import k\n")
    edges = import_edges(str(pkg))
    assert cycles(edges) == [["ops", "ring", "ops"]]
    assert violations(edges) == ["megatron_mtraining/ops/k.py: ops imports ring, a higher layer"]


@pytest.mark.parametrize("unit", ["patterns", "ops", "ring"])
def test_named_layers_exist(unit):
    assert os.path.isdir(os.path.join(ROOT, unit))

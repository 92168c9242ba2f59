"""Imports point one way (DESIGN.md): no cycle among the project's modules, lazy imports included,
and the codec package stands alone."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dlrm", "compression", "data")


def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package __init__) for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def imports(name: str, path: Path, is_pkg: bool, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file (top level, functions, classes)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            # a module importing its own package's __init__ (the re-export idiom) is not an edge
            if t and t != name and not (name.startswith(t + ".") and t in known):
                found.add(t)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {m: imports(m, f, is_pkg, set(mods)) for m, (f, is_pkg) in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_the_project_modules_lazy_imports_included():
    g = graph()
    assert len(g) > 40 and "dlrm.embedding_comm.comm_ops" in g  # the walk sees the whole project
    assert cycles(g) == []


def test_the_cycle_finder_sees_a_cycle_made_by_a_lazy_import(tmp_path):
    # the shape the comm stats once had: a leaf importing, inside a function, what imports it
    (tmp_path / "dlrm").mkdir()
    (tmp_path / "dlrm" / "__init__.py").write_text("")
    (tmp_path / "dlrm" / "stats.py").write_text("def f():\n    from dlrm.sharded import X\n")
    (tmp_path / "dlrm" / "sharded.py").write_text("from .stats import f\nX = 1\n")
    for pkg in ("compression", "data"):
        (tmp_path / pkg).mkdir()
    assert cycles(graph(tmp_path)) == [["dlrm.sharded", "dlrm.stats"]]


def test_layers_point_one_way():
    g = graph()
    upward = sorted(
        f"{m} -> {t}"
        for m, ts in g.items()
        for t in ts
        if (m.startswith(("compression", "data")) and t.startswith("dlrm"))
        or (m.startswith("compression") and t.startswith("data"))
        or (m.startswith("data") and t.startswith("compression"))
        or (not m.startswith("dlrm.bench") and t.startswith("dlrm.bench"))
    )
    assert upward == []  # the trainer never imports its benchmarks, the codec never the trainer


def test_import_compression_loads_no_heavy_or_upward_dependency():
    code = (
        "import sys, compression, compression.policies, compression.cost_model; "
        "bad = [m for m in ('torchrec', 'dlrm', 'data', 'fbgemm_gpu', 'triton', 'omegaconf', 'hydra') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr

"""Imports point one way (docs/architecture.md, "The packages and their layers"): no cycle among the
project's modules, lazy imports included, and the codec package stands alone."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the codec folder compression/ imports as dlrm_compression (the top-level link of that name)
PACKAGES = ("dlrm", "dlrm_compression", "data")
# The trainer's packages, lowest first (docs/architecture.md): a module imports its own package and
# the packages below it, never one at its level or above. ``dlrm/__init__`` only installs the
# warning filters of ``dlrm.process.quiet`` (TRAINER_INIT).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dlrm.process",),
    ("dlrm.trainer", "dlrm.performance"),
    ("dlrm.embedding_comm",),
    ("dlrm.dense_comm",),
    ("dlrm.strategy",),
    ("dlrm.placement",),
    ("dlrm.telemetry", "dlrm.precision"),
    ("dlrm.train",),
    ("dlrm.bench",),
)


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
    assert (
        len(g) > 40 and "dlrm.embedding_comm.comm_ops" in g and "dlrm_compression.lossy" in g
    )  # the walk sees the whole project
    assert cycles(g) == []


def test_the_cycle_finder_sees_a_cycle_made_by_a_lazy_import(tmp_path):
    # the shape the comm stats once had: a leaf importing, inside a function, what imports it
    (tmp_path / "dlrm").mkdir()
    (tmp_path / "dlrm" / "__init__.py").write_text("")
    (tmp_path / "dlrm" / "stats.py").write_text("def f():\n    from dlrm.sharded import X\n")
    (tmp_path / "dlrm" / "sharded.py").write_text("from .stats import f\nX = 1\n")
    for pkg in ("dlrm_compression", "data"):
        (tmp_path / pkg).mkdir()
    assert cycles(graph(tmp_path)) == [["dlrm.sharded", "dlrm.stats"]]


def imports_where(upward: Callable[[str, str], bool]) -> list[str]:
    """Every import ``module -> target`` of the tree for which ``upward(module, target)``."""
    return sorted(f"{m} -> {t}" for m, ts in graph().items() for t in ts if upward(m, t))


def test_layers_point_one_way():
    upward = imports_where(
        lambda m, t: (
            (m.startswith(("dlrm_compression", "data")) and is_trainer(t))
            or (m.startswith("dlrm_compression") and t.startswith("data"))
            or (m.startswith("data") and t.startswith("dlrm_compression"))
            or (not m.startswith("dlrm.bench") and t.startswith("dlrm.bench"))
        )
    )
    assert upward == []  # the trainer never imports its benchmarks, the codec never the trainer


TRAINER_INIT = "dlrm"


def is_trainer(module: str) -> bool:
    return module == "dlrm" or module.startswith("dlrm.")


def layer_of(module: str) -> int:
    """The index in LAYERS of the deepest package that holds ``module``."""
    best, depth = -1, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and n.count(".") > depth:
                best, depth = i, n.count(".")
    return best


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2]) if module.startswith("dlrm.") else module


def test_every_trainer_module_has_a_layer():
    assert [m for m in graph() if is_trainer(m) and m != TRAINER_INIT and layer_of(m) < 0] == []


def test_the_trainer_packages_import_only_the_layers_below_them():
    upward = imports_where(
        lambda m, t: (
            m.startswith("dlrm.") and is_trainer(t) and package_of(m) != package_of(t) and layer_of(t) >= layer_of(m)
        )
    )
    assert upward == []


def test_the_layer_check_sees_a_feature_importing_the_entry_point():
    fake = {"dlrm.placement.hot_rows": {"dlrm.train"}, "dlrm.train": set()}
    assert layer_of("dlrm.placement.hot_rows") < layer_of("dlrm.train")
    assert any(layer_of(t) >= layer_of(m) for m, ts in fake.items() for t in ts)


def config_targets(root: Path = ROOT) -> dict[str, str]:
    """``file: _target_`` for every Hydra ``_target_`` in configs/ that names one of our modules."""
    out = {}
    for f in sorted((root / "configs").rglob("*.yaml")):
        for m in re.finditer(r"_target_:\s*([\w.]+)", f.read_text()):
            if m.group(1).split(".")[0] in PACKAGES:
                out[f"{f.relative_to(root)}: {m.group(1)}"] = m.group(1)
    return out


def test_config_targets_resolve_to_trainer_layers_never_to_the_benchmarks():
    known = set(graph())
    targets = config_targets()
    assert targets  # the sweep summary callback, at least
    for where, target in targets.items():
        module = target.rpartition(".")[0]
        assert module in known, where
        assert layer_of(module) <= layer_of("dlrm.train"), f"{where}: every training run would import it"


def assert_loads_none_of(modules: str, banned: tuple[str, ...]) -> None:
    """Importing ``modules`` (comma-separated) in a fresh interpreter loads none of ``banned``."""
    code = f"import sys, {modules}; bad = [m for m in {banned!r} if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_import_compression_loads_no_heavy_or_upward_dependency():
    banned = ("torchrec", "dlrm", "data", "fbgemm_gpu", "triton", "omegaconf", "hydra")
    assert_loads_none_of("dlrm_compression, dlrm_compression.policies", banned)


def test_the_performance_model_prices_without_torch():
    # a notebook prices a configuration with the cost model and the search alone (link timing aside)
    modules = "dlrm.performance.cost_model, dlrm.performance.network, dlrm.performance.search"
    assert_loads_none_of(modules, ("torch", "torchrec", "numpy", "dlrm_compression", "dlrm.trainer"))

"""The layer rule of docs/architecture.md, checked over every import of graphddp's code, lazy ones included.

passes ← runtime ← compiler ← ddp ← integrations ← tools: a module imports its own layer and the layers before it,
never one after it; nothing inside imports the ``graphddp`` facade (its ``__init__``); and no two modules import
each other, directly or around a cycle. Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("passes", "runtime", "compiler", "ddp", "integrations", "tools")
TOP_LEVEL = {"graphddp.__main__": "tools", "graphddp.ddp": "ddp", "graphddp.options": "ddp", "graphddp.torch_compat": "ddp", "graphddp._version": "passes"}
"""Modules at the top of ``graphddp/`` and their layer (``_version`` imports nothing: every layer may read it)."""


def module_files() -> dict[str, Path]:
    """Every module of the package, by its import name (``passes/`` ships as ``graphddp.passes``)."""
    files = {}
    for folder, package in ((ROOT / "graphddp", "graphddp"), (ROOT / "passes", "graphddp.passes")):
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def layer_of(module: str) -> str | None:
    """The layer of a module (None: the ``graphddp`` facade itself)."""
    if module == "graphddp":
        return None
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    second = module.split(".")[1]
    assert second in LAYERS, f"{module} lives in no layer: put it in a layer's folder, or list it in TOP_LEVEL"
    return second


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The graphddp modules ``module`` imports, anywhere in its body (functions included)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from .x import y`: y may be a module of its own
                candidate = f"{source}.{alias.name}"
                found.add(candidate if candidate in known else source)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in known and name != module}


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    files = module_files()
    g = nx.DiGraph()
    for module, path in files.items():
        g.add_node(module)
        g.add_edges_from((module, target) for target in imports_of(module, path, set(files)))
    return g


def test_every_module_sits_in_a_layer(graph: nx.DiGraph) -> None:
    assert len(graph) > 40
    for module in graph:
        layer_of(module)


def test_imports_point_down_the_layers(graph: nx.DiGraph) -> None:
    wrong = []
    for source, target in graph.edges:
        if source == "graphddp":  # the facade re-exports every layer
            continue
        if target == "graphddp":
            wrong.append(f"{source} imports the graphddp facade")
        elif LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(source)):
            wrong.append(f"{source} ({layer_of(source)}) imports {target} ({layer_of(target)})")
    assert not wrong, "imports against the layer order passes ← runtime ← compiler ← ddp ← integrations ← tools:\n" + "\n".join(wrong)


def test_no_import_cycles(graph: nx.DiGraph) -> None:
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles)


def test_passes_need_no_process_group(graph: nx.DiGraph) -> None:
    """``graphddp.passes`` is pure: no torch.distributed, nothing of the runtime (the design's contract)."""
    for path in (ROOT / "passes").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in getattr(node, "names", [])]
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                assert not any(n.startswith("torch.distributed") for n in names), f"{path} imports {names}"
    assert all(target.startswith("graphddp.passes") for source, target in graph.edges if source.startswith("graphddp.passes"))


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    """The walk above finds lazy imports and leaves type-only ones out (else the tests above prove nothing)."""
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..tools import cli\n"
        "def f():\n    from ..ddp import DistributedDataParallel\n"
    )
    found = imports_of("graphddp.runtime.m", source, {"graphddp.ddp", "graphddp.tools.cli", "graphddp.tools"})
    assert found == {"graphddp.ddp"}


CLASS_LINES = 300
"""No class of graphddp's is longer: a longer one holds features that want objects of their own."""
SMALLER = {"Reducer": 250}
"""The coordinators stay smaller still (docs/architecture.md): the Reducer coordinates one iteration."""
INIT_LINES = {"DistributedDataParallel": 60}


def test_no_class_outgrows_its_room() -> None:
    too_long = []
    for module, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            length = node.end_lineno - node.lineno + 1
            if length > SMALLER.get(node.name, CLASS_LINES):
                too_long.append(f"{module}.{node.name}: {length} lines (at most {SMALLER.get(node.name, CLASS_LINES)})")
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is not None and node.name in INIT_LINES and init.end_lineno - init.lineno + 1 > INIT_LINES[node.name]:
                too_long.append(f"{module}.{node.name}.__init__: {init.end_lineno - init.lineno + 1} lines")
    assert not too_long, "\n".join(too_long)

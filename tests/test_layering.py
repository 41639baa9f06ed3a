"""The package's layers import only downwards: every import, at module level or inside a function, walked as a
syntax tree. The order (a layer may import its own and lower layers):

    model, store  <  fusion, restore  <  controller  <  engine, integrations  <  eval, server  <  bench  <  cli

`kvreuse/__init__.py` holds only the version and imports nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvreuse

PACKAGE = Path(kvreuse.__file__).parent
RANK = {"model": 0, "store": 0, "fusion": 1, "restore": 1, "controller": 2, "engine": 3, "integrations": 3,
        "eval": 4, "server": 4, "bench": 5, "cli": 6}


def _imported_layers(tree: ast.AST) -> set[str]:
    layers = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kvreuse" and len(parts) > 1 and parts[1] in RANK:
                layers.add(parts[1])
    return layers


def upward_imports(package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if len(relative.parts) == 1:
            assert relative.name == "__init__.py", f"{relative}: a module outside every layer"
            assert not _imported_layers(ast.parse(path.read_text())), "kvreuse/__init__.py imports a layer"
            continue
        layer = relative.parts[0]
        assert layer in RANK, f"{relative}: in no known layer (add it to RANK)"
        for imported in _imported_layers(ast.parse(path.read_text())):
            if RANK[imported] > RANK[layer]:
                found.append(f"{relative} ({layer}) imports {imported}")
    return found


def test_no_module_imports_from_a_layer_above_it():
    assert upward_imports(PACKAGE) == []


def test_an_upward_import_is_found(tmp_path):
    """The walk is not vacuous: the model layer importing the engine, inside a function, is caught."""
    (tmp_path / "model").mkdir()
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "model" / "check.py").write_text("def f():\n    from kvreuse.engine.generate import iter_tokens\n")
    assert upward_imports(tmp_path) == ["model/check.py (model) imports engine"]

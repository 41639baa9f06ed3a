"""The store knows tensors and keys, nothing about transformers: it never imports the model runtime."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvreuse.store

STORE = Path(kvreuse.store.__file__).parent
FORBIDDEN = ("transformers", "kvreuse.model", "pickle")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_store_module_imports_the_runtime_or_pickle():
    for path in STORE.glob("*.py"):
        bad = {m for m in imported_modules(path) if m.split(".")[0] in FORBIDDEN or m.startswith(FORBIDDEN)}
        assert not bad, f"{path.name} imports {bad}"


def test_importing_the_store_loads_no_transformers():
    code = "import sys, kvreuse.store, kvreuse.store.bench; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=STORE.parent.parent)
    assert out.stdout.strip() == "False"

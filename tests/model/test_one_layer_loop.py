"""One layer step and one loop over layers: the package's source, walked as syntax trees.

Prefill, decode, every fusion plan and every restoration drive `LayerwiseModel.run_layers`; none may grow a loop
of its own that computes layers. These tests fail on such a loop, on a layer computed outside the step, and on
model computation inside `kvreuse/restore/` (which decides what to load or compute, and computes nothing).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvreuse

PACKAGE = Path(kvreuse.__file__).parent
# What computes a decoder layer, or a part of one.
LAYER_COMPUTE = {"step", "qkv", "attend", "finish_layer"}
# The controller's machine profile times the dense parts of a layer (qkv, RoPE, MLP) apart from attention, which
# it fits separately: a microbenchmark of the step's parts, not a path that computes requests.
MEASURED_APART = {("controller/measure.py", "_dense_seconds.step")}
# The script vLLM's own venv runs steps vLLM's engine (`LLMEngine.step`): another engine's step, not this model's.
VLLM_ENGINE_STEP = {("bench/peers/vllm_runner.py", "_time_batch")}
# The step's own form for rows whose layers run as native calls resolved once: taken by the step alone (below).
RESOLVED_STEP = "model/resolved_step.py"


def _calls_in(node: ast.AST) -> set[str]:
    """Method names called anywhere under `node` (obj.name(...))."""
    return {n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}


def _functions() -> list[tuple[str, str, ast.AST]]:
    """(file relative to the package, qualified name, node) of every function and method."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((str(path.relative_to(PACKAGE)), prefix + child.name, child))
                    visit(child, prefix + child.name + ".")
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")

        visit(tree, "")
    return found


def _own_body(function: ast.AST) -> list[ast.AST]:
    """The function's statements without the functions defined inside it (each is checked on its own)."""
    nested = [n for n in ast.walk(function) if n is not function
              and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    inner = {id(m) for n in nested for m in ast.walk(n)}
    return [n for n in ast.walk(function) if id(n) not in inner]


def _loops_computing_layers(function: ast.AST) -> list[ast.AST]:
    """Loops whose variable is the layer index of a call that computes a layer (a loop over one layer's row
    groups, or over prompt lengths at a fixed layer, is not a loop over layers)."""
    loops = []
    for loop in _own_body(function):
        if isinstance(loop, ast.For):
            variables, body = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}, loop.body
        elif isinstance(loop, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            variables = {n.id for g in loop.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
            body = [loop]
        else:
            continue
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in LAYER_COMPUTE
               and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id in variables
               for stmt in body for n in ast.walk(stmt)):
            loops.append(loop)
    return loops


def test_one_definition_loops_over_the_models_layers():
    looping = {(file, name) for file, name, fn in _functions() if _loops_computing_layers(fn)}
    assert looping == {("model/runtime.py", "LayerwiseModel.run_layers")}


def test_layers_are_computed_only_by_the_one_step():
    computing = {(file, name) for file, name, fn in _functions()
                 if {c for n in _own_body(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     for c in [n.func.attr]} & (LAYER_COMPUTE - {"step"})}
    primitives = {("model/runtime.py", f"LayerwiseModel.{name}") for name in LAYER_COMPUTE - {"step"}}
    outside_the_step = {(file, name) for file, name in computing if file != RESOLVED_STEP}
    assert outside_the_step - MEASURED_APART - primitives == {("model/runtime.py", "LayerwiseModel.step")}


def test_the_resolved_form_of_the_step_is_taken_only_by_the_step():
    running = {(file, name) for file, name, fn in _functions() if "run_layer" in _calls_in(fn)}
    assert running == {("model/runtime.py", "LayerwiseModel.step")}


def test_the_step_is_taken_only_by_the_one_loop():
    stepping = {(file, name) for file, name, fn in _functions()
                if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step"
                       for n in _own_body(fn))}
    assert stepping - VLLM_ENGINE_STEP == {("model/runtime.py", "LayerwiseModel.run_layers")}


def test_restoration_computes_nothing_itself():
    """restore/ decides which rows are loaded and which computed; the model's loop computes, its placer places."""
    allowed = {"run_layers", "place", "place_layers", "embed", "logits", "rotary", "new_cache"}
    for path in sorted((PACKAGE / "restore").rglob("*.py")):
        tree = ast.parse(path.read_text())
        used = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, (ast.Name, ast.Attribute))
                and (getattr(n.func.value, "id", None) == "model" or getattr(n.func.value, "attr", None) == "model")}
        assert used <= allowed, f"{path.name} calls the model's {sorted(used - allowed)}"
        assert not _calls_in(tree) & (LAYER_COMPUTE | {"rope", "qkv"}), f"{path.name} computes a layer's part"


def test_the_checks_catch_a_second_loop(tmp_path, monkeypatch):
    """The walk is not vacuous: a driver with a loop of its own over the layers is found."""
    copy = tmp_path / "kvreuse"
    (copy / "model").mkdir(parents=True)
    (copy / "model" / "runtime.py").write_text((PACKAGE / "model" / "runtime.py").read_text())
    (copy / "fusion").mkdir()
    (copy / "fusion" / "rogue.py").write_text(
        "def run(model, hidden, groups):\n"
        "    for layer in range(model.num_layers):\n"
        "        q, k, v = model.qkv(layer, hidden)\n"
        "        hidden = model.finish_layer(layer, hidden, q)\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", copy)
    looping = {(file, name) for file, name, fn in _functions() if _loops_computing_layers(fn)}
    assert ("fusion/rogue.py", "run") in looping

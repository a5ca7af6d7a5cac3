"""The layer rule of ../shared/GUIDE.md and README's architecture section, checked on the source itself.

Imports are read from the syntax tree of every module (function-level imports included: a lazy import
is still a dependency, and a lazy import circle is still a circle), so the check does not depend on which
module a test happened to import first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "trainer", "evaluation", "data")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()

def _imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name `module` imports: `import a.b` gives a.b; `from a import b` gives a and a.b."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb from this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def _project_module(name: str) -> str | None:
    """The project module a dotted name lives in (`trainer.loss.reduce_loss` -> `trainer.loss`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


IMPORTS = {m: _imported_names(m, p) for m, p in MODULES.items()}
GRAPH = {m: {d for n in names if (d := _project_module(n)) and d != m} for m, names in IMPORTS.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_a_known_import_and_a_known_cycle():
    # The checks below are only as good as the import walk: it must see real edges and real circles.
    assert "trainer.loss" in GRAPH["trainer.grpo"]
    assert "data.answers" in GRAPH["trainer.rewards.math_rewards"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_between_project_modules():
    assert _cycles(GRAPH) == []


def _tops(module: str) -> set[str]:
    return {n.split(".")[0] for n in IMPORTS[module] if n}


@pytest.mark.parametrize("module", [m for m in MODULES if m.split(".")[0] in ("trainer", "data", "evaluation")])
def test_lower_layers_import_no_prefect_mlflow_flows_or_tasks(module):
    # The trainer runs standalone under torchrun/deepspeed, the evaluator against any endpoint.
    assert not _tops(module) & {"prefect", "mlflow", "flows", "tasks"}


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("data")])
def test_data_imports_no_other_layer(module):
    assert not _tops(module) & {"trainer", "evaluation", "flows", "tasks"}


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("trainer")])
def test_trainer_never_imports_evaluation(module):
    assert "evaluation" not in _tops(module)


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("evaluation")])
def test_evaluation_uses_only_the_trainer_parts_it_is_allowed(module):
    # Scoring shares the answer verifier (trainer.rewards); serving a checkpoint is inference and shares the
    # model loader (with its ModelConfig) and the generation engines. Nothing else of the trainer.
    allowed = ("trainer.rewards",)
    if module.startswith("evaluation.serving"):
        allowed += ("trainer.model_loading", "trainer.recipe", "trainer.rollout", "trainer.prompts")
    used = {d for d in GRAPH[module] if d.startswith("trainer")}
    assert {d for d in used if not d.startswith(allowed)} == set()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_another_modules_private_names(module):
    private = {n for n in IMPORTS[module]
               if (owner := n.rpartition(".")[0]) in MODULES and owner != module
               and n.rpartition(".")[2].startswith("_") and not n.rpartition(".")[2].startswith("__")}
    assert private == set()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_over_400_lines(module):
    assert len(MODULES[module].read_text().splitlines()) <= MAX_LINES

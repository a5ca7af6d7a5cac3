"""The layer map of README's Architecture section, checked on the source itself, with no exceptions.

The rule, stated once: the top-level packages form one order, bottom to top,

    data < trainer < evaluation < tasks < flows < infra

and a module imports only from its own package and the packages below it. Prefect and MLflow are imported
from tasks/ up: the trainer must run standalone under torchrun/deepspeed, the evaluator against any
checkpoint or endpoint. No import circles, and no module imports another module's private names.

Imports are read from the syntax tree of every module (function-level imports included: a lazy import
is still a dependency, and a lazy import circle is still a circle), so the check does not depend on which
module a test happened to import first.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("data", "trainer", "evaluation", "tasks", "flows", "infra")  # bottom to top
# third-party packages kept out of the lower layers: each with the lowest layer that may import it
LOWEST_LAYER_FOR = {"prefect": "tasks", "mlflow": "tasks"}


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules(REPO)


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


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The project module a dotted name lives in (`trainer.loss.reduce_loss` -> `trainer.loss`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _graph(modules: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(every dotted name each module imports, the project modules each module depends on)."""
    imports = {m: _imported_names(m, p) for m, p in modules.items()}
    graph = {
        m: {d for n in names if (d := _project_module(n, modules)) and d != m} for m, names in imports.items()
    }
    return imports, graph


IMPORTS, GRAPH = _graph(MODULES)


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


def _rank(name: str) -> int | None:
    """The position in LAYERS of the package `name` is in (None for a package outside the map)."""
    top = name.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def _upward_imports(module: str, imports: set[str]) -> set[str]:
    """What `module` imports from a package above its own, or from a third-party package kept above it."""
    own = _rank(module)
    upward = {n for n in imports if (rank := _rank(n)) is not None and rank > own}
    upward |= {
        n
        for n in imports
        if n.split(".")[0] in LOWEST_LAYER_FOR and own < LAYERS.index(LOWEST_LAYER_FOR[n.split(".")[0]])
    }
    return upward


def test_the_walker_sees_every_kind_of_import_and_the_rule_flags_what_it_should(tmp_path):
    # The checks below are only as good as the import walk and the rule: both on a made-up tree.
    for name in ("data", "trainer", "evaluation"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "data" / "base.py").write_text("X = 1\n")
    (tmp_path / "trainer" / "loop.py").write_text(
        "from data.base import X\nfrom . import helpers\n\ndef lazy():\n    import evaluation.score\n"
        "    import mlflow\n"
    )
    (tmp_path / "trainer" / "helpers.py").write_text("import trainer.loop\n")
    (tmp_path / "evaluation" / "score.py").write_text("from trainer.loop import lazy\n")
    modules = _modules(tmp_path)
    imports, graph = _graph(modules)
    assert graph["trainer.loop"] == {"data.base", "trainer", "trainer.helpers", "evaluation.score"}
    assert _cycles(graph) == [["evaluation.score", "trainer.helpers", "trainer.loop"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _upward_imports("trainer.loop", imports["trainer.loop"]) == {"evaluation.score", "mlflow"}
    assert _upward_imports("evaluation.score", imports["evaluation.score"]) == set()


def test_every_top_level_package_with_python_code_is_on_the_map():
    # A new package must take its place in LAYERS (and in README's map) before its imports can be checked.
    packages = {
        d.name
        for d in REPO.iterdir()
        if d.is_dir() and not d.name.startswith(".") and d.name != "tests" and next(d.rglob("*.py"), None)
    }
    assert packages <= set(LAYERS)


def test_no_import_circle_between_project_modules():
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_own_layer_and_the_layers_below(module):
    assert _upward_imports(module, IMPORTS[module]) == set()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_another_modules_private_names(module):
    private = {
        n
        for n in IMPORTS[module]
        if (owner := n.rpartition(".")[0]) in MODULES
        and owner != module
        and n.rpartition(".")[2].startswith("_")
        and not n.rpartition(".")[2].startswith("__")
    }
    assert private == set()

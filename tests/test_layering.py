"""The library's import graph: the arrows the layout of docs/ and ARCHITECTURE allow, read from the code with ast
(imports inside functions included)."""

from __future__ import annotations

import ast

from tests.conftest import REPO


def _imports(package: str) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file), for every module under `package`."""
    graph: dict[str, set[str]] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[module] = {name for name in found if name.split(".")[0] in ("rlhf", "flows", "tasks", "benchmarks")}
    return graph


def _modules(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports reduced to modules that exist (``from rlhf.ppo import update`` is rlhf.ppo.update)."""
    return {module: {name for name in names if name in graph and name != module} for module, names in graph.items()}


def test_the_models_layer_reads_no_data_sets():
    graph = _imports("rlhf")
    arrows = sorted((m, i) for m, names in graph.items() if m.startswith("rlhf.models") for i in names)
    assert [(m, i) for m, i in arrows if i.startswith("rlhf.data")] == []


def test_no_two_library_files_import_each_other():
    raw = _imports("rlhf")
    assert "flows.pipeline_command" in raw["rlhf.cli"], "the reader sees imports inside functions"
    graph = _modules(raw)
    assert "rlhf.data.scan" in graph["rlhf.data.sources"] and "rlhf.ppo.update" in graph["rlhf.ppo.optimise"]
    pairs = sorted({tuple(sorted((a, b))) for a, names in graph.items() for b in names if a in graph.get(b, set())})
    assert pairs == []

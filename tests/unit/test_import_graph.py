"""The package's import graph, read from the source (every import statement, function-level ones
included): no cycles, and the layering. The rules, each a test of its own:

- the rollout imports nothing of the queue (what both sides of dispatch share is asyncgrpo.contract),
  nor the config's loading and validation (asyncgrpo.config): a generator is handed its settings;
- only the CLI imports the study and the simulator; only the entry points import the driver and
  the plot command (what the study and the simulator read of a run is in asyncgrpo.metrics.runs);
- the simulator loads no torch and no numpy when imported: it is pure Python;
- the config schema and the contract are leaves: they import nothing of the package;
- asyncgrpo.runtime imports nothing of the package but the schema, the contract and itself;
- these light layers (schema, contract, runtime) import nothing heavy (`HEAVY`) anywhere in their
  source, and importing each of them leaves none of it in sys.modules: roles and tools load them
  without paying for torch, vLLM, Ray or ZeroMQ, by construction rather than by imports hidden in
  functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "asyncgrpo"
# Third-party packages too heavy for the light layers: seconds to import, or native libraries.
HEAVY = ("torch", "vllm", "ray", "zmq", "msgpack", "numpy")
# The light layers: leaves and the process plumbing every role uses.
LEAVES = ("asyncgrpo.schema", "asyncgrpo.contract")
RUNTIME = "asyncgrpo.runtime"
# The entry points: the `asyncgrpo` command and the commands it runs.
CLI = "asyncgrpo.cli"
ENTRY_POINTS = (CLI, "asyncgrpo.train", "asyncgrpo.plot")
# What must exist for the light-layer rules to test anything (a move or rename fails here, loudly).
REQUIRED_LIGHT = ("asyncgrpo.schema", "asyncgrpo.contract", "asyncgrpo.runtime", "asyncgrpo.runtime.faults", "asyncgrpo.runtime.files",
                  "asyncgrpo.runtime.interrupts", "asyncgrpo.runtime.memory", "asyncgrpo.runtime.placement",
                  "asyncgrpo.runtime.ray_cluster", "asyncgrpo.runtime.resources", "asyncgrpo.runtime.timing")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_names(name: str, path: Path) -> set[str]:
    """Every absolute module name `path` (module `name`) imports anywhere in its body, relative
    imports resolved; for `from a import b`, both `a` and `a.b` (b may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def within(name: str, prefix: str) -> bool:
    """`name` is the module or package `prefix` or lies inside it."""
    return name == prefix or name.startswith(prefix + ".")


def import_graph() -> dict[str, set[str]]:
    """module -> the asyncgrpo modules it imports anywhere in its body (a package's __init__ is
    imported with any of its submodules, so `a.b` also depends on `a`)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in imported_names(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    for name in modules:  # importing a.b.c runs a/__init__ and a/b/__init__ first
        parent = name.rpartition(".")[0]
        while parent:
            if parent != name:
                graph[name].add(parent)
            parent = parent.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            # A package's __init__ importing its own submodules is how packages work, not a cycle.
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "asyncgrpo.schema" in graph["asyncgrpo.config"]
    assert len(graph) > 40


def test_no_import_cycles_function_level_imports_included():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_a_cycle_is_found_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def light_modules() -> list[str]:
    """The modules the light-layer rules cover: the leaves and everything in runtime."""
    return sorted(name for name in package_modules() if name in LEAVES or within(name, RUNTIME))


def test_the_light_layers_exist():
    missing = sorted(set(REQUIRED_LIGHT) - set(light_modules()))
    assert not missing, f"the light-layer rules would not test: {', '.join(missing)}"


def test_rollout_imports_nothing_of_the_queue():
    graph = import_graph()
    found = sorted(f"{name} -> {target}" for name in graph if within(name, "asyncgrpo.rollout")
                   for target in graph[name] if within(target, "asyncgrpo.queue"))
    assert not found, "; ".join(found)


def outside_importers(graph: dict[str, set[str]], package: str) -> set[str]:
    """The modules outside `package` that import it or anything in it."""
    return {name for name in graph if not within(name, package)
            and any(within(target, package) for target in graph[name])}


def test_the_rollout_does_not_import_the_config():
    graph = import_graph()
    found = sorted(name for name in graph if within(name, "asyncgrpo.rollout") and "asyncgrpo.config" in graph[name])
    assert not found, "; ".join(f"{name} -> asyncgrpo.config" for name in found)


@pytest.mark.parametrize("package", ["asyncgrpo.study", "asyncgrpo.sim"])
def test_only_the_cli_imports_the_study_and_the_simulator(package):
    found = sorted(outside_importers(import_graph(), package) - {CLI})
    assert not found, f"{package} imported by {', '.join(found)}"


@pytest.mark.parametrize("package", ["asyncgrpo.driver", "asyncgrpo.plot"])
def test_only_the_entry_points_import_the_driver_and_the_plot_command(package):
    found = sorted(outside_importers(import_graph(), package) - set(ENTRY_POINTS))
    assert not found, f"{package} imported by {', '.join(found)}"


def test_importing_the_simulator_loads_no_torch_and_no_numpy():
    modules = sorted(name for name in package_modules() if within(name, "asyncgrpo.sim"))
    assert len(modules) > 1
    code = f"import sys, {', '.join(modules)}; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing the simulator loads {out.strip()}"


def test_the_config_schema_and_the_contract_are_leaves():
    graph = import_graph()
    found = sorted(f"{name} -> {target}" for name in LEAVES if name in graph
                   for target in graph[name] if target != "asyncgrpo")
    assert not found, "; ".join(found)


def test_runtime_imports_only_the_schema_the_contract_and_runtime():
    graph = import_graph()
    allowed = {"asyncgrpo", *LEAVES}
    found = sorted(f"{name} -> {target}" for name in graph if within(name, RUNTIME)
                   for target in graph[name] if target not in allowed and not within(target, RUNTIME))
    assert not found, "; ".join(found)


def test_the_light_layers_import_nothing_heavy_even_inside_functions():
    modules = package_modules()
    found = sorted(f"{name} -> {target}" for name in light_modules()
                   for target in imported_names(name, modules[name]) if target.split(".")[0] in HEAVY)
    assert not found, "; ".join(found)


@pytest.mark.parametrize("module", light_modules())
def test_importing_a_light_module_loads_nothing_heavy(module):
    code = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module} loads {out.strip()}"

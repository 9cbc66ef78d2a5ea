"""The scripts under tools/ imported as modules, for unit tests of their pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as module `name`."""
    return load_file(name, TOOLS / f"{name}.py")


def load_file(name: str, path: Path) -> ModuleType:
    """The Python file `path` as module `name` (registered in sys.modules: dataclasses look their module up by name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

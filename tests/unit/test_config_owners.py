"""Each config section is read by its owner package and by the composition root only
(docs/ARCHITECTURE.md, "Config sections and their readers"; the table there is the one this test
reads). A read is `cfg.<section>` or `<x>.cfg.<section>` (a `Config` is always called `cfg`), or importing one of the
section's dataclasses from the schema (a part that takes a `WireConfig` reads the wire section).
The composition roots (the entry points, config.py, inert_settings.py, composition.py, driver/, each process's factory:
learner/parts.py, rollout/parts.py, and the simulator's model of a whole run, sim/settings.py) turn the config into parts and may read every section."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

from asyncgrpo.schema import Config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "asyncgrpo"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
COMPOSITION_ROOT = ("cli.py", "train.py", "plot.py", "config.py", "inert_settings.py", "schema.py", "composition.py", "driver/",
                    "learner/parts.py", "rollout/parts.py", "sim/settings.py")


def owners() -> dict[str, str]:
    """section -> owner package, from the ARCHITECTURE.md table."""
    text = ARCHITECTURE.read_text()
    block = text.split("### Config sections and their readers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| (\w+)/ \|$", block, re.M)
    return dict(rows)


def _dataclasses_in(hint: typing.Any) -> list[type]:
    if dataclasses.is_dataclass(hint):
        return [hint]
    return [c for arg in typing.get_args(hint) for c in _dataclasses_in(arg)]


def section_classes() -> dict[str, str]:
    """Each schema dataclass name -> the section it belongs to (nested ones included)."""
    found: dict[str, str] = {}
    for section, hint in typing.get_type_hints(Config).items():
        todo = _dataclasses_in(hint)
        while todo:
            cls = todo.pop()
            found[cls.__name__] = section
            todo.extend(c for h in typing.get_type_hints(cls).values() for c in _dataclasses_in(h))
    return found


def _package_of(rel: str) -> str:
    return rel.split("/", 1)[0] if "/" in rel else ""


def _in_composition_root(rel: str) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in COMPOSITION_ROOT)


def _names_a_config(node: ast.expr) -> bool:
    """`cfg`, or an attribute called cfg or _cfg (`self.cfg`, `self._cfg`, `parts.cfg`)."""
    if isinstance(node, ast.Name):
        return node.id == "cfg"
    return isinstance(node, ast.Attribute) and node.attr in ("cfg", "_cfg")


def reads(path: Path, sections: set[str], classes: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, section, how) for each read of a section in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in sections and _names_a_config(node.value):
            found.append((node.lineno, node.attr, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncgrpo.schema":
            found += [(node.lineno, classes[a.name], f"imports {a.name}") for a in node.names if a.name in classes]
    return found


def foreign_reads() -> dict[tuple[str, str], list[str]]:
    table, classes = owners(), section_classes()
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if _in_composition_root(rel):
            continue
        for line, section, how in reads(path, set(table), classes):
            if table[section] != _package_of(rel):
                out.setdefault((rel, section), []).append(f"asyncgrpo/{rel}:{line} {how}")
    return out


def test_the_owner_table_names_every_config_section_once_and_an_existing_package():
    table = owners()
    sections = {f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type) or f.name in table}
    assert sorted(table) == sorted(s for s, h in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(h))
    assert set(table) <= sections
    assert all((PACKAGE / pkg).is_dir() for pkg in table.values())


def test_every_config_section_is_read_only_by_its_owner_and_the_composition_root():
    unexpected = foreign_reads()
    assert not unexpected, "sections read outside their owner (docs/ARCHITECTURE.md):\n" + "\n".join(
        site for sites in unexpected.values() for site in sites)



def test_a_config_parameter_is_always_called_cfg():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.arg) and node.annotation is not None:
                note = ast.unparse(node.annotation).strip("'\"")
                if note in ("Config", "schema.Config") and node.arg != "cfg":
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.arg}")
    assert not wrong, wrong


def test_the_read_scan_finds_a_foreign_read_and_a_section_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from asyncgrpo.schema import WireConfig, Config\n\ndef f(cfg, x):\n"
                      "    return cfg.rollout.dtype, x.cfg.model.path, x._cfg.env.name, x.model.path\n")
    found = reads(module, set(owners()), section_classes())
    assert sorted((s, how) for _, s, how in found) == [("env", "x._cfg.env"), ("model", "x.cfg.model"),
                                                       ("rollout", "cfg.rollout"), ("wire", "imports WireConfig")]

"""The keys docs/METRICS.md documents, for the tests that hold every emitted key to it.

A documented key is the first cell of a table row, in backticks. A key may be a template: each
`<placeholder>` stands for one name without a slash (`wire/rejected/<reason>`, `time/<phase>_s`).
Keys are grouped by the level-2 heading (`## ...`) they are under, so a metric key and a
summary.json key of the same name are told apart.
"""

from __future__ import annotations

import re
from pathlib import Path

METRICS_DOC = Path(__file__).resolve().parent.parent / "docs" / "METRICS.md"

# The documents' sections whose tables list what a run writes.
STEP_SECTION = "metrics.jsonl"
SUMMARY_SECTION = "summary.json"

_HEADING = re.compile(r"^(#{2,})\s+(.*?)\s*$")
_FIRST_CELL = re.compile(r"^\|\s*`([^`]+)`\s*\|")
_PLACEHOLDER = re.compile(r"<[A-Za-z_]+>")


def documented_keys(text: str) -> dict[str, dict[str, set[str]]]:
    """{level-2 heading: {the nearest heading above the table: keys}} of every table row whose first
    cell is a key in backticks (a header or separator row has none)."""
    sections: dict[str, dict[str, set[str]]] = {}
    top = sub = ""
    for line in text.splitlines():
        heading = _HEADING.match(line)
        if heading:
            level, title = len(heading.group(1)), _plain(heading.group(2))
            if level == 2:
                top = sub = title
            else:
                sub = title
            continue
        cell = _FIRST_CELL.match(line)
        if cell and top:
            sections.setdefault(top, {}).setdefault(sub, set()).add(cell.group(1).strip())
    return sections


def section_keys(text: str, section: str, subsection: str | None = None) -> set[str]:
    """The keys of one level-2 section (all its tables, or only those under `subsection`)."""
    tables = documented_keys(text).get(section, {})
    if subsection is not None:
        return set(tables.get(subsection, set()))
    return set().union(*tables.values()) if tables else set()


def undocumented(keys: set[str] | list[str], documented: set[str], templates: bool = True) -> list[str]:
    """The keys that are neither documented as they are nor (with `templates`) match a template."""
    patterns = [_template_regex(key) for key in documented if _PLACEHOLDER.search(key)] if templates else []
    return sorted(key for key in keys
                  if key not in documented and not any(pattern.fullmatch(key) for pattern in patterns))


def _template_regex(template: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(template)
    return re.compile("[^/]+".join(re.escape(part) for part in parts))


def _plain(title: str) -> str:
    return title.replace("`", "").strip()

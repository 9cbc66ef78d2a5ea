"""The README stays a two-minute read that matches the tree, and the docs' links lead somewhere.

Computed from the file tree, so a new module, tool or doc without its line fails here rather than
leaving the README's layout or the docs index quietly out of date."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PACKAGE = ROOT / "asyncgrpo"
MAX_README_LINES = 300

# [text](target) or ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def section(text: str, title: str) -> str:
    """The body of the `## title` section: up to the next heading of level 2 or above."""
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def without_code_blocks(text: str) -> str:
    """Markdown outside fenced code blocks: a link-like string in an example command is no link."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def relative_links(path: Path) -> list[str]:
    targets = []
    for target in LINK.findall(without_code_blocks(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in the same file: no file to check
        targets.append(target.split("#", 1)[0])
    return targets


def layout_names() -> list[str]:
    """Every package (a directory with __init__.py) and top-level module of asyncgrpo/."""
    packages = [f"{path.parent.name}/" for path in PACKAGE.glob("*/__init__.py")]
    modules = [path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py"]
    return sorted(packages + modules)


def test_readme_is_at_most_300_lines() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; measurements belong in docs/"


def test_readme_layout_names_every_package_and_top_level_module() -> None:
    layout = section(README.read_text(), "Layout")
    missing = [name for name in layout_names()
               if not re.search(rf"^\s*{re.escape(name)}(\s|$)", layout, re.M)]
    assert not missing, f"README.md's Layout section has no line for: {', '.join(missing)}"


def test_readme_layout_names_every_tool_and_top_level_directory() -> None:
    layout = section(README.read_text(), "Layout")
    tools = sorted(path.name for path in (ROOT / "tools").iterdir() if path.is_file())
    missing = [name for name in tools + ["configs/", "tools/", "tests/", "docs/"]
               if not re.search(rf"^\s*{re.escape(name)}(\s|$)", layout, re.M)]
    assert not missing, f"README.md's Layout section has no line for: {', '.join(missing)}"


@pytest.mark.parametrize("doc", [README, *sorted(DOCS.glob("*.md"))], ids=lambda path: path.name)
def test_every_relative_link_points_at_a_file_that_exists(doc: Path) -> None:
    broken = [target for target in relative_links(doc) if target and not (doc.parent / target).exists()]
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {', '.join(broken)}"


def test_docs_index_names_every_doc_file() -> None:
    index = DOCS / "README.md"
    assert index.is_file(), "docs/README.md (the docs index) is missing"
    text = index.read_text()
    missing = [path.name for path in sorted(DOCS.glob("*.md"))
               if path.name != "README.md" and f"({path.name})" not in text]
    assert not missing, f"docs/README.md does not link: {', '.join(missing)}"


def test_relative_links_are_found_outside_code_blocks_only(tmp_path: Path) -> None:
    path = tmp_path / "probe.md"
    path.write_text("[a](docs/A.md#x) ![b](img.png) [c](https://x.org) [d](#here)\n```\n[e](nowhere.md)\n```\n")
    assert relative_links(path) == ["docs/A.md", "img.png"]

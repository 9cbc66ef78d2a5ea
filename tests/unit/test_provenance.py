"""Which code a run ran (summary.json's `code`): the commit of the git checkout the package sits at
the top of, whether tracked files changed, and nothing when it is not such a checkout."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from asyncgrpo.runtime.provenance import code_identity, short_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / "asyncgrpo").mkdir()
    (tmp_path / "asyncgrpo" / "__init__.py").write_text("__version__ = '9.9'\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return tmp_path


def test_a_clean_checkout_gives_its_head_commit(checkout):
    identity = code_identity("9.9", checkout / "asyncgrpo")
    assert identity == {"version": "9.9", "commit": git(checkout, "rev-parse", "HEAD"), "dirty": False}
    assert short_commit(identity) == identity["commit"][:7]


def test_a_changed_tracked_file_marks_it_dirty_and_an_untracked_one_does_not(checkout):
    (checkout / "runs").mkdir()
    (checkout / "runs" / "metrics.jsonl").write_text("{}\n")  # a run directory inside the checkout
    assert code_identity("9.9", checkout / "asyncgrpo")["dirty"] is False
    (checkout / "asyncgrpo" / "__init__.py").write_text("__version__ = '9.10'\n")
    identity = code_identity("9.9", checkout / "asyncgrpo")
    assert identity["dirty"] is True and short_commit(identity).endswith("+dirty")


def test_a_package_that_is_not_the_top_of_a_checkout_has_no_commit(checkout, tmp_path_factory):
    installed = tmp_path_factory.mktemp("site-packages") / "asyncgrpo"
    installed.mkdir()
    assert code_identity("9.9", installed) == {"version": "9.9", "commit": None, "dirty": None}
    # Inside a checkout but not at its top (a vendored copy): its commit would be someone else's.
    (checkout / "vendor" / "asyncgrpo").mkdir(parents=True)
    assert code_identity("9.9", checkout / "vendor" / "asyncgrpo")["commit"] is None
    assert short_commit(None) == "" and short_commit({"commit": None}) == ""

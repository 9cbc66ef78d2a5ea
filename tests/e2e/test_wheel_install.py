"""A wheel built from the repository works outside this checkout: installed into a fresh virtual
environment, run from another directory, it finds its presets and study specs and answers
`--version`, `train --cfg`, `study quick --dry-run` and `train check=true`.

The fresh environment sees the test environment's third-party packages through a path file (so no
registry is needed), but not its editable install of asyncgrpo: a directory named in a .pth file is
added to sys.path without running that directory's own .pth files, which is how the editable
install finds the checkout."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ directory of a fresh virtual environment with the repository's wheel installed."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"  # built from a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT / "asyncgrpo", source / "asyncgrpo", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    dist = base / "dist"
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                 "-w", str(dist), str(source)], cwd=base)
    assert built.returncode == 0, built.stderr[-2000:]
    wheels = list(dist.glob("asyncgrpo-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = base / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    env_python = env_dir / "bin" / "python"
    env_site = Path(run([str(env_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=base).stdout.strip())
    (env_site / "test-environment-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    installed_wheel = run([sys.executable, "-m", "pip", "--python", str(env_python), "install", "-q",
                           "--no-deps", "--no-index", str(wheels[0])], cwd=base)
    assert installed_wheel.returncode == 0, installed_wheel.stderr[-2000:]
    return env_dir / "bin"


def test_the_installed_package_is_the_wheel_not_the_checkout(installed, tmp_path):
    where = run([str(installed / "python"), "-c", "import asyncgrpo; print(asyncgrpo.__file__)"], cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.parent), where.stdout
    assert not Path(where.stdout.strip()).is_relative_to(ROOT)


def test_the_installed_cli_reports_its_version(installed, tmp_path):
    import asyncgrpo

    result = run([str(installed / "asyncgrpo"), "--version"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"asyncgrpo {asyncgrpo.__version__}"


def test_the_installed_cli_prints_the_default_config_from_its_packaged_presets(installed, tmp_path):
    result = run([str(installed / "asyncgrpo"), "train", "--cfg"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "max_staleness" in result.stdout


def test_the_installed_cli_finds_its_packaged_study_spec(installed, tmp_path):
    result = run([str(installed / "asyncgrpo"), "study", "quick", "--dry-run"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "to run" in result.stdout


def test_the_installed_cli_passes_the_preflight_check(installed, tmp_path):
    result = run([str(installed / "asyncgrpo"), "train", "check=true", f"run_dir={tmp_path / 'run'}",
                  f"weights.shm_dir={tmp_path}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["model"]["num_parameters"] > 0

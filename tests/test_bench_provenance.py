"""`tawpipe.bench.provenance`: every result file names the code that produced it."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import tawpipe
from tawpipe import bench

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(where: Path, *cmd: str) -> str:
    return subprocess.run(["git", "-C", str(where), *cmd], capture_output=True, text=True, check=True).stdout.strip()


def _repo(root: Path, package: Path) -> Path:
    """A fresh repository at ``root`` with one committed file in ``package``."""
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"# {root.name}\n")
    _git(root.parent, "init", "-q", str(root))
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return package


def test_versions_always() -> None:
    got = bench.provenance()
    assert got["tawpipe"] == tawpipe.__version__ and got["torch"] == torch.__version__
    assert got["python"] == platform.python_version() and got["cpus"] >= 1


@needs_git
def test_commit_of_a_checkout_and_whether_it_is_dirty(tmp_path: Path) -> None:
    package = _repo(tmp_path / "src", tmp_path / "src" / "tawpipe")
    assert bench.checkout(package) == {"commit": _git(package, "rev-parse", "HEAD"), "dirty": False}
    (package / "__init__.py").write_text("# edited\n")
    assert bench.checkout(package)["dirty"] is True


@needs_git
def test_a_copy_inside_another_work_tree_claims_no_commit(tmp_path: Path) -> None:
    """An installed copy inside some other repository (a virtualenv in a project) must not report
    that project's commit as its own."""
    package = _repo(tmp_path / "project", tmp_path / "project" / "venv" / "site-packages" / "tawpipe")
    assert bench.checkout(package) == {}


def test_no_git_means_versions_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def missing(*_args, **_kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", missing)
    assert bench.checkout(tmp_path) == {}
    got = bench.provenance()
    assert "commit" not in got and got["tawpipe"] == tawpipe.__version__


def test_not_a_work_tree(tmp_path: Path) -> None:
    assert bench.checkout(tmp_path) == {}

"""``tools/_bench.provenance()`` on the CPU: the commit a benchmark's JSON records is this package's, from
``BENCH_GIT_REVISION`` or from the package's own git checkout, and never the commit of a repository around a copy."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from tests.git_checkout import not_own_checkout
from tools import _bench

ROOT = Path(__file__).resolve().parents[2]


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


def _repository_with_a_commit(path: Path) -> str:
    """``git init`` in ``path`` and one commit of a file; its short hash."""
    path.mkdir(parents=True, exist_ok=True)
    _git(path, "init", "-q")
    (path / "README").write_text("another project\n")
    _git(path, "add", "README")
    _git(path, "commit", "-q", "-m", "another project's commit")
    return _git(path, "rev-parse", "--short", "HEAD")


def _copy_of_the_package(folder: Path) -> ModuleType:
    """``tools/_bench.py`` and an empty ``megatron_deepepv2/`` in ``folder`` (a copy of the package without its own
    ``.git``), the copy's module loaded from there."""
    (folder / "tools").mkdir(parents=True)
    (folder / "megatron_deepepv2").mkdir()
    shutil.copy(ROOT / "tools" / "_bench.py", folder / "tools" / "_bench.py")
    spec = importlib.util.spec_from_file_location("_bench_copy", folder / "tools" / "_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_environment_variable_wins_over_git(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_bench.REVISION_ENV, "abc1234-dirty")
    found = _bench.provenance()
    assert (found["git_commit"], found["git_dirty"], found["commit_source"]) == ("abc1234", True, "BENCH_GIT_REVISION")
    monkeypatch.setenv(_bench.REVISION_ENV, "abc1234")
    found = _bench.provenance()
    assert (found["git_commit"], found["git_dirty"], found["commit_source"]) == ("abc1234", False, "BENCH_GIT_REVISION")


def test_a_copy_inside_another_repository_records_no_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_bench.REVISION_ENV, raising=False)
    outer = tmp_path / "outer"
    outer_commit = _repository_with_a_commit(outer)
    copy = _copy_of_the_package(outer / "vendor" / "megatron-deepepv2")
    found = copy.provenance()
    assert outer_commit not in str(found), found
    assert (found["git_commit"], found["git_dirty"], found["commit_source"]) == (None, None, "unknown"), found
    # The same copy with a repository of its own (still inside the other one) records its own commit.
    own_commit = _repository_with_a_commit(outer / "vendor" / "megatron-deepepv2")
    found = copy.provenance()
    assert (found["git_commit"], found["commit_source"]) == (own_commit, "git"), found


def test_this_checkout_records_its_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_bench.REVISION_ENV, raising=False)
    reason = not_own_checkout(ROOT)
    if reason:
        pytest.skip(reason)
    found = _bench.provenance()
    assert found["git_commit"] == _git(ROOT, "rev-parse", "--short", "HEAD"), found
    assert found["commit_source"] == "git" and isinstance(found["git_dirty"], bool) and found["date"].endswith("Z")
    assert set(found) >= {"git_commit", "git_dirty", "date"}  # what the tools and their readers use

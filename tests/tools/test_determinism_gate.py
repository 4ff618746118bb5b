"""The determinism coverage gate, run against throwaway git repositories made here."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_kernel_determinism_coverage.py"

MANIFEST = textwrap.dedent(
    '''
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("real_manifest", {real!r})
    real = importlib.util.module_from_spec(spec); sys.modules[spec.name] = real; spec.loader.exec_module(real)
    KernelEntry, EXEMPT_LABEL = real.KernelEntry, real.EXEMPT_LABEL
    kernel_patterns_in, is_scanned = real.kernel_patterns_in, real.is_scanned
    KERNELS = (
        KernelEntry(name="ops", sources=("megatron_deepepv2/ops.py",), tests=("tests/determinism/test_ops.py",)),
        KernelEntry(name="util", sources=("megatron_deepepv2/util.py",), exempt_reason="sizes only"),
    )
    def entries_for(path):
        return [e for e in KERNELS if path in e.sources]
    '''
)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "megatron_deepepv2").mkdir()
    (tmp_path / "tests/determinism").mkdir(parents=True)
    (tmp_path / "manifest.py").write_text(MANIFEST.format(real=str(ROOT / "manifest.py")))
    (tmp_path / "megatron_deepepv2/ops.py").write_text("import torch\nclass F(torch.autograd.Function):\n    pass\n")
    (tmp_path / "megatron_deepepv2/util.py").write_text("x = 1\n")
    (tmp_path / "megatron_deepepv2/plain.py").write_text('"""dist.all_reduce( in a docstring"""\n# buffer.dispatch(\n')
    (tmp_path / "tests/determinism/test_ops.py").write_text("def test_ops():\n    pass\n")
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    _git(tmp_path, "checkout", "-q", "-b", "change")
    return tmp_path


def _commit(repo: Path, message: str = "change") -> None:
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", message)


def _gate(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "--root", str(repo), *args], capture_output=True, text=True)


def test_source_change_without_test_change_fails(repo: Path) -> None:
    (repo / "megatron_deepepv2/ops.py").write_text((repo / "megatron_deepepv2/ops.py").read_text() + "# edit\n")
    _commit(repo)
    done = _gate(repo, "--base-ref", "main")
    assert done.returncode == 1, done.stdout
    assert ("megatron_deepepv2/ops.py changed (manifest entry 'ops') but none of its determinism tests did"
            in done.stdout)


def test_source_change_with_test_change_passes(repo: Path) -> None:
    (repo / "megatron_deepepv2/ops.py").write_text((repo / "megatron_deepepv2/ops.py").read_text() + "# edit\n")
    test_file = repo / "tests/determinism/test_ops.py"
    test_file.write_text(test_file.read_text() + "# replay case updated with the source\n")
    _commit(repo)
    done = _gate(repo, "--base-ref", "main")
    assert done.returncode == 0, done.stdout


def test_exempt_label_downgrades_to_warning(repo: Path) -> None:
    (repo / "megatron_deepepv2/ops.py").write_text((repo / "megatron_deepepv2/ops.py").read_text() + "# edit\n")
    _commit(repo)
    done = _gate(repo, "--base-ref", "main", "--labels", "determinism-exempt")
    assert done.returncode == 0 and "warning:" in done.stdout and "allowed by label" in done.stdout


def test_unregistered_kernel_bearing_file_fails_even_with_label(repo: Path) -> None:
    (repo / "megatron_deepepv2/new_comm.py").write_text(
        "import torch.distributed as dist\ndist.all_to_all_single(a, b)\n"
    )
    _commit(repo)
    done = _gate(repo, "--base-ref", "main", "--labels", "determinism-exempt")
    assert done.returncode == 1
    assert "megatron_deepepv2/new_comm.py is kernel-bearing (collective) but not registered" in done.stdout


def test_patterns_ignore_comments_and_strings(repo: Path) -> None:
    done = _gate(repo, "--files", "megatron_deepepv2/plain.py", "megatron_deepepv2/util.py")
    assert done.returncode == 0, done.stdout


def test_entry_without_tests_or_exemption_fails(repo: Path) -> None:
    manifest = repo / "manifest.py"
    manifest.write_text(manifest.read_text().replace('exempt_reason="sizes only"', "tests=()"))
    done = _gate(repo, "--files", "megatron_deepepv2/util.py")
    assert done.returncode == 1 and "must have determinism tests or an exempt reason" in done.stdout


def test_usage_errors_exit_2(repo: Path) -> None:
    assert _gate(repo).returncode == 2
    assert _gate(repo, "--base-ref", "no-such-ref").returncode == 2


@pytest.mark.parametrize("where", ["alone", "inside another repository"])
def test_all_judges_a_copy_without_its_own_git(repo: Path, tmp_path_factory: pytest.TempPathFactory,
                                              where: str) -> None:
    """A copy of the project without ``.git`` (git answers nothing, or for an outer repository that tracks none of
    its files) is judged file by file, from the folder: an unregistered kernel file is still found."""
    outer = tmp_path_factory.mktemp("outer")
    if where != "alone":
        _git(outer, "init", "-q")
    copy = shutil.copytree(repo, outer / "vendor" / "project", ignore=shutil.ignore_patterns(".git"))
    (copy / "megatron_deepepv2" / "fused.py").write_text("import triton\n@triton.jit\ndef k():\n    pass\n")
    done = _gate(copy, "--all")
    assert done.returncode == 1 and "megatron_deepepv2/fused.py" in done.stdout, done.stdout
    assert "(the folder's files)" in done.stdout, done.stdout
    (copy / "megatron_deepepv2" / "fused.py").unlink()
    assert _gate(copy, "--all").returncode == 0


def test_whole_project_is_covered() -> None:
    done = subprocess.run([sys.executable, str(TOOL), "--all"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout


def test_real_detector_sees_our_kernel_files() -> None:
    sys.path.insert(0, str(ROOT))
    import manifest

    for path in ("megatron_deepepv2/ops.py", "megatron_deepepv2/backends/reference.py",
                 "megatron_deepepv2/backends/deepep/adapter.py"):
        assert manifest.kernel_patterns_in((ROOT / path).read_text()), path
        assert manifest.entries_for(path), path
    # A buffer's method passed to the one function that calls it is a call too.
    assert manifest.kernel_patterns_in("self._call(self.buffer.dispatch, streams, x)\n") == ["deepep-buffer-call"]
    # A method named dispatch on some other object is not a buffer call.
    assert manifest.kernel_patterns_in("router.dispatch(x)\nqueue.combine(y)\n") == []


# --base-ref auto: the change rule as `make test` runs it, against the base of the change.


def _edit(repo: Path, path: str) -> None:
    (repo / path).write_text((repo / path).read_text() + "# edit\n")


def _head(repo: Path, rev: str = "HEAD") -> str:
    done = subprocess.run(["git", "rev-parse", rev], cwd=repo, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def test_auto_base_fails_a_kernel_change_without_its_test(repo: Path) -> None:
    """No upstream branch: the previous commit is the base; a kernel edited alone fails naming the test to change."""
    _edit(repo, "megatron_deepepv2/ops.py")
    _commit(repo)
    done = _gate(repo, "--all", "--base-ref", "auto")
    assert done.returncode == 1, done.stdout
    assert f"compared with {_head(repo, 'HEAD~1')[:12]} (HEAD~1, the previous commit" in done.stdout, done.stdout
    assert "kernels changed: ops (megatron_deepepv2/ops.py); determinism tests changed: none" in done.stdout
    assert ("violation: megatron_deepepv2/ops.py changed (manifest entry 'ops') but none of its determinism tests did: "
            "tests/determinism/test_ops.py") in done.stdout, done.stdout


@pytest.mark.parametrize("base_ref", ["auto", "main"])
@pytest.mark.parametrize("trailer, exempt", [("Determinism-exempt: a log line, nothing it computes", True),
                                             ("Determinism-exempt:", False),  # a trailer must say why
                                             ("determinism-exempt is what this is not", False)])
def test_a_commit_trailer_labels_the_change_exempt(repo: Path, base_ref: str, trailer: str, exempt: bool) -> None:
    """A kernel edited alone passes, as a warning, when a commit of the change says why in the trailer."""
    _edit(repo, "megatron_deepepv2/ops.py")
    _commit(repo, f"log the build\n\n{trailer}\n")
    done = _gate(repo, "--all", "--base-ref", base_ref)
    assert done.returncode == (0 if exempt else 1), done.stdout
    assert ("warning: megatron_deepepv2/ops.py changed" in done.stdout) == exempt, done.stdout
    assert ("labelled determinism-exempt by the commit trailer" in done.stdout) == exempt, done.stdout


def test_auto_base_passes_a_kernel_change_with_its_test(repo: Path) -> None:
    _edit(repo, "megatron_deepepv2/ops.py")
    _edit(repo, "tests/determinism/test_ops.py")
    _commit(repo)
    done = _gate(repo, "--all", "--base-ref", "auto")
    assert done.returncode == 0, done.stdout
    assert "determinism tests changed: tests/determinism/test_ops.py" in done.stdout, done.stdout


def test_auto_base_is_the_merge_base_with_the_upstream_branch(repo: Path) -> None:
    """With origin/main, every commit since the merge base is the change: a test edited in an earlier commit counts,
    where HEAD~1 alone would fail the kernel edited last."""
    _git(repo, "update-ref", "refs/remotes/origin/main", "main")
    _edit(repo, "tests/determinism/test_ops.py")
    _commit(repo)
    _edit(repo, "megatron_deepepv2/ops.py")
    _commit(repo)
    done = _gate(repo, "--all", "--base-ref", "auto")
    assert done.returncode == 0, done.stdout
    assert f"compared with {_head(repo, 'main')[:12]} (the merge base with origin/main)" in done.stdout, done.stdout


def _clone_of_a_kernel_change_on_main(repo: Path, dest: Path, depth: int, unregistered: bool = False) -> Path:
    """A fresh clone (as CI makes) of main whose last commit edits a kernel alone (and adds an unregistered one)."""
    _git(repo, "checkout", "-q", "main")
    _edit(repo, "megatron_deepepv2/ops.py")
    if unregistered:
        (repo / "megatron_deepepv2/fused.py").write_text("import triton\n@triton.jit\ndef k():\n    pass\n")
    _commit(repo)
    _git(dest.parent, "clone", "-q", f"--depth={depth}", f"file://{repo}", str(dest))
    return dest


def test_fresh_clone_on_main_judges_its_last_commit(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """HEAD is origin/main in a fresh clone (merge base = HEAD): the last commit, against HEAD~1, is the change."""
    clone = _clone_of_a_kernel_change_on_main(repo, tmp_path_factory.mktemp("ci") / "clone", depth=2)
    done = _gate(clone, "--all", "--base-ref", "auto")
    assert done.returncode == 1, done.stdout
    assert "(HEAD~1, the previous commit: HEAD is on origin/main)" in done.stdout, done.stdout
    assert "none of its determinism tests did: tests/determinism/test_ops.py" in done.stdout, done.stdout


@pytest.mark.parametrize("unregistered", [False, True], ids=["kernel edit", "unregistered kernel"])
def test_shallow_clone_skips_the_change_rule_but_not_registration(
    repo: Path, tmp_path_factory: pytest.TempPathFactory, unregistered: bool
) -> None:
    """A depth-1 clone has no HEAD~1: the rule is skipped with the reason; registration is still judged."""
    clone = _clone_of_a_kernel_change_on_main(repo, tmp_path_factory.mktemp("ci") / "clone", 1, unregistered)
    done = _gate(clone, "--all", "--base-ref", "auto")
    assert "determinism change rule not run: a shallow clone without HEAD~1" in done.stdout, done.stdout
    assert "(git ls-files)" in done.stdout, done.stdout
    if unregistered:
        assert done.returncode == 1 and "megatron_deepepv2/fused.py is kernel-bearing" in done.stdout, done.stdout
    else:
        assert done.returncode == 0 and "none of its determinism tests did" not in done.stdout, done.stdout


def test_first_commit_skips_the_change_rule(repo: Path) -> None:
    _git(repo, "checkout", "-q", "--orphan", "root")
    _commit(repo)
    done = _gate(repo, "--all", "--base-ref", "auto")
    assert done.returncode == 0, done.stdout
    assert "determinism change rule not run: HEAD is the first commit" in done.stdout, done.stdout


@pytest.mark.parametrize("where", ["alone", "inside another repository"])
@pytest.mark.parametrize("unregistered", [False, True], ids=["kernel edit", "unregistered kernel"])
def test_auto_base_in_a_copy_without_its_own_git(repo: Path, tmp_path_factory: pytest.TempPathFactory, where: str,
                                                 unregistered: bool) -> None:
    """No history of its own: the rule is skipped saying why, and every file's registration is judged."""
    outer = tmp_path_factory.mktemp("outer")
    if where != "alone":
        _git(outer, "init", "-q")
    copy = shutil.copytree(repo, outer / "vendor" / "project", ignore=shutil.ignore_patterns(".git"))
    _edit(copy, "megatron_deepepv2/ops.py")
    if unregistered:
        (copy / "megatron_deepepv2/fused.py").write_text("import triton\n@triton.jit\ndef k():\n    pass\n")
    done = _gate(copy, "--all", "--base-ref", "auto")
    answers = f"git answers for {outer.resolve()})"
    why = "is not a git checkout (" if where == "alone" else f"has no .git of its own ({answers}"
    assert f"determinism change rule not run: {copy.resolve()} {why}" in done.stdout, done.stdout
    assert "(the folder's files)" in done.stdout, done.stdout
    assert done.returncode == int(unregistered), done.stdout


def test_explicit_base_ref_needs_a_checkout_of_its_own(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    outer = tmp_path_factory.mktemp("outer")
    _git(outer, "init", "-q")
    copy = shutil.copytree(repo, outer / "project", ignore=shutil.ignore_patterns(".git"))
    done = _gate(copy, "--base-ref", "HEAD")
    assert done.returncode == 2 and "needs the project's own git checkout" in done.stderr, done.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_runs_the_change_rule() -> None:
    """``make test`` runs the gate with the change rule against the change's base, and passes make's labels on."""
    done = subprocess.run(["make", "-n", "-s", "test", "DETERMINISM_LABELS=determinism-exempt"], cwd=ROOT,
                          capture_output=True, text=True)
    gate = [line for line in done.stdout.splitlines() if "check_kernel_determinism_coverage.py" in line]
    assert len(gate) == 1 and gate[0].endswith(
        "tools/check_kernel_determinism_coverage.py --all --base-ref auto --labels determinism-exempt"
    ), done.stdout + done.stderr

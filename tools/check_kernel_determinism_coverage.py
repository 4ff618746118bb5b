#!/usr/bin/env python3
"""Determinism coverage gate: kernel-bearing code must be registered in ``manifest.py`` and tested.

Violations (exit code 1):

* a kernel-bearing file (registered, or matching the manifest's content patterns) is not registered;
* a manifest entry has neither determinism tests nor an exempt reason, or names paths that do not exist;
* a registered source changed while none of its determinism tests changed (the *change rule*; a warning instead
  with the ``determinism-exempt`` label).

Usage::

    tools/check_kernel_determinism_coverage.py --base-ref origin/main [--labels determinism-exempt]
    tools/check_kernel_determinism_coverage.py --files megatron_deepepv2/ops.py tests/determinism/test_replay.py
    tools/check_kernel_determinism_coverage.py --all          # every file of the project, registration only (also
                                                              # in a copy without its own .git)
    tools/check_kernel_determinism_coverage.py --all --base-ref auto    # make test: registration of every file,
                                        # and the change rule against the change's base (labels: DETERMINISM_LABELS=)

``--base-ref auto`` compares against the merge base with ``upstream/main`` or ``origin/main`` (the first that
exists), or against ``HEAD~1`` when there is neither or HEAD is already on it (a fresh clone of main: its last commit
is the change). Where there is no such base -- a copy without its own ``.git``, a shallow clone without ``HEAD~1``,
a first commit -- it says why, skips the change rule and judges the registration of every file. A diff is against
the working tree, so uncommitted edits of tracked files count. A commit of the change whose message has the trailer
``Determinism-exempt: <why>`` labels the change ``determinism-exempt`` as ``--labels`` does (a change that touches a
kernel's file without touching what it computes: a log line, a docstring).

Exit codes: 0 clean, 1 violations, 2 usage error. Standard library only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional, Sequence


def load_manifest(path: Path) -> ModuleType:
    """Loads ``manifest.py`` by file path (no package import, no torch)."""
    spec = importlib.util.spec_from_file_location("determinism_manifest", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _git(root: Path, *args: str) -> list[str]:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return [line for line in done.stdout.splitlines() if line.strip()]


def _git_value(root: Path, *args: str) -> Optional[str]:
    """The first line git prints for ``args``, or None when git fails or prints nothing."""
    try:
        lines = _git(root, *args)
    except RuntimeError:
        return None
    return lines[0].strip() if lines else None


#: Folders of a working tree that hold no project source (environments, caches, build outputs, git's own).
NOT_SOURCE = {".git", ".venv", ".compat", "__pycache__", ".pytest_cache", "build", "dist", ".gpu", ".whl",
              "third_party", "out"}

#: Remote branches whose merge base with HEAD is the base of a change (``--base-ref auto``), first found first.
UPSTREAM_REFS = ("upstream/main", "origin/main")


def not_own_checkout(root: Path) -> Optional[str]:
    """Why ``root`` is not a git checkout of its own, or None when it is.

    A copy without its own ``.git`` is either alone (git answers nothing) or inside another repository (git answers
    for that one, which tracks none of these files under these paths).

    Args:
        root: The project's root folder.

    Returns:
        None when ``git rev-parse --show-toplevel`` run in ``root`` names ``root`` itself, else the reason.
    """
    try:
        toplevel = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    except OSError as error:  # no git at all
        return f"git cannot run ({error})"
    if toplevel.returncode != 0:
        said = toplevel.stderr.strip().splitlines()
        return f"{root} is not a git checkout ({said[-1] if said else 'git gave no reason'})"
    if Path(toplevel.stdout.strip()).resolve() != root.resolve():
        return f"{root} has no .git of its own (git answers for {toplevel.stdout.strip()})"
    return None


def project_files(root: Path) -> tuple[list[str], str]:
    """Every file of the project, and where the list came from.

    In the project's own git checkout, git's tracked files. A copy without its own ``.git`` (alone, where git answers
    nothing, or inside another repository, where git answers for that one and tracks none of these files) is walked
    instead, leaving out :data:`NOT_SOURCE` folders and ``*.egg-info``.

    Args:
        root: The project's root folder.

    Returns:
        Root-relative paths, and ``"git ls-files"`` or ``"the folder's files"``.
    """
    if not_own_checkout(root) is None:
        return _git(root, "ls-files"), "git ls-files"
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in NOT_SOURCE and not d.endswith(".egg-info"))
        files += [os.path.relpath(os.path.join(folder, name), root) for name in sorted(names)]
    return files, "the folder's files"


#: The commit-message trailer that labels a change ``determinism-exempt`` (its value says why).
EXEMPT_TRAILER = "Determinism-exempt:"


def trailer_labels(root: Path, base: str) -> list[str]:
    """``["determinism-exempt"]`` when a commit after ``base`` (up to HEAD) has the :data:`EXEMPT_TRAILER` trailer with
    a reason, else ``[]``; each such trailer is printed."""
    lines = _git(root, "log", "--format=%B", f"{base}..HEAD")
    trailers = [line.strip() for line in lines
                if line.strip().lower().startswith(EXEMPT_TRAILER.lower()) and line.split(":", 1)[1].strip()]
    for trailer in trailers:
        print(f"determinism change rule: labelled determinism-exempt by the commit trailer {trailer!r}")
    return ["determinism-exempt"] if trailers else []


def changed_files(root: Path, base_ref: str) -> list[str]:
    """Files added, copied, modified or renamed since the merge base with ``base_ref`` (working tree included)."""
    return _git(root, "diff", "--name-only", "--diff-filter=ACMR", "--merge-base", base_ref)


def auto_base(root: Path) -> tuple[Optional[str], str]:
    """The base of the change being judged, for ``--base-ref auto``.

    The merge base of HEAD with the first of :data:`UPSTREAM_REFS` that exists; ``HEAD~1`` when none exists, when the
    merge base cannot be found (a shallow history) or when it is HEAD itself (HEAD is on the upstream branch, as in a
    fresh clone of main: its last commit is the change).

    Args:
        root: The project's root folder.

    Returns:
        ``(commit, how it was chosen)``, or ``(None, why there is no base)``: not a git checkout of its own, no commit
        yet, a shallow clone without ``HEAD~1``, or a first commit.
    """
    reason = not_own_checkout(root)
    if reason is not None:
        return None, reason
    head = _git_value(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    if head is None:
        return None, "HEAD names no commit yet"
    note = "no upstream branch (" + " or ".join(UPSTREAM_REFS) + ")"
    for ref in UPSTREAM_REFS:
        if _git_value(root, "rev-parse", "--verify", "--quiet", f"refs/remotes/{ref}^{{commit}}") is None:
            continue
        base = _git_value(root, "merge-base", "HEAD", f"refs/remotes/{ref}")
        if base is not None and base != head:
            return base, f"the merge base with {ref}"
        note = f"HEAD is on {ref}" if base == head else f"no merge base with {ref} in this history"
        break
    parent = _git_value(root, "rev-parse", "--verify", "--quiet", "HEAD~1^{commit}")
    if parent is not None:
        return parent, f"HEAD~1, the previous commit: {note}"
    if _git_value(root, "rev-parse", "--is-shallow-repository") == "true":
        return None, f"a shallow clone without HEAD~1 ({note}; 'git fetch --deepen=1' brings HEAD~1)"
    return None, "HEAD is the first commit: nothing before it to compare with"


def manifest_violations(root: Path, manifest: ModuleType) -> list[str]:
    """Entries with a duplicate name, both or neither of tests and an exempt reason, or paths that do not exist."""
    violations: list[str] = []
    names = [entry.name for entry in manifest.KERNELS]
    for duplicate in sorted({n for n in names if names.count(n) > 1}):
        violations.append(f"manifest entry name {duplicate!r} is used more than once")
    for entry in manifest.KERNELS:
        if bool(entry.tests) == bool(entry.exempt_reason):
            violations.append(
                f"manifest entry {entry.name!r} must have determinism tests or an exempt reason (exactly one)"
            )
        for path in (*entry.sources, *entry.tests):
            if not (root / path).exists():
                violations.append(f"manifest entry {entry.name!r} names {path}, which does not exist")
    return violations


def registration_violations(root: Path, manifest: ModuleType, files: Sequence[str]) -> list[str]:
    """Kernel-bearing library files among ``files`` that no manifest entry registers."""
    violations: list[str] = []
    for path in sorted(set(files)):
        if not manifest.is_scanned(path) or not (root / path).is_file() or manifest.entries_for(path):
            continue
        found = manifest.kernel_patterns_in((root / path).read_text(encoding="utf-8", errors="replace"))
        if found:
            violations.append(
                f"{path} is kernel-bearing ({', '.join(found)}) but not registered in manifest.py; add a "
                "KernelEntry with its determinism tests (or an exempt reason)"
            )
    return violations


def change_rule(manifest: ModuleType, changed: Sequence[str], labels: Sequence[str]) -> tuple[list[str], list[str]]:
    """The change rule: a registered source that changed needs one of its determinism tests changed too.

    Args:
        manifest: The loaded manifest module.
        changed: Repository-relative paths changed since the base.
        labels: Change labels (``determinism-exempt`` turns the violations into warnings).

    Returns:
        ``(violations, warnings)`` as sentences, each naming the sources, the entry and the tests that must change.
    """
    violations: list[str] = []
    warnings: list[str] = []
    exempt = manifest.EXEMPT_LABEL in labels
    changed_set = set(changed)
    for entry in manifest.KERNELS:
        touched = sorted(changed_set.intersection(entry.sources))
        if not touched or not entry.tests or changed_set.intersection(entry.tests):
            continue
        message = (
            f"{', '.join(touched)} changed (manifest entry {entry.name!r}) but none of its determinism tests "
            f"did: {', '.join(entry.tests)}"
        )
        (warnings if exempt else violations).append(
            message + (f" [allowed by label {manifest.EXEMPT_LABEL!r}]" if exempt else
                       f"; update a test or label the change {manifest.EXEMPT_LABEL!r} (a commit trailer "
                       f"'{EXEMPT_TRAILER} <why>', --labels; make test: "
                       f"DETERMINISM_LABELS={manifest.EXEMPT_LABEL})")
        )
    return violations, warnings


def change_summary(manifest: ModuleType, changed: Sequence[str]) -> str:
    """Which registered kernels (entries and their changed sources) and determinism tests are among ``changed``."""
    changed_set = set(changed)
    kernels = [f"{entry.name} ({', '.join(sorted(changed_set.intersection(entry.sources)))})"
               for entry in manifest.KERNELS if changed_set.intersection(entry.sources)]
    tests = sorted(changed_set.intersection(test for entry in manifest.KERNELS for test in entry.tests))
    return (f"{len(changed_set)} file(s) changed; kernels changed: {', '.join(kernels) or 'none'}; "
            f"determinism tests changed: {', '.join(tests) or 'none'}")


def check(root: Path, manifest: ModuleType, files: Sequence[str], labels: Sequence[str],
          changed: Optional[Sequence[str]] = None) -> tuple[list[str], list[str]]:
    """Runs the gate.

    Args:
        root: Repository root.
        manifest: The loaded manifest module.
        files: Repository-relative paths whose registration is judged (changed files, or every file).
        labels: Change labels (``determinism-exempt`` downgrades missing test updates to warnings).
        changed: Paths the change rule judges; None leaves the rule out (registration only).

    Returns:
        ``(violations, warnings)`` as sentences.
    """
    violations = manifest_violations(root, manifest) + registration_violations(root, manifest, files)
    warnings: list[str] = []
    if changed is not None:
        rule_violations, warnings = change_rule(manifest, changed, labels)
        violations += rule_violations
    return violations, warnings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-ref", help="judge the files changed since the merge base with this ref; 'auto': with "
                        f"{' or '.join(UPSTREAM_REFS)}, else HEAD~1, else (no history) registration only")
    parser.add_argument("--files", nargs="+", help="judge these repository-relative files")
    parser.add_argument("--all", action="store_true", help="judge every file of the project (registration): git's "
                        "tracked files, or the folder's own where it is not a git checkout of its own")
    parser.add_argument("--labels", nargs="*", default=[], help="labels of the change (e.g. determinism-exempt)")
    parser.add_argument("--root", default=None, help="repository root (default: this file's repository)")
    parser.add_argument("--manifest", default=None, help="manifest path (default: ROOT/manifest.py)")
    return parser


def _select(root: Path, manifest: ModuleType, args: argparse.Namespace) -> tuple[list[str], str, Optional[list[str]]]:
    """The files whose registration is judged, where they came from, and the files the change rule judges (or None).

    Raises:
        RuntimeError: git failed, or an explicit ``--base-ref`` needs a checkout of the project's own.
    """
    if args.files:
        return list(args.files), "given", list(args.files)
    changed: Optional[list[str]] = None
    if args.base_ref == "auto":
        base, how = auto_base(root)
        if base is None:
            print(f"determinism change rule not run: {how}; registration of every file judged instead")
        else:
            changed = _git(root, "diff", "--name-only", "--diff-filter=ACMR", base)
            print(f"determinism change rule: compared with {base[:12]} ({how}); {change_summary(manifest, changed)}")
            args.labels += trailer_labels(root, base)
    elif args.base_ref:
        reason = not_own_checkout(root)
        if reason is not None:
            raise RuntimeError(f"--base-ref {args.base_ref} needs the project's own git checkout: {reason}")
        changed = changed_files(root, args.base_ref)
        print(f"determinism change rule: compared with the merge base with {args.base_ref}; "
              f"{change_summary(manifest, changed)}")
        args.labels += trailer_labels(root, _git(root, "merge-base", "HEAD", args.base_ref)[0])
    if args.all or changed is None:
        files, listed_by = project_files(root)
        return files, listed_by, changed
    return changed, "git diff", changed


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return 2 if exit_.code else 0
    if bool(args.files) == bool(args.all or args.base_ref):
        print("error: give --files, or --all and/or --base-ref", file=sys.stderr)
        return 2
    root = Path(args.root or Path(__file__).resolve().parent.parent).resolve()
    manifest_path = Path(args.manifest) if args.manifest else root / "manifest.py"
    if not manifest_path.is_file():
        print(f"error: manifest {manifest_path} not found", file=sys.stderr)
        return 2
    manifest = load_manifest(manifest_path)
    try:
        files, listed_by, changed = _select(root, manifest, args)  # adds the labels of commit trailers
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    labels = [label for value in args.labels for label in value.split(",") if label]
    violations, warnings = check(root, manifest, files, labels, changed)
    for warning in warnings:
        print(f"warning: {warning}")
    for violation in violations:
        print(f"violation: {violation}")
    print(f"determinism coverage: {len(files)} file(s) checked ({listed_by}), {len(violations)} violation(s), "
          f"{len(warnings)} warning(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Determinism coverage gate: kernel-bearing code must be registered in ``manifest.py`` and tested.

Violations (exit code 1):

* a kernel-bearing file (registered, or matching the manifest's content patterns) is not registered;
* a manifest entry has neither determinism tests nor an exempt reason, or names paths that do not exist;
* a registered source changed while none of its determinism tests changed (a warning instead with the
  ``determinism-exempt`` label).

Usage::

    tools/check_kernel_determinism_coverage.py --base-ref origin/main [--labels determinism-exempt]
    tools/check_kernel_determinism_coverage.py --files megatron_deepepv2/ops.py tests/determinism/test_replay.py
    tools/check_kernel_determinism_coverage.py --all          # every file of the project (CI; also in a copy
                                                              # without its own .git)

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


#: Folders of a working tree that hold no project source (environments, caches, build outputs, git's own).
NOT_SOURCE = {".git", ".venv", ".compat", "__pycache__", ".pytest_cache", "build", "dist", ".gpu", ".whl",
              "third_party", "out"}


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
    try:
        toplevel = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
        own_checkout = toplevel.returncode == 0 and Path(toplevel.stdout.strip()).resolve() == root.resolve()
    except OSError:  # no git at all
        own_checkout = False
    if own_checkout:
        return _git(root, "ls-files"), "git ls-files"
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in NOT_SOURCE and not d.endswith(".egg-info"))
        files += [os.path.relpath(os.path.join(folder, name), root) for name in sorted(names)]
    return files, "the folder's files"


def changed_files(root: Path, base_ref: str) -> list[str]:
    """Files added, copied, modified or renamed since the merge base with ``base_ref``."""
    return _git(root, "diff", "--name-only", "--diff-filter=ACMR", "--merge-base", base_ref)


def check(root: Path, manifest: ModuleType, files: Sequence[str], labels: Sequence[str],
          require_test_update: bool = True) -> tuple[list[str], list[str]]:
    """Runs the gate.

    Args:
        root: Repository root.
        manifest: The loaded manifest module.
        files: Repository-relative paths to judge (changed files, or every file).
        labels: Change labels (``determinism-exempt`` downgrades missing test updates to warnings).
        require_test_update: Whether a changed source needs a changed test.

    Returns:
        ``(violations, warnings)`` as sentences.
    """
    violations: list[str] = []
    warnings: list[str] = []
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

    changed = set(files)
    for path in sorted(changed):
        if not manifest.is_scanned(path) or not (root / path).is_file():
            continue
        entries = manifest.entries_for(path)
        if entries:
            continue
        found = manifest.kernel_patterns_in((root / path).read_text(encoding="utf-8", errors="replace"))
        if found:
            violations.append(
                f"{path} is kernel-bearing ({', '.join(found)}) but not registered in manifest.py; add a "
                "KernelEntry with its determinism tests (or an exempt reason)"
            )

    if require_test_update:
        exempt = manifest.EXEMPT_LABEL in labels
        for entry in manifest.KERNELS:
            touched = sorted(changed.intersection(entry.sources))
            if not touched or not entry.tests or changed.intersection(entry.tests):
                continue
            message = (
                f"{', '.join(touched)} changed (manifest entry {entry.name!r}) but none of its determinism tests "
                f"did: {', '.join(entry.tests)}"
            )
            (warnings if exempt else violations).append(
                message + (f" [allowed by label {manifest.EXEMPT_LABEL!r}]" if exempt else
                           f"; update a test or label the change {manifest.EXEMPT_LABEL!r}")
            )
    return violations, warnings


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--base-ref", help="judge the files changed since the merge base with this ref")
    source.add_argument("--files", nargs="+", help="judge these repository-relative files")
    source.add_argument("--all", action="store_true", help="judge every file of the project (registration only): git's "
                        "tracked files, or the folder's own where it is not a git checkout of its own")
    parser.add_argument("--labels", nargs="*", default=[], help="labels of the change (e.g. determinism-exempt)")
    parser.add_argument("--root", default=None, help="repository root (default: this file's repository)")
    parser.add_argument("--manifest", default=None, help="manifest path (default: ROOT/manifest.py)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return 2 if exit_.code else 0
    root = Path(args.root or Path(__file__).resolve().parent.parent).resolve()
    manifest_path = Path(args.manifest) if args.manifest else root / "manifest.py"
    if not manifest_path.is_file():
        print(f"error: manifest {manifest_path} not found", file=sys.stderr)
        return 2
    manifest = load_manifest(manifest_path)
    labels = [label for value in args.labels for label in value.split(",") if label]
    listed_by = "given"
    try:
        if args.base_ref:
            files, listed_by = changed_files(root, args.base_ref), "git diff"
        elif args.all:
            files, listed_by = project_files(root)
        else:
            files = list(args.files)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    violations, warnings = check(root, manifest, files, labels, require_test_update=not args.all)
    for warning in warnings:
        print(f"warning: {warning}")
    for violation in violations:
        print(f"violation: {violation}")
    print(f"determinism coverage: {len(files)} file(s) checked ({listed_by}), {len(violations)} violation(s), "
          f"{len(warnings)} warning(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())

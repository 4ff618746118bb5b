"""Whether the tests run in the package's own git checkout: a copy of the project without its own ``.git``, placed
inside another repository (vendored, a monorepo), makes every ``git`` call answer for that repository instead."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]


def not_own_checkout(root: Path = ROOT) -> Optional[str]:
    """Why ``root`` is not a git checkout of its own (for ``pytest.skip``), or None when it is.

    Args:
        root: The project's root folder.

    Returns:
        None when ``git rev-parse --show-toplevel`` run in ``root`` names ``root`` itself; otherwise a reason that
        says what git answered.
    """
    toplevel = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    if toplevel.returncode != 0:
        return f"{root} is not a git checkout: {toplevel.stderr.strip()}"
    if Path(toplevel.stdout.strip()).resolve() != root.resolve():
        return f"{root} is not a git checkout of its own: git answers for {toplevel.stdout.strip()}"
    return None

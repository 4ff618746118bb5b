"""The package's code shape: every ``.py`` under ``megatron_deepepv2/`` keeps its lines at most 120 columns and every
function (methods and nested functions included) at most 60 lines, the rule the hot-path test applies to its six
modules (``test_import_graph.py``), here over the whole package. Each failure lists every offender as ``path:line``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_deepepv2"
MAX_COLUMNS = 120
MAX_FUNCTION_LINES = 60


def _sources(package: Path) -> list[Path]:
    """Every Python file under ``package``, in a fixed order."""
    return sorted(package.rglob("*.py"))


def _where(path: Path, line: int, base: Path) -> str:
    """``path:line`` with ``path`` relative to ``base``."""
    return f"{path.relative_to(base).as_posix()}:{line}"


def long_lines(package: Path, base: Path = ROOT) -> list[str]:
    """Lines over :data:`MAX_COLUMNS`.

    Args:
        package: The folder whose ``.py`` files are read.
        base: What the reported paths are relative to.

    Returns:
        One ``path:line (N columns)`` entry per offending line.
    """
    return [f"{_where(path, number, base)} ({len(line)} columns)"
            for path in _sources(package)
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_COLUMNS]


def long_functions(package: Path, base: Path = ROOT) -> list[str]:
    """Functions (``def`` and ``async def`` at any depth) longer than :data:`MAX_FUNCTION_LINES`, decorators not
    counted, docstring and body counted, as the hot-path test counts them.

    Args:
        package: The folder whose ``.py`` files are parsed.
        base: What the reported paths are relative to.

    Returns:
        One ``path:line name (N lines)`` entry per offending function, ``line`` being its ``def``.
    """
    found = []
    for path in _sources(package):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append((path, node.lineno, f"{node.name} ({length} lines)"))
    return [f"{_where(path, line, base)} {what}" for path, line, what in sorted(found)]


def test_no_line_of_the_package_is_over_120_columns() -> None:
    """Every line of every module of the package fits in 120 columns."""
    offenders = long_lines(PACKAGE)
    assert not offenders, f"{len(offenders)} line(s) over {MAX_COLUMNS} columns:\n" + "\n".join(offenders)


def test_no_function_of_the_package_is_over_60_lines() -> None:
    """Every function of the package, methods and nested functions included, is at most 60 lines long."""
    offenders = long_functions(PACKAGE)
    assert not offenders, (f"{len(offenders)} function(s) over {MAX_FUNCTION_LINES} lines:\n"
                           + "\n".join(offenders))


def test_the_checks_find_what_is_over_the_limits_and_only_that(tmp_path: Path) -> None:
    """On a package written here: a 121-column line and a 61-line method are reported where they are; a 120-column
    line and a 60-line function are not."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    at_limit = "def short() -> None:\n" + "    pass\n" * (MAX_FUNCTION_LINES - 1)
    over = "class Thing:\n    def long(self) -> None:\n" + "        pass\n" * MAX_FUNCTION_LINES
    (package / "__init__.py").write_text("x = '" + "a" * (MAX_COLUMNS - 6) + "'\n")  # 120 columns
    (package / "sub" / "mod.py").write_text(at_limit + over + "y = '" + "b" * (MAX_COLUMNS - 5) + "'\n")
    line_of_long = MAX_FUNCTION_LINES + 2
    assert long_lines(package, tmp_path) == [f"pkg/sub/mod.py:{line_of_long + MAX_FUNCTION_LINES + 1} (121 columns)"]
    assert long_functions(package, tmp_path) == [f"pkg/sub/mod.py:{line_of_long} long (61 lines)"]

"""The package's code shape: every ``.py`` under ``megatron_deepepv2/`` keeps its lines at most 120 columns and every
function (methods and nested functions included) at most 60 lines, and the backend-neutral modules (the package root,
the contract and the registry) name no backend in their strings. Each failure lists every offender as ``path:line``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_deepepv2"
MAX_COLUMNS = 120
MAX_FUNCTION_LINES = 60
#: A backend named in a string: DeepEP (not the ``deepepv2`` dispatcher), its module, its buffers, the reference backend.
BACKEND_NAME = re.compile(r"\bDeepEP\b|\bdeep_ep\b|ElasticBuffer|EPBuffer|reference backend", re.IGNORECASE)


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


def neutral_modules(package: Path) -> list[Path]:
    """The modules that serve every backend: the package root (its ``__init__`` aside, which imports the built-in
    backends), the contract ``backends/base.py`` and the registry ``backends/registry.py``."""
    return sorted(path for path in package.glob("*.py") if path.name != "__init__.py") + [
        package / "backends" / "base.py", package / "backends" / "registry.py"]


def backend_names_in_strings(files: list[Path], base: Path = ROOT) -> list[str]:
    """Strings (messages, log lines; docstrings and comments aside) of ``files`` that name a backend
    (:data:`BACKEND_NAME`).

    Args:
        files: The modules to read.
        base: What the reported paths are relative to.

    Returns:
        One ``path:line 'text'`` entry per offending string.
    """
    found = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        found += [f"{_where(path, node.lineno, base)} {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and BACKEND_NAME.search(node.value)]
    return sorted(found)


def test_the_backend_neutral_modules_name_no_backend() -> None:
    """What every backend runs through speaks of no backend: a fix that belongs to one backend is said in that
    backend's own ``*_reason`` texts or messages."""
    files = neutral_modules(PACKAGE)
    assert {"ops.py", "validation.py", "base.py", "registry.py"} <= {path.name for path in files}
    offenders = backend_names_in_strings(files)
    assert not offenders, f"{len(offenders)} string(s) name a backend:\n" + "\n".join(offenders)


def test_backend_names_are_found_in_messages_only(tmp_path: Path) -> None:
    """On a module written here: a message naming DeepEP, deep_ep or the reference backend is reported; a docstring
    that does, a comment that does and the dispatcher's own name ``deepepv2`` are not."""
    module = tmp_path / "mod.py"
    module.write_text('"""Built over DeepEP."""\n'
                      'def f() -> None:\n'
                      '    """Calls deep_ep."""\n'
                      '    # DeepEP asserts this\n'
                      '    print("deepepv2 dispatch")\n'
                      '    raise ValueError(f"install DeepEP {1}")\n'
                      'MESSAGES = ("import deep_ep", "or the reference backend")\n')
    assert backend_names_in_strings([module], tmp_path) == [
        "mod.py:6 'install DeepEP '", "mod.py:7 'import deep_ep'", "mod.py:7 'or the reference backend'"]


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

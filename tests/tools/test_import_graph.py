"""tools/import_graph.py: floors, cycles, lazy and type-only imports, package inits, line counts and the gates, on small
packages written here, and structural truths of the real package."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools import import_graph

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "import_graph.py"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    """Writes a package ``pkg`` (an empty ``__init__.py`` unless given) and returns its directory."""
    package = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return package


def _report(package: Path, *args: str, capsys: pytest.CaptureFixture, tmp_path: Path) -> tuple[int, str, dict]:
    """Runs the tool's ``main``; returns its exit status, text report and JSON report."""
    out = tmp_path / "report.json"
    status = import_graph.main(["--package", str(package), "--json", str(out), *args])
    return status, capsys.readouterr().out, json.loads(out.read_text())


def _floors(report: dict) -> list[list[str]]:
    return [floor["modules"] for floor in report["floors"]]


def _edges(report: dict) -> dict[tuple[str, str], str]:
    return {(e["from"], e["to"]): e["kind"] for e in report["edges"]}


def test_a_chain_stands_on_three_floors(tmp_path, capsys):
    package = _package(tmp_path, {"a.py": "import pkg.b\n", "b.py": "from pkg.c import f\n", "c.py": "def f(): pass\n"})
    status, text, report = _report(package, capsys=capsys, tmp_path=tmp_path)
    assert status == 0
    assert _floors(report) == [["c", "pkg"], ["b"], ["a"]]
    assert _edges(report) == {("a", "b"): "module", ("b", "c"): "module"}
    assert "floor 1: c, pkg\nfloor 2: b\nfloor 3: a\n" in text
    assert text.rstrip().endswith("floors: 3\narrows up: 0")


def test_roots_keep_only_what_they_reach(tmp_path, capsys):
    package = _package(tmp_path, {"a.py": "import pkg.b\n", "b.py": "import pkg.c\n", "c.py": "", "d.py": ""})
    _, text, report = _report(package, "--roots", "b", capsys=capsys, tmp_path=tmp_path)
    assert _floors(report) == [["c"], ["b"]]
    assert _edges(report) == {("b", "c"): "module"}
    assert "reachable from b" in text


def test_a_cycle_is_one_node_and_each_of_its_edges_is_an_arrow_up(tmp_path, capsys):
    package = _package(tmp_path, {
        "a.py": "from pkg import b\n",
        "b.py": "def g():\n    from pkg.a import x\n",
        "c.py": "import pkg.a\n",
        "d.py": "",
    })
    _, text, report = _report(package, capsys=capsys, tmp_path=tmp_path)
    assert report["cycles"] == [{"floor": 1, "members": ["a", "b"]}]
    assert _floors(report) == [["a", "b", "d", "pkg"], ["c"]]
    assert {(e["from"], e["to"], e["kind"]) for e in report["arrows_up"]} == {("a", "b", "module"), ("b", "a", "lazy")}
    assert "  a -> b (module, line 1)\n  b -> a (lazy, line 2)\n" in text
    assert text.rstrip().endswith("floors: 2\narrows up: 2")


def test_an_import_inside_a_function_is_a_lazy_arrow(tmp_path, capsys):
    package = _package(tmp_path, {
        "a.py": "import os\n\nclass K:\n    def m(self):\n        import pkg.b\n",
        "b.py": "",
        "c.py": "try:\n    from pkg import b\nexcept ImportError:\n    pass\n",
    })
    _, text, report = _report(package, capsys=capsys, tmp_path=tmp_path)
    assert _edges(report) == {("a", "b"): "lazy", ("c", "b"): "module"}
    assert _floors(report) == [["b", "pkg"], ["a", "c"]]
    assert "lazy imports:\n  a -> b (lazy, line 5)\n" in text


def test_a_type_checking_import_is_no_arrow(tmp_path, capsys):
    package = _package(tmp_path, {
        "a.py": """\
            from typing import TYPE_CHECKING
            import typing
            if TYPE_CHECKING:
                from pkg.b import B
            if typing.TYPE_CHECKING:
                import pkg.c
            else:
                import pkg.d
            """,
        "b.py": "",
        "c.py": "",
        "d.py": "",
    })
    _, text, report = _report(package, capsys=capsys, tmp_path=tmp_path)
    assert _edges(report) == {("a", "d"): "module"}
    assert [(e["from"], e["to"], e["kind"]) for e in report["type_only"]] == [("a", "b", "type-only"),
                                                                              ("a", "c", "type-only")]
    assert _floors(report) == [["b", "c", "d", "pkg"], ["a"]]
    assert "type-only imports (not arrows):\n  a -> b (type-only, line 4)\n" in text


def test_from_the_package_a_submodule_is_the_submodule_and_a_name_is_the_init(tmp_path, capsys):
    package = _package(tmp_path, {
        "__init__.py": "VERSION = 1\n",
        "a.py": "from pkg import b, VERSION\n",
        "b.py": "",
        "c.py": "from . import b\nfrom .b import thing\n",
        "d.py": "import pkg\n",
    })
    _, _, report = _report(package, capsys=capsys, tmp_path=tmp_path)
    assert _edges(report) == {("a", "b"): "module", ("a", "pkg"): "module", ("c", "b"): "module",
                              ("d", "pkg"): "module"}


def test_a_submodule_imported_from_outside_its_package_runs_the_package_init(tmp_path, capsys):
    package = _package(tmp_path, {
        "sub/__init__.py": "from pkg.sub.mod import X\n",
        "sub/mod.py": "X = 1\n",
        "sub/other.py": "import pkg.sub.mod\nfrom .mod import X\n",
        "outside.py": "from pkg.sub.mod import X\n",
        "relative.py": "from .sub import mod\n",
    })
    _, _, report = _report(package, capsys=capsys, tmp_path=tmp_path)
    assert _edges(report) == {
        ("outside", "sub"): "module", ("outside", "sub.mod"): "module",
        ("relative", "sub"): "module", ("relative", "sub.mod"): "module",
        ("sub", "sub.mod"): "module",
        ("sub.other", "sub.mod"): "module",
    }
    assert _floors(report) == [["pkg", "sub.mod"], ["sub", "sub.other"], ["outside", "relative"]]


def test_rooms_are_the_root_modules_and_the_subpackages_whole(tmp_path, capsys):
    """``--rooms``: one node per root module (the top ``__init__`` included) and per subpackage; an arrow between two
    rooms stands for the module imports behind it, of the strongest kind; imports inside a room are no arrow; two
    rooms importing each other through different modules are a cycle of rooms though the modules form none."""
    package = _package(tmp_path, {
        "__init__.py": "from pkg.top import T\n",
        "top.py": "import pkg.sub.y\nT = 1\n",
        "low.py": "",
        "sub/__init__.py": "",
        "sub/x.py": "import pkg.low\nfrom pkg.sub import y\n",
        "sub/y.py": "def f():\n    import pkg.low\n",
        "side/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.low\n",
        "side/deep/__init__.py": "",
        "side/deep/z.py": "import pkg.top\n",
        "other.py": "import pkg.sub.x\n",
    })
    status, text, report = _report(package, "--rooms", capsys=capsys, tmp_path=tmp_path)
    assert status == 0
    assert report["rooms"] == {"count": 6, "root_modules": ["low", "other", "pkg", "top"],
                               "subpackages": ["side", "sub"]}
    assert _floors(report) == [["low"], ["sub"], ["other", "top"], ["pkg", "side"]]
    assert _edges(report) == {("other", "sub"): "module", ("pkg", "top"): "module", ("side", "top"): "module",
                              ("sub", "low"): "module", ("top", "sub"): "module"}
    via = {(e["from"], e["to"]): e["via"] for e in report["edges"]}
    assert via[("sub", "low")] == ["sub.x -> low", "sub.y -> low"]  # module and lazy: the edge is of kind module
    assert via[("top", "sub")] == ["top -> sub", "top -> sub.y"]  # the subpackage's init runs first
    assert [(e["from"], e["to"]) for e in report["type_only"]] == [("side", "low")]
    assert "sub -> low (module, via sub.x -> low, sub.y -> low)" not in text  # module edges are not listed as lazy
    assert text.rstrip().endswith("rooms: 6 (root modules: 4, subpackages: 2)\nfloors: 4\narrows up: 0")
    # The module graph of the same package: more nodes, no rooms line.
    _, text, report = _report(package, capsys=capsys, tmp_path=tmp_path)
    assert "rooms" not in report and "rooms:" not in text and "side.deep.z" in str(report["floors"])


def test_rooms_that_import_each_other_through_different_modules_are_a_cycle(tmp_path, capsys):
    package = _package(tmp_path, {
        "a.py": "import pkg.sub.y\n",
        "sub/__init__.py": "",
        "sub/x.py": "def f():\n    import pkg.a\n",
        "sub/y.py": "",
    })
    status, _, report = _report(package, capsys=capsys, tmp_path=tmp_path)
    assert (status, report["arrows_up_count"]) == (0, 0)
    status, text, report = _report(package, "--rooms", "--max-arrows-up", "0", capsys=capsys, tmp_path=tmp_path)
    assert status == 1
    assert report["cycles"] == [{"floor": 1, "members": ["a", "sub"]}]
    assert "  a -> sub (module, via a -> sub, a -> sub.y)\n  sub -> a (lazy, via sub.x -> a)\n" in text
    # Line counts still name modules; the roots name rooms.
    status, text, report = _report(package, "--rooms", "--roots", "sub", "--modules", "sub.x", capsys=capsys,
                                   tmp_path=tmp_path)
    assert report["line_counts"]["modules"] == {"sub.x": {"total": 2, "code": 2}}
    assert report["rooms"]["count"] == 2 and "reachable from sub" in text


def test_code_lines_leave_out_blanks_comments_and_docstrings(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent('''\
        """Module docstring,
        on two lines."""
        # a comment

        import os  # code with a comment: 1

        TEXT = """a string that is
        not a docstring"""  # 2 and 3


        class K:  # 4
            """Class docstring."""

            field: int = 0  # 5
            """Attribute docstring."""

            def f(self) -> int:  # 6
                """Function docstring,

                with a blank line.
                """
                return (1 +  # 7
                        2)  # 8
        '''))
    assert import_graph.count_lines(path) == import_graph.LineCount(total=23, code=8)


def test_line_counts_of_the_listed_modules_and_their_sum(tmp_path, capsys):
    package = _package(tmp_path, {"a.py": '"""Doc."""\nx = 1\n\ny = 2\n', "b.py": "# note\nz = 3\n"})
    _, text, report = _report(package, "--modules", "a,pkg.b", capsys=capsys, tmp_path=tmp_path)
    assert report["line_counts"] == {"modules": {"a": {"total": 4, "code": 2}, "b": {"total": 2, "code": 1}},
                                     "sum": {"total": 6, "code": 3}}
    assert "sum      6      3" in text


def test_the_limits_fail_only_when_exceeded(tmp_path, capsys, caplog):
    package = _package(tmp_path, {"a.py": "import pkg.b\n", "b.py": "import pkg.c\n", "c.py": "import pkg.b\n"})
    status, _, report = _report(package, capsys=capsys, tmp_path=tmp_path)
    assert (status, report["floor_count"], report["arrows_up_count"]) == (0, 2, 2)
    assert import_graph.main(["--package", str(package), "--max-floors", "2", "--max-arrows-up", "2"]) == 0
    assert import_graph.main(["--package", str(package), "--max-floors", "1"]) == 1
    assert "the import graph has 2 floors, more than --max-floors 1 allows" in caplog.text
    caplog.clear()
    assert import_graph.main(["--package", str(package), "--max-arrows-up", "1"]) == 1
    assert "2 arrows back up, more than --max-arrows-up 1 allows (b -> c (module, line 1)" in caplog.text


def test_bad_input_is_named_and_exits_2(tmp_path, capsys, caplog):
    package = _package(tmp_path, {"a.py": "import pkg.b\n", "b.py": ""})
    assert import_graph.main(["--package", str(package), "--roots", "a,nope"]) == 2
    assert "--roots names nope, not a module of pkg; known modules: a, b, pkg" in caplog.text
    assert import_graph.main(["--package", str(package), "--modules", "zzz"]) == 2
    assert "--modules names zzz" in caplog.text
    assert import_graph.main(["--package", str(tmp_path / "missing")]) == 2
    assert "does not exist" in caplog.text
    (package / "broken.py").write_text("def f(:\n")
    assert import_graph.main(["--package", str(package)]) == 2
    assert f"{package / 'broken.py'}:1: does not parse" in caplog.text
    assert capsys.readouterr().out == ""


def _package_imports(path: Path, top: str) -> bool:
    """Whether a file holds any import of the package, absolute or relative, anywhere."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == top):
            return True
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == top for alias in node.names):
            return True
    return False


def test_on_the_real_package_floors_follow_the_imports(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(TOOL), "--json", str(out)], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert done.stdout.rstrip().endswith(f"floors: {report['floor_count']}\narrows up: {report['arrows_up_count']}")
    package = ROOT / "megatron_deepepv2"
    floor_of = {name: floor["floor"] for floor in report["floors"] for name in floor["modules"]}
    names = {}
    for path in package.rglob("*.py"):
        if "__pycache__" not in path.parts:
            parts = path.relative_to(package).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "megatron_deepepv2"] = path
    assert set(floor_of) == set(names)
    # A file that imports nothing of the package stands on floor 1.
    for name, path in names.items():
        if not _package_imports(path, "megatron_deepepv2"):
            assert floor_of[name] == 1, name
    # Every arrow between two modules not in one cycle points down; every arrow inside a cycle is an arrow up.
    cycle_of = {name: number for number, cycle in enumerate(report["cycles"]) for name in cycle["members"]}
    arrows_up = {(e["from"], e["to"]) for e in report["arrows_up"]}
    for edge in report["edges"]:
        pair = (edge["from"], edge["to"])
        if edge["from"] in cycle_of and cycle_of[edge["from"]] == cycle_of.get(edge["to"]):
            assert pair in arrows_up
            assert floor_of[edge["from"]] == floor_of[edge["to"]]
        else:
            assert floor_of[edge["from"]] > floor_of[edge["to"]], pair
            assert pair not in arrows_up
    assert len(arrows_up) == report["arrows_up_count"]


def test_on_the_real_package_a_root_stands_on_the_top_floor_of_what_it_reaches(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert import_graph.main(["--roots", "mcore.manager", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "mcore.manager" in report["floors"][-1]["modules"]
    reached = {name for floor in report["floors"] for name in floor["modules"]}
    assert reached >= {target for edge in report["edges"] for target in (edge["from"], edge["to"])}


#: Where a dispatch starts: the Megatron manager, and the DeepEP adapter that makes DeepEP's calls over a built buffer
#: (its build is the registered subclass's, ``backends.deepep.backend``, which the package's top module imports).
DISPATCH_ROOTS = "mcore.manager,backends.deepep.adapter"
#: The most code lines (not blank, not only a comment, not a docstring) the modules a dispatch reaches may hold.
DISPATCH_CODE_LINES = 1_897
#: What only DeepEP's buffer build reaches: no dispatch imports it (nor DeepEP's buffer arithmetic, ``sizing``, which
#: only the tests and tools read).
DEEPEP_BUILD = ("backends.deepep.backend", "backends.deepep.lines", "backends.deepep.probes",
                "backends.deepep.topology")
#: The most code lines the DeepEP build reaches beyond what a dispatch reaches.
DEEPEP_BUILD_CODE_LINES = 398


def _reached(roots: str, tmp_path: Path, capsys: pytest.CaptureFixture, *limits: str) -> list[str]:
    """The modules ``roots`` reach by the import graph, floor by floor (the tool's limits asserted as given)."""
    out = tmp_path / "reached.json"
    assert import_graph.main(["--roots", roots, "--json", str(out), *limits]) == 0, capsys.readouterr().out
    return [name for floor in json.loads(out.read_text())["floors"] for name in floor["modules"]]


def test_what_a_dispatch_reaches_stays_flat_one_way_and_short(tmp_path, capsys):
    """From the Megatron manager and the DeepEP adapter down, every module they import, found by the import graph (no
    hand list): at most 7 floors, no import back up, at most :data:`DISPATCH_CODE_LINES` code lines in all (docstrings
    state contracts; reasons and measurements live in docs/internals.md). Line lengths and function lengths hold
    package-wide (tests/tools/test_code_shape.py)."""
    reached = _reached(DISPATCH_ROOTS, tmp_path, capsys, "--max-floors", "7", "--max-arrows-up", "0")
    assert {"mcore.manager", "ops", "buffers", "validation", "agreement", "failures", "groups", "backends.base",
            "backends.deepep.adapter"} <= set(reached), reached
    assert not {*DEEPEP_BUILD, "backends.deepep.sizing"} & set(reached), reached
    assert _code_lines(reached, tmp_path) <= DISPATCH_CODE_LINES


def _code_lines(modules: list[str], tmp_path: Path) -> int:
    """The code lines of ``modules``, summed (the tool's ``--modules``)."""
    out = tmp_path / "lines.json"
    assert import_graph.main(["--modules", ",".join(modules), "--json", str(out)]) == 0
    counts = json.loads(out.read_text())["line_counts"]
    assert set(counts["modules"]) == set(modules), counts
    return counts["sum"]["code"]


def test_the_deepep_build_stands_apart_from_the_dispatch_and_is_counted_too(tmp_path, capsys):
    """The registered DeepEP backend builds the buffer over the adapter: it reaches every module of the build
    (:data:`DEEPEP_BUILD`), which no dispatch reaches, and at most :data:`DEEPEP_BUILD_CODE_LINES` code lines beyond
    what a dispatch reaches."""
    dispatch = set(_reached(DISPATCH_ROOTS, tmp_path, capsys))
    build = _reached("backends.deepep.backend", tmp_path, capsys, "--max-arrows-up", "0")
    assert {"backends.deepep.adapter", *DEEPEP_BUILD} <= set(build), build
    assert _code_lines([name for name in build if name not in dispatch], tmp_path) <= DEEPEP_BUILD_CODE_LINES


#: What a backend may import beyond the backends themselves: the neutral core of the package root.
BACKEND_MAY_IMPORT = {"config", "groups", "agreement", "failures", "layout", "fp8", "kernels"}


def test_backends_stand_on_the_neutral_core_only(tmp_path, capsys):
    """Every module under ``backends/`` reaches only backends and the neutral core (:data:`BACKEND_MAY_IMPORT`):
    never ``ops``, ``buffers``, ``validation``, ``expert_ids``, ``mcore``, ``cli`` or ``testing``, which stand on
    the backends."""
    package = ROOT / "megatron_deepepv2"
    modules = sorted(".".join(path.relative_to(package).with_suffix("").parts)
                     for path in (package / "backends").rglob("*.py") if path.name != "__init__.py")
    assert {"backends.base", "backends.reference", "backends.deepep.backend"} <= set(modules), modules
    reached = set(_reached(",".join(modules), tmp_path, capsys, "--max-arrows-up", "0"))
    beyond = {name for name in reached if name.split(".")[0] != "backends" and name not in BACKEND_MAY_IMPORT}
    assert not beyond, f"backends import {sorted(beyond)}"


#: The command-line tools: the cli subpackage.
TOOLS = ("cli",)


def test_the_library_stands_apart_from_its_tools(tmp_path, capsys):
    """What a training step imports (the package's top module, ``install()`` included) stands in at most 7 floors
    and reaches no tool; the whole package, tools on top, in at most 9; no import runs back up anywhere."""
    out = tmp_path / "library.json"
    assert import_graph.main(["--roots", "megatron_deepepv2", "--json", str(out), "--max-floors", "7",
                              "--max-arrows-up", "0"]) == 0, capsys.readouterr().out
    reached = {name for floor in json.loads(out.read_text())["floors"] for name in floor["modules"]}
    assert {"mcore.integration", "mcore.manager", "ops", "buffers", "backends.deepep.adapter",
            "backends.reference"} <= reached
    assert not [name for name in reached if name.split(".")[0] in TOOLS], reached
    whole = tmp_path / "package.json"
    assert import_graph.main(["--json", str(whole), "--max-floors", "9", "--max-arrows-up", "0"]) == 0, \
        capsys.readouterr().out
    floors = json.loads(whole.read_text())["floors"]
    tools_floor = min(number for number, floor in enumerate(floors, 1)
                      if any(name.split(".")[0] in TOOLS and name not in ("cli", "cli.doctor", "cli.install_deepep")
                             for name in floor["modules"]))
    assert tools_floor > 7, floors  # the tools that import the library stand above it


def test_the_package_stands_in_few_rooms_on_few_floors(tmp_path, capsys):
    """Drawn by rooms (each root module and each subpackage, whole): at most 18 rooms on at most 9 floors, no arrow
    back up between rooms, and at most 12 modules at the package root (its ``__init__`` included); the DeepEP backend
    and what only it uses stand in ``backends``, what serves only Megatron in ``mcore``."""
    out = tmp_path / "rooms.json"
    assert import_graph.main(["--rooms", "--json", str(out), "--max-floors", "9", "--max-arrows-up", "0"]) == 0, \
        capsys.readouterr().out
    rooms = json.loads(out.read_text())["rooms"]
    assert rooms["count"] <= 18 and len(rooms["root_modules"]) <= 12, rooms
    assert {"backends", "cli", "mcore", "testing"} <= set(rooms["subpackages"]), rooms
    moved = {"deepep_lines", "receive_order", "sizing", "topology", "integration", "manager", "megatron_config",
             "experts", "expert_kernels", "bounded_receive", "doctor", "demo", "install_deepep", "run"}
    assert not moved & set(rooms["root_modules"]), rooms

#!/usr/bin/env python3
"""The package's internal import graph, in floors: which module stands on which, cycles, and arrows back up.

The package is read as text with :mod:`ast`; nothing of it is imported, so the tool runs without torch or Megatron.

* A node is a module of the package: ``ops.py`` is ``ops``, ``backends/base.py`` is ``backends.base``,
  ``backends/__init__.py`` is ``backends``, and the top ``__init__.py`` carries the package's own name.
* An edge is an import of another module of the package, absolute or relative, wherever it stands. One at module
  level (class bodies and ``try`` blocks included) is of kind ``module``; one inside a function is ``lazy`` (it
  still runs, only later). One under ``if TYPE_CHECKING:`` never runs: it is listed as ``type-only`` and is no
  edge. A pair of modules joined by several imports is one edge of the strongest kind (module, then lazy).
* Targets follow Python's own import system. ``from pkg.x import y`` reaches ``x.y`` when that is a submodule, else
  ``x``. Importing a submodule also runs the ``__init__`` of every package above it, so ``backends.base`` imported
  from outside ``backends`` adds an edge to ``backends`` too; from inside ``backends`` that init is already running
  and adds nothing. The top ``__init__`` runs before every module and is an edge only where its names are read:
  ``import pkg`` or ``from pkg import name`` where ``name`` is no module.
* Floor 1 holds the modules that import no other module of the package; a module's floor is one more than the
  highest floor it imports. A cycle (a strongly connected component of more than one module) is one node for the
  floors; every edge inside it points to the same floor, an "arrow back up", and each is listed.
* ``--rooms`` draws the same graph over the package's rooms, its top-level entries: each module at the package root
  (the top ``__init__`` included, under the package's name) and each subpackage, whole. An arrow joins two rooms when
  a module of one imports a module of the other (the strongest kind wins, and the module imports behind it are
  listed); imports inside a room are no arrow. The report then counts the rooms and the modules at the root.

Usage::

    tools/import_graph.py                                  # the whole package
    tools/import_graph.py --roots manager                  # manager and everything it imports
    tools/import_graph.py --modules manager,ops --json graph.json
    tools/import_graph.py --max-floors 8 --max-arrows-up 0 # a gate for CI
    tools/import_graph.py --rooms                          # root modules and subpackages as the nodes

Exit codes: 0 report written (and within the limits), 1 a ``--max-*`` limit exceeded, 2 bad input (unknown module,
no package, a file that does not parse). Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import logging
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

log = logging.getLogger("import_graph")

DEFAULT_PACKAGE = Path(__file__).resolve().parent.parent / "megatron_deepepv2"

MODULE, LAZY, TYPE_ONLY = "module", "lazy", "type-only"
# Strongest first: a pair imported both ways is an edge of the first kind that occurs.
_KIND_RANK = {MODULE: 0, LAZY: 1, TYPE_ONLY: 2}

_NOT_CODE_TOKENS = frozenset(
    {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
     tokenize.ENDMARKER}
)


class GraphError(ValueError):
    """Input the graph cannot be built from: no package directory, a file that does not parse, an unknown module."""


@dataclass(frozen=True)
class Edge:
    """One arrow between two modules of the package.

    Attributes:
        source: The importing module, e.g. ``ops``.
        target: The imported module, e.g. ``backends.base``.
        kind: ``module``, ``lazy`` or ``type-only`` (the strongest of the imports behind it).
        lines: Line numbers in ``source`` of the import statements behind the edge, ascending (empty between rooms).
        via: Between rooms: the module edges behind it, as ``module -> module`` texts, sorted; empty otherwise.
    """

    source: str
    target: str
    kind: str
    lines: tuple[int, ...]
    via: tuple[str, ...] = ()

    def as_json(self) -> dict:
        """The edge as a JSON object: ``from``, ``to``, ``kind``, ``lines`` (and ``via`` between rooms)."""
        out = {"from": self.source, "to": self.target, "kind": self.kind, "lines": list(self.lines)}
        if self.via:
            out["via"] = list(self.via)
        return out


@dataclass
class ImportGraph:
    """The modules of one package and the imports between them.

    Attributes:
        top: The package's own name (its directory name); the node of the top ``__init__.py``.
        modules: Module name to file, for every ``.py`` file of the package.
        edges: Arrows (kinds ``module`` and ``lazy``), one per ordered pair of modules, sorted.
        type_only: Imports under ``if TYPE_CHECKING:`` between pairs that have no arrow, sorted.
        unresolved: Sentences naming imports of the package that reach no module (stale or misspelt).
        rooms: Whether the nodes are rooms (:func:`room_graph`): ``modules`` then maps a room to its file or folder.
    """

    top: str
    modules: dict[str, Path]
    edges: list[Edge]
    type_only: list[Edge]
    unresolved: list[str] = field(default_factory=list)
    rooms: bool = False

    def successors(self) -> dict[str, set[str]]:
        """Module name to the set of modules it imports through an arrow (every module is a key)."""
        out: dict[str, set[str]] = {name: set() for name in self.modules}
        for edge in self.edges:
            out[edge.source].add(edge.target)
        return out


@dataclass(frozen=True)
class Layering:
    """Floors, cycles and arrows back up of a graph (or of the part of it reachable from some roots).

    Attributes:
        floor_of: Module name to its floor, counted from 1.
        floors: ``floors[i]`` lists the modules on floor ``i + 1``, sorted.
        cycles: Each cycle's members, sorted; cycles ordered by floor, then by first member.
        arrows_up: Every edge whose ends share a cycle, sorted.
    """

    floor_of: dict[str, int]
    floors: list[list[str]]
    cycles: list[list[str]]
    arrows_up: list[Edge]


@dataclass(frozen=True)
class LineCount:
    """Line counts of one file.

    Attributes:
        total: Every line of the file.
        code: Lines holding code: not blank, not only a comment, not part of a docstring (a statement that is only
            a string literal: the docstring of a module, class or function, or an attribute docstring).
    """

    total: int
    code: int


def discover_modules(package_dir: Path) -> dict[str, Path]:
    """Names every module of a package directory.

    Args:
        package_dir: The package's directory (holding its ``__init__.py``).

    Returns:
        Module name to file, sorted by name; the top ``__init__.py`` is named after the directory.

    Raises:
        GraphError: ``package_dir`` is not a directory or holds no ``.py`` file.
    """
    if not package_dir.is_dir():
        raise GraphError(f"package directory {package_dir} does not exist; pass --package PATH to the package")
    top = package_dir.name
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir)
        if any(part == "__pycache__" or part.startswith(".") for part in relative.parts):
            continue
        parts = relative.with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts) if parts else top] = path
    if not modules:
        raise GraphError(f"{package_dir} holds no .py file; pass --package PATH to the package")
    return dict(sorted(modules.items()))


def _is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` test is ``TYPE_CHECKING`` or ``<module>.TYPE_CHECKING``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Yields every import statement of a module with its kind (module, lazy or type-only)."""

    def walk(nodes: Iterable[ast.AST], in_function: bool, type_only: bool) -> Iterator[tuple[ast.AST, str]]:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, TYPE_ONLY if type_only else LAZY if in_function else MODULE
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, in_function, True)
                yield from walk(node.orelse, in_function, type_only)
            elif isinstance(node, ast.If) and isinstance(node.test, ast.UnaryOp) and isinstance(
                node.test.op, ast.Not
            ) and _is_type_checking(node.test.operand):
                yield from walk(node.body, in_function, type_only)
                yield from walk(node.orelse, in_function, True)
            else:
                inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(ast.iter_child_nodes(node), inner, type_only)

    yield from walk(tree.body, False, False)  # type: ignore[misc]


class _Resolver:
    """Turns import statements of one package into target module names, as Python's import system would."""

    def __init__(self, top: str, modules: dict[str, Path]) -> None:
        self.top = top
        self.paths = {self._parts(name): name for name in modules}

    def _parts(self, name: str) -> tuple[str, ...]:
        return () if name == self.top else tuple(name.split("."))

    def _name(self, parts: tuple[str, ...]) -> str:
        return self.paths[parts]

    def targets(
        self, importer: str, is_package: bool, node: ast.Import | ast.ImportFrom
    ) -> tuple[list[str], list[str]]:
        """The modules one import statement runs.

        Args:
            importer: The importing module's name.
            is_package: Whether the importer is a package ``__init__``.
            node: The import statement.

        Returns:
            ``(targets, unresolved)``: target module names (the importer itself left out) and sentences naming the
            parts of the statement that reach no module of the package.
        """
        here = self._parts(importer)
        explicit: list[tuple[str, ...]] = []
        unresolved: list[str] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                path = self._inside(alias.name)
                if path is None:
                    continue
                if path in self.paths:
                    explicit.append(path)
                else:
                    unresolved.append(f"line {node.lineno}: import {alias.name}")
        else:
            base: Optional[tuple[str, ...]]
            if node.level:
                package = here if is_package else here[:-1]
                if node.level - 1 > len(package):
                    unresolved.append(f"line {node.lineno}: relative import above the package")
                    return [], unresolved
                base = package[: len(package) - (node.level - 1)] + (
                    tuple(node.module.split(".")) if node.module else ()
                )
            else:
                base = self._inside(node.module or "")
                if base is None:
                    return [], []
            for alias in node.names:
                if alias.name != "*" and base + (alias.name,) in self.paths:
                    explicit.append(base + (alias.name,))
                elif base in self.paths:
                    explicit.append(base)
                else:
                    dots = "." * node.level
                    unresolved.append(f"line {node.lineno}: from {dots}{node.module or ''} import {alias.name}")
        reached: list[tuple[str, ...]] = []
        for path in explicit:
            reached.append(path)
            # Every package above the target runs its __init__ first, unless the importer is inside it (then that
            # init is already running). The top package runs before anything and is left out.
            for depth in range(1, len(path)):
                package = path[:depth]
                if package in self.paths and here[:depth] != package:
                    reached.append(package)
        names = [self._name(path) for path in dict.fromkeys(reached) if path != here]
        return names, unresolved

    def _inside(self, dotted: str) -> Optional[tuple[str, ...]]:
        """The path of an absolute dotted name inside the package, or None for another package's name."""
        if dotted == self.top:
            return ()
        if dotted.startswith(self.top + "."):
            return tuple(dotted[len(self.top) + 1 :].split("."))
        return None


def build_graph(package_dir: Path) -> ImportGraph:
    """Reads every module of a package and collects the imports between them.

    Args:
        package_dir: The package's directory.

    Returns:
        The package's :class:`ImportGraph`.

    Raises:
        GraphError: No such package, or a file of it does not parse (the message names the file and line).
    """
    modules = discover_modules(package_dir)
    top = package_dir.name
    resolver = _Resolver(top, modules)
    found: dict[tuple[str, str], tuple[str, list[int]]] = {}
    unresolved: list[str] = []
    for name, path in modules.items():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as error:
            raise GraphError(f"{path}:{error.lineno}: does not parse ({error.msg}); fix the file or wait for the edit "
                             "in progress to finish") from error
        for node, kind in _imports(tree):
            targets, missing = resolver.targets(name, path.name == "__init__.py", node)
            unresolved.extend(f"{name} {sentence}" for sentence in missing)
            for target in targets:
                old_kind, lines = found.get((name, target), (kind, []))
                best = min(old_kind, kind, key=_KIND_RANK.__getitem__)
                found[(name, target)] = (best, lines + [node.lineno])
    edges, type_only = [], []
    for (source, target), (kind, lines) in sorted(found.items()):
        edge = Edge(source, target, kind, tuple(sorted(set(lines))))
        (type_only if kind == TYPE_ONLY else edges).append(edge)
    return ImportGraph(top=top, modules=modules, edges=edges, type_only=type_only, unresolved=unresolved)


def room_of(module: str, top: str) -> str:
    """The room of a module: the top-level entry of the package it belongs to (``backends.base`` is in ``backends``;
    ``ops`` and the top ``__init__``, named ``top``, are rooms of their own)."""
    return module if module == top else module.split(".", 1)[0]


def root_modules(graph: ImportGraph) -> list[str]:
    """The nodes that are files at the package root (the top ``__init__`` included), sorted: of a module graph or of
    a room graph alike."""
    root = graph.modules[graph.top].parent
    return sorted(name for name, path in graph.modules.items() if path.parent == root and path.suffix == ".py")


def room_graph(graph: ImportGraph) -> ImportGraph:
    """The graph over the package's rooms: each root module and each subpackage is one node.

    Args:
        graph: The package's module graph (:func:`build_graph`).

    Returns:
        An :class:`ImportGraph` with ``rooms`` set: a room maps to its file (a root module) or folder (a
        subpackage); an arrow joins two rooms when a module of one imports a module of the other, of the strongest
        kind behind it, its ``via`` naming those module imports; imports inside one room are dropped. Type-only
        imports between rooms with no arrow are kept the same way; unresolved imports are named by room.
    """
    rooms: dict[str, Path] = {}
    for name, path in graph.modules.items():
        room = room_of(name, graph.top)
        rooms.setdefault(room, path.parent if room != graph.top and path.name == "__init__.py" else path)

    def collapse(edges: list[Edge]) -> dict[tuple[str, str], tuple[str, list[str]]]:
        found: dict[tuple[str, str], tuple[str, list[str]]] = {}
        for edge in edges:
            pair = (room_of(edge.source, graph.top), room_of(edge.target, graph.top))
            if pair[0] != pair[1]:
                kind, via = found.get(pair, (edge.kind, []))
                kind = min(kind, edge.kind, key=_KIND_RANK.__getitem__)
                found[pair] = (kind, via + [f"{edge.source} -> {edge.target}"])
        return found

    arrows = collapse(graph.edges)
    edges = [Edge(source, target, kind, (), tuple(sorted(via)))
             for (source, target), (kind, via) in sorted(arrows.items())]
    type_only = [Edge(source, target, kind, (), tuple(sorted(via)))
                 for (source, target), (kind, via) in sorted(collapse(graph.type_only).items())
                 if (source, target) not in arrows]
    unresolved = [f"{room_of(sentence.split(' ', 1)[0], graph.top)} ({sentence})" for sentence in graph.unresolved]
    return ImportGraph(top=graph.top, modules=dict(sorted(rooms.items())), edges=edges, type_only=type_only,
                       unresolved=unresolved, rooms=True)


def strongly_connected_components(successors: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, without recursion.

    Args:
        successors: Node to the nodes it points to; every node is a key, and every successor is a key.

    Returns:
        The components, each sorted, in reverse topological order: a component comes after every component it
        points to.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def enter(node: str) -> tuple[str, Iterator[str]]:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return node, iter(sorted(successors[node]))

    for root in sorted(successors):
        if root in index:
            continue
        work = [enter(root)]
        while work:
            node, pending = work[-1]
            for nxt in pending:
                if nxt not in index:
                    work.append(enter(nxt))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def reachable(graph: ImportGraph, roots: Sequence[str]) -> set[str]:
    """The roots and every module they reach through arrows (module-level and lazy imports).

    Raises:
        GraphError: A root is no module of the package.
    """
    successors = graph.successors()
    _check_known(graph, roots, "--roots")
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(successors[node] - seen)
    return seen


def layer(graph: ImportGraph, only: Optional[set[str]] = None) -> Layering:
    """Floors, cycles and arrows back up.

    Args:
        graph: The package's graph.
        only: Restrict to these modules; must be closed under arrows (as :func:`reachable` returns), else floors
            would miss what the kept modules stand on. None keeps every module.

    Returns:
        The :class:`Layering` of the kept modules.
    """
    kept = set(graph.modules) if only is None else only
    successors = {name: targets & kept for name, targets in graph.successors().items() if name in kept}
    floor_of: dict[str, int] = {}
    cycles: list[list[str]] = []
    component_of: dict[str, int] = {}
    for number, component in enumerate(strongly_connected_components(successors)):
        members = set(component)
        below = {target for member in component for target in successors[member] - members}
        floor = 1 + max((floor_of[target] for target in below), default=0)
        for member in component:
            floor_of[member] = floor
            component_of[member] = number
        if len(component) > 1:
            cycles.append(component)
    floors = [sorted(name for name, f in floor_of.items() if f == number) for number in
              range(1, max(floor_of.values(), default=0) + 1)]
    cycles.sort(key=lambda members: (floor_of[members[0]], members))
    arrows_up = [
        edge for edge in graph.edges
        if edge.source in kept and edge.target in kept and component_of[edge.source] == component_of[edge.target]
    ]
    return Layering(floor_of=floor_of, floors=floors, cycles=cycles, arrows_up=arrows_up)


def count_lines(path: Path) -> LineCount:
    """Counts the lines of one Python file.

    Args:
        path: The file.

    Returns:
        Its :class:`LineCount`. A line is code when it holds (part of) a token that is neither a comment nor part
        of a statement that is only a string literal; a multi-line string that is not a docstring counts on every
        line it spans.
    """
    text = path.read_text(encoding="utf-8")
    docstrings = [
        ((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset))
        for node in ast.walk(ast.parse(text, filename=str(path)))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in _NOT_CODE_TOKENS:
            continue
        if any(start <= token.start and token.end <= end for start, end in docstrings):
            continue
        code.update(range(token.start[0], token.end[0] + 1))
    return LineCount(total=len(text.splitlines()), code=len(code))


def _check_known(graph: ImportGraph, names: Sequence[str], option: str) -> None:
    unknown = [name for name in names if name not in graph.modules]
    if unknown:
        raise GraphError(f"{option} names {', '.join(unknown)}, not a module of {graph.top}; known modules: "
                         f"{', '.join(graph.modules)}")


def _names(text: Optional[str], top: str) -> list[str]:
    """Splits a comma list of module names; ``<top>.x`` is accepted for ``x``."""
    if not text:
        return []
    names = [name.strip() for name in text.split(",") if name.strip()]
    return [name[len(top) + 1 :] if name.startswith(top + ".") else name for name in names]


def build_report(graph: ImportGraph, roots: Sequence[str] = (), line_modules: Sequence[str] = (),
                 modules: Optional[ImportGraph] = None) -> dict:
    """The report as a JSON-ready dictionary.

    Args:
        graph: The package's graph, of modules or of rooms (:func:`room_graph`).
        roots: Restrict the floors, edges, cycles and arrows to what these nodes reach; empty for every node.
        line_modules: Modules to count lines of (any module of the package, whatever the roots).
        modules: The module graph the line counts read, where ``graph`` is of rooms (default: ``graph``).

    Returns:
        ``{"package", "roots", "floors": [{"floor", "modules"}], "edges": [...], "type_only": [...],
        "cycles": [{"floor", "members"}], "arrows_up": [...], "unresolved": [...],
        "line_counts": {"modules": {name: {"total", "code"}}, "sum": {"total", "code"}}}``, with
        ``floor_count`` and ``arrows_up_count``. Edges are as :meth:`Edge.as_json`. A room graph adds
        ``"rooms": {"count", "root_modules", "subpackages"}`` (the rooms kept, the root's modules named).

    Raises:
        GraphError: A root or a line-count module is no node of the package.
    """
    kept = reachable(graph, roots) if roots else set(graph.modules)
    counted = modules or graph
    _check_known(counted, line_modules, "--modules")
    layering = layer(graph, kept)
    counts = {name: count_lines(counted.modules[name]) for name in line_modules}
    rooms = {}
    if graph.rooms:
        root = [name for name in root_modules(graph) if name in kept]
        rooms = {"rooms": {"count": len(kept), "root_modules": root,
                           "subpackages": sorted(kept - set(root))}}
    return {**rooms,
        "package": graph.top,
        "roots": list(roots),
        "floors": [{"floor": number, "modules": names} for number, names in enumerate(layering.floors, start=1)],
        "edges": [e.as_json() for e in graph.edges if e.source in kept and e.target in kept],
        "type_only": [e.as_json() for e in graph.type_only if e.source in kept],
        "cycles": [{"floor": layering.floor_of[members[0]], "members": members} for members in layering.cycles],
        "arrows_up": [e.as_json() for e in layering.arrows_up],
        "unresolved": [sentence for sentence in graph.unresolved if sentence.split(" ", 1)[0] in kept],
        "line_counts": {
            "modules": {name: {"total": c.total, "code": c.code} for name, c in counts.items()},
            "sum": {"total": sum(c.total for c in counts.values()), "code": sum(c.code for c in counts.values())},
        },
        "floor_count": len(layering.floors),
        "arrows_up_count": len(layering.arrows_up),
    }


def _edge_text(edge: dict) -> str:
    if edge.get("via"):
        return f"{edge['from']} -> {edge['to']} ({edge['kind']}, via {', '.join(edge['via'])})"
    lines = ", ".join(str(n) for n in edge["lines"])
    return f"{edge['from']} -> {edge['to']} ({edge['kind']}, line{'s' if len(edge['lines']) > 1 else ''} {lines})"


def format_report(report: dict) -> str:
    """The report as readable text: one line per floor, then cycles, arrows up, lazy and type-only imports, line
    counts, of a room graph the ``rooms: N (root modules: M, subpackages: S)`` line, and the closing ``floors: N``
    and ``arrows up: M`` lines."""
    roots = f" reachable from {', '.join(report['roots'])}" if report["roots"] else ""
    nodes = " rooms" if "rooms" in report else ""
    out = [f"import graph of {report['package']}{nodes}{roots}"]
    out += [f"floor {f['floor']}: {', '.join(f['modules'])}" for f in report["floors"]]
    out.append("cycles:" + ("" if report["cycles"] else " none"))
    out += [f"  floor {c['floor']}: {', '.join(c['members'])}" for c in report["cycles"]]
    out.append("arrows back up:" + ("" if report["arrows_up"] else " none"))
    out += [f"  {_edge_text(e)}" for e in report["arrows_up"]]
    lazy = [e for e in report["edges"] if e["kind"] == LAZY]
    out.append("lazy imports:" + ("" if lazy else " none"))
    out += [f"  {_edge_text(e)}" for e in lazy]
    out.append("type-only imports (not arrows):" + ("" if report["type_only"] else " none"))
    out += [f"  {_edge_text(e)}" for e in report["type_only"]]
    if report["unresolved"]:
        out.append("imports that reach no module:")
        out += [f"  {sentence}" for sentence in report["unresolved"]]
    counts = report["line_counts"]["modules"]
    if counts:
        width = max(len(name) for name in [*counts, "sum"])
        out.append(f"lines: {'module'.ljust(width)}  total   code")
        for name, c in [*counts.items(), ("sum", report["line_counts"]["sum"])]:
            out.append(f"       {name.ljust(width)}  {c['total']:5d}  {c['code']:5d}")
    if "rooms" in report:
        rooms = report["rooms"]
        out.append(f"rooms: {rooms['count']} (root modules: {len(rooms['root_modules'])}, subpackages: "
                   f"{len(rooms['subpackages'])})")
    out.append(f"floors: {report['floor_count']}")
    out.append(f"arrows up: {report['arrows_up_count']}")
    return "\n".join(out)


def gate(report: dict, max_floors: Optional[int], max_arrows_up: Optional[int]) -> list[str]:
    """Sentences naming each limit the report exceeds; empty when within every limit given (None: no limit)."""
    failures = []
    if max_floors is not None and report["floor_count"] > max_floors:
        top = report["floors"][-1]["modules"]
        failures.append(f"the import graph has {report['floor_count']} floors, more than --max-floors {max_floors} "
                        f"allows (top floor: {', '.join(top)}); move code down or raise the limit")
    if max_arrows_up is not None and report["arrows_up_count"] > max_arrows_up:
        arrows = "; ".join(_edge_text(e) for e in report["arrows_up"])
        failures.append(f"the import graph has {report['arrows_up_count']} arrows back up, more than --max-arrows-up "
                        f"{max_arrows_up} allows ({arrows}); break the cycle or raise the limit")
    return failures


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--package", type=Path, default=DEFAULT_PACKAGE,
                        help="the package directory (default: megatron_deepepv2 of this repository)")
    parser.add_argument("--rooms", action="store_true",
                        help="one node per room: each module at the package root and each subpackage, whole")
    parser.add_argument("--roots", help="comma list of modules (rooms with --rooms): report only what they reach")
    parser.add_argument("--modules", help="comma list of modules to count lines of (total and code), with the sum")
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this path")
    parser.add_argument("--max-floors", type=int, help="exit 1 when the graph has more floors than this")
    parser.add_argument("--max-arrows-up", type=int, help="exit 1 when the graph has more arrows back up than this")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the tool.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 within the limits, 1 a limit exceeded, 2 bad input.
    """
    args = _parser().parse_args(argv)
    try:
        graph = build_graph(args.package)
        drawn = room_graph(graph) if args.rooms else graph
        report = build_report(drawn, _names(args.roots, graph.top), _names(args.modules, graph.top), graph)
    except GraphError as error:
        log.error("import_graph: %s", error)
        return 2
    # The report is this tool's output, so it goes to stdout as plain text.
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    failures = gate(report, args.max_floors, args.max_arrows_up)
    for failure in failures:
        log.error("import_graph: %s", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    sys.exit(main())

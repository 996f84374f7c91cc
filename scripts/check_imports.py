"""The import contracts of ditorch and op_tools, checked on the source (run by ``make lint``).

    python scripts/check_imports.py [ROOT]      # exit 0, or 1 listing every broken contract

Every ``import`` statement counts, including those inside functions (an import deferred into a function still
closes a circle: it only hides it until the function runs); those under ``if TYPE_CHECKING:`` do not (they never
run). A package's ``__init__`` is a module of its own; importing ``a.b.c`` counts as an edge to ``a.b.c`` only.

The contracts (``CONTRACTS``):

* no circle among the modules of ``ditorch`` nor among those of ``op_tools``;
* ``ditorch`` never imports ``op_tools``, and ``op_tools`` never imports ``ditorch`` (a tool works on plain
  PyTorch, on any device), but where the import is optional (inside ``try: ... except ImportError``: the replay
  picks ditorch's device where ditorch is installed, as a user's script would);
* the offline code (``OFFLINE``: the replay, ``run_op_from_data``, the conformance report, ``compare_runs``)
  never reaches the engine or a tool (``ONLINE``), directly or through other modules;
* each folder of ``op_tools`` is a layer (``LAYERS``, lowest first): a module never imports one of a higher layer,
  nor one of another folder of its own layer, nor the package's face (``op_tools/__init__.py``, ``__main__.py``
  and the shims kept at the original paths), which sits above every layer.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterable

PACKAGES = ("ditorch", "op_tools")
OFFLINE = ("op_tools.offline", "op_tools.run_op_from_data", "op_tools.conformance", "op_tools.compare_runs")
ONLINE = ("op_tools.core", "op_tools.tools", "op_tools.__main__")
# op_tools' layers, lowest first; folders in one tuple are side by side (neither imports the other)
LAYERS = (("ops",), ("numerics",), ("config",), ("output",), ("core", "offline"), ("tools",))

Graph = dict[str, dict[str, str]]  # module -> imported module -> "file:line" of the first such import
OPTIONAL = " (optional)"  # the end of a "file:line" whose import sits in try/except ImportError


def _in(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def modules_of(root: str) -> dict[str, str]:
    """Dotted module name -> file, for every module of ``PACKAGES`` under ``root``."""
    found = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(root, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    parts = os.path.relpath(path, root)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts.pop()
                    found[".".join(parts)] = path
    return found


_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")  # the fields of a node that hold statements


def _statements(node: ast.AST) -> list[ast.stmt]:
    """Every statement under ``node`` (itself included when it is one), in source order. Imports are statements: the
    expressions, nine nodes in ten, are never visited (``ast.walk`` spent most of this script's time on them)."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        if isinstance(current, ast.stmt):
            found.append(current)
        for field in _BLOCKS:
            stack.extend(getattr(current, field, None) or ())
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _type_checking_only(statements: list[ast.stmt]) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never run)."""
    skipped: set[int] = set()
    for node in statements:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in _statements(stmt))
    return skipped


def _optional(statements: list[ast.stmt]) -> set[int]:
    """ids of the nodes inside ``try:`` blocks that catch ImportError (an import that may fail)."""
    optional: set[int] = set()
    for node in statements:
        if isinstance(node, ast.Try) and any(
                h.type is not None and any(name in ast.unparse(h.type) for name in ("ImportError", "ModuleNotFound"))
                for h in node.handlers):
            optional.update(id(n) for stmt in node.body for n in _statements(stmt))
    return optional


def imports_of(module: str, path: str, known: set[str]) -> dict[str, str]:
    """The modules of ``known`` that ``module`` imports -> where."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    statements = _statements(tree)
    skipped = _type_checking_only(statements)
    optional = _optional(statements)
    edges: dict[str, str] = {}

    def add(target: str, node: ast.stmt) -> None:
        while target and target not in known:  # `from .x import name`: the module x
            target = target.rpartition(".")[0]
        if target and target != module:
            edges.setdefault(target, f"{path}:{node.lineno}" + (OPTIONAL if id(node) in optional else ""))

    for node in statements:
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                add(submodule if submodule in known else target, node)
    return edges


def import_graph(root: str) -> Graph:
    files = modules_of(root)
    known = set(files)
    return {module: imports_of(module, path, known) for module, path in files.items()}


def cycles(graph: Graph) -> list[list[str]]:
    """One circle per strongly connected component of two modules or more (Tarjan), as a path back to its start."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_in(graph, set(c), c[0]) for c in components]


def _circle_in(graph: Graph, members: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``members`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w not in members or w in previous:
                    continue
                previous[w] = v
                if w == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(previous[path[-1]])
                    return list(reversed(path))
                following.append(w)
        frontier = following
    return [start]


def reaches(graph: Graph, start: str, targets: Iterable[str]) -> list[str] | None:
    """A path of imports from ``start`` to a module in ``targets``, or None."""
    targets = tuple(targets)
    previous: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w in previous:
                    continue
                previous[w] = v
                if _in(w, targets):
                    path = [w]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])  # type: ignore[arg-type]  # checked just above
                    return list(reversed(path))
                following.append(w)
        frontier = following
    return None


def layer_of(module: str) -> tuple[int, str] | None:
    """(level, folder) of an op_tools module in ``LAYERS``; None for one of the package's face."""
    parts = module.split(".")
    if len(parts) > 2 and parts[0] == "op_tools":
        for level, folders in enumerate(LAYERS):
            if parts[1] in folders:
                return level, parts[1]
    return None


def upward_imports(graph: Graph) -> list[str]:
    """Each import by a layer's module of a higher layer's, of a side-by-side folder's, or of the package's face."""
    problems = []
    for module, edges in sorted(graph.items()):
        source = layer_of(module)
        if source is None:
            continue
        for target, where in sorted(edges.items()):
            if not _in(target, ("op_tools",)):
                continue
            dest = layer_of(target)
            if dest is None:
                problems.append(f"{module} imports {target} ({where}): layer {source[1]} is below the package's face")
            elif dest[0] > source[0]:
                problems.append(f"{module} imports {target} ({where}): layer {source[1]} is below layer {dest[1]}")
            elif dest[0] == source[0] and dest[1] != source[1]:
                problems.append(f"{module} imports {target} ({where}): layers {source[1]} and {dest[1]} are side by "
                                "side")
    return problems


def _where(graph: Graph, path: list[str]) -> str:
    return " -> ".join(path) + f" (first import at {graph[path[0]][path[1]]})"


def broken_contracts(graph: Graph) -> list[str]:
    problems = []
    for package in PACKAGES:
        inside = {m: {t: w for t, w in e.items() if _in(t, (package,))} for m, e in graph.items()
                  if _in(m, (package,))}
        for circle in cycles(inside):
            problems.append(f"import circle in {package}: {_where(inside, circle)}")
    for package, other in (("ditorch", "op_tools"), ("op_tools", "ditorch")):
        for module, edges in sorted(graph.items()):
            if _in(module, (package,)):
                for target, where in sorted(edges.items()):
                    if _in(target, (other,)) and not where.endswith(OPTIONAL):
                        problems.append(f"{module} imports {target} ({where}): {package} never imports {other}")
    for module in sorted(m for m in graph if _in(m, OFFLINE)):
        path = reaches(graph, module, ONLINE)
        if path is not None:
            problems.append(f"offline code reaches the engine or a tool: {_where(graph, path)}")
    problems.extend(upward_imports(graph))
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = argv[0] if argv else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    graph = import_graph(root)
    problems = broken_contracts(graph)
    for problem in problems:
        print(problem)
    print(f"import contracts: {len(graph)} modules, {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

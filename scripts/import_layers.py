#!/usr/bin/env python
"""The import graph of ``src/ampflow``: its floors, its circles, its arrows back up.

Every import counts: at module level, inside functions, under ``TYPE_CHECKING``. Nodes are
ampflow's sub-packages (``ampflow.io``) and top-level modules (``ampflow.demo``).

Printed:

* each node's **floor**, computed from the graph alone: 0 for a node that imports nothing
  of ampflow, else one more than the highest floor it imports (defined only without
  circles);
* the edges, with the number of import statements and one place of each;
* **circles** between nodes, and between the modules inside one node;
* **arrows back up**: edges from a node to one in a higher layer of the layers declared in
  ``pyproject.toml`` (``[[tool.importlinter.contracts]]``, the ``layers`` contract that
  ``make lint`` enforces with import-linter, an independent checker);
* whether the foundation (``ampflow.base``) imports anything of ampflow.

``--check`` exits 1 on a circle, an arrow back up or a foundation import.

    python scripts/import_layers.py
    python scripts/import_layers.py --check
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
PACKAGE = "ampflow"
FOUNDATION = "ampflow.base"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def targets(mod: str, path: Path, node: ast.ImportFrom, known: dict) -> list[str]:
    """The ampflow modules one ``from ... import`` reads (a name that is a submodule
    counts as that submodule)."""
    if node.level:
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]


def imports(known: dict[str, Path]):
    """(importing module, imported module, line) for every ampflow import."""
    for mod, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                found = targets(mod, path, node, known)
            else:
                continue
            for t in found:
                if t == PACKAGE or t.startswith(PACKAGE + "."):
                    yield mod, t, node.lineno


def node_of(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def floors(graph: dict[str, set[str]], nodes: list[str]) -> dict[str, int]:
    memo: dict[str, int] = {}

    def floor(v: str) -> int:
        if v not in memo:
            memo[v] = 1 + max((floor(w) for w in graph.get(v, ())), default=-1)
        return memo[v]

    return {v: floor(v) for v in nodes}


def declared_layers() -> list[list[str]]:
    """The ``layers`` contract's layers in ``pyproject.toml``, top first; each a list of
    the nodes it holds (siblings split on ``|`` or ``:``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return []
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text()).get("tool", {}).get("importlinter", {}).get("contracts", [])
    layered = [c for c in contracts if c.get("type") == "layers"]
    if not layered:
        return []
    container = layered[0].get("containers", [PACKAGE])[0]
    out = []
    for layer in layered[0]["layers"]:
        names = [n.strip().strip("()") for n in layer.replace(":", "|").split("|")]
        out.append([f"{container}.{n}" for n in names if n])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 on a circle, an arrow back up or a foundation import")
    args = p.parse_args(argv)

    known = modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    module_graph: dict[str, set[str]] = defaultdict(set)
    for src, dst, line in imports(known):
        place = f"{known[src].relative_to(REPO)}:{line}"
        if node_of(src) != node_of(dst):
            edges[node_of(src), node_of(dst)].append(place)
        if src != dst and dst in known:
            module_graph[src].add(dst)
    nodes = sorted({node_of(m) for m in known} - {PACKAGE})
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        if a != PACKAGE:
            graph[a].add(b)

    problems = 0
    node_circles = circles(graph)
    inner = [c for c in circles(module_graph) if len({node_of(m) for m in c}) == 1]
    layer_of = {n: i for i, layer in enumerate(declared_layers()) for n in layer}
    back_up = [(a, b, places) for (a, b), places in sorted(edges.items()) if a in layer_of and b in layer_of and layer_of[b] < layer_of[a]]
    foundation = sorted({b for (a, b) in edges if a == FOUNDATION})
    undeclared = [n for n in nodes if layer_of and n not in layer_of]

    print(f"# import graph of src/{PACKAGE}: {len(known)} modules, {len(nodes)} nodes, {len(edges)} edges between nodes")
    print("# every import counted: module level, inside functions, under TYPE_CHECKING\n")
    if not node_circles:
        by_floor: dict[int, list[str]] = defaultdict(list)
        for n, f in floors(graph, nodes).items():
            by_floor[f].append(n)
        print("floors (0 imports nothing of ampflow; each node sits one above the highest it imports):")
        for f in sorted(by_floor, reverse=True):
            print(f"  {f:>2}  {', '.join(sorted(by_floor[f]))}")
        print()
    print("edges (importer -> imported: import statements, one place):")
    for (a, b), places in sorted(edges.items()):
        if a != PACKAGE:
            print(f"  {a:<18} -> {b:<18} {len(places):>3}  {places[0]}")
    print()
    print(f"circles between nodes: {len(node_circles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in node_circles))
    print(f"circles between modules of one node: {len(inner)}" + "".join(f"\n  {' <-> '.join(c)}" for c in inner))
    print(f"arrows back up (against the layers in pyproject.toml): {len(back_up)}" + "".join(f"\n  {a} -> {b} ({p[0]})" for a, b, p in back_up))
    print(f"nodes in no declared layer: {len(undeclared)}" + (f" ({', '.join(undeclared)})" if undeclared else ""))
    print(f"the foundation ({FOUNDATION}) imports of ampflow: {', '.join(foundation) or 'nothing'}")
    problems = len(node_circles) + len(inner) + len(back_up) + len(undeclared) + len(foundation)
    if args.check and problems:
        print(f"import layers: {problems} problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

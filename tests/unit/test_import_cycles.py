"""No import cycle among tether's four packages (shared, supervisor, agent, cli).

The graph is read from the source with ``ast``, not from what Python happens to import: every
``import`` and ``from ... import`` anywhere in a module counts, at its top, inside a function and
under ``if TYPE_CHECKING:`` alike. A cycle through a type-only import is still two modules that
cannot be understood (or split) apart, and a function-level import is a cycle deferred to run time.
A failure names every strongly connected set of modules and one cycle through each.

None is tolerated (issue 26). The agent's parts, which take the agent, type it with their
protocol in agent/view.py rather than with daemon.Agent, which imports them.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("shared", "supervisor", "agent", "cli")


def modules() -> dict[str, str]:
    """Dotted name (``tether.supervisor.pmi``) -> source path, for every module of the four."""
    found = {}
    for pkg in PACKAGES:
        for name in sorted(os.listdir(os.path.join(ROOT, pkg))):
            if not name.endswith(".py"):
                continue
            stem = name[:-3]
            dotted = f"tether.{pkg}" if stem == "__init__" else f"tether.{pkg}.{stem}"
            found[dotted] = os.path.join(ROOT, pkg, name)
    return found


def imports_of(path: str, dotted: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that the module at ``path`` imports, wherever it does."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = dotted if path.endswith("__init__.py") else dotted.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(_owner(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else _owner(base, known))
    out.discard("")
    out.discard(dotted)
    return out & known


def _owner(name: str, known: set[str]) -> str:
    """The longest known module that ``name`` is or lies in."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(p, m, known) for m, p in mods.items()}


def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(g[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def one_cycle(g: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside it)."""
    members = set(comp)
    start = comp[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(g[node] & members):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    return comp


def test_the_graph_sees_every_kind_of_import() -> None:
    """The reader itself: a type-only import and a function-level one are edges."""
    g = graph()
    assert "tether.shared.protocol" in g["tether.supervisor.handlers"]
    assert len(g) > 100


def test_no_import_cycle() -> None:
    g = graph()
    comps = strongly_connected(g)
    lines = [" -> ".join(m.removeprefix("tether.") for m in one_cycle(g, c))
             + f"   (all of: {', '.join(m.removeprefix('tether.') for m in c)})"
             for c in comps]
    assert not comps, f"{len(comps)} import cycle(s):\n" + "\n".join(lines)


def test_the_supervisor_has_no_import_cycle_at_all() -> None:
    g = graph()
    assert not [c for c in strongly_connected(g) if c[0].startswith("tether.supervisor.")]


def test_the_cycle_finder_finds_one() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    comps = strongly_connected(g)
    assert comps == [["a", "b", "c"]]
    assert one_cycle(g, comps[0]) == ["a", "b", "c", "a"]

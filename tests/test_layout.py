"""The code's layout: no module imports, even inside a function, a module that imports it back (directly or
through others). A circle hides which part is built on which; the building blocks sit below what uses them."""

import ast
import os

from conftest import REPO

PACKAGES = ("trainer", "parallelism")


def modules() -> dict[str, str]:
    """Every module of the packages, by its dotted name (a package by its own), to its file."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    found[os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")] = path
    return found


def imported(path: str, name: str, known: dict) -> set[str]:
    """The packages' modules a module imports anywhere in it (a name imported from a package counts as its
    module where it is one)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in names:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected parts of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imported(path, name, known) for name, path in known.items()}
    assert len(graph) > 100 and graph["trainer.model.layers"] >= {"trainer.model.primitives"}
    assert not circles(graph), circles(graph)


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

"""The code's layout. No module imports, even inside a function, a module that imports it back (directly or
through others): a circle hides which part is built on which; the building blocks sit below what uses them.
And no module imports from a layer above its own (LAYERS, drawn in docs/layout.md)."""

import ast
import os

from conftest import REPO

PACKAGES = ("trainer", "parallelism")

# The folders, lowest layer first. A module imports from its own folder and from the layers below it, never
# from a layer above nor from a sibling folder of its own layer. trainer/'s only module of its own is its
# package face (trainer/__init__.py).
LAYERS = [
    ["parallelism"],
    ["trainer.config"],
    ["trainer.storage"],
    ["trainer.data"],
    ["trainer.objectives"],
    ["trainer.model"],
    ["trainer.optim"],
    ["trainer.training"],
    ["trainer.evaluation", "trainer.interop"],
    ["trainer.run"],
    ["trainer.planning"],
]


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


def folder_of(module: str) -> str | None:
    """The LAYERS folder a module lives in (None for trainer's package face or a module in no folder)."""
    return next((f for layer in LAYERS for f in layer if module == f or module.startswith(f + ".")), None)


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a folder above its own, or from a sibling folder of its own layer."""
    level = {f: i for i, layer in enumerate(LAYERS) for f in layer}
    found = []
    for module, targets in sorted(graph.items()):
        here = folder_of(module)
        for target in sorted(targets):
            there = folder_of(target)
            if here is not None and there not in (None, here) and level[there] >= level[here]:
                found.append(f"{module} imports {target} ({there} is not below {here})")
    return found


def test_no_module_imports_from_a_layer_above_its_own():
    known = modules()
    loose = sorted(m for m in known if m != "trainer" and folder_of(m) is None)
    assert not loose, f"modules in no folder of LAYERS: {loose}"
    graph = {name: imported(path, name, known) for name, path in known.items()}
    assert graph["trainer.run.loop"] >= {"trainer.training.stability", "trainer.storage.checkpoint"}
    assert not upward(graph), "\n".join(upward(graph))


def test_the_layer_rule_finds_an_import_from_above_and_from_a_sibling():
    graph = {"trainer.data.streams": {"trainer.training.step", "trainer.storage.workdir"},
             "trainer.interop.scoring": {"trainer.evaluation.loss"}}  # fmt: skip
    assert upward(graph) == [
        "trainer.data.streams imports trainer.training.step (trainer.training is not below trainer.data)",
        "trainer.interop.scoring imports trainer.evaluation.loss (trainer.evaluation is not below trainer.interop)",
    ]


# A module is read at a sitting: past this many lines it holds more than one idea, and is split by what it holds.
MOST_LINES = 450


def test_every_module_and_script_reads_at_a_sitting():
    files = list(modules().values())
    for folder in ("scripts", "benchmarks"):
        files += [os.path.join(REPO, folder, n) for n in os.listdir(os.path.join(REPO, folder)) if n.endswith(".py")]
    long = {os.path.relpath(f, REPO): n for f in files if (n := sum(1 for _ in open(f))) > MOST_LINES}
    assert not long, f"over {MOST_LINES} lines: {long}; split each by what it holds"

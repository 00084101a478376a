"""The layers of `app/` (docs/architecture.md): a module imports only from layers below its own, and
no import, function-local or under TYPE_CHECKING, closes a cycle.

The order, lowest first. Packages on one line are peers and do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAYERS: list[tuple[str, ...]] = [
    ("http", "tasks"),  # the HTTP/1.1 server and client | asyncio task helpers: import nothing else of app/
    ("store",),  # what lives on disk: durable files, the answer cache, names, hashing, ownership
    ("checkpoints",),  # the checkpoint manager, chunk files, resume, publishing, output locations
    ("ops",),  # metrics, logs, memory tuning
    ("service",),  # the app, its routes, the upstream pool, settings, errors: all that knows HTTP exists
    ("job",),  # the job client (client.py) and its loop (run.py)
    ("integrations", "tools"),  # datatrove's adapters; status, inspect, demo, the fake upstream
    ("cli",),  # `inferproxy ...`
]
#: At most this many modules directly in app/ (the issue's bound): the rest live in the layers.
MAX_TOP_MODULES = 6

APP = Path(__file__).resolve().parent.parent / "app"


def layer_of(module: str) -> int:
    """The layer of `app.<package>...`; `app` itself (the version) is below them all."""
    parts = module.split(".")
    if parts == ["app"]:
        return -1
    for rank, names in enumerate(LAYERS):
        if parts[1] in names:
            return rank
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS in {__file__}")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(APP.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every `app` module `path` imports, at any depth of the file (functions, TYPE_CHECKING)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "app")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "app":
                continue
            found.add(target)
            # `from app.checkpoints import publish` imports the module app.checkpoints.publish
            found.update(
                f"{target}.{alias.name}"
                for alias in node.names
                if (APP.parent / target.replace(".", "/") / f"{alias.name}.py").exists()
            )
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in APP.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def upward_arrows(edges: dict[str, set[str]]) -> list[str]:
    arrows = []
    for module, targets in sorted(edges.items()):
        for target in sorted(targets):
            if target == "app" or target.startswith(module + "."):
                continue
            same_package = module.split(".")[:2] == target.split(".")[:2]
            if not same_package and layer_of(target) >= layer_of(module):
                arrows.append(f"{module} imports {target}")
    return arrows


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's), each a cycle's members."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_import_goes_down_a_layer() -> None:
    assert upward_arrows(graph()) == []


def test_no_import_cycle() -> None:
    # a package's __init__ re-exporting its modules is not a cycle of theirs
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph().items()}
    assert cycles(edges) == []


def test_few_modules_directly_in_app() -> None:
    top = sorted(p.name for p in APP.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_every_package_is_in_a_layer() -> None:
    packages = {p.parent.name for p in APP.glob("*/__init__.py")}
    assert packages <= {name for names in LAYERS for name in names}


@pytest.mark.parametrize(
    ("source", "arrow"),
    [
        ("from app.service.errors import NotFound\n", "app.store.durable imports app.service.errors"),
        ("def f():\n    from app.tools import demo\n", "app.store.durable imports app.tools.demo"),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import app.cli\n",
            "app.store.durable imports app.cli",
        ),
    ],
)
def test_an_import_back_up_is_found(source: str, arrow: str) -> None:
    edges = graph()
    path = APP / "store" / "durable.py"
    edges["app.store.durable"] |= {m for m in _imports_of_source(source, path) if m in edges}
    assert arrow in upward_arrows(edges)


def test_a_cycle_is_found() -> None:
    edges = graph()
    edges["app.store.durable"].add("app.store.cache")
    edges["app.store.cache"].add("app.store.durable")
    assert ["app.store.cache", "app.store.durable"] in cycles(edges)


def _imports_of_source(source: str, path: Path) -> set[str]:
    probe = path.with_name(".layers_probe.py")
    probe.write_text(source)
    try:
        return imports_of(probe)
    finally:
        probe.unlink()

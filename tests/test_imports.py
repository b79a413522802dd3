"""The import graph of src/narwhal, read from the source (nothing is imported).

Two rules: no module imports itself back through others (no cycles), and no import runs up a
layer. The packages, lowest first, are `LAYERS`; a module of one may import modules of its own
package and of packages below it. The top-level `narwhal` and `narwhal.__main__` sit above all.
Every import counts: at module level, inside functions and under `if TYPE_CHECKING:`.

A third rule: only configuration reads the environment, so no module outside narwhal/config/
names `os.environ`, `os.getenv` or `environ`.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SOURCE / "narwhal"

LAYERS = [
    "runtime",
    "config",
    "protocol",
    "engines",
    "fleet",
    "tenants",
    "conversations",
    "router",
    "control",
    "observe",
    "http",
    "app",
    "workers",
    "tools",
    "commands",
]

ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb"}


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(importer: str, level: int, target: str | None) -> str:
    """The absolute name a relative `from ... import` names, seen from `importer`."""
    if level == 0:
        return target or ""
    base = importer.split(".")
    if not _is_package(importer):
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def _imports_of(module: str, tree: ast.AST) -> Iterator[str]:
    """The narwhal modules `module` imports, wherever in its source the import is."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node.level, node.module)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                # `from narwhal.x import y` imports module narwhal.x.y when there is one.
                yield submodule if submodule in MODULES else source


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = {
            imported
            for imported in _imports_of(module, tree)
            if imported in MODULES and imported != module
        }
    return graph


def _layer(module: str) -> int:
    """The index of the module's package in LAYERS; the top-level modules are above all."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return len(LAYERS)
    assert parts[1] in LAYERS, f"{module}: its package {parts[1]!r} is not in LAYERS"
    return LAYERS.index(parts[1])


def _strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively; only those of more than one module are returned."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
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
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def _cycle_through(start: str, members: set[str], graph: Mapping[str, set[str]]) -> list[str]:
    """A shortest path from `start` back to itself inside one component."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in sorted(graph[node] & members):
            if successor == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if successor not in previous:
                previous[successor] = node
                queue.append(successor)
    raise AssertionError(f"no cycle through {start}")


def _upward(graph: Mapping[str, set[str]]) -> set[tuple[str, str]]:
    return {
        (importer, imported)
        for importer, imports in graph.items()
        for imported in imports
        if _layer(imported) > _layer(importer)
    }


def _names_environment(node: ast.AST) -> bool:
    """Whether the node is `<anything>.environ`, a name `getenv`, or imports one of them."""
    if isinstance(node, ast.Attribute):
        return node.attr in ENVIRONMENT_NAMES
    if isinstance(node, ast.Name):
        return node.id in ENVIRONMENT_NAMES
    if isinstance(node, ast.Import | ast.ImportFrom):
        return any(alias.name.split(".")[-1] in ENVIRONMENT_NAMES for alias in node.names)
    return False


def _reads_environment(tree: ast.AST) -> list[int]:
    """The lines that name the process environment (os.environ, os.getenv, environ...)."""
    return sorted(
        {
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.expr | ast.stmt) and _names_environment(node)
        }
    )


def test_the_walk_sees_every_kind_of_import() -> None:
    source = """
from typing import TYPE_CHECKING
import narwhal.protocol.ids
from narwhal.protocol import errors
from narwhal.runtime.clock import clock
from . import assemble
from ..fleet.table import Fleet
if TYPE_CHECKING:
    from narwhal.observe.tracing import Tracing
def later() -> None:
    from narwhal.engines import client
"""
    imports = set(_imports_of("narwhal.router.call", ast.parse(source)))
    assert imports >= {
        "narwhal.protocol.ids",
        "narwhal.protocol.errors",
        "narwhal.runtime.clock",
        "narwhal.router.assemble",
        "narwhal.fleet.table",
        "narwhal.observe.tracing",
        "narwhal.engines.client",
    }
    assert _resolve("narwhal.router", 1, "call") == "narwhal.router.call"
    packages = {module.split(".")[1] for module in MODULES if module.count(".") >= 1}
    assert packages - {"__main__"} <= set(LAYERS), "a package missing from LAYERS"


def test_no_module_imports_itself_back() -> None:
    graph = _graph()
    cycles = [
        " -> ".join(_cycle_through(component[0], set(component), graph))
        + f"  (component: {', '.join(component)})"
        for component in _strongly_connected(graph)
    ]
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_no_import_runs_up_a_layer() -> None:
    upward = sorted(_upward(_graph()))
    assert not upward, (
        f"imports up a layer (order, lowest first: {' < '.join(LAYERS)}):\n  "
        + "\n  ".join(f"{importer} -> {imported}" for importer, imported in upward)
    )


def test_the_request_path_does_not_know_its_http_server() -> None:
    """router/ writes through `router.reply.Reply`; aiohttp's side of it lives in http/."""
    importers = sorted(
        module
        for module, path in MODULES.items()
        if module.startswith("narwhal.router")
        and any(
            name == "aiohttp" or name.startswith("aiohttp.")
            for name in _imports_of(module, ast.parse(path.read_text(), filename=str(path)))
        )
    )
    assert not importers, f"router modules importing aiohttp: {importers}"


def test_only_configuration_reads_the_environment() -> None:
    readers = {}
    for module, path in MODULES.items():
        if module == "narwhal.config" or module.startswith("narwhal.config."):
            continue
        lines = _reads_environment(ast.parse(path.read_text(), filename=str(path)))
        if lines:
            readers[module] = lines
    assert not readers, "the environment read outside narwhal/config/:\n  " + "\n  ".join(
        f"{MODULES[module].relative_to(SOURCE)}: line {', '.join(map(str, readers[module]))}"
        for module in sorted(readers)
    )

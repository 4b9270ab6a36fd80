"""The import seams of docs/architecture.md, checked by reading the source.

Every module under gateway/, policy/, backends/ and kernels/ is parsed with
``ast`` (nothing is imported, so this takes a second and needs no torch). Each
``import`` and ``from ... import`` of a project module is an arrow, those inside
functions included: a lazy import still ties two modules together, it only
hides the tie from the import machinery until the first call. An arrow points
at the most specific module it names (``from a.b import c`` is ``a.b.c`` when
that is a module, else ``a.b``); the packages above it get no arrow of their
own, or every package ``__init__`` that re-exports its modules would be a cycle.

Imports under ``if TYPE_CHECKING:`` never run, but they count as arrows too,
in the cycle check as across the layers: two modules that name each other's
types are one module to a reader, whatever the interpreter does. A cycle is
cured by moving what both need to the lower module (or a small new one below
both), not by hiding an import under ``TYPE_CHECKING`` or inside a function.

No module imports another module's private name (``from a import _b``): what
a module shares is public, and what it keeps private stays in it.

The layers, lowest first: kernels ← backends ← policy ← gateway; policy never
imports gateway, and loading the engine (backends/engine/) loads no tensor library.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "policy", "backends", "kernels")

# What each package may not import: the arrows that would go up the layers.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "policy": ("gateway",),
    "backends": ("policy", "gateway"),
    "kernels": ("backends", "policy", "gateway"),
}
ENGINE = "inferflux.backends.engine"
TENSOR_LIBRARIES = ("torch", "triton", "mlx")

# Known violations, each being removed by its owner (issue 19): delete an entry when the
# change that removes it lands. A violation not listed here fails; a stale entry does not.
KNOWN_UPWARD: tuple[tuple[str, str], ...] = (
    # (importing package or module, imported module)
)
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


@dataclass(frozen=True)
class Arrow:
    source: str  # the importing module
    target: str  # the imported project module, or the top-level name of a library
    path: Path  # the importing module's file, relative to the repository
    line: int
    on_import: bool  # runs when the module is imported (not inside a function)
    type_checking: bool  # under ``if TYPE_CHECKING:``, so never at run time
    private: bool = False  # names a private name of the target (``from a import _b``, ``import a._b``)

    def where(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


@functools.cache
def module_files() -> dict[str, Path]:
    """``inferflux.gateway.routes.admin`` -> ``gateway/routes/admin.py``, for every module of the four packages."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            parts = list(relative.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(["inferflux", *parts])] = relative  # installed as inferflux.<folder>
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


ImportSite = tuple[ast.Import | ast.ImportFrom, bool, bool]  # the statement, on import, under TYPE_CHECKING


def _import_sites(nodes: Iterable[ast.AST], on_import: bool = True, type_checking: bool = False) -> Iterator[ImportSite]:
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, on_import, type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_sites(node.body, on_import, True)
            yield from _import_sites(node.orelse, on_import, type_checking)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _import_sites(ast.iter_child_nodes(node), False, type_checking)
        else:  # class bodies, and if/try/with at the top: they run on import
            yield from _import_sites(ast.iter_child_nodes(node), on_import, type_checking)


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The longest prefix of the dotted ``name`` that is a project module, else its top-level name."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return parts[0]


def _private(name: str) -> bool:
    """``_name``, which its module keeps to itself (dunders such as ``__version__`` are public)."""
    return name.startswith("_") and not name.startswith("__")


def arrows_of(source: str, path: Path, text: str, modules: dict[str, Path]) -> list[Arrow]:
    """The arrows out of module ``source`` (file ``path``), whose code is ``text``."""
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    found = []
    for node, on_import, type_checking in _import_sites(ast.parse(text).body):
        if isinstance(node, ast.Import):
            named = [(_resolve(a.name, modules), any(map(_private, a.name.split(".")))) for a in node.names]
        else:
            if node.level:  # relative: ``from ..x import y`` climbs level - 1 packages from this one
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from a import b``: the module a.b when there is one, else the name b of module a.
            named = [(_resolve(f"{base}.{a.name}", modules), _private(a.name)) for a in node.names]
        targets: dict[str, bool] = {}  # each target once, private if any of its names is
        for target, private in named:
            targets[target] = targets.get(target, False) or private
        for target, private in targets.items():
            if target != source:
                found.append(Arrow(source, target, path, node.lineno, on_import, type_checking, private))
    return found


@functools.cache
def import_graph() -> tuple[Arrow, ...]:
    modules = module_files()
    return tuple(
        arrow
        for name, path in modules.items()
        for arrow in arrows_of(name, path, (ROOT / path).read_text(encoding="utf-8"), modules)
    )


def _layer(module: str) -> str:
    """The folder a project module lives in (``inferflux.gateway.app`` -> ``gateway``), else its top-level name."""
    parts = module.split(".")
    return parts[1] if parts[0] == "inferflux" and len(parts) > 1 else parts[0]


def _within(module: str, package: str) -> bool:
    """``module`` is ``package`` or inside it (``a.metal`` is within ``a``; ``ax`` is not)."""
    return module == package or module.startswith(package + ".")


def _reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return seen


def _shortest_cycle(start: str, graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from ``start`` back to it (breadth first), for the message."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    return [start]


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {name: set() for name in module_files()}
    lines: dict[tuple[str, str], int] = {}
    for arrow in import_graph():
        if arrow.target in graph:
            graph[arrow.source].add(arrow.target)
            lines.setdefault((arrow.source, arrow.target), arrow.line)
    reach = {name: _reachable(name, graph) for name in graph}
    # The modules on a cycle, grouped: each with every module it reaches that reaches it back.
    groups = {frozenset(n for n in reach[name] if name in reach[n]) for name in graph if name in reach[name]}
    cycles = []
    for group in sorted(groups, key=sorted):
        if any(group <= known for known in KNOWN_CYCLES):
            continue
        cycle = _shortest_cycle(min(group), graph)
        steps = [f"{a} (line {lines[(a, b)]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        cycles.append(", ".join(sorted(group)) + ":\n    " + "\n    ".join(steps))
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_no_private_name_is_imported_across_modules() -> None:
    """``from a import _b`` ties the importer to what ``a`` keeps to itself: a name another module needs is public."""
    modules = module_files()
    wrong = [arrow.where() for arrow in import_graph() if arrow.private and arrow.target in modules]
    assert not wrong, "private names imported from another module:\n  " + "\n  ".join(wrong)


def test_no_arrow_goes_up_the_layers() -> None:
    wrong = []
    for arrow in import_graph():
        layer, target_layer = _layer(arrow.source), _layer(arrow.target)
        known = any(_within(arrow.source, s) and _within(arrow.target, t) for s, t in KNOWN_UPWARD)
        if target_layer in FORBIDDEN.get(layer, ()) and not known:
            wrong.append(arrow.where())
    assert not wrong, "imports that go up the layers:\n  " + "\n  ".join(wrong)


def test_loading_the_engine_loads_no_tensor_library() -> None:
    """backends/engine/ and everything importing it loads (package ``__init__``s too) import none on import."""
    on_import: dict[str, list[Arrow]] = {}
    for arrow in import_graph():
        if arrow.on_import and not arrow.type_checking:
            on_import.setdefault(arrow.source, []).append(arrow)
    modules = module_files()
    seen: set[str] = set()
    todo = [name for name in modules if _within(name, ENGINE)]
    wrong = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:end]) for end in range(1, len(parts)))  # its packages run first
        for arrow in on_import.get(name, []):
            if arrow.target in TENSOR_LIBRARIES:
                wrong.append(arrow.where())
            elif arrow.target in modules:
                todo.append(arrow.target)
    assert not wrong, "loading the engine imports a tensor library:\n  " + "\n  ".join(sorted(wrong))


def test_the_graph_holds_lazy_relative_type_checking_and_private_imports() -> None:
    """The checks above are only as good as the graph: it must hold each kind of arrow they look for."""
    text = """
import inferflux.gateway.errors
from inferflux.policy import fileio
from .. import base
from ..models import config as cfg
from inferflux.kernels.reference import rms_norm
from inferflux.kernels.triton import _common
from inferflux.gateway.metrics import CLIENT_CLOSED_STATUS, _KNOWN_METHODS
import inferflux.backends.cpu._private_module
if TYPE_CHECKING:
    from inferflux.policy.store import Store

class Holder:
    import numpy

def later():
    from inferflux.gateway.routes import admin
    import torch.nn
"""
    found = arrows_of("inferflux.backends.cpu.probe", Path("backends/cpu/probe.py"), text, module_files())
    assert {(a.target, a.on_import, a.type_checking, a.private) for a in found} == {
        ("inferflux.gateway.errors", True, False, False),
        ("inferflux.policy.fileio", True, False, False),
        ("inferflux.backends.base", True, False, False),
        ("inferflux.backends.models.config", True, False, False),
        ("inferflux.kernels.reference", True, False, False),
        ("inferflux.kernels.triton._common", True, False, True),
        ("inferflux.gateway.metrics", True, False, True),
        ("inferflux.backends.cpu", True, False, True),  # no such module: the package, named by a private path
        ("inferflux.policy.store", True, True, False),
        ("numpy", True, False, False),
        ("inferflux.gateway.routes.admin", False, False, False),
        ("torch", False, False, False),
    }

"""The package map holds: the two services never import each other, the shared packages import
neither service, and no modules import each other in a cycle (read from the sources' ASTs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ktserve", "ktshm", "expert_service", "gpu_service")
# package -> the packages it must never import, anywhere in its code (lazy imports included);
# the one exception is the `ktserve` command itself, which imports the chosen service lazily.
DISPATCHER = "ktserve.cli"
FORBIDDEN = {
    "gpu_service": ("expert_service",),
    "expert_service": ("gpu_service",),
    "ktserve": ("gpu_service", "expert_service"),
    "ktshm": ("gpu_service", "expert_service", "ktserve"),
}


# inside gpu_service: a room -> the rooms above it, which it must never import (the engine
# imports the expert path and the layers, never the reverse)
BELOW = {
    "gpu_service.experts": ("gpu_service.engine", "gpu_service.api", "gpu_service.launch"),
    "gpu_service.workers": ("gpu_service.engine", "gpu_service.api", "gpu_service.launch"),
    "gpu_service.layers": ("gpu_service.engine", "gpu_service.api", "gpu_service.models"),
    "gpu_service.attention": ("gpu_service.engine", "gpu_service.api", "gpu_service.models"),
    "gpu_service.kvcache": ("gpu_service.engine", "gpu_service.api", "gpu_service.models"),
    "gpu_service.engine": ("gpu_service.api", "gpu_service.launch"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "protocol" not in path.relative_to(REPO).parts:  # generated stubs
                found[module_name(path)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, module: str, type_checking: bool = False) -> set[str]:
    """Modules (and imported names, as module.name) `path` imports, lazy imports in functions
    included; imports under `if TYPE_CHECKING:` (they never run) only with type_checking."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")
                    anchor = anchor if is_package else anchor[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    visit([c for c in children if isinstance(c, ast.stmt | ast.ExceptHandler)])
            if isinstance(node, ast.ExceptHandler | ast.ClassDef):
                visit(node.body)

    visit(tree.body)
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_what_the_map_allows(package: str) -> None:
    offending = []
    for module, path in sources().items():
        if module.split(".")[0] != package or module == DISPATCHER:
            continue
        for name in imports(path, module):
            if name.split(".")[0] in FORBIDDEN[package]:
                offending.append(f"{module} imports {name}")
    assert not offending, "\n".join(sorted(set(offending)))


@pytest.mark.parametrize("room", sorted(BELOW))
def test_rooms_of_gpu_service_import_nothing_above_them(room: str) -> None:
    offending = []
    for module, path in sources().items():
        if module != room and not module.startswith(room + "."):
            continue
        for name in imports(path, module, type_checking=True):
            if any(name == above or name.startswith(above + ".") for above in BELOW[room]):
                offending.append(f"{module} imports {name}")
    assert not offending, "\n".join(sorted(set(offending)))


def test_no_import_cycles() -> None:
    """Type-checking imports included: a cycle that only type hints close is still two modules
    that cannot be understood (or moved) apart."""
    modules = sources()
    graph = {
        module: {name for name in imports(path, module, type_checking=True) if name in modules}
        - {module}
        for module, path in modules.items()
    }
    # NOTE: a package's __init__ importing its own submodules is how packages re-export; a
    # submodule importing its parent package back is the cycle that breaks, and is kept.
    for module in graph:
        graph[module] = {n for n in graph[module] if not n.startswith(module + ".")}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checks_see_a_forbidden_import_and_a_cycle(tmp_path: Path) -> None:
    """The AST reading itself: a lazy cross-service import and a two-module cycle are found."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from expert_service.worker import ExpertWorker\n")
    assert "expert_service.worker" in imports(lazy, "gpu_service.lazy")
    relative = tmp_path / "rel.py"
    relative.write_text("from .b import c\nif TYPE_CHECKING:\n    import x\n")
    assert imports(relative, "pkg.a") == {"pkg.b", "pkg.b.c"}
    assert imports(relative, "pkg.a", type_checking=True) == {"pkg.b", "pkg.b.c", "x"}


def test_no_test_module_imports_another() -> None:
    """Helpers and fixtures shared by test modules live in tests/support."""
    offending = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        module = module_name(path)
        for name in imports(path, module, type_checking=True):
            parts = name.split(".")
            if parts[0] == "tests" and any(p.startswith("test_") for p in parts[1:]):
                offending.append(f"{module} imports {name}")
    assert not offending, "\n".join(sorted(set(offending)))

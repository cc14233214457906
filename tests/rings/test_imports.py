"""Imports flow one way and never in a circle.

Every `import` of every package counts (py_engine, the applications above it,
the CLI and training), at module level or inside a function
(a lazy import still ties the modules together: the cpu_layers <-> cpu_stack
<-> cpu_transforms circle of issue 13 was made of them); only imports under
`if TYPE_CHECKING:`, which never run, are left out. `from a import b` is an
edge to a.b when that is a module, else to a. The implicit import of parent
packages is not an edge (every module has it).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import REPO

APPLICATIONS = ("export", "native_server", "web", "ruvllm_cli")  # ring 2 and the CLI above it
PACKAGES = ("py_engine", *APPLICATIONS, "training")


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of a package under root by dotted name (a package is its __init__.py)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.targets: list[tuple[str, str | None]] = []  # (module, name imported from it or None)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.targets += [(alias.name, None) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1])
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module
        self.targets += [(source, alias.name) for alias in node.names]


def import_edges(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules it imports (any package), as described in this file's docstring."""
    own = modules(root, package)
    edges = {}
    for name, path in own.items():
        visitor = _Imports(name, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        edges[name] = {f"{source}.{item}" if f"{source}.{item}" in own else source
                       for source, item in visitor.targets}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or of one that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v] & edges.keys()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_py_engine_imports_no_application():
    edges = import_edges(REPO, "py_engine")
    assert len(edges) > 60 and "py_engine.cpu.transforms" in edges["py_engine.backends.torch"]
    upward = {m: sorted(t for t in targets if t.split(".")[0] in APPLICATIONS) for m, targets in edges.items()}
    assert {m: t for m, t in upward.items() if t} == {}


def test_every_package_has_a_package_file_and_is_checked():
    """A top folder with an __init__.py is a package the circle check below walks (tests aside)."""
    found = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert sorted(found) == sorted(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_has_an_import_circle(package):
    edges = import_edges(REPO, package)
    assert len(edges) > 2 and circles(edges) == []


def _native_server_edges() -> dict[str, set[str]]:
    return import_edges(REPO, "native_server")


def test_native_server_top_level_is_packages_and_entry_modules():
    """Its folders name the architecture; beside them only the package file and `ruvllm serve`'s module."""
    root = REPO / "native_server"
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py", "serve.py"]
    packages = sorted(p.parent.name for p in root.glob("*/__init__.py"))
    assert packages == ["api", "bench", "cluster", "engine", "learning"]


def test_the_engine_imports_no_http_learning_or_benchmark_module():
    """The seam of the server: api/, learning/ and bench/ build on the engine, never the other way."""
    above = ("native_server.api", "native_server.learning", "native_server.bench", "native_server.serve",
             "native_server.cluster")
    upward = {m: sorted(t for t in targets if t.startswith(above))
              for m, targets in _native_server_edges().items() if m.startswith("native_server.engine")}
    assert len(upward) > 12 and {m: t for m, t in upward.items() if t} == {}


def test_attention_backends_import_the_interface_not_the_picker():
    """interface.py imports no backend; the backends never import the package that picks among them."""
    edges = _native_server_edges()
    package = "native_server.engine.attention"
    backends = [m for m in edges if m.startswith(package + ".")]
    assert {f"{package}.{name}" for name in ("interface", "reference", "cold", "cpu", "triton")} <= set(backends)
    assert [m for m in backends if package in edges[m]] == []
    assert not {t for t in edges[f"{package}.interface"] if t.startswith(package)}


def test_the_checks_see_lazy_circles_and_upward_imports(tmp_path):
    """The walker on a made-up package: a circle of function-level imports, a TYPE_CHECKING import
    (not an edge), a relative import of a module and of a name, and an import of an application."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from .sub import b\n",
        "sub/__init__.py": "from .b import thing\n",
        "sub/b.py": "def g():\n    from ..c import h\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n"
                "def h():\n    import pkg.a\n    import native_server.engine\n",
        "d.py": "from . import c\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    edges = import_edges(tmp_path, "pkg")
    assert edges["pkg.a"] == {"pkg.sub.b"} and edges["pkg.sub"] == {"pkg.sub.b"}
    assert edges["pkg.c"] == {"typing", "pkg.a", "native_server.engine"} and edges["pkg.d"] == {"pkg.c"}
    assert circles(edges) == [["pkg.a", "pkg.c", "pkg.sub.b"]]

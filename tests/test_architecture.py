"""The package's layers come from its packages: no import cycle, no internal package imports the front.

A *unit* is a top-level module (``tierstore/errors.py``) or a top-level
package (``tierstore/_storage/``); the units' import graph is read from the
code (function-level, lazy imports count too). Its layers are derived: a unit
with no imports inside the package is layer 0, every other unit sits one
above the highest unit it imports. The rules:

- no import cycle between modules, nor between units;
- an internal unit (``_name``) imports only internal units and the public
  vocabulary (public units that import no internal unit: errors, sizes,
  backends), never the public front built over the internals;
- the adapters (checkpoints, DCP, the state reader, ...) never import the optimizer;
- every public module declares ``__all__``, and each name in it exists;
- ``docs/architecture.md`` shows this graph: the block between its
  ``package-graph`` markers is :func:`render_graph`'s output (rewrite it with
  ``python tests/test_architecture.py``).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

import tierstore

PACKAGE = Path(tierstore.__file__).parent
DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
MARK = re.compile(r"(<!-- package-graph:start -->\n)(.*?)(<!-- package-graph:end -->)", re.S)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str] | None = None) -> set[str]:
    """Package modules ``name`` imports (any depth in the file), by dotted name under ``tierstore``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    here = name.split(".") if name != "__init__" else []
    base = here if is_package else here[:-1]
    found: set[str] = set()
    known = set(_modules()) if known is None else known
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            elif node.module and (node.module == "tierstore" or node.module.startswith("tierstore.")):
                prefix = node.module.removeprefix("tierstore").lstrip(".")
            else:
                continue
            for alias in node.names:
                full = f"{prefix}.{alias.name}" if prefix else alias.name
                targets.append(full if full in known else prefix)
        elif isinstance(node, ast.Import):
            targets = [a.name.removeprefix("tierstore").lstrip(".") for a in node.names if a.name.startswith("tierstore")]
        for t in targets:
            found.add(t or "__init__")
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def unit_of(module: str) -> str:
    """The top-level module or package a module belongs to (``_storage.store`` -> ``_storage``)."""
    return module.split(".")[0]


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        graph.setdefault(unit_of(name), set()).update(unit_of(d) for d in deps)
    for unit, deps in graph.items():
        deps.discard(unit)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep):], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each unit's layer: 0 without imports, else one above the highest unit it imports (needs no cycle)."""
    out: dict[str, int] = {}

    def layer(unit: str) -> int:
        if unit not in out:
            out[unit] = 1 + max((layer(d) for d in graph.get(unit, ())), default=-1)
        return out[unit]

    for unit in graph:
        layer(unit)
    return out


def is_internal(unit: str) -> bool:
    return unit.startswith("_") and unit not in ("__init__", "_version")


def vocabulary(graph: dict[str, set[str]]) -> set[str]:
    """Public units the internals may use: those that import no internal unit."""
    return {u for u, deps in graph.items() if not is_internal(u) and not any(is_internal(d) for d in deps)}


def render_graph(graph: dict[str, set[str]]) -> str:
    """The markdown table of units by layer, as docs/architecture.md shows it."""
    lay = layers(graph)
    rows = ["| layer | unit | kind | imports |", "|---|---|---|---|"]
    for unit in sorted(graph, key=lambda u: (lay[u], u)):
        path = f"`{unit}/`" if (PACKAGE / unit).is_dir() else f"`{unit}.py`"
        kind = "internal" if is_internal(unit) or unit == "_version" else ("face" if unit == "__init__" else "public")
        deps = ", ".join(f"`{d}`" for d in sorted(graph[unit], key=lambda d: (lay[d], d))) or "-"
        rows.append(f"| {lay[unit]} | {path} | {kind} | {deps} |")
    return "\n".join(rows) + "\n"


def test_no_module_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_package_import_cycles() -> None:
    cycles = _cycles(unit_graph())
    assert not cycles, "cycles between packages: " + "; ".join(" -> ".join(c) for c in cycles)


def test_internal_packages_never_import_the_public_front() -> None:
    graph = unit_graph()
    vocab = vocabulary(graph)
    bad = [
        f"{unit} imports {dep}: internal code may import internal packages and {sorted(vocab)} only"
        for unit, deps in sorted(graph.items())
        if is_internal(unit)
        for dep in sorted(deps)
        if not is_internal(dep) and dep not in vocab
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "adapter",
    ["checkpoint", "dcp", "_state.reader", "deepspeed_config", "_state.manifest", "planner", "cli.inspection"],
)
def test_adapters_do_not_import_the_optimizer(adapter: str) -> None:
    modules = _modules()
    if adapter not in modules:  # a package: every module in it
        found = [n for n in modules if n.startswith(adapter + ".")]
        assert found, f"no module {adapter}"
    else:
        found = [adapter]
    for name in found:
        assert "optimizer" not in _imports(name, modules[name]), name


def public_modules() -> list[str]:
    """Modules of the public units (``tierstore.cli``'s subcommand modules excepted: the command is the API)."""
    return sorted(
        n for n in _modules()
        if not is_internal(unit_of(n)) and unit_of(n) not in ("__init__", "_version", "_moved")
        and not n.startswith("cli.")
    )  # fmt: skip


@pytest.mark.parametrize("name", public_modules())
def test_every_public_module_declares_all(name: str) -> None:
    module = importlib.import_module(f"tierstore.{name}")
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, list), f"tierstore.{name} has no __all__: list its public names"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"tierstore.{name}.__all__ names what it lacks: {missing}"
    assert not [n for n in exported if n.startswith("_") and n != "__version__"]


def test_the_architecture_page_shows_the_package_graph() -> None:
    text = DOC.read_text()
    match = MARK.search(text)
    assert match, f"{DOC} lacks the <!-- package-graph:start --> ... :end --> markers"
    assert match.group(2) == render_graph(unit_graph()), (
        "docs/architecture.md's package graph is out of date: run python tests/test_architecture.py"
    )


def test_the_checker_sees_a_cycle_and_an_internal_import_of_the_front(tmp_path: Path, monkeypatch) -> None:
    # A deliberately broken package: _inner imports the optimizer lazily, the optimizer imports _inner.
    pkg = tmp_path / "tierstore"
    (pkg / "_inner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "_inner" / "__init__.py").write_text("")
    (pkg / "_inner" / "layout.py").write_text("from ..errors import X\ndef f():\n    from ..optimizer import TieredAdamW\n")
    (pkg / "optimizer.py").write_text("from ._inner.layout import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert unit_graph()["_inner"] == {"errors", "optimizer"}
    with pytest.raises(AssertionError, match="_inner.layout -> optimizer -> _inner.layout"):
        test_no_module_import_cycles()
    with pytest.raises(AssertionError, match="_inner -> optimizer -> _inner"):
        test_no_package_import_cycles()
    with pytest.raises(AssertionError, match="_inner imports optimizer"):
        test_internal_packages_never_import_the_public_front()


if __name__ == "__main__":  # rewrite the graph in docs/architecture.md
    text = DOC.read_text()
    DOC.write_text(MARK.sub(lambda m: m.group(1) + render_graph(unit_graph()) + m.group(3), text))
    print(f"wrote the package graph into {DOC}")

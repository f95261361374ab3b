"""The module layers: no import cycle, and no module imports one from a higher layer.

Each module of the package owns one concept (``docs/architecture.md`` has
the module map). Layers run from leaf vocabulary up to the tools; a module
may import modules of its own layer or below, never above, so the lower
layers can be read, tested and changed without the optimizer. Function-level
(lazy) imports count too: they are edges of the same graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tierstore

PACKAGE = Path(tierstore.__file__).parent

#: Layer of every module, lowest first. A new module must be placed here (the test says so).
LAYERS: dict[str, int] = {
    # 0: leaves
    "_version": 0, "errors": 0, "sizes": 0, "faults": 0, "dtensor": 0, "dynamo": 0, "torch_private": 0, "build_flags": 0,
    # 1: pure descriptions and arithmetic (no I/O)
    "workers": 0, "native": 0, "codecs": 1, "layout": 1, "hyper": 1, "knobs": 1, "kernel": 1, "integrity": 1, "factory": 1, "distributed": 1,
    "commit_policy": 1,
    "fused_update": 2, "spec": 2, "budget": 2, "manifest": 2, "torch_format": 2, "deepspeed_config": 3,
    # 4: memory and files
    "hostmem": 4, "chunkfile": 4, "dcp_memory": 4, "backends": 4, "backends.base": 4, "backends.direct": 4, "backends.mmap_file": 4,
    "transfer": 5,
    # 6: the shard store and what moves shards
    "store": 6, "pipeline": 7, "statedir": 6, "journal": 7, "reader": 7,
    # 8: one step's update and the running machinery
    "update": 8, "overlap": 8, "grad_offload": 5, "runtime": 9, "startup": 9, "access": 8,
    # 10: adapters over the access protocol
    "checkpoint": 10, "dcp": 10,
    # 11: the front
    "optimizer": 11,
    # 12: tools and the package face
    "planner": 12, "diagnose": 12, "inspection": 12, "cli": 12, "__init__": 13,
    "demo": 12, "demo.model": 12, "demo.run": 12,
    "benchmarks": 12, "benchmarks.floor": 12, "benchmarks.footprint": 12, "benchmarks.io": 12,
    "benchmarks.peer": 12, "benchmarks.rawio": 12, "benchmarks.report": 12, "benchmarks.rss": 12,
    "benchmarks.step": 12, "benchmarks.workload": 12, "benchmarks.resources": 12, "benchmarks.durability": 12, "benchmarks.overlap": 12,
    "benchmarks.codec_adamw": 12, "benchmarks.codec_speed": 12, "benchmarks.convergence": 12,
    # 14: test kits, over the public face
    "testing": 14, "testing.backend": 14, "testing.crash": 14, "testing.distributed": 14,
    "testing.fsimage": 14, "testing.formats": 14, "testing.fsrecord": 14, "testing.powercut": 14, "testing.memory": 14,
}  # fmt: skip


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """Package modules ``name`` imports (any depth in the file), as keys of :data:`LAYERS`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    here = name.split(".") if name != "__init__" else []
    base = here if is_package else here[:-1]
    found: set[str] = set()
    known = _modules()
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
    return {name: _imports(name, path) for name, path in _modules().items()}


def test_every_module_has_a_layer() -> None:
    missing = sorted(set(_modules()) - set(LAYERS))
    assert not missing, f"place these modules in a layer of tests/test_architecture.py LAYERS: {missing}"


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{name} (layer {LAYERS[name]}) imports {dep} (layer {LAYERS[dep]})"
        for name, deps in _graph().items()
        for dep in sorted(deps)
        if name in LAYERS and dep in LAYERS and LAYERS[dep] > LAYERS[name]
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles() -> None:
    graph = _graph()
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
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "adapter", ["checkpoint", "dcp", "reader", "deepspeed_config", "manifest", "planner", "inspection"]
)
def test_adapters_do_not_import_the_optimizer(adapter: str) -> None:
    assert "optimizer" not in _imports(adapter, _modules()[adapter])


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A deliberately broken package: a imports b lazily, b imports a; layout imports the optimizer.
    pkg = tmp_path / "tierstore"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "layout.py").write_text("def f():\n    from .optimizer import TieredAdamW\n")
    (pkg / "optimizer.py").write_text("from .layout import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    graph = {name: _imports(name, path) for name, path in _modules().items()}
    assert graph["layout"] == {"optimizer"} and graph["optimizer"] == {"layout"}
    with pytest.raises(AssertionError, match="layout -> optimizer -> layout"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match="layout .layer 1. imports optimizer"):
        test_no_module_imports_a_higher_layer()

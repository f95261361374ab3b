"""Import paths of modules that moved into the private packages: they keep working, with a warning.

Until 0.2 the package was one flat folder, so code may say ``from
tierstore.store import ShardStore``. Those modules now live in private
packages by role (``docs/architecture.md``); the old path imports the same
module object under its new name and warns once per path (a module that was
split, ``tierstore.codecs``, imports as one whose names resolve from their new
homes: :data:`SPLIT`). Internal modules make no promise of stability: import
from :mod:`tierstore` and the public modules instead. This shim goes in 0.3.

Example
-------
>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from tierstore.sizes import parse_size        # public: no warning
...     import tierstore.layout as old                 # moved: a warning
>>> import tierstore._layout.layout as new
>>> old is new, [str(w.message).split(";")[0] for w in caught]
(True, ['tierstore.layout moved to tierstore._layout.layout'])
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Old path (under ``tierstore.``) -> new path; a package's submodules move with it.
MOVED: dict[str, str] = {
    "access": "_runtime.access",
    "benchmarks": "cli.bench",
    "budget": "_layout.budget",
    "build_flags": "_compute.build_flags",
    "chunkfile": "_storage.chunkfile",
    "commit_policy": "_state.commit_policy",
    "dcp_memory": "_storage.dcp_memory",
    "demo": "cli.demo",
    "distributed": "_platform.distributed",
    "dtensor": "_platform.dtensor",
    "dynamo": "_platform.dynamo",
    "factory": "_platform.factory",
    "faults": "_platform.faults",
    "fused_update": "_compute.fused_update",
    "grad_offload": "_runtime.grad_offload",
    "hostmem": "_platform.hostmem",
    "hyper": "_compute.hyper",
    "inspection": "cli.inspection",
    "integrity": "_storage.integrity",
    "journal": "_state.journal",
    "kernel": "_compute.kernel",
    "knobs": "_config.knobs",
    "layout": "_layout.layout",
    "manifest": "_state.manifest",
    "native": "_compute.native",
    "overlap": "_runtime.overlap",
    "pipeline": "_storage.pipeline",
    "reader": "_state.reader",
    "runtime": "_runtime.runtime",
    "spec": "_layout.spec",
    "startup": "_runtime.startup",
    "statedir": "_state.statedir",
    "store": "_storage.store",
    "torch_format": "_layout.torch_format",
    "torch_private": "_platform.torch_private",
    "transfer": "_storage.transfer",
    "update": "_runtime.update",
    "workers": "_platform.workers",
}
#: Old path -> the modules its names were split into, searched in order: the old
#: module's names resolve from their new homes (``tierstore.codecs.encode`` is
#: ``tierstore._compute.codecs.encode``, ``tierstore.codecs.moment_format`` is
#: ``tierstore._compute.formats.moment_format``).
SPLIT: dict[str, tuple[str, ...]] = {
    "codecs": ("_compute.codecs", "_compute.formats"),
}


def new_path(fullname: str) -> str | None:
    """The module ``fullname`` (``tierstore.x.y``) moved to, or ``None`` if it did not move.

    >>> new_path("tierstore.benchmarks.report"), new_path("tierstore.optimizer")
    ('tierstore.cli.bench.report', None)
    """
    head, _, rest = fullname.removeprefix("tierstore.").partition(".")
    if not fullname.startswith("tierstore.") or head not in MOVED:
        return None
    return f"tierstore.{MOVED[head]}" + (f".{rest}" if rest else "")


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (one module object, two names)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the old path's spec on the module: give it back its own.
        module.__spec__ = self.own_spec
        warnings.warn(
            f"{_old_name(self.target)} moved to {self.target}; "
            "it is internal and may change: import the public API from tierstore (docs/architecture.md)",
            DeprecationWarning,
            stacklevel=2,
        )


def _old_name(target: str) -> str:
    for old, new in MOVED.items():
        prefix = f"tierstore.{new}"
        if target == prefix or target.startswith(prefix + "."):
            return f"tierstore.{old}" + target.removeprefix(prefix)
    return target


class _Split(importlib.abc.Loader):
    """Loads an old path whose names now live in several modules: a module that looks each name up in them."""

    def __init__(self, old: str, targets: tuple[str, ...]) -> None:
        self.old = old
        self.targets = targets

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module; exec_module fills it

    def exec_module(self, module: ModuleType) -> None:
        homes = [importlib.import_module(t) for t in self.targets]
        old = self.old

        def __getattr__(name: str) -> object:
            for home in homes:
                try:
                    return getattr(home, name)
                except AttributeError:
                    continue
            raise AttributeError(f"module {old!r} has no attribute {name!r} (its names moved to {', '.join(self.targets)})")

        module.__getattr__ = __getattr__
        module.__dir__ = lambda: sorted({n for home in homes for n in dir(home)})
        module.__all__ = [n for home in homes for n in getattr(home, "__all__", ())]
        warnings.warn(
            f"{old} moved to {', '.join(self.targets[:-1])} and {self.targets[-1]}; "
            "it is internal and may change: import the public API from tierstore (docs/architecture.md)",
            DeprecationWarning,
            stacklevel=2,
        )


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds ``tierstore.<old>`` for every module in :data:`MOVED` and :data:`SPLIT` (installed by ``tierstore/__init__``)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - the MetaPathFinder protocol
        split = SPLIT.get(fullname.removeprefix("tierstore.")) if fullname.startswith("tierstore.") else None
        if split is not None:
            return importlib.machinery.ModuleSpec(fullname, _Split(fullname, tuple(f"tierstore.{t}" for t in split)))
        new = new_path(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put :class:`MovedFinder` first on ``sys.meta_path``, once.

    First: a moved package's old submodule path (``tierstore.benchmarks.report``)
    would otherwise be found in the new folder and run a second time.
    """
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())

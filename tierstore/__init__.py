"""tierstore: AdamW whose state lives in a bounded slice of host RAM and files on local disk.

The public API is what this module exports (:data:`__all__`) and the public
modules: :mod:`tierstore.optimizer`, :mod:`tierstore.checkpoint`,
:mod:`tierstore.dcp`, :mod:`tierstore.planner`, :mod:`tierstore.deepspeed_config`,
:mod:`tierstore.diagnose`, :mod:`tierstore.backends`, :mod:`tierstore.errors`,
:mod:`tierstore.sizes`, :mod:`tierstore.testing` and the ``tierstore`` command
(:mod:`tierstore.cli`). Packages whose names start with ``_`` are internal.

The optimizers (``TieredAdamW`` and the fronts of :mod:`tierstore.fronts`)
and ``diagnose`` are imported on first use, so ``import tierstore`` (and
``tierstore --help``) does not import torch.

>>> import tierstore
>>> tierstore.TieredAdamW.__module__
'tierstore.optimizer'
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from . import _moved
from ._version import __version__
from .errors import (
    BackendError,
    BudgetError,
    CheckpointExistsError,
    ClosedError,
    ConfigError,
    ConfigTypeError,
    CorruptStateError,
    DiskFullError,
    DriveSetError,
    FormatVersionError,
    LayoutMismatchError,
    NoStateError,
    NotStateDirError,
    ParamsChangedError,
    StateDirError,
    StateDirInUseError,
    StateExistsError,
    StepFailedError,
    TierstoreError,
)
from .sizes import format_size, parse_size

if TYPE_CHECKING:
    from .diagnose import diagnose
    from .fronts import (
        TieredAdadelta,
        TieredAdagrad,
        TieredAdam,
        TieredAdamax,
        TieredLion,
        TieredNAdam,
        TieredRAdam,
        TieredRMSprop,
        TieredSGD,
    )
    from .fronts.deepspeed import from_deepspeed_config
    from .fronts.generic import tiered
    from .optimizer import TieredAdamW

_moved.install()

__all__ = [
    "BackendError",
    "BudgetError",
    "CheckpointExistsError",
    "ClosedError",
    "ConfigError",
    "ConfigTypeError",
    "CorruptStateError",
    "DiskFullError",
    "DriveSetError",
    "FormatVersionError",
    "LayoutMismatchError",
    "NoStateError",
    "NotStateDirError",
    "ParamsChangedError",
    "StateDirError",
    "StateDirInUseError",
    "StateExistsError",
    "StepFailedError",
    "TieredAdadelta",
    "TieredAdagrad",
    "TieredAdam",
    "TieredAdamW",
    "TieredAdamax",
    "TieredLion",
    "TieredNAdam",
    "TieredRAdam",
    "TieredRMSprop",
    "TieredSGD",
    "TierstoreError",
    "__version__",
    "diagnose",
    "format_size",
    "from_deepspeed_config",
    "parse_size",
    "tiered",
]

_LAZY = {
    "TieredAdamW": ("optimizer", "TieredAdamW"),
    "tiered": ("fronts.generic", "tiered"),
    "TieredRMSprop": ("fronts", "TieredRMSprop"),
    "TieredAdamax": ("fronts", "TieredAdamax"),
    "TieredNAdam": ("fronts", "TieredNAdam"),
    "TieredRAdam": ("fronts", "TieredRAdam"),
    "TieredAdadelta": ("fronts", "TieredAdadelta"),
    "TieredLion": ("fronts", "TieredLion"),
    "TieredAdam": ("fronts", "TieredAdam"),
    "TieredSGD": ("fronts", "TieredSGD"),
    "TieredAdagrad": ("fronts", "TieredAdagrad"),
    "diagnose": ("diagnose", "diagnose"),
    "from_deepspeed_config": ("fronts.deepspeed", "from_deepspeed_config"),
}


def __getattr__(name: str) -> Any:
    # PEP 562: the names that need torch are imported when first asked for.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value  # after the submodule import, which bound the module under its name
        return value
    raise AttributeError(f"module 'tierstore' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """The package's module type: ``tierstore.diagnose`` stays the function.

    Importing the submodule :mod:`tierstore.diagnose` binds it on the package
    under the same name; the function, not the module, is what
    ``tierstore.diagnose`` and ``from tierstore import diagnose`` give.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return  # the import system binding a submodule over a lazy name: keep the name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

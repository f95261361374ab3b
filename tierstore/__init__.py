"""tierstore: AdamW whose state lives in a bounded slice of host RAM and files on local disk."""

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

__all__ = [
    "BackendError",
    "BudgetError",
    "CheckpointExistsError",
    "ClosedError",
    "ConfigError",
    "ConfigTypeError",
    "CorruptStateError",
    "DiskFullError",
    "FormatVersionError",
    "LayoutMismatchError",
    "NoStateError",
    "NotStateDirError",
    "ParamsChangedError",
    "StateDirError",
    "StateDirInUseError",
    "StateExistsError",
    "StepFailedError",
    "TierstoreError",
    "format_size",
    "parse_size",
    "__version__",
]

from .diagnose import diagnose  # noqa: E402
from .optimizer import TieredAdamW  # noqa: E402

__all__ += ["TieredAdamW", "diagnose"]

"""tierstore: AdamW whose state lives in a bounded slice of host RAM and files on local disk."""

from .errors import (
    BackendError,
    BudgetError,
    CheckpointExistsError,
    ClosedError,
    ConfigError,
    CorruptStateError,
    DiskFullError,
    FormatVersionError,
    LayoutMismatchError,
    ParamsChangedError,
    StateDirError,
    StateDirInUseError,
    StateExistsError,
    StepFailedError,
    TierstoreError,
)
from .sizes import format_size, parse_size

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BudgetError",
    "CheckpointExistsError",
    "ClosedError",
    "ConfigError",
    "CorruptStateError",
    "DiskFullError",
    "FormatVersionError",
    "LayoutMismatchError",
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

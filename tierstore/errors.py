"""The exceptions tierstore raises.

Every error derives from :class:`TierstoreError`, so a caller can catch them
all; each also derives from the builtin a Python user would expect
(``ValueError`` for bad arguments, ``OSError`` for I/O faults), so existing
``except ValueError`` code keeps working.

Messages name the offending value, what was expected, and the fix.

Example
-------
>>> from tierstore.errors import TierstoreError, BudgetError
>>> issubclass(BudgetError, (TierstoreError, ValueError))
True
"""

from __future__ import annotations

__all__ = [
    "TierstoreError",
    "ConfigError",
    "ConfigTypeError",
    "BudgetError",
    "ParamsChangedError",
    "StateDirError",
    "StateDirInUseError",
    "StateExistsError",
    "NoStateError",
    "NotStateDirError",
    "DriveSetError",
    "LayoutMismatchError",
    "FormatVersionError",
    "CorruptStateError",
    "DiskFullError",
    "BackendError",
    "ClosedError",
    "CheckpointExistsError",
    "StepFailedError",
]

class TierstoreError(Exception):
    """Base class of every error tierstore raises on purpose."""


class ConfigError(TierstoreError, ValueError):
    """An argument has a value tierstore cannot use (size strings, knobs, backends)."""


class ConfigTypeError(ConfigError, TypeError):
    """An argument has the wrong type (a ``TypeError`` too, as torch raises for it)."""


class BudgetError(ConfigError):
    """``ram_budget`` is too small for the arena that streaming shards needs."""


class ParamsChangedError(TierstoreError, RuntimeError):
    """The parameters differ from those the optimizer was built with."""


class StateDirError(TierstoreError, OSError):
    """The state directory cannot be used (unwritable, not a directory, ...)."""


class StateDirInUseError(StateDirError):
    """Another open optimizer (in this or another process) holds the state directory."""


class StateExistsError(StateDirError):
    """The state directory already holds tierstore state and ``resume`` was not asked for."""


class NoStateError(StateDirError, FileNotFoundError):
    """``resume=True`` asked for committed state where there is none (a missing or empty directory)."""


class NotStateDirError(StateDirError):
    """The directory holds files tierstore did not write: it is not a tierstore state directory."""


class DriveSetError(StateDirError):
    """The directories given as ``state_dir`` are not the drives of one state: one is missing, belongs to
    another state, is given twice or out of order, or their number differs from the state's."""


class LayoutMismatchError(TierstoreError, ValueError):
    """Saved state belongs to another model (its layout fingerprint differs)."""


class FormatVersionError(TierstoreError, ValueError):
    """Saved state was written by a format version this tierstore cannot read."""


class CorruptStateError(TierstoreError, OSError):
    """A state file failed its checksum, is truncated or is missing."""


class DiskFullError(TierstoreError, OSError):
    """The drive behind the state directory ran out of space while writing."""


class BackendError(TierstoreError, OSError):
    """An I/O backend failed or is not supported on the chosen filesystem."""


class ClosedError(TierstoreError, RuntimeError):
    """The optimizer (or store) was used after ``close()``."""


class CheckpointExistsError(TierstoreError, FileExistsError):
    """A checkpoint path exists and ``overwrite`` was not asked for."""


class StepFailedError(TierstoreError, RuntimeError):
    """An earlier step failed part-way; the optimizer must be rebuilt with ``resume=True``."""

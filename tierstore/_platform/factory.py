"""Resolve a ``module:attr`` (or ``path/to/file.py:attr``) spec to the callable it names.

The command-line tools take user code this way (``tierstore plan --model``,
``tierstore diagnose --model``). A module name is imported with the current
directory importable, as ``python -m`` does; a file path is loaded directly.

Example
-------
>>> resolve("torch.nn:Linear", flag="--model").__name__
'Linear'
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def resolve(spec: str, *, flag: str) -> Callable[..., Any]:
    """Import ``module:attr`` or ``path/to/file.py:attr`` and return the attribute.

    ``flag`` names the option in error messages.

    Raises
    ------
    ConfigError
        If the spec is malformed, names a path that is not a ``.py`` file,
        the import fails, or the attribute is missing or not callable.

    Example
    -------
    >>> resolve("torch.nn:PReLU", flag="--model")().__class__.__name__
    'PReLU'
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{flag} {spec!r} must be 'module:factory', e.g. 'mypkg.models:build'")
    expected = "pass path/to/file.py:FACTORY (a Python file) or package.module:FACTORY (an importable module)"
    try:
        if module_name.endswith(".py") or "/" in module_name or Path(module_name).exists():
            file = Path(module_name)
            if file.is_dir():
                raise ConfigError(f"{flag} {spec!r}: {module_name!r} is a directory, not a Python file; {expected}")
            if not file.is_file():
                raise ConfigError(f"{flag} {spec!r}: no file {module_name!r} (from {Path.cwd()}); {expected}")
            if file.suffix != ".py":
                # A file of another kind would be run as Python (or fail as a module name): say what is expected.
                raise ConfigError(
                    f"{flag} {spec!r}: {module_name!r} is not a .py file; {expected}"
                    + ("" if not file.with_suffix(".py").is_file() else f" (did you mean {file.with_suffix('.py')}?)")
                )
            mod_spec = importlib.util.spec_from_file_location(f"_tierstore_user_{file.stem}", file)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            with _cwd_importable():
                module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{flag} {spec!r}: cannot import {module_name!r}: {exc!r}") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(f"{flag} {spec!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ConfigError(f"{flag} {spec!r}: {attr!r} is a {type(target).__name__}, not a callable factory")
    return target


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """Let ``module:factory`` name a module in the current directory, as ``python -m`` does."""
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)

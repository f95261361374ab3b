"""Byte sizes written the way people write them: ``"512MiB"``, ``"2GB"``, ``1 << 30``.

Example
-------
>>> parse_size("512MiB")
536870912
>>> parse_size("2GB")
2000000000
>>> format_size(3 << 30)
'3.00 GiB'
"""

from __future__ import annotations

import re

from .errors import ConfigError

__all__ = ["parse_size", "format_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}

_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    Parameters
    ----------
    value
        An ``int`` (bytes), or a string such as ``"512MiB"``, ``"1.5 GB"``,
        ``"4096"``. Decimal units (kB, MB, GB, TB) are powers of 1000, binary
        units (KiB, MiB, GiB, TiB) powers of 1024.
    name
        The argument's name, used in the error message.

    Raises
    ------
    ConfigError
        If ``value`` is negative, not a number, or has an unknown unit.

    Example
    -------
    >>> parse_size("1KiB")
    1024
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is a bool; give a byte count such as 512 << 20 or '512MiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}={value} is negative; give a byte count >= 0")
        return value
    if isinstance(value, float):
        if not value >= 0 or value != value or value == float("inf"):
            raise ConfigError(f"{name}={value!r} is not a finite byte count >= 0")
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"{name}={value!r} has type {type(value).__name__}; give an int (bytes) or a string like '512MiB'"
        )
    match = _PATTERN.match(value)
    if match is None:
        raise ConfigError(f"{name}={value!r} is not a size; write it like '512MiB', '2GB' or '1048576'")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(
            f"{name}={value!r} has unknown unit {unit!r}; use one of B, kB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    return int(float(number) * factor)


def format_size(nbytes: int | float) -> str:
    """Format a byte count with a binary unit, e.g. ``'1.50 GiB'``.

    Example
    -------
    >>> format_size(1536)
    '1.50 KiB'
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")

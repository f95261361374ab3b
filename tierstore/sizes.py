"""Byte sizes written the way people write them: ``"512MiB"``, ``"2GB"``, ``1 << 30``.

Example
-------
>>> parse_size("512MiB")
536870912
>>> parse_size("2GB")
2000000000
>>> format_size(3 << 30)
'3.00 GiB'

A RAM budget may also be a share of the optimizer state's size: ``"1/8"``,
``"12.5%"`` or a float below 1 such as ``0.125`` (all three are the same
budget; see :func:`parse_budget`).

>>> parse_budget("1/8", state_bytes=8 << 20)
1048576
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from .errors import ConfigError

__all__ = ["parse_size", "parse_budget", "budget_request", "format_size"]

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
        if not value.is_integer():
            # 0.125 used to be read as 0 bytes: a fraction of a byte is never what was meant
            raise ConfigError(f"{name}={value!r} is not a whole number of bytes; give an int such as {int(value)} or a string like '512MiB'")
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"{name}={value!r} has type {type(value).__name__}; give an int (bytes) or a string like '512MiB'"
        )
    match = _PATTERN.match(value)
    if match is None and _PATTERN.match(value.strip().removeprefix("-")):
        raise ConfigError(f"{name}={value!r} is not a size: it is negative; give a byte count >= 0 such as '512MiB'")
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


# A budget's share: "1/8", "12.5%", or a bare number below 1 ("0.125").
_SHARE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?:/\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)|(%))\s*$")
_SHARE_FIX = "give a share in (0, 1] of the state such as '1/8', '12.5%' or 0.125, or a size such as '512MiB'"


def budget_request(value: int | float | str | Fraction | None, *, name: str = "ram_budget") -> int | Fraction | None:
    """Validate a RAM budget before the state's size is known: bytes, a share, or ``None``.

    Returns ``None`` (no budget: all state in RAM), an ``int`` of bytes, or a
    :class:`fractions.Fraction` in (0, 1]: the share of the state's size that
    :func:`parse_budget` resolves to bytes. The forms:

    - bytes: an ``int`` >= 0, an integral ``float`` >= 1 (``8e9``), or a
      string with a unit (``"512MiB"``, ``"2GB"``, ``"4096"``);
    - a share: ``"1/8"``, ``"12.5%"``, or a float (or numeric string) in
      (0, 1) such as ``0.125``. ``"1/1"`` and ``"100%"`` are the whole state.

    Raises
    ------
    ConfigError
        For a bool, a negative, NaN or infinite number, a share <= 0 or > 1,
        a float >= 1 with a fractional part (``1.5``: neither bytes nor a
        share), or text that is neither a size nor a share; the message
        names the value and the fix.

    Example
    -------
    >>> budget_request("12.5%"), budget_request(0.125), budget_request("1/8")
    (Fraction(1, 8), Fraction(1, 8), Fraction(1, 8))
    >>> budget_request("2GiB")
    2147483648
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is a bool; {_SHARE_FIX}")
    if isinstance(value, Fraction):  # a share already read (this function's own result)
        return _share(value, value, name)
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{name}={value!r} is not a finite number >= 0; {_SHARE_FIX}")
        if value < 1:
            return _share(Fraction(value), value, name)
        if not value.is_integer():
            raise ConfigError(
                f"{name}={value!r} is ambiguous: a float >= 1 is a byte count and must be whole; "
                f"give bytes such as {int(value)} or a share below 1 such as 0.125"
            )
        return int(value)
    if isinstance(value, str):
        match = _SHARE.match(value)
        if match is not None:
            number, denominator, percent = match.groups()
            try:
                share = Fraction(number) / (Fraction(denominator) if denominator else 100 if percent else 1)
            except ZeroDivisionError:
                raise ConfigError(f"{name}={value!r} divides by zero; {_SHARE_FIX}") from None
            return _share(share, value, name)
        if _PATTERN.match(value) and not any(c.isalpha() for c in value) and "." in value:
            bare = float(value)  # a unitless number with a point: a share below 1, whole bytes above
            return budget_request(bare, name=name) if bare >= 1 or bare == 0 else _share(Fraction(value.strip()), value, name)
    return parse_size(value, name=name)


def _share(share: Fraction, value: object, name: str) -> Fraction:
    if not 0 < share <= 1:
        raise ConfigError(f"{name}={value!r} is a share of {float(share):g} of the state; {_SHARE_FIX}")
    return share


def parse_budget(value: int | float | str | None, *, state_bytes: int, name: str = "ram_budget") -> int | None:
    """A RAM budget in bytes, a share resolved against the state's size ``state_bytes``.

    The forms and errors are :func:`budget_request`'s; a share rounds down to
    whole bytes. ``TieredAdamW(ram_budget=...)``, ``tierstore plan
    --ram-budget`` and ``tierstore bench step --ram-budget`` read it.

    Raises
    ------
    ConfigError
        As :func:`budget_request`.

    Example
    -------
    >>> parse_budget(0.125, state_bytes=1000), parse_budget("12.5%", state_bytes=1000), parse_budget(64, state_bytes=1000)
    (125, 125, 64)
    """
    return resolve_budget(budget_request(value, name=name), state_bytes=state_bytes)


def resolve_budget(request: int | Fraction | None, *, state_bytes: int) -> int | None:
    """Bytes of a :func:`budget_request` result for a state of ``state_bytes`` bytes.

    Example
    -------
    >>> resolve_budget(Fraction(1, 4), state_bytes=10)
    2
    """
    if isinstance(request, Fraction):
        return int(request * state_bytes)
    return request

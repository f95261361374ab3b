"""The record of each parameter's scalars besides ``step`` (NAdam's ``mu_product``) that state directories,
checkpoints and DCP keep beside the step counts.

An algorithm with :attr:`~tierstore._compute.algorithms.base.Algorithm.scalar_inits`
keeps, per parameter, scalars that cannot be recomputed from the step count
(``mu_product`` multiplies in each step's ``beta1`` and ``momentum_decay``,
which may change between steps). A manifest and a checkpoint header record
them under :data:`RECORD_KEY` as ``{name: [value or null per parameter]}``:
a float where the parameter has a step, ``null`` where it has none, as its
``param_steps`` entry. An algorithm without such scalars records no key at
all, so the bytes of its manifests and checkpoints are what they were.
Read back, a record is checked (:func:`check_record`): exactly the
algorithm's names, one entry per parameter, ``null`` exactly where the step is,
and every value a finite number within float32's range (the scalars are
float32 tensors, as torch's ``load_state_dict`` casts them); a crafted one is
refused, never used.

Example
-------
>>> import torch
>>> inits = {"mu_product": 1.0}
>>> record = record_of(inits, [2.0, None], [{"mu_product": torch.tensor(0.25)}, {}])
>>> record
{'mu_product': [0.25, None]}
>>> tensors_of(record, 2)[0]["mu_product"]
tensor(0.2500)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError

__all__ = ["RECORD_KEY", "FLOAT32_MAX", "scalar_tensor", "record_of", "check_record", "tensors_of", "given_scalars",
           "within_float32"]

#: The key of the record in a manifest and in a checkpoint's attributes.
RECORD_KEY = "param_scalars"
#: The largest magnitude a recorded scalar may have: float32's (its tensor would otherwise be infinite).
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def scalar_tensor(value: float) -> Tensor:
    """A per-parameter scalar as the engine keeps it: a 0-d tensor of the dtype torch creates it in
    (``torch.optim``'s ``_get_scalar_dtype()``: float64 only where that is the default dtype)."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(value), dtype=dtype)


def record_of(
    inits: Mapping[str, float], steps: Sequence[float | None], values: Sequence[Mapping[str, Any]]
) -> dict[str, list[float | None]] | None:
    """The record of ``values`` (each parameter's scalars, from its optimizer state) for a commit or a header.

    ``inits`` are the algorithm's :attr:`~tierstore._compute.algorithms.base.Algorithm.scalar_inits`:
    ``None`` (no record) when it has none. A parameter with a step and no
    value yet is recorded at its initial value, the value its next step reads.
    Values are read now (the state's tensors are updated in place later).
    """
    if not inits:
        return None
    return {
        name: [None if step is None else float(values[i].get(name, init)) for i, step in enumerate(steps)]
        for name, init in inits.items()
    }


def within_float32(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool) that is finite within float32's range (a recordable scalar)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return math.isfinite(number) and abs(number) <= FLOAT32_MAX


def check_record(
    value: Any,
    inits: Mapping[str, float],
    steps: Sequence[float | None],
    invalid: Callable[[str, Any, str], Exception],
) -> dict[str, list[float | None]] | None:
    """A record read back (a manifest's or a checkpoint's; ``None`` where it has none), checked before use.

    ``inits`` are the state's algorithm's scalars, ``steps`` its checked
    ``param_steps``. ``invalid(key, value, expected)`` makes the error a bad
    value raises (the caller's wording: where it was read and the fix).

    Raises
    ------
    Exception
        ``invalid``'s: for a record an algorithm without such scalars should not
        have, a missing or malformed one, a list of another length, a value where
        the parameter has no step or ``null`` where it has one, or a value that is
        not a finite number within float32's range.

    Example
    -------
    >>> bad = lambda key, value, expected: ValueError(f"{key}={value!r}, expected {expected}")
    >>> check_record({"mu_product": [float("nan")]}, {"mu_product": 1.0}, [1.0], bad)
    Traceback (most recent call last):
    ...
    ValueError: param_scalars.mu_product[0]=nan, expected a finite number within float32's range (parameter 0 has a step)
    """
    names = list(inits)
    if not names:
        if value is not None:
            raise invalid(RECORD_KEY, value, "no such record (the state's algorithm keeps no per-parameter scalar besides step)")
        return None
    if not isinstance(value, dict) or sorted(value) != sorted(names):
        shape = ", ".join(f"{n!r}: [a number or null per parameter]" for n in names)
        raise invalid(RECORD_KEY, value, f"{{{shape}}} (the state's algorithm keeps {' and '.join(names)} per parameter)")
    out: dict[str, list[float | None]] = {}
    for name in names:
        values = value[name]
        key = f"{RECORD_KEY}.{name}"
        if not isinstance(values, list) or len(values) != len(steps):
            raise invalid(key, values, f"a list of {len(steps)} entries, one per parameter")
        for i, (v, step) in enumerate(zip(values, steps)):
            if step is None and v is not None:
                raise invalid(f"{key}[{i}]", v, f"null (parameter {i} has no step: its param_steps entry is null)")
            if step is not None and not within_float32(v):
                raise invalid(f"{key}[{i}]", v, f"a finite number within float32's range (parameter {i} has a step)")
        out[name] = [None if v is None else float(v) for v in values]
    return out


def tensors_of(record: Mapping[str, Sequence[float | None]] | None, count: int) -> list[dict[str, Tensor]]:
    """Each of ``count`` parameters' scalars as tensors (:func:`scalar_tensor`), an empty dict where it has none."""
    out: list[dict[str, Tensor]] = [{} for _ in range(count)]
    for name, values in (record or {}).items():
        for i, v in enumerate(values):
            if v is not None:
                out[i][name] = scalar_tensor(v)
    return out


def given_scalars(
    record: Mapping[str, Sequence[float | None]] | None, inits: Mapping[str, float], indices: Sequence[int], count: int, front: str
) -> dict[int, dict[str, Tensor]]:
    """The scalars an adapter hands ``replace_shards`` for the parameters at ``indices`` (those given a step).

    Raises
    ------
    ConfigError
        If the algorithm has such scalars and ``record`` is missing, malformed, or
        lacks a finite value for one of those parameters.
    """
    if not inits:
        return {}

    def refuse(key: str, value: Any, expected: str) -> ConfigError:
        text = repr(value)
        text = text if len(text) <= 80 else f"{text[:75]}...{text[-2:]}"
        return ConfigError(
            f"{front} keeps a per-parameter {' and '.join(inits)} beside each step count: replace_shards needs "
            f"param_scalars with it ({key}={text}, expected {expected}); pass what the state's source records "
            f"(an optimizer's param_scalars(), a checkpoint's {RECORD_KEY})"
        )

    chosen = set(indices)
    steps = [0.0 if i in chosen else None for i in range(count)]  # only the parameters given a step need values
    if not isinstance(record, Mapping) or sorted(record) != sorted(inits) or any(
        not isinstance(record[n], Sequence) or len(record[n]) != count for n in inits
    ):
        raise refuse(RECORD_KEY, record, f"{{name: [a number or null per parameter]}} for {list(inits)}, {count} parameters")
    masked = {n: [v if steps[i] is not None else None for i, v in enumerate(record[n])] for n in inits}
    scalars = tensors_of(check_record(masked, inits, steps, refuse), count)
    return {i: scalars[i] for i in indices}

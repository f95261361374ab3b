"""The optimizer algorithms whose state tierstore stores: one description each, one registry.

:class:`Algorithm` (:mod:`.base`) says what the engine needs of an optimizer:
its per-element fields, torch's checks and group keys, the per-step snapshot
of a group's hyperparameters and the update over flat pieces.
:data:`ALGORITHMS` holds the registered ones by the name a layout records.

Example
-------
>>> algorithm_named("adamw") is ADAMW
True
>>> algorithm_named("lamb")
Traceback (most recent call last):
...
tierstore.errors.ConfigError: unknown optimizer algorithm 'lamb'; tierstore knows ['adadelta', 'adagrad', 'adam', 'adamax', 'adamw', 'lion', 'nadam', 'radam', 'rmsprop', 'sgd']
"""

from __future__ import annotations

from types import MappingProxyType

from ...errors import ConfigError
from .adadelta import ADADELTA
from .adagrad import ADAGRAD
from .adam import ADAM
from .adamax import ADAMAX
from .adamw import ADAMW
from .base import FLAG, FLAG_OR_NULL, NUMBER, PAIR, Algorithm, FieldSpec
from .lion import LION
from .nadam import NADAM
from .radam import RADAM
from .rmsprop import RMSPROP
from .sgd import SGD

#: Every registered algorithm by its name.
ALGORITHMS = MappingProxyType(
    {a.name: a for a in (ADAMW, ADAM, ADAGRAD, SGD, RMSPROP, ADAMAX, NADAM, RADAM, ADADELTA, LION)}
)


def algorithm_named(name: str | Algorithm) -> Algorithm:
    """The registered algorithm called ``name`` (an :class:`Algorithm` is returned as it is).

    Raises
    ------
    ConfigError
        For a name no algorithm is registered under.
    """
    if isinstance(name, Algorithm):
        return name
    found = ALGORITHMS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"unknown optimizer algorithm {name!r}; tierstore knows {sorted(ALGORITHMS)}")
    return found


__all__ = ["ADAMW", "ALGORITHMS", "Algorithm", "FieldSpec", "algorithm_named", "NUMBER", "PAIR", "FLAG", "FLAG_OR_NULL",
           "ADADELTA", "ADAGRAD", "ADAM", "ADAMAX", "LION", "NADAM", "RADAM", "RMSPROP", "SGD"]  # fmt: skip

"""The algorithm a saved state may name besides the registered ones: the one the optimizer being built runs.

A layout records its algorithm by name (``Layout.to_dict``), and reading it
back (``Layout.from_dict``, when a state directory is resumed) looks the name
up. Registered algorithms (:data:`~tierstore._compute.algorithms.ALGORITHMS`)
are always found. An algorithm that is not registered, such as the generic
adapter's (:mod:`tierstore._compute.algorithms.generic`, named
``"generic:<module>.<qualname>"`` after the class the user passed), is found
only while :func:`using` it: the optimizer being built declares the algorithm
it runs, so a state file can name only that one, and nothing named in a file
is ever imported.

Example
-------
>>> from tierstore._compute.algorithms import ADAMW
>>> class Mine(type(ADAMW)):
...     name = "mine"
>>> mine = Mine()
>>> with using(mine):
...     in_use("mine") is mine
True
>>> in_use("mine") is None
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from types import MappingProxyType

from .base import Algorithm

#: How the generic adapter's algorithms are named: ``"generic:<module>.<qualname>"`` of the class it runs.
GENERIC_PREFIX = "generic:"

_IN_USE: ContextVar[MappingProxyType] = ContextVar("tierstore_algorithms_in_use", default=MappingProxyType({}))


@contextlib.contextmanager
def using(algorithm: Algorithm) -> Iterator[None]:
    """Within the block, a saved layout naming ``algorithm.name`` resolves to ``algorithm`` (this thread, this context)."""
    token = _IN_USE.set(MappingProxyType({**_IN_USE.get(), algorithm.name: algorithm}))
    try:
        yield
    finally:
        _IN_USE.reset(token)


def in_use(name: object) -> Algorithm | None:
    """The algorithm called ``name`` that :func:`using` declared here, else ``None`` (registered ones are looked up
    in :data:`~tierstore._compute.algorithms.ALGORITHMS`)."""
    return _IN_USE.get().get(name) if isinstance(name, str) else None

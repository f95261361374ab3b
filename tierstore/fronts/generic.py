"""``tierstore.tiered``: any elementwise ``torch.optim.Optimizer`` class, its state in tiers.

``tiered(cls, params, **kwargs)`` builds a :class:`TieredGeneric`: the
class's hyperparameters go to the class, the tier arguments (``state_dir``,
``ram_budget``, ``moment_dtype``, ... as :class:`~tierstore.TieredAdamW`
documents them) to the store. Before anything is laid out the class is
probed on small tensors (:mod:`tierstore._compute.algorithms.generic_probe`):
what it keeps per element becomes the state's fields, and a class that is not
elementwise (factored moments, a per-tensor norm, an orthogonalisation, a
per-parameter scalar besides ``step``) is refused with the reason. Each step
then runs the class's own ``step`` on flat pieces of the parameters with
their state swapped in (:mod:`tierstore._compute.algorithms.generic`), so
the result is the class's, bit for bit.

The state records ``"generic:<module>.<qualname>"`` as its algorithm: a
``state_dir`` resumes with the same class passed again (never by importing
what a file names). State dicts load into and from the class itself.

Example
-------
>>> import torch
>>> from tierstore import tiered
>>> w = torch.nn.Parameter(torch.ones(3))
>>> with tiered(torch.optim.Adamax, [w], lr=0.1) as opt:
...     w.grad = torch.ones(3); _ = opt.step()
...     sorted(opt.state_dict()["state"][0])
['exp_avg', 'exp_inf', 'step']
>>> [round(x, 3) for x in w.tolist()]
[0.9, 0.9, 0.9]
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .._compute.algorithms.generic import Generic, constructor_arguments
from .._compute.algorithms.generic_probe import check_elementwise, probe
from ..errors import ConfigError
from ..tiered_optimizer import TieredOptimizer

__all__ = ["TIER_ARGUMENTS", "TieredGeneric", "tiered"]

#: The keyword arguments that go to the store rather than to the class (TieredOptimizer's keyword-only ones).
TIER_ARGUMENTS = tuple(
    name
    for name, p in inspect.signature(TieredOptimizer.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)


class TieredGeneric(TieredOptimizer):
    """An elementwise torch optimizer class whose state lives in tiers; build it with :func:`tiered`.

    Its ``algorithm`` is built for the class and these arguments (an instance
    attribute, where other fronts have a class attribute).
    """

    def __init__(self, optimizer_cls: type, params: Iterable[Tensor] | Iterable[dict[str, Any]], /, **kwargs: Any) -> None:
        tier = {k: kwargs.pop(k) for k in TIER_ARGUMENTS if k in kwargs}
        named, _ = constructor_arguments(optimizer_cls) if isinstance(optimizer_cls, type) else ((), False)
        clash = sorted(set(named) & set(tier))
        if clash:
            raise ConfigError(
                f"{optimizer_cls.__qualname__} takes {clash[0]}=, which tierstore.tiered also takes for the store; "
                "tierstore.tiered cannot tell whose it is: use the class itself"
            )
        params = list(params)
        overrides = [g for g in params if isinstance(g, dict)]
        found = probe(optimizer_cls, kwargs, overrides)
        algorithm = Generic(found, kwargs)
        check_elementwise(algorithm, overrides)
        self.algorithm = algorithm
        super().__init__(params, kwargs, **tier)

    def __repr__(self) -> str:
        closed = self._rt is None or self._rt.closed
        return f"tiered({self.algorithm.torch_class}, {'closed' if closed else self.describe()})"


def tiered(optimizer_cls: type[torch.optim.Optimizer], params: Iterable[Tensor] | Iterable[dict[str, Any]],
           **kwargs: Any) -> TieredGeneric:  # fmt: skip
    """Run ``optimizer_cls`` (any elementwise ``torch.optim.Optimizer`` subclass) with its state in tiers.

    Parameters
    ----------
    optimizer_cls
        The class, e.g. ``pytorch_optimizer.Lion`` or ``torch.optim.Adamax``.
    params
        Parameters or param-group dicts, as the class takes them.
    **kwargs
        The class's hyperparameters, and the tier arguments
        (:data:`TIER_ARGUMENTS`: ``state_dir``, ``ram_budget``, ``moment_dtype``,
        ..., as :class:`tierstore.TieredAdamW` documents them).

    Raises
    ------
    ConfigError
        If the class is not elementwise (the message says what it reads or
        keeps), refuses its arguments, or takes an argument named like a
        tier argument; and as :class:`tierstore.TieredAdamW` raises.

    Example
    -------
    >>> import torch
    >>> tiered(torch.optim.Muon, [torch.nn.Parameter(torch.ones(4, 4))])
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigError: tierstore.tiered cannot run torch.optim.Muon: it is not elementwise: ...
    """
    return TieredGeneric(optimizer_cls, params, **kwargs)

"""``tierstore.from_deepspeed_config``: the tiered front a DeepSpeed config's ``optimizer.type`` names, built.

The mapping is :mod:`tierstore.deepspeed_config`'s (pure); this picks the
front of the algorithm it names among the fronts (:class:`~tierstore.TieredAdamW`
and those of :mod:`tierstore.fronts`) and builds it.

Example
-------
>>> import torch
>>> cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
...        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
>>> with from_deepspeed_config(torch.nn.Linear(4, 4).parameters(), cfg) as opt:
...     type(opt).__name__, opt.param_groups[0]["momentum"]
('TieredSGD', 0.9)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._compute.algorithms import ALGORITHMS
from ..deepspeed_config import (
    deepspeed_kwargs,
    map_deepspeed_config,
    materialize_params,
)
from ..errors import ConfigError
from ..tiered_optimizer import TieredOptimizer

__all__ = ["from_deepspeed_config", "front_of", "front_arguments"]


def front_arguments(front: type[TieredOptimizer]) -> set[str]:
    """The keyword arguments ``front`` takes besides ``params``: its torch class's, and the tier arguments
    (``state_dir``, ``ram_budget``, ...) it passes on to :class:`~tierstore.tiered_optimizer.TieredOptimizer`
    (``**tiers``).

    Example
    -------
    >>> from tierstore.fronts import TieredSGD
    >>> {"momentum", "state_dir", "ram_budget"} <= front_arguments(TieredSGD), "tiers" in front_arguments(TieredSGD)
    (True, False)
    """
    parameters = inspect.signature(front.__init__).parameters
    names = {n for n, p in parameters.items() if n not in ("self", "params") and p.kind is not p.VAR_KEYWORD}
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        tiers = inspect.signature(TieredOptimizer.__init__).parameters.items()
        names |= {n for n, p in tiers if p.kind is p.KEYWORD_ONLY}
    return names


def front_of(name: str) -> type[TieredOptimizer] | None:
    """The front whose class attribute ``algorithm`` is the registered algorithm called ``name`` (``None``: none here)."""
    from .. import fronts
    from ..optimizer import TieredAdamW

    for cls in (TieredAdamW, *(getattr(fronts, n) for n in fronts.__all__)):
        algorithm = getattr(cls, "algorithm", None)
        if isinstance(cls, type) and algorithm is not None and algorithm is ALGORITHMS.get(name):
            return cls
    return None


def from_deepspeed_config(params: Any, config: Mapping[str, Any] | str | Path, **overrides: Any) -> TieredOptimizer:
    """The tiered front ``optimizer.type`` names, built from a DeepSpeed config (a dict or a JSON path).

    ``Adam``/``AdamW`` build :class:`~tierstore.TieredAdamW` (``Adam`` with
    ``adam_w_mode: false``: ``TieredAdam``, torch's L2 decay), ``Adagrad``
    ``TieredAdagrad``, ``Lion`` ``TieredLion`` (with DeepSpeed's defaults), and
    a ``torch.optim`` class name (``SGD``, ``RMSprop``, ...) its front, with
    ``params`` as its arguments; the ZeRO offload section maps as for every
    front (:mod:`tierstore.deepspeed_config`'s table). ``overrides`` (the
    front's keyword arguments) win over the config.

    Raises
    ------
    ConfigError
        For a type tierstore has no front for (with the reason for DeepSpeed's
        own, such as 1-bit Adam or LAMB), or keys the front cannot honour.
    """
    params = materialize_params(params)
    name = map_deepspeed_config(config, overrides=overrides, algorithm=None).algorithm
    front = front_of(name)
    if front is None:
        algorithm = ALGORITHMS.get(name)
        wanted = algorithm.front if algorithm is not None else f"the {name!r} optimizer"
        raise ConfigError(
            f"the DeepSpeed config's optimizer.type asks for {wanted}, which this tierstore does not have; "
            "upgrade tierstore, or use another optimizer type"
        )
    kwargs, _ = deepspeed_kwargs(params, config, accepted=front_arguments(front), algorithm=name, **overrides)
    return front(params, **kwargs)

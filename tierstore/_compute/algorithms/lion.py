"""Lion as an :class:`~tierstore._compute.algorithms.base.Algorithm`: bitwise lion-pytorch's ``Lion``.

lion-pytorch (``pip install lion-pytorch``) is a third-party optimizer, the
one DeepSpeed's ``CPULion`` and most fine-tuning recipes mean by Lion. Its
state per parameter is ``exp_avg`` alone (signed; compressed moment formats
may store it: the update reads only the sign of ``beta1 * exp_avg + (1 -
beta1) * grad``), and it keeps no step count: tierstore counts each
parameter's steps internally, and a loaded ``exp_avg`` counts as one. Its
group keys are ``lr``, ``betas`` and ``weight_decay``; the update is
:mod:`tierstore._compute.lion_kernel` (compiled, one pass, or its torch ops).

lion-pytorch checks its constructor with ``assert lr > 0.`` and ``assert
0 <= beta <= 1`` for each beta; tierstore makes the same checks with a
message and the fix (a :class:`~tierstore.errors.ConfigError`, not an
``AssertionError``).

Example
-------
>>> import torch
>>> group = LION.defaults(dict(lr=0.1, betas=(0.9, 0.99), weight_decay=0.0))
>>> hyper = LION.snapshot(group, fields=("exp_avg",))
>>> p, g, m = torch.ones(2), torch.full((2,), -0.5), torch.zeros(2)
>>> LION.update([p], [g], {"exp_avg": [m]}, [torch.tensor(1.0)], hyper)
>>> [round(x, 4) for x in p.tolist()], [round(x, 4) for x in m.tolist()]
([1.1, 1.1], [-0.005, -0.005])
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any

from torch import Tensor

from ...errors import ConfigError, ConfigTypeError
from .. import lion_kernel
from ..lion_kernel import LionHyper
from .base import Algorithm, FieldSpec


def _number(name: str, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigTypeError(f"{name}={value!r}{where} must be a number (lion-pytorch's Lion takes Python numbers)")
    return float(value)


class Lion(Algorithm):
    """Lion (sign momentum; weight decay, lion-pytorch's decoupled weight decay), bitwise ``lion_pytorch.Lion``."""

    name = "lion"
    front = "TieredLion"
    torch_class = "lion_pytorch.Lion"
    fields = (FieldSpec("exp_avg", signed=True),)
    state_scalars = ()  # lion-pytorch keeps no step
    group_kinds = MappingProxyType({"lr": "number", "betas": "pair", "weight_decay": "number"})

    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        """Lion has no option that adds a field."""
        return False

    def check_group(self, group: Mapping[str, Any], where: str = "") -> None:
        """lion-pytorch's ``lr > 0`` and ``0 <= beta <= 1``, with messages and the fix; every value a number."""
        lr = _number("lr", group["lr"], where)
        if not lr > 0.0:
            raise ConfigError(f"Invalid learning rate: {group['lr']}{where}; lion-pytorch's Lion needs lr > 0")
        betas = group["betas"]
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ConfigTypeError(f"betas={betas!r}{where} must be a pair of numbers, e.g. betas=(0.9, 0.99)")
        for k, b in enumerate(betas):
            if not 0.0 <= _number(f"betas[{k}]", b, where) <= 1.0:
                raise ConfigError(f"Invalid beta parameter at index {k}: {b}{where}; it must be in [0, 1]")
        _number("weight_decay", group["weight_decay"], where)

    def defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``lr``, ``betas``, ``weight_decay``: lion-pytorch's group keys, in its order."""
        return dict(lr=values["lr"], betas=values["betas"], weight_decay=values["weight_decay"])

    def loaded_step(self, entry: Mapping[str, Any]) -> float | None:
        """A ``step`` if the entry has one; else a loaded ``exp_avg`` counts as one step (lion-pytorch keeps none)."""
        if "step" in entry:
            return float(entry["step"])
        return 1.0 if "exp_avg" in entry else None

    def snapshot(self, group: Mapping[str, Any], fields: Collection[str]) -> LionHyper:
        """The group's numbers (a front adjusts ``weight_decay`` for lion-pytorch's decoupled weight decay)."""
        b1, b2 = group["betas"]
        return LionHyper(lr=float(group["lr"]), beta1=float(b1), beta2=float(b2), weight_decay=float(group["weight_decay"]))

    def update(
        self,
        targets: list[Tensor],
        grads: list[Tensor],
        fields: Mapping[str, list[Tensor]],
        steps: list[Tensor],
        hyper: LionHyper,
    ) -> None:
        """:func:`tierstore._compute.lion_kernel.update` (the compiled kernel where it matches, else the torch ops)."""
        lion_kernel.update(targets, grads, fields["exp_avg"], hyper)

    def probe(self) -> None:
        """Nothing to probe: the torch ops exist in every torch, and the compiled kernel is optional."""


#: The registered Lion.
LION = Lion()

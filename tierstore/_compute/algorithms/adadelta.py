"""Adadelta as an :class:`~tierstore._compute.algorithms.base.Algorithm`: ``torch.optim.Adadelta``'s own implementation.

Fields: ``square_avg`` and ``acc_delta``, both non-negative averages of
squares; each parameter keeps a ``step``. Compressed moment formats may
store both: the update reads each through ``sqrt(x + eps)``, so a value
rounded to zero gives ``sqrt(eps)``, as it does after the first step.

Example
-------
>>> ADADELTA.field_names, tuple(f.name for f in ADADELTA.fields if f.compressible)
(('square_avg', 'acc_delta'), ('square_avg', 'acc_delta'))
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .base import FieldSpec
from .functional import (
    EPS,
    FLAG,
    FLAG_OR_NULL,
    LR,
    NUMBER,
    OFF,
    WEIGHT_DECAY,
    Bound,
    TorchFunctional,
)


class Adadelta(TorchFunctional):
    """Adadelta (rho, weight decay, maximize), bitwise ``torch.optim.Adadelta``."""

    name = "adadelta"
    front = "TieredAdadelta"
    torch_class = "torch.optim.Adadelta"
    module = "adadelta"
    fields = (FieldSpec("square_avg"), FieldSpec("acc_delta"))
    arguments = ("square_avg", "acc_delta")
    group_keys = ("lr", "rho", "eps", "weight_decay", "maximize", "capturable", "foreach", "differentiable")
    bounds = (LR, Bound("rho", "rho value", high=1.0, high_open=False), EPS, WEIGHT_DECAY)
    group_defaults = MappingProxyType({"foreach": None, "maximize": False, "differentiable": False,
                                       "capturable": False})  # fmt: skip
    group_kinds = MappingProxyType({"lr": NUMBER, "rho": NUMBER, "eps": NUMBER, "weight_decay": NUMBER,
                                    "maximize": FLAG, "capturable": FLAG, "differentiable": FLAG,
                                    "foreach": FLAG_OR_NULL})  # fmt: skip

    def kernel_kwargs(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """As ``torch.optim.Adadelta.step`` passes them."""
        return dict(lr=group["lr"], rho=group["rho"], eps=group["eps"], weight_decay=group["weight_decay"],
                    maximize=group["maximize"], **OFF)  # fmt: skip


#: The registered Adadelta.
ADADELTA = Adadelta()

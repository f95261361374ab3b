"""Adamax as an :class:`~tierstore._compute.algorithms.base.Algorithm`: ``torch.optim.Adamax``'s own implementation.

Fields: ``exp_avg`` (signed) and ``exp_inf``; each parameter keeps a ``step``.
Compressed moment formats may store ``exp_avg`` only. ``exp_inf`` is what the
update divides by, directly (no square root, no ``eps`` after it): an int8
block stores values more than six decades below its largest as zero, and a
zero there is a division by zero.

Example
-------
>>> ADAMAX.field_names, tuple(f.name for f in ADAMAX.fields if f.compressible)
(('exp_avg', 'exp_inf'), ('exp_avg',))
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .base import FieldSpec
from .functional import (
    BETAS,
    EPS,
    FLAG,
    FLAG_OR_NULL,
    LR,
    NUMBER,
    OFF,
    PAIR,
    WEIGHT_DECAY,
    TorchFunctional,
)


class Adamax(TorchFunctional):
    """Adamax (the infinity-norm Adam), bitwise ``torch.optim.Adamax``."""

    name = "adamax"
    front = "TieredAdamax"
    torch_class = "torch.optim.Adamax"
    module = "adamax"
    fields = (FieldSpec("exp_avg", signed=True), FieldSpec("exp_inf", compressible=False))
    arguments = ("exp_avg", "exp_inf")
    group_keys = ("lr", "betas", "eps", "weight_decay", "foreach", "maximize", "differentiable", "capturable")
    bounds = (LR, EPS, *BETAS, WEIGHT_DECAY)
    group_defaults = MappingProxyType({"foreach": None, "maximize": False, "differentiable": False,
                                       "capturable": False})  # fmt: skip
    group_kinds = MappingProxyType({"lr": NUMBER, "eps": NUMBER, "weight_decay": NUMBER, "betas": PAIR,
                                    "maximize": FLAG, "differentiable": FLAG, "capturable": FLAG,
                                    "foreach": FLAG_OR_NULL})  # fmt: skip

    def kernel_kwargs(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """As ``torch.optim.Adamax.step`` passes them."""
        beta1, beta2 = group["betas"]
        return dict(eps=group["eps"], beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                    maximize=group["maximize"], **OFF)  # fmt: skip


#: The registered Adamax.
ADAMAX = Adamax()

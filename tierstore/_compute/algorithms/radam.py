"""RAdam as an :class:`~tierstore._compute.algorithms.base.Algorithm`: ``torch.optim.RAdam``'s own implementation.

Fields: ``exp_avg`` (signed) and ``exp_avg_sq``, as AdamW's, and compressed
moment formats may store both for the same reasons (``exp_avg_sq`` is used
through ``sqrt(v) + eps``); each parameter keeps a ``step``.
``decoupled_weight_decay=True`` is RAdamW's weight decay.

Example
-------
>>> RADAM.field_names, tuple(f.name for f in RADAM.fields if f.compressible)
(('exp_avg', 'exp_avg_sq'), ('exp_avg', 'exp_avg_sq'))
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


class RAdam(TorchFunctional):
    """Rectified Adam (decoupled weight decay, maximize), bitwise ``torch.optim.RAdam``."""

    name = "radam"
    front = "TieredRAdam"
    torch_class = "torch.optim.RAdam"
    module = "radam"
    fields = (FieldSpec("exp_avg", signed=True), FieldSpec("exp_avg_sq"))
    arguments = ("exp_avg", "exp_avg_sq")
    group_keys = ("lr", "betas", "eps", "weight_decay", "maximize", "foreach", "capturable", "decoupled_weight_decay",
                  "differentiable")  # fmt: skip
    bounds = (LR, EPS, *BETAS, WEIGHT_DECAY)
    group_defaults = MappingProxyType({"foreach": None, "maximize": False, "differentiable": False,
                                       "decoupled_weight_decay": False, "capturable": False})  # fmt: skip
    group_kinds = MappingProxyType({"lr": NUMBER, "eps": NUMBER, "weight_decay": NUMBER, "betas": PAIR,
                                    "maximize": FLAG, "capturable": FLAG, "decoupled_weight_decay": FLAG,
                                    "differentiable": FLAG, "foreach": FLAG_OR_NULL})  # fmt: skip

    def kernel_kwargs(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """As ``torch.optim.RAdam.step`` passes them."""
        beta1, beta2 = group["betas"]
        return dict(beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=group["maximize"], decoupled_weight_decay=group["decoupled_weight_decay"], **OFF)  # fmt: skip


#: The registered RAdam.
RADAM = RAdam()

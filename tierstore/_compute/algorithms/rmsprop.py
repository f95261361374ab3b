"""RMSprop as an :class:`~tierstore._compute.algorithms.base.Algorithm`: ``torch.optim.RMSprop``'s own implementation.

Fields, as torch's state names them: ``square_avg`` always; ``momentum_buffer``
in groups with ``momentum > 0``; ``grad_avg`` in groups with ``centered=True``.
Each parameter keeps a ``step``. Compressed moment formats may store
``square_avg`` (a non-negative average of squared gradients, used through
``sqrt(v) + eps`` as AdamW's ``exp_avg_sq``) and ``momentum_buffer`` (signed,
an average of update directions), never ``grad_avg``; and centered RMSprop
takes no compressed format at all: its denominator is ``sqrt(square_avg -
grad_avg**2)``, a difference that rounding either term can make negative
(NaN updates), most of all where the gradients hardly vary.

Example
-------
>>> RMSPROP.fields_for({"momentum"}), RMSPROP.options([{"momentum": 0.9, "centered": False}])
(('square_avg', 'momentum_buffer'), frozenset({'momentum'}))
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any

from ...errors import ConfigError
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


class RMSprop(TorchFunctional):
    """RMSprop (momentum, centered, weight decay, maximize), bitwise ``torch.optim.RMSprop``."""

    name = "rmsprop"
    front = "TieredRMSprop"
    torch_class = "torch.optim.RMSprop"
    module = "rmsprop"
    fields = (
        FieldSpec("square_avg"),
        FieldSpec("momentum_buffer", option="momentum", signed=True, enable="momentum > 0"),
        # Never compressed: centered RMSprop's square_avg - grad_avg**2 must stay >= 0 (see the module docs).
        FieldSpec("grad_avg", option="centered", signed=True, compressible=False, enable="centered=True"),
    )
    arguments = ("square_avg", "grad_avg", "momentum_buffer")
    group_keys = ("lr", "momentum", "alpha", "eps", "centered", "weight_decay", "capturable", "foreach", "maximize",
                  "differentiable")  # fmt: skip
    bounds = (LR, EPS, Bound("momentum", "momentum value"), WEIGHT_DECAY, Bound("alpha", "alpha value"))
    # What torch.optim.RMSprop.__setstate__ gives a loaded group that lacks them.
    group_defaults = MappingProxyType({"momentum": 0, "centered": False, "foreach": None, "maximize": False,
                                       "differentiable": False, "capturable": False})  # fmt: skip
    group_kinds = MappingProxyType({"lr": NUMBER, "momentum": NUMBER, "alpha": NUMBER, "eps": NUMBER,
                                    "weight_decay": NUMBER, "centered": FLAG, "capturable": FLAG, "maximize": FLAG,
                                    "differentiable": FLAG, "foreach": FLAG_OR_NULL})  # fmt: skip

    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        """``momentum`` (> 0) adds ``momentum_buffer``; ``centered`` adds ``grad_avg``."""
        if option == "momentum":
            return group.get("momentum", 0) > 0
        return option == "centered" and bool(group.get("centered", False))

    def check_format(self, options: Collection[str], format_name: str) -> None:
        """Centered RMSprop keeps float32 moments (see the module docs)."""
        if "centered" in options:
            raise ConfigError(
                f"moment_dtype={format_name!r} with centered=True: centered RMSprop divides by "
                "sqrt(square_avg - grad_avg**2), which a compressed format's rounding can make the square root of a "
                "negative number (NaN updates); use moment_dtype='float32' with centered=True"
            )

    def kernel_kwargs(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """As ``torch.optim.RMSprop.step`` passes them."""
        return dict(lr=group["lr"], alpha=group["alpha"], eps=group["eps"], weight_decay=group["weight_decay"],
                    momentum=group["momentum"], centered=group["centered"], maximize=group["maximize"], **OFF)  # fmt: skip


#: The registered RMSprop.
RMSPROP = RMSprop()

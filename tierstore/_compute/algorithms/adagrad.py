"""Adagrad as an :class:`~tierstore._compute.algorithms.base.Algorithm`: ``torch.optim.Adagrad(fused=True)``.

The one field is ``sum``, the running sum of squared gradients, which starts
at the constructor's ``initial_accumulator_value`` (``FieldSpec.init`` names
it; torch reads the constructor's value, whatever a param group says). As in
torch, every parameter has state from construction (:attr:`Adagrad.eager`:
``step`` 0 and ``sum`` at its initial value), so a state dict lists every
parameter from the start. Note: torch lists frozen parameters too; tierstore
holds no state for them, so its state dicts do not.

``sum`` is never stored compressed: it is kept as fp32 in every moment format
(``FieldSpec(compressible=False)``), so ``moment_dtype="bfloat16"``/``"int8"``
store Adagrad's state exactly as ``"float32"`` does. Why: the sum only grows.
Rounded to nearest in bfloat16 (8 significant bits), an increment below
1/512 of the sum is lost entirely, so after a few hundred steps of gradients
of one size the sum stops growing and the step size stops shrinking, which is
Adagrad's whole point; the error is one-sided and accumulates instead of
fading, unlike a moving average's (Adam's moments, SGD's momentum), whose
rounding errors decay geometrically. int8's blockwise map (about 1% steps near
a block's largest value) stalls sooner still.

Example
-------
>>> import torch
>>> p, g, acc = torch.ones(4), torch.full((4,), 0.5), torch.full((4,), 0.1)
>>> group = ADAGRAD.defaults(dict(lr=0.1, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.1,
...                               eps=1e-10, foreach=None, maximize=False, differentiable=False, fused=None))
>>> ADAGRAD.initial_values(group)
{'sum': 0.1}
>>> hyper = ADAGRAD.snapshot(group, fields=("sum",))
>>> ADAGRAD.update([p], [g], {"sum": [acc]}, [torch.tensor(1.0)], hyper)
>>> round(float(acc[0]), 4), round(float(p[0]), 4)
(0.35, 0.9155)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from torch import Tensor

from ..._platform import torch_private
from ...errors import ConfigError
from ..hyper import at_least_zero
from .base import FLAG, FLAG_OR_NULL, NUMBER, Algorithm, FieldSpec
from .fused_flags import refuse_cpu_meaningless, refuse_unfused

__all__ = ["ADAGRAD", "Adagrad", "AdagradHyper"]


class AdagradHyper(NamedTuple):
    """One param group's Adagrad hyperparameters as plain Python numbers, snapshotted for a step."""

    lr: float
    lr_decay: float
    weight_decay: float
    eps: float
    maximize: bool


class Adagrad(Algorithm):
    """Adagrad with lr decay, weight decay and maximize, bitwise ``torch.optim.Adagrad(fused=True)``."""

    name = "adagrad"
    front = "TieredAdagrad"
    torch_class = "torch.optim.Adagrad"
    fields = (FieldSpec("sum", init="initial_accumulator_value", compressible=False),)
    eager = True
    group_defaults = MappingProxyType({"foreach": None, "maximize": False, "differentiable": False, "fused": True})
    group_kinds = MappingProxyType(
        {
            "lr": NUMBER, "lr_decay": NUMBER, "eps": NUMBER, "weight_decay": NUMBER,
            "initial_accumulator_value": NUMBER, "maximize": FLAG, "differentiable": FLAG,
            "foreach": FLAG_OR_NULL, "fused": FLAG_OR_NULL,
        }
    )  # fmt: skip

    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        """Adagrad has no option that adds a field."""
        return False

    def check_group(self, group: Mapping[str, Any], where: str = "") -> None:
        """``torch.optim.Adagrad.__init__``'s checks in its order (``lr``, ``lr_decay``, ``weight_decay``,
        ``initial_accumulator_value``, ``eps``), then the flags with no CPU meaning."""
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ConfigError(f"Tensor lr must be 1-element{where}; pass a float or a 1-element tensor")
        if not at_least_zero("lr", lr, where, "0.01"):
            raise ConfigError(f"Invalid learning rate: {lr}{where}; lr must be >= 0")
        # (torch names eps "epsilon" in its message)
        for key, label in (("lr_decay", "lr_decay"), ("weight_decay", "weight_decay"),
                           ("initial_accumulator_value", "initial_accumulator_value"), ("eps", "epsilon")):  # fmt: skip
            value = group[key]
            if not at_least_zero(key, value, where, "0.01"):
                raise ConfigError(f"Invalid {label} value: {value}{where}; {key} must be >= 0")
        refuse_cpu_meaningless(group, where, self.front)

    def defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """torch's group keys in its order: ``lr``, ``lr_decay``, ``eps``, ``weight_decay``,
        ``initial_accumulator_value``, ``foreach``, ``maximize``, ``differentiable``, ``fused`` (True: what runs).

        Raises
        ------
        ConfigError
            For ``fused=False`` or ``foreach=True`` (:func:`~.fused_flags.refuse_unfused`).
        """
        refuse_unfused(values, self.front, self.torch_class)
        return dict(
            lr=values["lr"], lr_decay=values["lr_decay"], eps=values["eps"], weight_decay=values["weight_decay"],
            initial_accumulator_value=values["initial_accumulator_value"], foreach=values.get("foreach"),
            maximize=bool(values["maximize"]), differentiable=False, fused=True,
        )  # fmt: skip

    def snapshot(self, group: Mapping[str, Any], fields: Collection[str]) -> AdagradHyper:
        """The group's numbers (a tensor ``lr`` as its float)."""
        return AdagradHyper(
            lr=float(group["lr"]),
            lr_decay=float(group["lr_decay"]),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            maximize=bool(group["maximize"]),
        )

    def update(
        self,
        targets: list[Tensor],
        grads: list[Tensor],
        fields: Mapping[str, list[Tensor]],
        steps: list[Tensor],
        hyper: AdagradHyper,
    ) -> None:
        """``torch._fused_adagrad_`` over the pieces (each piece's step count sets its lr decay)."""
        torch_private.fused_adagrad_kernel()(
            targets,
            grads,
            fields["sum"],
            steps,
            lr=hyper.lr,
            lr_decay=hyper.lr_decay,
            weight_decay=hyper.weight_decay,
            eps=hyper.eps,
            maximize=hyper.maximize,
        )

    def probe(self) -> None:
        """``torch._fused_adagrad_`` exists."""
        torch_private.fused_adagrad_kernel()


#: The registered Adagrad.
ADAGRAD = Adagrad()

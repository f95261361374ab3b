"""SGD as an :class:`~tierstore._compute.algorithms.base.Algorithm`: ``torch.optim.SGD(fused=True)``.

The one field is ``momentum_buffer``, held only when some group uses
momentum (SGD without momentum stores nothing but, with ``keep_master``, the
masters). It is lazy, as in torch: a parameter's first step with momentum
sets it to that step's gradient (after weight decay and ``maximize``), and a
state dict lists it only from then. torch's SGD keeps no ``step``; tierstore
counts each parameter's steps with momentum (:meth:`SGD.advances`) so that it
knows which pieces take their first (``is_first_step`` of
``torch._fused_sgd_``; pieces are bucketed by it, :meth:`SGD.bucket`), and a
state dict omits the count (:attr:`SGD.state_scalars` is empty). A loaded
``momentum_buffer`` counts as one step taken (:meth:`SGD.loaded_step`).

``momentum_buffer`` may be stored compressed (bfloat16, int8 with a signed
map): it is a moving average of gradients, which forgets a rounding error
geometrically (by ``momentum`` each step), as Adam's ``exp_avg`` does.

Note: torch's fused SGD takes its first step for a whole param group at
once, and raises (``TypeError``) when some parameters of a group have a
buffer and others do not yet (one got its first gradient later); tierstore
takes each parameter's first step on its own, as torch's for-loop SGD does.

Example
-------
>>> import torch
>>> p, g, buf = torch.ones(4), torch.full((4,), 0.5), torch.zeros(4)
>>> group = SGD.defaults(dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
...                           maximize=False, foreach=None, differentiable=False, fused=None))
>>> hyper = SGD.snapshot(group, fields=("momentum_buffer",))
>>> SGD.update([p], [g], {"momentum_buffer": [buf]}, [torch.tensor(1.0)], hyper)  # a first step
>>> round(float(p[0]), 4), float(buf[0])
(0.95, 0.5)
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from torch import Tensor

from ..._platform import torch_private
from ...errors import ConfigError, ConfigTypeError
from .base import FLAG, FLAG_OR_NULL, NUMBER, Algorithm, FieldSpec
from .fused_flags import refuse_cpu_meaningless, refuse_unfused

__all__ = ["SGD", "SGDHyper", "StochasticGradientDescent"]


class SGDHyper(NamedTuple):
    """One param group's SGD hyperparameters as plain Python numbers, snapshotted for a step."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool


def _below_zero(name: str, value: Any, where: str) -> bool:
    """``value < 0.0``, torch's SGD test (a NaN passes it, as in torch); a non-number is a ``ConfigTypeError``."""
    try:
        return bool(value < 0.0)
    except TypeError:
        raise ConfigTypeError(f"{name}={value!r}{where} must be a number, e.g. {name}=0.01") from None


class StochasticGradientDescent(Algorithm):
    """SGD with momentum, dampening, Nesterov, weight decay and maximize, bitwise ``torch.optim.SGD(fused=True)``."""

    name = "sgd"
    front = "TieredSGD"
    torch_class = "torch.optim.SGD"
    fields = (
        FieldSpec("momentum_buffer", option="momentum", signed=True, lazy=True, enable="momentum > 0 (e.g. momentum=0.9)"),
    )
    state_scalars = ()  # torch's SGD keeps no step
    group_defaults = MappingProxyType({"nesterov": False, "maximize": False, "foreach": None,
                                       "differentiable": False, "fused": True})  # fmt: skip
    group_kinds = MappingProxyType(
        {
            "lr": NUMBER, "momentum": NUMBER, "dampening": NUMBER, "weight_decay": NUMBER,
            "nesterov": FLAG, "maximize": FLAG, "differentiable": FLAG, "foreach": FLAG_OR_NULL, "fused": FLAG_OR_NULL,
        }
    )  # fmt: skip

    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        """``momentum`` is the one option: a group with ``momentum != 0`` needs ``momentum_buffer``."""
        return option == "momentum" and group.get("momentum", 0) != 0

    def check_group(self, group: Mapping[str, Any], where: str = "") -> None:
        """``torch.optim.SGD.__init__``'s checks in its order (``lr``, ``momentum``, ``weight_decay``,
        Nesterov's), then the flags with no CPU meaning. As in torch, ``dampening`` is not checked."""
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ConfigError(f"Tensor lr must be 1-element{where}; pass a float or a 1-element tensor")
        if _below_zero("lr", lr, where):
            raise ConfigError(f"Invalid learning rate: {lr}{where}; lr must be >= 0")
        if _below_zero("momentum", momentum, where):
            raise ConfigError(f"Invalid momentum value: {momentum}{where}; momentum must be >= 0")
        if _below_zero("weight_decay", group["weight_decay"], where):
            raise ConfigError(f"Invalid weight_decay value: {group['weight_decay']}{where}; it must be >= 0")
        if group.get("nesterov", False) and (momentum <= 0 or dampening != 0):
            raise ConfigError(
                f"Nesterov momentum requires a momentum and zero dampening{where} (momentum={momentum}, "
                f"dampening={dampening}); pass momentum > 0 and dampening=0, or nesterov=False"
            )
        refuse_cpu_meaningless(group, where, self.front)

    def defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """torch's group keys in its order: ``lr``, ``momentum``, ``dampening``, ``weight_decay``,
        ``nesterov``, ``maximize``, ``foreach``, ``differentiable``, ``fused`` (True: what runs).

        Raises
        ------
        ConfigError
            For ``fused=False`` or ``foreach=True`` (:func:`~.fused_flags.refuse_unfused`).
        """
        refuse_unfused(values, self.front, self.torch_class)
        return dict(
            lr=values["lr"], momentum=values["momentum"], dampening=values["dampening"],
            weight_decay=values["weight_decay"], nesterov=bool(values["nesterov"]), maximize=bool(values["maximize"]),
            foreach=values.get("foreach"), differentiable=False, fused=True,
        )  # fmt: skip

    def loaded_step(self, entry: Mapping[str, Any]) -> float | None:
        """A ``step`` where the entry has one; else one step for an entry with a ``momentum_buffer``
        (so its next step is not its first), none otherwise (torch's SGD keeps no count)."""
        if "step" in entry:
            return float(entry["step"])
        return 1.0 if isinstance(entry.get("momentum_buffer"), Tensor) else None

    def advances(self, group: Mapping[str, Any]) -> bool:
        """Only a step with momentum counts: the count says whether ``momentum_buffer`` exists yet."""
        return group["momentum"] != 0

    def snapshot(self, group: Mapping[str, Any], fields: Collection[str]) -> SGDHyper:
        """The group's numbers (a tensor ``lr``/``weight_decay`` as its float).

        Raises
        ------
        ConfigError
            If the group switched to momentum but the state has no ``momentum_buffer``.
        """
        if group["momentum"] != 0 and "momentum_buffer" not in fields:
            raise ConfigError(
                f"a param group switched to momentum={group['momentum']} after construction; the state has no "
                "momentum_buffer field. Build TieredSGD with momentum > 0 from the start (a group can run "
                "without momentum with momentum=0)"
            )
        return SGDHyper(
            lr=float(group["lr"]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
        )

    def bucket(self, step: float) -> Hashable:
        """Whether the pieces take their parameter's first step with momentum (``is_first_step``)."""
        return step == 1.0

    def update(
        self,
        targets: list[Tensor],
        grads: list[Tensor],
        fields: Mapping[str, list[Tensor]],
        steps: list[Tensor],
        hyper: SGDHyper,
    ) -> None:
        """``torch._fused_sgd_`` over the pieces; a first step (their count is 1) sets the buffer to the gradient."""
        # Note: without momentum torch passes no buffers at all (none exist).
        buffers = fields.get("momentum_buffer", []) if hyper.momentum != 0 else []
        torch_private.fused_sgd_kernel()(
            targets,
            grads,
            buffers,
            weight_decay=hyper.weight_decay,
            momentum=hyper.momentum,
            lr=hyper.lr,
            dampening=hyper.dampening,
            nesterov=hyper.nesterov,
            maximize=hyper.maximize,
            is_first_step=bool(buffers) and float(steps[0]) == 1.0,
        )

    def probe(self) -> None:
        """``torch._fused_sgd_`` exists."""
        torch_private.fused_sgd_kernel()


#: The registered SGD.
SGD = StochasticGradientDescent()

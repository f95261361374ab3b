"""Adam as an :class:`~tierstore._compute.algorithms.base.Algorithm`: ``torch.optim.Adam(fused=True)``.

AdamW's fields (the two moments and, with ``amsgrad``, ``max_exp_avg_sq``;
every one compressible, as AdamW's: moving averages forget a rounding error
geometrically), its ``step``, torch's construction checks (Adam's are
AdamW's, plus the two a ``foreach=True`` makes about tensor ``lr`` and
``betas``) and group snapshot; the update is ``torch._fused_adam_`` (weight
decay added to the gradient, L2), or ``torch._fused_adamw_`` for a group with
``decoupled_weight_decay=True``, exactly as torch's ``_fused_adam`` chooses
per group. A state saved by Adam is another identity than AdamW's (the
layout records ``"adam"``), though the fields are the same.

Example
-------
>>> import torch
>>> p, g = torch.ones(4), torch.full((4,), 0.5)
>>> m, v, step = torch.zeros(4), torch.zeros(4), torch.tensor(1.0)
>>> group = ADAM.defaults(dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
...                            maximize=False, foreach=None, capturable=False, differentiable=False,
...                            fused=None, decoupled_weight_decay=False))
>>> hyper = ADAM.snapshot(group, fields=("exp_avg", "exp_avg_sq"))
>>> ADAM.update([p], [g], {"exp_avg": [m], "exp_avg_sq": [v]}, [step], hyper)
>>> round(float(p[0]), 4)
0.9
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from torch import Tensor

from ..._platform import torch_private
from ...errors import ConfigError
from ..hyper import GroupHyper, check_hyper, scalar_betas
from .base import FLAG, FLAG_OR_NULL, NUMBER, PAIR, Algorithm, FieldSpec
from .fused_flags import refuse_cpu_meaningless, refuse_unfused

__all__ = ["ADAM", "Adam", "AdamHyper"]


class AdamHyper(NamedTuple):
    """One param group's Adam hyperparameters for a step: AdamW's, and which kernel runs them."""

    hyper: GroupHyper
    decoupled_weight_decay: bool


class Adam(Algorithm):
    """Adam with L2 weight decay (or decoupled, per group), bitwise ``torch.optim.Adam(fused=True)``."""

    name = "adam"
    front = "TieredAdam"
    torch_class = "torch.optim.Adam"
    fields = (
        FieldSpec("exp_avg", signed=True),
        FieldSpec("exp_avg_sq"),
        FieldSpec("max_exp_avg_sq", option="amsgrad", enable="amsgrad=True"),
    )
    # torch.optim.Adam's implementation flags as the front runs them (the constructor's foreach and
    # decoupled_weight_decay are kept as given: Algorithm.defaults).
    group_defaults = MappingProxyType(
        {"foreach": None, "capturable": False, "differentiable": False, "fused": True, "decoupled_weight_decay": False}
    )
    group_kinds = MappingProxyType(
        {
            "lr": NUMBER, "eps": NUMBER, "weight_decay": NUMBER, "betas": PAIR,
            "amsgrad": FLAG, "maximize": FLAG, "capturable": FLAG, "differentiable": FLAG,
            "decoupled_weight_decay": FLAG, "foreach": FLAG_OR_NULL, "fused": FLAG_OR_NULL,
        }
    )  # fmt: skip

    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        """``amsgrad`` is the one option, and adds ``max_exp_avg_sq``."""
        return option == "amsgrad" and bool(group.get("amsgrad", False))

    def check_group(self, group: Mapping[str, Any], where: str = "") -> None:
        """``torch.optim.Adam.__init__``'s checks in its order, then the flags with no CPU meaning.

        The tensor ``lr``/``betas`` checks that ``foreach=True`` adds come
        first and after the range checks respectively, as in torch.
        """
        lr, betas = group["lr"], group["betas"]
        foreach_only = bool(group.get("foreach")) and not group.get("capturable", False)
        if isinstance(lr, Tensor) and foreach_only:
            raise ConfigError(
                f"lr as a Tensor is not supported for capturable=False and foreach=True{where}; pass a float lr "
                "or foreach=None (TieredAdam runs torch's fused kernel, which takes either)"
            )
        check_hyper(lr, betas, group["eps"], group["weight_decay"], where)
        for k, b in enumerate(betas):
            if isinstance(b, Tensor) and foreach_only:
                raise ConfigError(
                    f"betas[{k}] as a Tensor is not supported for capturable=False and foreach=True{where}; pass "
                    "float betas or foreach=None"
                )
        refuse_cpu_meaningless(group, where, self.front)

    def defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """torch's group keys in its order: ``lr``, ``betas`` (1-element tensors squeezed), ``eps``,
        ``weight_decay``, ``amsgrad``, ``maximize``, ``foreach``, ``capturable``, ``differentiable``,
        ``fused`` (True: what runs), ``decoupled_weight_decay``.

        Raises
        ------
        ConfigError
            For ``fused=False`` or ``foreach=True`` (:func:`~.fused_flags.refuse_unfused`).
        """
        refuse_unfused(values, self.front, self.torch_class)
        return dict(
            lr=values["lr"], betas=scalar_betas(values["betas"]), eps=values["eps"],
            weight_decay=values["weight_decay"], amsgrad=bool(values["amsgrad"]), maximize=bool(values["maximize"]),
            foreach=values.get("foreach"), capturable=False, differentiable=False, fused=True,
            decoupled_weight_decay=bool(values.get("decoupled_weight_decay", False)),
        )  # fmt: skip

    def restore_group(self, group: dict[str, Any]) -> None:
        """As ``torch.optim.Adam.__setstate__``: ``amsgrad``, ``maximize`` and ``decoupled_weight_decay`` default
        to off (a group saved by ``torch.optim.AdamW`` says True, and runs AdamW's update); ``betas`` become floats."""
        group.setdefault("amsgrad", False)
        group.setdefault("maximize", False)
        super().restore_group(group)
        group["betas"] = tuple(float(b) for b in group["betas"])

    def snapshot(self, group: Mapping[str, Any], fields: Collection[str]) -> AdamHyper:
        """AdamW's :class:`~tierstore._compute.hyper.GroupHyper` and the group's ``decoupled_weight_decay``.

        Raises
        ------
        ConfigError
            If the group switched to ``amsgrad=True`` but the state has no ``max_exp_avg_sq``.
        """
        if group["amsgrad"] and "max_exp_avg_sq" not in fields:
            raise ConfigError(
                "a param group switched to amsgrad=True after construction; the state has no max_exp_avg_sq "
                "field. Build TieredAdam with amsgrad=True from the start"
            )
        hyper = GroupHyper.of(dict(group), amsgrad_field=True)
        return AdamHyper(hyper, bool(group.get("decoupled_weight_decay", False)))

    def update(
        self,
        targets: list[Tensor],
        grads: list[Tensor],
        fields: Mapping[str, list[Tensor]],
        steps: list[Tensor],
        hyper: AdamHyper,
    ) -> None:
        """``torch._fused_adam_`` over the pieces (``torch._fused_adamw_`` for a decoupled group)."""
        group = hyper.hyper
        maxs = fields.get("max_exp_avg_sq", []) if group.amsgrad else []
        kernel = torch_private.fused_adamw_kernel() if hyper.decoupled_weight_decay else torch_private.fused_adam_kernel()
        kernel(targets, grads, fields["exp_avg"], fields["exp_avg_sq"], maxs, steps, **group.kernel_kwargs())

    def probe(self) -> None:
        """``torch._fused_adam_`` and ``torch._fused_adamw_`` exist."""
        torch_private.fused_adam_kernel()
        torch_private.fused_adamw_kernel()


#: The registered Adam.
ADAM = Adam()

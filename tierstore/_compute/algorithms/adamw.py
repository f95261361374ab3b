"""AdamW as an :class:`~tierstore._compute.algorithms.base.Algorithm`: ``torch.optim.AdamW(fused=True)``.

It wraps what the AdamW front always used: torch's construction checks
(:func:`tierstore._compute.hyper.check_hyper`), the per-step snapshot
(:class:`tierstore._compute.hyper.GroupHyper`) and the fused kernel
(:func:`tierstore._compute.kernel.adamw`). Its fields are the two moments and,
with ``amsgrad``, ``max_exp_avg_sq``; each parameter keeps a ``step``.

Example
-------
>>> import torch
>>> p, g = torch.ones(4), torch.full((4,), 0.5)
>>> m, v, step = torch.zeros(4), torch.zeros(4), torch.tensor(1.0)
>>> group = ADAMW.defaults(dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
...                             maximize=False))
>>> hyper = ADAMW.snapshot(group, fields=("exp_avg", "exp_avg_sq"))
>>> ADAMW.update([p], [g], {"exp_avg": [m], "exp_avg_sq": [v]}, [step], hyper)
>>> round(float(p[0]), 4)
0.9
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any

from torch import Tensor

from ..._platform import torch_private
from .. import kernel
from ..hyper import GroupHyper, check_hyper, scalar_betas
from .base import FLAG, FLAG_OR_NULL, NUMBER, PAIR, Algorithm, FieldSpec


class AdamW(Algorithm):
    """Decoupled-weight-decay Adam, bitwise ``torch.optim.AdamW(fused=True)``."""

    name = "adamw"
    front = "TieredAdamW"
    torch_class = "torch.optim.AdamW"
    fields = (
        FieldSpec("exp_avg", signed=True),
        FieldSpec("exp_avg_sq"),
        FieldSpec("max_exp_avg_sq", option="amsgrad", enable="amsgrad=True"),
    )
    group_defaults = MappingProxyType(
        {
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": True,
            "decoupled_weight_decay": True,
        }
    )
    compiled = True
    # The order a manifest and a checkpoint always checked them in (lr, eps, weight_decay, then betas).
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
        """``torch.optim.AdamW.__init__``'s checks of ``lr``, ``betas``, ``eps``, ``weight_decay`` (:func:`check_hyper`)."""
        check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"], where)

    def defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``lr``, ``betas`` (1-element tensors squeezed, as torch keeps them), ``eps``, ``weight_decay``,
        ``amsgrad``, ``maximize``, then :attr:`group_defaults`, in torch's order."""
        out = dict(lr=values["lr"], betas=scalar_betas(values["betas"]), eps=values["eps"],
                   weight_decay=values["weight_decay"])  # fmt: skip
        out.update(amsgrad=bool(values["amsgrad"]), maximize=bool(values["maximize"]), **self.group_defaults)
        return out

    def restore_group(self, group: dict[str, Any]) -> None:
        """``amsgrad``/``maximize`` default to off; every group is decoupled; ``betas`` become floats."""
        group.setdefault("amsgrad", False)
        group.setdefault("maximize", False)
        super().restore_group(group)
        # Note: as torch.optim.AdamW.__setstate__ does, a group loaded from any state (one saved by
        # torch.optim.Adam included, which says False) is decoupled: this is AdamW's update.
        group["decoupled_weight_decay"] = True
        group["betas"] = tuple(float(b) for b in group["betas"])

    def snapshot(self, group: Mapping[str, Any], fields: Collection[str]) -> GroupHyper:
        """:meth:`GroupHyper.of`; amsgrad needs the state's ``max_exp_avg_sq``."""
        return GroupHyper.of(dict(group), amsgrad_field="max_exp_avg_sq" in fields)

    def update(
        self,
        targets: list[Tensor],
        grads: list[Tensor],
        fields: Mapping[str, list[Tensor]],
        steps: list[Tensor],
        hyper: GroupHyper,
    ) -> None:
        """``torch._fused_adamw_`` over the pieces (:func:`tierstore._compute.kernel.adamw`)."""
        # kernel.adamw is looked up at each call, so a test (or a debugger) that replaces it sees its replacement used.
        maxs = fields.get("max_exp_avg_sq", []) if hyper.amsgrad else []
        kernel.adamw(targets, grads, fields["exp_avg"], fields["exp_avg_sq"], maxs, steps, **hyper.kernel_kwargs())

    def probe(self) -> None:
        """``torch._fused_adamw_`` exists (:func:`tierstore._platform.torch_private.fused_adamw_kernel`)."""
        torch_private.fused_adamw_kernel()


#: The registered AdamW.
ADAMW = AdamW()

"""NAdam as an :class:`~tierstore._compute.algorithms.base.Algorithm`: ``torch.optim.NAdam``'s own implementation.

Fields: ``exp_avg`` (signed) and ``exp_avg_sq``, as AdamW's, and compressed
moment formats may store both for the same reasons. Each parameter keeps a
``step`` and a ``mu_product``, the running product of the momentum schedule
``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))``: a per-parameter
scalar (:attr:`~tierstore._compute.algorithms.base.Algorithm.scalar_inits`) that
the engine advances once per parameter and step, as torch does (a float32
tensor multiplied by ``mu_t``), and that torch state dicts carry. State
directories, checkpoints and DCP record it beside each step count
(:mod:`tierstore._layout.scalar_record`: a manifest's and a checkpoint
header's ``param_scalars``, DCP's ``mu_product`` entries, the access
protocol's ``param_scalars``), since it cannot be recomputed from the step
count: ``beta1`` and ``momentum_decay`` may change between steps.

Example
-------
>>> import torch
>>> group = NADAM.defaults(dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum_decay=4e-3,
...                             decoupled_weight_decay=False, maximize=False, foreach=None, capturable=False,
...                             differentiable=False))
>>> hyper = NADAM.snapshot(group, fields=NADAM.field_names)
>>> after = NADAM.advance_scalars({"mu_product": torch.tensor(1.0)}, torch.tensor(1.0), hyper)
>>> round(float(after["mu_product"]), 6)
0.450073
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from torch import Tensor

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
    Bound,
    FunctionalHyper,
    TorchFunctional,
)


class NAdam(TorchFunctional):
    """Nesterov Adam (momentum decay, decoupled weight decay, maximize), bitwise ``torch.optim.NAdam``."""

    name = "nadam"
    front = "TieredNAdam"
    torch_class = "torch.optim.NAdam"
    module = "nadam"
    fields = (FieldSpec("exp_avg", signed=True), FieldSpec("exp_avg_sq"))
    state_scalars = ("step", "mu_product")
    scalar_inits = MappingProxyType({"mu_product": 1.0})
    arguments = ("exp_avg", "exp_avg_sq", "mu_product")
    group_keys = ("lr", "betas", "eps", "weight_decay", "momentum_decay", "decoupled_weight_decay", "maximize",
                  "foreach", "capturable", "differentiable")  # fmt: skip
    bounds = (LR, EPS, *BETAS, WEIGHT_DECAY, Bound("momentum_decay", "momentum_decay value"))
    group_defaults = MappingProxyType({"maximize": False, "foreach": None, "capturable": False,
                                       "differentiable": False, "decoupled_weight_decay": False})  # fmt: skip
    group_kinds = MappingProxyType({"lr": NUMBER, "eps": NUMBER, "weight_decay": NUMBER, "momentum_decay": NUMBER,
                                    "betas": PAIR, "decoupled_weight_decay": FLAG, "maximize": FLAG,
                                    "capturable": FLAG, "differentiable": FLAG, "foreach": FLAG_OR_NULL})  # fmt: skip

    def kernel_kwargs(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """As ``torch.optim.NAdam.step`` passes them."""
        beta1, beta2 = group["betas"]
        return dict(beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                    momentum_decay=group["momentum_decay"], eps=group["eps"], maximize=group["maximize"],
                    decoupled_weight_decay=group["decoupled_weight_decay"], **OFF)  # fmt: skip

    def advance_scalars(self, scalars: Mapping[str, Tensor], step: Tensor, hyper: FunctionalHyper) -> dict[str, Tensor]:
        """``mu_product * mu_t``, with ``mu_t`` in Python floats and the product in the tensor's dtype, as torch's
        single-tensor and foreach implementations both compute it."""
        kw = hyper.kwargs
        t = float(step)  # torch: _get_value(step_t), the count after this step
        mu = kw["beta1"] * (1.0 - 0.5 * (0.96 ** (t * kw["momentum_decay"])))
        product = scalars["mu_product"].clone()
        product *= mu
        return {"mu_product": product}


#: The registered NAdam.
NADAM = NAdam()

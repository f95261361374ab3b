"""AdamW's hyperparameters: torch's construction-time checks, and a param group's per-step snapshot.

:func:`check_hyper` makes the checks ``torch.optim.AdamW`` makes when it is
built, in the same order and with the same messages (each followed by the
fix), so a value torch refuses is refused here too. :class:`GroupHyper` is
what the update kernel needs of one param group, read once when a step
starts: LR schedulers and param-group edits take effect at the next step.

Example
-------
>>> group = {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
...          "amsgrad": False, "maximize": False}
>>> GroupHyper.of(group, amsgrad_field=False).kernel_kwargs()["beta2"]
0.999
>>> check_hyper(0.1, (0.9, 0.999), 1e-8, 0.01)
>>> import torch
>>> check_hyper(0.1, (0.9, torch.tensor(0.999)), 1e-8, 0.01)
Traceback (most recent call last):
...
tierstore.errors.ConfigError: betas must be either both floats or both Tensors; pass betas=(0.9, 0.999) or two 1-element tensors
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..errors import ConfigError, ConfigTypeError


def at_least_zero(name: str, value: Any, where: str, example: str = "0.001") -> bool:
    """``value >= 0.0``, torch's test (a NaN fails it); a non-number is a ``ConfigTypeError`` showing ``example``."""
    try:
        return bool(value >= 0.0)
    except TypeError:
        raise ConfigTypeError(f"{name}={value!r}{where} must be a number, e.g. {name}={example}") from None


def check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> None:
    """Validate like ``torch.optim.AdamW.__init__`` (same order and messages), plus the fix.

    ``where`` (e.g. ``" in param group 1"``) is appended to the value in each message.

    Raises
    ------
    ConfigError
        For an out-of-range value, a Tensor ``lr``/``betas`` that is not
        1-element, or ``betas`` mixing floats and Tensors.
    ConfigTypeError
        For a value that is not a number (also a ``TypeError``, as torch raises).
    """
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ConfigError(f"Tensor lr must be 1-element{where}; pass a float or a 1-element tensor")
    if not at_least_zero("lr", lr, where):
        raise ConfigError(f"Invalid learning rate: {lr}{where}; lr must be >= 0")
    if not at_least_zero("eps", eps, where):
        raise ConfigError(f"Invalid epsilon value: {eps}{where}; eps must be >= 0")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ConfigError(f"Invalid betas: {betas!r}{where}; pass a pair such as (0.9, 0.999)") from None
    for k, b in enumerate((b1, b2)):
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ConfigError(f"Tensor betas[{k}] must be 1-element{where}; pass a float or a 1-element tensor")
        try:
            ok = bool(0.0 <= b < 1.0)
        except TypeError:
            raise ConfigTypeError(f"betas[{k}]={b!r}{where} must be a number in [0, 1)") from None
        if not ok:
            raise ConfigError(f"Invalid beta parameter at index {k}: {b}{where}; it must be in [0, 1)")
    if not at_least_zero("weight_decay", weight_decay, where):
        raise ConfigError(f"Invalid weight_decay value: {weight_decay}{where}; it must be >= 0")
    both_floats = isinstance(b1, float) and isinstance(b2, float)
    both_tensors = isinstance(b1, Tensor) and isinstance(b2, Tensor)
    if not (both_floats or both_tensors):
        raise ConfigError(
            f"betas must be either both floats or both Tensors{where}; pass betas=(0.9, 0.999) or two "
            "1-element tensors"
        )


def scalar_betas(betas: Any) -> tuple[Any, ...]:
    """``betas`` as torch keeps them: 1-element tensors squeezed to 0-d, floats as they are."""
    return tuple(b.squeeze() if isinstance(b, Tensor) and b.dim() != 0 else b for b in betas)


@dataclass(frozen=True)
class GroupHyper:
    """One param group's AdamW hyperparameters as plain Python numbers, snapshotted for a step."""

    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    amsgrad: bool
    maximize: bool

    @classmethod
    def of(cls, group: dict[str, Any], *, amsgrad_field: bool) -> GroupHyper:
        """Snapshot ``group``; ``amsgrad_field`` says whether the state has ``max_exp_avg_sq``.

        Raises
        ------
        ConfigError
            If the group switched to ``amsgrad=True`` but the state has no ``max_exp_avg_sq``.
        """
        if group["amsgrad"] and not amsgrad_field:
            raise ConfigError(
                "a param group switched to amsgrad=True after construction; the state has no "
                "max_exp_avg_sq field. Build TieredAdamW with amsgrad=True from the start"
            )
        b1, b2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(b1),
            beta2=float(b2),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
        )

    def kernel_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`tierstore._compute.kernel.adamw`."""
        # Note: not dataclasses.asdict, which deep-copies: this runs once per shard and group.
        return {
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "weight_decay": self.weight_decay,
            "eps": self.eps,
            "amsgrad": self.amsgrad,
            "maximize": self.maximize,
        }


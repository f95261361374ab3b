"""Algorithms whose update is torch's own functional implementation: the base of RMSprop, Adamax, NAdam, RAdam, Adadelta.

torch has no fused CPU kernel for these classes; their ``step`` calls
``torch.optim.<name>._single_tensor_<name>`` (``foreach=False``, torch's CPU
default) or ``_multi_tensor_<name>`` (``foreach=True``) on lists of tensors.
:class:`TorchFunctional` calls the same function on lists of flat pieces:
every operation is elementwise (the step-dependent factors are Python
numbers per tensor), and pieces start at multiples of 64 elements, so the
result is torch's on whole tensors bit for bit.

Each piece gets its own step tensor holding the count before this step
(torch's function increments what it is given; the engine's count is
shared by a parameter's pieces and is already incremented), and its own
copy of any other per-parameter scalar (NAdam's ``mu_product``, which
torch multiplies in place).

A subclass says: the torch module (:attr:`TorchFunctional.module`), the
kernel's list arguments in order (:attr:`TorchFunctional.arguments`), the
constructor's group keys in torch's order, its checks
(:attr:`TorchFunctional.bounds`) and the keyword arguments its ``step``
passes (:meth:`TorchFunctional.kernel_kwargs`).

Example
-------
>>> import torch
>>> from tierstore._compute.algorithms import RMSPROP
>>> group = RMSPROP.defaults(dict(lr=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False,
...                               capturable=False, foreach=None, maximize=False, differentiable=False))
>>> hyper = RMSPROP.snapshot(group, fields=("square_avg",))
>>> p, g, v = torch.ones(4), torch.full((4,), 0.5), torch.zeros(4)
>>> RMSPROP.update([p], [g], {"square_avg": [v]}, [torch.tensor(1.0)], hyper)
>>> round(float(p[0]), 4), round(float(v[0]), 6)
(0.9, 0.0025)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from ..._platform import torch_private
from ...errors import ConfigError, ConfigTypeError
from .base import Algorithm

# The kinds of a saved group's values (Algorithm.group_kinds), as base names them.
NUMBER, PAIR, FLAG, FLAG_OR_NULL = "number", "pair", "flag", "flag or null"
#: Flags of torch's classes that mean nothing for an update on the CPU: refused when true.
NO_CPU_MEANING = {
    "capturable": "it captures the step in a CUDA graph, and the update runs on the CPU",
    "differentiable": "it keeps autograd through the step, and tiered state lives outside autograd",
}


@dataclass(frozen=True)
class Bound:
    """One of torch's construction checks: ``low <= value`` (and ``< high`` or ``<= high``), its message, its fix."""

    key: str  # the group key
    label: str  # torch's message: f"Invalid {label}: {value}"
    index: int | None = None  # the element of a pair (betas[0])
    high: float | None = None
    high_open: bool = True  # value < high (else value <= high)

    def check(self, group: Mapping[str, Any], where: str) -> None:
        """Raise torch's ``ValueError`` (a :class:`ConfigError`) with the fix, or a ``TypeError`` for a non-number."""
        value = group[self.key]
        name = self.key
        if self.index is not None:
            try:
                value = value[self.index]
            except (TypeError, IndexError, KeyError):
                raise ConfigTypeError(
                    f"{self.key}={group[self.key]!r}{where} must be a pair of numbers, e.g. {self.key}=(0.9, 0.999)"
                ) from None
            name = f"{self.key}[{self.index}]"
        try:
            ok = bool(value >= 0.0) and (
                self.high is None or bool(value < self.high if self.high_open else value <= self.high)
            )
        except TypeError:
            raise ConfigTypeError(f"{name}={value!r}{where} must be a number") from None
        if not ok:
            span = ">= 0" if self.high is None else f"in [0, {self.high:g}{')' if self.high_open else ']'}"
            raise ConfigError(f"Invalid {self.label}: {value}{where}; {name} must be {span}")


@dataclass(frozen=True)
class FunctionalHyper:
    """One param group's hyperparameters for a step, as torch's ``step`` passes them to its implementation."""

    kernel: Callable[..., None]  # torch's _single_tensor_<name> or _multi_tensor_<name>
    kwargs: Mapping[str, Any]  # its keyword arguments (tensor hyperparameters cloned when the step started)
    lists: frozenset[str]  # the fields whose lists this group passes (an option's only where the group uses it)


class TorchFunctional(Algorithm):
    """An algorithm that runs torch's functional implementation of its class on flat pieces (see the module docs)."""

    #: The module of ``torch.optim`` that holds the implementations (``"rmsprop"``).
    module: ClassVar[str]
    #: The implementation's list arguments between ``grads`` and ``state_steps``, in its order: field
    #: names and scalar names (:attr:`~tierstore._compute.algorithms.base.Algorithm.scalar_inits`).
    arguments: ClassVar[tuple[str, ...]]
    #: The group keys torch's constructor makes, in its order (:meth:`defaults`).
    group_keys: ClassVar[tuple[str, ...]]
    #: torch's construction checks of the hyperparameters, in its order (after the Tensor ``lr`` check).
    bounds: ClassVar[tuple[Bound, ...]]

    def kernel_kwargs(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments torch's ``step`` passes its implementation, from ``group`` (a subclass names them)."""
        raise NotImplementedError

    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        """Whether ``group`` uses ``option``; the base has none (a subclass with optional fields says)."""
        return False

    # -- hyperparameters ----------------------------------------------
    def check_group(self, group: Mapping[str, Any], where: str = "") -> None:
        """torch's checks in its order (a Tensor ``lr`` must have one element, then :attr:`bounds`), with the
        fix, then the flags that have no meaning on the CPU (``capturable``, ``differentiable``) refused."""
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ConfigError(f"Tensor lr must be 1-element{where}; pass a float or a 1-element tensor")
        for bound in self.bounds:
            bound.check(group, where)
        for flag, why in NO_CPU_MEANING.items():
            if group.get(flag, False):
                raise ConfigError(f"{flag}=True{where} is not supported by {self.front}: {why}; pass {flag}=False")

    def defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor's values under torch's group keys, in torch's order (``betas`` kept as given, as torch keeps them)."""
        return {key: values[key] for key in self.group_keys}

    def snapshot(self, group: Mapping[str, Any], fields: Collection[str]) -> FunctionalHyper:
        """The implementation ``foreach`` picks (``None``: the single-tensor one, torch's CPU default), its keyword
        arguments, and the option fields this group passes.

        Raises
        ------
        ConfigError
            If the group now uses an option whose field the state lacks, or a flag with no CPU meaning.
        """
        # Note: torch checks its hyperparameters when it is built only; a flag set later fails at its step.
        for flag, why in NO_CPU_MEANING.items():
            if group.get(flag, False):
                raise ConfigError(f"a param group now has {flag}=True, which {self.front} does not support: {why}")
        lists = set()
        for spec in self.fields:
            if spec.option is None:
                lists.add(spec.name)
            elif self.uses(group, spec.option):
                if spec.name not in fields:
                    raise ConfigError(
                        f"a param group uses {spec.enable or spec.option} but the state has no {spec.name} (no group "
                        f"used it when the optimizer was built); build {self.front} with {spec.enable or spec.option} "
                        "from the start"
                    )
                lists.add(spec.name)
        # Note: torch's step picks _multi_tensor_* only for foreach=True on CPU tensors
        # (torch.optim.optimizer._default_to_fused_or_foreach gives False for them).
        kind = "multi" if group.get("foreach") else "single"
        kernel = torch_private.optim_kernel(self.module, f"_{kind}_tensor_{self.module}")
        kwargs = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in self.kernel_kwargs(group).items()}
        return FunctionalHyper(kernel, kwargs, frozenset(lists))

    # -- the update ---------------------------------------------------
    def update(
        self,
        targets: list[Tensor],
        grads: list[Tensor],
        fields: Mapping[str, list[Tensor]],
        steps: list[Tensor],
        hyper: FunctionalHyper,
        scalars: Mapping[str, list[Tensor]] | None = None,
    ) -> None:
        """torch's implementation on the pieces, each with its own count before this step and its own scalars."""
        lists = []
        for name in self.arguments:
            if name in self.scalar_inits:
                lists.append([s.clone() for s in scalars[name]])  # torch updates them in place
            else:
                lists.append(fields[name] if name in hyper.lists else [])
        hyper.kernel(targets, grads, *lists, [s - 1 for s in steps], **hyper.kwargs)

    def probe(self) -> None:
        """This torch has both implementations (:func:`tierstore._platform.torch_private.optim_kernel`)."""
        for kind in ("single", "multi"):
            torch_private.optim_kernel(self.module, f"_{kind}_tensor_{self.module}")


#: The flags every one of these classes passes its implementation as off (``has_complex``: tierstore
#: holds no complex parameters).
OFF = {"differentiable": False, "capturable": False, "has_complex": False}

#: torch's ``Invalid ...`` checks shared by several classes.
LR, EPS, WEIGHT_DECAY = Bound("lr", "learning rate"), Bound("eps", "epsilon value"), Bound("weight_decay", "weight_decay value")
BETAS = (Bound("betas", "beta parameter at index 0", index=0, high=1.0), Bound("betas", "beta parameter at index 1", index=1, high=1.0))

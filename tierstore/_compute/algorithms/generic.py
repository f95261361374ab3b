"""The generic adapter's algorithm: an elementwise ``torch.optim.Optimizer`` class run on flat pieces.

:class:`Generic` describes a class tierstore has never seen from what a probe
of it found (:mod:`.generic_probe`): its per-element state fields (named as
the class names them), whether it keeps a per-parameter ``step``, and the
group keys its step changes. Its update runs **the class's own** ``step``:
for each bucket of pieces it builds one parameter per piece, an alias of the
flat piece (:class:`torch.nn.Parameter` over the view, so an in-place update
lands in the shard) whose ``.grad`` is the gradient piece, gives an instance
of the class a state whose tensors are the pieces of the fields, calls its
``step`` and copies back whatever the class replaced instead of updating in
place. Pieces start at multiples of 64 elements, as the engine cuts them, so
an elementwise class gives every element the bits it gives on the whole
tensor; the probe proves that for each class before use.

What is kept where:

- per-element fields: in the layout's shards (every tier, every format);
- a per-parameter ``step`` (torch's classes keep one): the engine's step count
  (``optimizer.state[p]["step"]``, the manifest's ``param_steps``); each
  piece gets its own copy of the count before the step, so a parameter cut
  into several pieces sees its step once, not once per piece;
- group-level scalars the class's step changes (``pytorch-optimizer`` keeps
  ``group["step"]``): in the param group. :meth:`Generic.snapshot` works out
  their change once per step (the class's step on the group with no
  gradient) and applies it to the group, so state dicts and manifests carry
  them as the class's own state dicts do; every bucket's call starts from
  the values before the step.

Per-parameter scalars other than ``step`` (``mu_product``) are refused by the
probe: the engine advances such a scalar once per parameter and step
(:meth:`~tierstore._compute.algorithms.base.Algorithm.advance_scalars`, how
NAdam's is recorded and resumed), while the class updates its own copy inside
its step, once per piece, with no description of how that could be done once.

The name a layout records is ``"generic:<module>.<qualname>"``
(:data:`~tierstore._compute.algorithms.in_use.GENERIC_PREFIX`). It is not
registered: a state directory naming it resumes only in an optimizer built
with that class (:func:`~tierstore._compute.algorithms.in_use.using`), and no
module named in a file is ever imported.

Example
-------
>>> import torch
>>> from tierstore._compute.algorithms.generic_probe import probe
>>> algorithm = Generic(probe(torch.optim.Adam, {"lr": 0.1}, []), {"lr": 0.1})
>>> algorithm.name, algorithm.field_names, algorithm.state_scalars
('generic:torch.optim.adam.Adam', ('exp_avg', 'exp_avg_sq'), ('step',))
"""

from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError, ConfigTypeError
from ..formats import CODED_FIELDS, SIGNED_FIELDS
from .base import Algorithm, FieldSpec
from .in_use import GENERIC_PREFIX

#: Group keys that are not hyperparameters of a constructor.
_NOT_ARGUMENTS = frozenset({"params", "param_names"})


@dataclass(frozen=True)
class ClassProbe:
    """What a probe found a class keeps (:func:`~tierstore._compute.algorithms.generic_probe.probe`).

    ``fields`` are its per-element state keys in the order it creates them,
    ``signed`` those seen negative, ``step`` how it keeps a per-parameter step
    count (``None``: it keeps none; else the type of the value, a float32
    tensor for torch's classes), ``group_keys`` the group keys its step changes.
    """

    cls: type
    fields: tuple[str, ...]
    signed: frozenset[str] = frozenset()
    step: type | torch.dtype | None = None
    group_keys: frozenset[str] = frozenset()
    arguments: tuple[str, ...] = ()  # the constructor's named arguments after params
    var_keyword: bool = False  # the constructor takes **kwargs

    def constructor_kwargs(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The keys of ``group`` the class's constructor takes (all but ``params`` when it takes ``**kwargs``)."""
        named = set(self.arguments)
        return {k: v for k, v in group.items() if k not in _NOT_ARGUMENTS and (k in named or self.var_keyword)}


class GenericHyper:
    """One param group as it was when a step started (without ``params``): what every bucket's call starts from."""

    __slots__ = ("group",)

    def __init__(self, group: Mapping[str, Any]) -> None:
        self.group = {k: v for k, v in group.items() if k != "params"}

    def __repr__(self) -> str:
        return f"GenericHyper({self.group!r})"


def class_name(cls: type) -> str:
    """``cls`` as ``module.qualname`` (what messages and the recorded name use)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def constructor_arguments(cls: type) -> tuple[tuple[str, ...], bool]:
    """The named arguments of ``cls.__init__`` after ``params``, and whether it takes ``**kwargs``."""
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return (), True
    names, var_keyword = [], False
    for i, (name, parameter) in enumerate(signature.parameters.items()):
        if i == 0 or name == "params":  # self, params
            continue
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            var_keyword = True
        elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
            names.append(name)
    return tuple(names), var_keyword


class Generic(Algorithm):
    """An elementwise torch optimizer class, as the engine sees it (one instance per optimizer built)."""

    compiled = False

    def __init__(self, found: ClassProbe, kwargs: Mapping[str, Any]) -> None:
        cls = found.cls
        self.cls = cls
        self.found = found
        self.kwargs = dict(kwargs)
        self.name = GENERIC_PREFIX + class_name(cls)
        self.front = f"tierstore.tiered({cls.__qualname__})"
        self.torch_class = class_name(cls)
        # The codecs know fields by name (formats.CODED_FIELDS) and give a name a signed or non-negative
        # int8 table (formats.SIGNED_FIELDS): a moment format may store a field whose name they know and
        # whose table fits what the probe saw (a field seen negative needs a signed one); others stay fp32.
        self.fields = tuple(
            FieldSpec(name, signed=name in found.signed,
                      compressible=name in CODED_FIELDS and (name in found.signed) == (name in SIGNED_FIELDS))
            for name in found.fields
        )  # fmt: skip
        self.state_scalars = ("step",) if found.step is not None else ()
        self.group_defaults = {}
        self.group_kinds = _group_kinds(self.defaults(kwargs))
        self._local = threading.local()  # one instance of the class per thread (updates run on workers)

    # -- the class's constructor ---------------------------------------
    def instance(self, group: Mapping[str, Any] | None = None) -> torch.optim.Optimizer:
        """A new instance of the class over one small parameter, built with ``group``'s arguments (``kwargs``)."""
        return self.cls([torch.nn.Parameter(torch.zeros(64))], **self.found.constructor_kwargs(self.kwargs if group is None else group))

    def _inner(self) -> torch.optim.Optimizer:
        inner = getattr(self._local, "inner", None)
        if inner is None:
            inner = self._local.inner = self.instance()
        return inner

    # -- hyperparameters ----------------------------------------------
    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        """No option adds a field: the fields are what the probe found."""
        return False

    def check_group(self, group: Mapping[str, Any], where: str = "") -> None:
        """The class's own checks: its constructor, given ``group``'s arguments."""
        try:
            self.instance(group)
        except TypeError as exc:
            raise ConfigTypeError(f"{exc}{where} ({self.torch_class} refuses it)") from None
        except ValueError as exc:
            raise ConfigError(f"{exc}{where} ({self.torch_class} refuses it)") from None

    def defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The param-group defaults the class builds from ``values`` (its ``defaults``)."""
        return dict(self.instance(values).defaults)

    def restore_group(self, group: dict[str, Any]) -> None:
        """What the class's ``__setstate__`` adds to a loaded group (torch's classes: the keys they default)."""
        scratch = self.instance()
        scratch.__setstate__({"defaults": scratch.defaults, "state": {}, "param_groups": [group]})

    def loaded_step(self, entry: Mapping[str, Any]) -> float | None:
        """``step`` where the class keeps one; else 1 for an entry with fields (it took steps; how many, the class
        does not say, so :attr:`~tierstore.TieredAdamW.step_count` starts from 1 after such a load)."""
        if "step" in entry:
            return float(entry["step"])
        return 1.0 if any(name in entry for name in self.field_names) else None

    # -- the update ---------------------------------------------------
    def snapshot(self, group: Mapping[str, Any], fields: Collection[str]) -> GenericHyper:
        """``group`` before this step; the group keys the class's step changes are changed in ``group`` now."""
        hyper = GenericHyper(group)
        if self.found.group_keys:
            after = self.group_after_step(hyper.group)
            for key in self.found.group_keys:
                if key in after:
                    group[key] = after[key]  # type: ignore[index]
        return hyper

    def group_after_step(self, before: Mapping[str, Any]) -> dict[str, Any]:
        """The group keys as the class's step leaves them, run on a group whose one parameter has no gradient."""
        inner = self._inner()
        dummy = torch.nn.Parameter(torch.zeros(64))
        inner.param_groups = [{**before, "params": [dummy]}]
        inner.state = defaultdict(dict)
        with torch.no_grad():
            inner.step()
        after = inner.param_groups[0]
        inner.param_groups, inner.state = [], defaultdict(dict)
        return {k: v for k, v in after.items() if k != "params"}

    def update(
        self,
        targets: list[Tensor],
        grads: list[Tensor],
        fields: Mapping[str, list[Tensor]],
        steps: list[Tensor],
        hyper: GenericHyper,
    ) -> None:
        """The class's ``step`` over the pieces (see the module docs)."""
        inner = self._inner()
        fakes: list[Tensor] = []
        state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for i, (target, grad) in enumerate(zip(targets, grads)):
            fake = torch.nn.Parameter(target)  # an alias of the piece: in-place updates land in the shard
            fake.grad = grad
            count = float(steps[i])
            if count > 1:  # not its first step: the class sees its state (at the first, it creates it)
                entry = {name: fields[name][i] for name in self.field_names}
                if self.found.step is not None:
                    entry = {"step": self._step_value(count - 1), **entry}
                state[fake] = entry
            fakes.append(fake)
        inner.param_groups = [{**hyper.group, "params": fakes}]
        inner.state = state
        try:
            with torch.no_grad():
                inner.step()
            for i, fake in enumerate(fakes):
                if fake.data_ptr() != targets[i].data_ptr():  # the class replaced p.data
                    targets[i].copy_(fake.detach())
                self._copy_back(state.get(fake, {}), fields, i)
        finally:
            inner.param_groups, inner.state = [], defaultdict(dict)

    def _copy_back(self, entry: Mapping[str, Any], fields: Mapping[str, list[Tensor]], i: int) -> None:
        """Copy the fields the class replaced (or created) into piece ``i``; refuse state the probe did not see."""
        unknown = sorted(set(entry) - set(self.field_names) - {"step"})
        if unknown:
            raise ConfigError(
                f"{self.torch_class}'s step created state {unknown} that its probe did not (its fields are "
                f"{list(self.field_names)}): its state depends on the data or on options its probe did not use, "
                "which tierstore.tiered cannot lay out; use the class itself"
            )
        for name, pieces in fields.items():
            value = entry.get(name)
            if value is None:
                raise ConfigError(f"{self.torch_class}'s step left no {name!r} for a parameter; use the class itself")
            piece = pieces[i]
            if value.data_ptr() != piece.data_ptr():
                piece.copy_(value.reshape(-1))

    def _step_value(self, count: float) -> Any:
        """A per-parameter step count as the class keeps it."""
        kind = self.found.step
        if isinstance(kind, torch.dtype):
            return torch.tensor(count, dtype=kind)
        return int(count) if kind is int else float(count)

    def probe(self) -> None:
        """Nothing to check: the class is at hand (the probe ran when this description was built)."""


def _group_kinds(defaults: Mapping[str, Any]) -> dict[str, str]:
    """How a saved group's hyperparameters are checked (``Algorithm.group_kinds``): numbers, pairs, flags."""
    kinds: dict[str, str] = {}
    for key, value in defaults.items():
        if isinstance(value, bool):
            kinds[key] = "flag"
        elif isinstance(value, (int, float)):
            kinds[key] = "number"
        elif isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            kinds[key] = "pair"
    return kinds


class Recorded(Algorithm):
    """A generic adapter's state read without its class: the fields a layout names, and nothing to run.

    ``Layout.from_dict`` gives a ``"generic:..."`` name that no optimizer being
    built declared (:func:`~tierstore._compute.algorithms.in_use.using`) this
    description, so the state can be read (``inspect``, ``verify``, ``to-torch``)
    and a resume with another algorithm is refused naming both; nothing named
    in the file is imported. Fields are taken as the codecs take their names
    (:data:`~tierstore._compute.formats.CODED_FIELDS`). Note: a field the adapter
    kept in fp32 because its values had another sign than its name's table reads
    wrong in a compressed format here; the class itself reads it right.

    Example
    -------
    >>> algorithm = Recorded("generic:pytorch_optimizer.Lion", ["master", "exp_avg"])
    >>> algorithm.field_names, algorithm.front
    (('exp_avg',), 'tierstore.tiered(pytorch_optimizer.Lion)')
    """

    compiled = False

    def __init__(self, name: str, fields: object) -> None:
        if not (isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
            raise ConfigError(f"layout fields={fields!r} must be a list of field names")
        self.name = name
        self.torch_class = name.removeprefix(GENERIC_PREFIX)
        self.front = f"tierstore.tiered({self.torch_class})"
        self.fields = tuple(
            FieldSpec(f, compressible=f in CODED_FIELDS, signed=f in SIGNED_FIELDS) for f in fields if f != "master"
        )
        self.group_defaults = {}

    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        return False

    def check_group(self, group: Mapping[str, Any], where: str = "") -> None:
        """Nothing to check without the class (it checked its groups when it ran)."""

    def _refuse(self) -> ConfigError:
        return ConfigError(f"a state of {self.name} runs only with its class: {self.front[:-1]}, params, ...)")

    def defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        raise self._refuse()

    def snapshot(self, group: Mapping[str, Any], fields: Collection[str]) -> Any:
        raise self._refuse()

    def update(self, targets, grads, fields, steps, hyper) -> None:  # noqa: ANN001 -- never runs
        raise self._refuse()

    def probe(self) -> None:
        raise self._refuse()

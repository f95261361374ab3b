"""What the engine needs to know of an optimizer algorithm: :class:`Algorithm` and its :class:`FieldSpec`.

The engine (layout, tiers, pipeline, commits, formats, checkpoints) stores
per-element state and runs an update over flat pieces of it; everything that
differs between optimizers is said here, once per algorithm: the state's
fields (their names, which are torch's state-dict keys, their initial value,
the option that adds one), the per-parameter scalars torch keeps beside them
(``step``), torch's construction checks and group keys, the per-step snapshot
of a param group's hyperparameters, and the update over lists of pieces.

An algorithm is a description, not a fork: a subclass fills in the class
attributes and the few methods below, and one instance of it is registered
(:data:`tierstore._compute.algorithms.ALGORITHMS`).

Example
-------
>>> from tierstore._compute.algorithms import ADAMW
>>> ADAMW.field_names, ADAMW.fields_for({"amsgrad"})
(('exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'), ('exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'))
>>> ADAMW.options([{"amsgrad": False}, {"amsgrad": True}])
frozenset({'amsgrad'})
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor

from ...errors import ConfigError

#: The kinds of value a hyperparameter takes in a saved param group (JSON: a manifest's, a checkpoint's),
#: as :attr:`Algorithm.group_kinds` names them: a number and a pair of numbers must be there; a flag
#: (``true``/``false``; the last kind: or ``null``) is checked where present.
NUMBER, PAIR, FLAG, FLAG_OR_NULL = "number", "pair", "flag", "flag or null"


@dataclass(frozen=True)
class FieldSpec:
    """One per-element state field of an algorithm.

    ``name`` is the field's name in a layout and its key in torch's state
    dict (``exp_avg``, ``momentum_buffer``, ``sum``). ``option`` is the group
    option that adds the field (``"amsgrad"``); ``None``: the state always
    holds it. ``init`` is its value before the first update: a number, or the
    name of the constructor argument that gives it (:meth:`Algorithm.initial_values`);
    a fresh state holds it, and so does a parameter that a loaded state dict
    gives no value for the field. ``compressible``: a
    compressed moment format (bfloat16, int8) may store it; ``signed``: its
    values may be negative (an int8 code table then spans both signs;
    :data:`tierstore._compute.formats.SIGNED_FIELDS` lists such fields by name).
    ``lazy``: torch creates it at a parameter's first step from that step's
    values (SGD's ``momentum_buffer`` starts as the first gradient), so a
    state dict lists it only once the parameter took a step; the update sees
    which pieces take their first step (their step count is 1). ``enable`` is
    the constructor argument that adds an optional field, as a message shows
    it (``"amsgrad=True"``).
    """

    name: str
    option: str | None = None
    init: float | str = 0.0
    compressible: bool = True
    signed: bool = False
    lazy: bool = False
    enable: str = ""


class Algorithm:
    """An optimizer's algorithm as the engine sees it (one registered instance per algorithm).

    Subclasses set the class attributes and implement :meth:`uses`,
    :meth:`check_group`, :meth:`defaults`, :meth:`snapshot`, :meth:`update`
    and :meth:`probe`.
    """

    #: The name a layout records (``to_dict`` writes it when it is not ``"adamw"``).
    name: ClassVar[str]
    #: The tierstore class that runs it, for messages (``"TieredAdamW"``).
    front: ClassVar[str]
    #: The torch class it is bitwise equal to, for messages (``"torch.optim.AdamW"``).
    torch_class: ClassVar[str]
    #: The per-element fields, in extent order (the engine puts its ``master`` first).
    fields: ClassVar[tuple[FieldSpec, ...]]
    #: Keys of a parameter's torch state besides the fields (tierstore keeps them as step counts).
    state_scalars: ClassVar[tuple[str, ...]] = ("step",)
    #: The per-parameter scalars of :attr:`state_scalars` besides ``step``, each with its value before a
    #: parameter's first step (NAdam: ``{"mu_product": 1.0}``). The engine keeps them in the parameter's
    #: ``optimizer.state`` entry as 0-d tensors, advances them once per parameter and step
    #: (:meth:`advance_scalars`), hands :meth:`update` their values as the step starts, and carries them
    #: through torch state dicts, state directories, checkpoints and DCP, each recorded beside the step
    #: count (:mod:`tierstore._layout.scalar_record`): nothing recomputes them from it.
    scalar_inits: ClassVar[Mapping[str, float]] = {}
    #: Group keys of the torch class that the front does not use, with the values that describe what
    #: it does, so state dicts load into either optimizer.
    group_defaults: ClassVar[Mapping[str, Any]] = {}
    #: Whether tierstore's compiled update (:mod:`tierstore._compute.fused_update`) implements it.
    compiled: ClassVar[bool] = False
    #: Whether torch creates every parameter's state when the optimizer is built (``torch.optim.Adagrad``:
    #: ``step`` 0 and each field at its initial value), so its state dict lists every parameter from the
    #: start. Otherwise a parameter's state appears at its first step, as in AdamW.
    eager: ClassVar[bool] = False
    #: The hyperparameters a saved param group holds (a manifest's, a checkpoint's), each with its kind
    #: (:data:`NUMBER`, :data:`PAIR`, :data:`FLAG`, :data:`FLAG_OR_NULL`), in the order a read-back group
    #: is checked before :meth:`check_group`; keys it does not name (a user's own) are kept unchecked.
    group_kinds: ClassVar[Mapping[str, str]] = MappingProxyType({})

    @property
    def label(self) -> str:
        """The front and the name, as messages show an algorithm: ``"TieredAdamW (adamw)"``."""
        return f"{self.front} ({self.name})"

    # -- fields ---------------------------------------------------------
    @property
    def field_names(self) -> tuple[str, ...]:
        """Every field's name, in extent order."""
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> FieldSpec:
        """The field called ``name``.

        Raises
        ------
        KeyError
            If the algorithm has no such field.
        """
        for spec in self.fields:
            if spec.name == name:
                return spec
        raise KeyError(f"{self.name} has no state field {name!r}; its fields are {self.field_names}")

    def fields_for(self, options: Collection[str]) -> tuple[str, ...]:
        """The fields a state holds when ``options`` are in use (see :meth:`options`), in extent order."""
        return tuple(f.name for f in self.fields if f.option is None or f.option in options)

    def options(self, groups: Iterable[Mapping[str, Any]]) -> frozenset[str]:
        """The options that add a field and that some group of ``groups`` uses."""
        groups = list(groups)
        wanted = {f.option for f in self.fields if f.option is not None}
        return frozenset(o for o in wanted if any(self.uses(g, o) for g in groups))

    def uses(self, group: Mapping[str, Any], option: str) -> bool:
        """Whether param group ``group`` uses ``option`` (so the state needs the field it adds)."""
        raise NotImplementedError

    def required_fields(self) -> tuple[str, ...]:
        """The fields a parameter's torch state must hold once it took a step (the ones always created)."""
        return tuple(f.name for f in self.fields if f.option is None and not f.lazy)

    def require_fields(self, groups: Iterable[Mapping[str, Any]], fields: Collection[str], source: str) -> None:
        """Refuse groups that use an option whose field a state of ``fields`` lacks (amsgrad without ``max_exp_avg_sq``).

        ``source`` says whose groups these are (``"loaded"``, ``"checkpoint x"``).

        Raises
        ------
        ConfigError
            Naming the group, the option and the constructor argument that adds the field.
        """
        for gi, group in enumerate(groups):
            for spec in self.fields:
                if spec.option is not None and spec.name not in fields and self.uses(group, spec.option):
                    raise ConfigError(
                        f"{source} parameter group {gi} uses {spec.option} but this optimizer was built without it; "
                        f"build {self.front} with {spec.enable or spec.option}"
                    )

    # -- hyperparameters ----------------------------------------------
    def check_format(self, options: Collection[str], format_name: str) -> None:
        """Refuse a compressed moment format (``format_name``: ``"bfloat16"``, ``"int8"``) that the
        state's fields cannot take with ``options`` in use (the base takes every format).

        :attr:`FieldSpec.compressible` says per field whether a format may store it; this says
        when fields that each may be stored compressed must not be together (centered RMSprop
        subtracts ``grad_avg**2`` from ``square_avg``: rounding either can make it negative).

        Raises
        ------
        ConfigError
            Naming the option, the format and the fix.
        """

    def check_group(self, group: Mapping[str, Any], where: str = "") -> None:
        """Refuse the hyperparameters ``torch_class`` refuses, in its order, with its messages plus the fix.

        ``where`` (e.g. ``" in param group 1"``) is appended to the value in each message.

        Raises
        ------
        ConfigError, ConfigTypeError
            For a value torch refuses (a ``ValueError``, or a ``TypeError`` for a non-number).
        """
        raise NotImplementedError

    def defaults(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """A constructor's hyperparameters ``values`` as torch's param-group defaults keep them.

        The front's own group keys (:attr:`group_defaults`) are added.
        """
        raise NotImplementedError

    def restore_group(self, group: dict[str, Any]) -> None:
        """Complete a param group loaded from a state dict in place, as the torch class's ``__setstate__`` does.

        The base adds :attr:`group_defaults` where absent.
        """
        for key, value in self.group_defaults.items():
            group.setdefault(key, value)

    def decode_group(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """A param group read back from JSON as torch keeps it: each :data:`PAIR` hyperparameter a tuple of floats.

        ``saved`` was checked against :attr:`group_kinds` (JSON has no tuples: ``betas`` comes back a list).
        """
        group = dict(saved)
        for key, kind in self.group_kinds.items():
            if kind == PAIR and key in group:
                group[key] = tuple(float(b) for b in group[key])
        return group

    def loaded_scalars(self, entry: Mapping[str, Any]) -> dict[str, Tensor]:
        """The :attr:`scalar_inits` scalars of a parameter's entry in a loaded torch state dict, as fp32 0-d tensors.

        As ``torch.optim.Optimizer.load_state_dict`` casts them for an fp32 parameter; absent ones are left out.
        """
        out = {}
        for name in self.scalar_inits:
            if name in entry:
                value = entry[name]
                out[name] = (value.detach().clone() if isinstance(value, Tensor) else torch.tensor(value)).to(torch.float32)
        return out

    def loaded_step(self, entry: Mapping[str, Any]) -> float | None:
        """A parameter's step count from its entry in a loaded torch state dict (``None``: it took no step).

        The base reads ``step``; an algorithm whose torch state keeps none says how else it is known.
        """
        return float(entry["step"]) if "step" in entry else None

    def advances(self, group: Mapping[str, Any]) -> bool:
        """Whether a step of ``group`` moves a parameter's step count (torch: every step).

        A step of a group that does not advance updates its parameters but
        leaves their counts (and so whether their next step is their first)
        as they were: SGD counts only steps with momentum, the ones that
        touch its lazy ``momentum_buffer``.
        """
        return True

    def initial_values(self, defaults: Mapping[str, Any]) -> dict[str, float]:
        """Each field's value before a parameter's first step, by field name.

        ``defaults`` are the constructor's hyperparameters as torch keeps them
        (``optimizer.defaults``); a :attr:`FieldSpec.init` that names one of
        them takes its value there (torch reads ``initial_accumulator_value``
        from the constructor's defaults, whatever a param group says).

        Example
        -------
        >>> from tierstore._compute.algorithms import ADAMW
        >>> ADAMW.initial_values({})
        {'exp_avg': 0.0, 'exp_avg_sq': 0.0, 'max_exp_avg_sq': 0.0}
        """
        return {f.name: float(defaults[f.init] if isinstance(f.init, str) else f.init) for f in self.fields}

    # -- the update ---------------------------------------------------
    def snapshot(self, group: Mapping[str, Any], fields: Collection[str]) -> Any:
        """``group``'s hyperparameters for one step, as :meth:`update` takes them.

        ``fields`` are the fields the state holds. Read when a step starts, so
        LR schedulers and param-group edits take effect at the next step.

        Raises
        ------
        ConfigError
            If the group now uses an option whose field the state lacks.
        """
        raise NotImplementedError

    def bucket(self, step: float) -> Hashable:
        """What pieces updated in one kernel call must share, besides their group (``step``: after this step).

        ``None`` for algorithms whose kernel takes each piece's step count.
        """
        return None

    def advance_scalars(self, scalars: Mapping[str, Tensor], step: Tensor, hyper: Any) -> dict[str, Tensor]:
        """A parameter's :attr:`scalar_inits` scalars after this step, computed as torch computes them.

        ``scalars`` hold their values as the step starts (not to be modified),
        ``step`` the parameter's count after it, ``hyper`` its group's
        :meth:`snapshot`. Called once per parameter and step; the results become
        the parameter's state once the step succeeded. The base has no such scalars.
        """
        return {}

    def update(
        self,
        targets: list[Tensor],
        grads: list[Tensor],
        fields: Mapping[str, list[Tensor]],
        steps: list[Tensor],
        hyper: Any,
    ) -> None:
        """Update ``targets`` and the fields' pieces in place, pairwise by position.

        ``fields[name]`` holds the pieces of each field the state has;
        ``steps`` are the parameters' step counts after this step (already
        incremented, one tensor per parameter, shared by its pieces). All are
        fp32 CPU tensors; pieces start at multiples of the SIMD width, so the
        result equals the update of whole tensors bit for bit. An algorithm
        with :attr:`scalar_inits` is also passed ``scalars``: ``scalars[name]``
        holds each piece's value of that scalar as the step starts (a tensor
        shared by a parameter's pieces: read it, never modify it).
        """
        raise NotImplementedError

    def probe(self) -> None:
        """Check that this torch has the kernel :meth:`update` calls (at construction, not mid-step).

        Raises
        ------
        ConfigError
            Naming the missing kernel and the fix.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<algorithm {self.name}>"


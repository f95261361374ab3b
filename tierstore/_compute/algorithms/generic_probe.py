"""What a torch optimizer class keeps, and whether it is elementwise: found by running it.

:func:`probe` runs the class on two small parameters (a matrix and a vector,
seeded random values and gradients) for a few steps and sorts what it keeps:

- a state tensor of the parameter's shape and dtype is a per-element field;
- a per-parameter ``step`` (a number, or a 0-d tensor) that counts the steps is
  the step count tierstore keeps anyway;
- group keys its step changes (``pytorch-optimizer``'s ``group["step"]``) are
  group-level scalars (:meth:`~tierstore._compute.algorithms.generic.Generic.snapshot`);
- anything else (a state of another shape, as factored second moments keep;
  a per-parameter scalar besides ``step``; a field that appears only later)
  is refused with what it is.

:func:`check_elementwise` then runs the class on two shardings of the same
parameters, the whole tensors (the class itself) and flat pieces cut at
multiples of 64 elements and spread over two calls (the adapter's update, as
the engine runs it), and compares every parameter, field and group key bit
for bit after every step. A class that reads a whole tensor (its shape, a
norm, an orthogonalisation) differs, or fails on a flat piece, and is
refused with the reason.

Example
-------
>>> import torch
>>> found = probe(torch.optim.Adam, {"lr": 0.1}, [])
>>> found.fields, found.step
(('exp_avg', 'exp_avg_sq'), torch.float32)
>>> probe(torch.optim.Muon, {}, [])
Traceback (most recent call last):
...
tierstore.errors.ConfigError: tierstore.tiered cannot run torch.optim.Muon: it is not elementwise: it refuses a flat (1-D) parameter ...
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError
from .generic import ClassProbe, Generic, class_name, constructor_arguments

#: The probe's parameters: a matrix (shape-dependent updates differ on it) and a vector; sizes that are
#: not multiples of 64, so pieces end in a partial vector as the engine's last pieces do.
PROBE_SHAPES = ((6, 100), (200,))
PROBE_STEPS = 3
#: Where the pieces of a flattened probe parameter start (multiples of 64, as the engine cuts).
PIECE_STARTS = (0, 64, 256)


def refuse(cls: type, why: str) -> ConfigError:
    """The error that says ``cls`` cannot run in ``tierstore.tiered``, and why."""
    return ConfigError(f"tierstore.tiered cannot run {class_name(cls)}: {why}; use the class itself (its state in RAM)")


def _data(seed: int) -> tuple[list[torch.nn.Parameter], list[list[Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in PROBE_SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in PROBE_SHAPES] for _ in range(PROBE_STEPS)]
    return params, grads


def _groups(kwargs: Mapping[str, Any], overrides: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The distinct hyperparameter sets to probe: the constructor's, and each param group's on top of it."""
    out: list[dict[str, Any]] = []
    for extra in [{}, *overrides]:
        config = {**kwargs, **{k: v for k, v in extra.items() if k not in ("params", "param_names")}}
        if all(repr(config) != repr(seen) for seen in out):
            out.append(config)
    return out


def _run_class(cls: type, config: Mapping[str, Any], arguments: Callable[[Mapping[str, Any]], dict]) -> tuple:
    """The class itself on the probe's data: the state after each step, the params and groups after each."""
    params, grads = _data(0)
    try:
        opt = cls(params, **arguments(config))
    except Exception as exc:  # noqa: BLE001 -- whatever the class raises, the user learns it
        try:  # a class that takes the matrix alone refuses a vector: it reads the tensor's shape
            cls(params[:1], **arguments(config))
        except Exception:  # noqa: BLE001 -- it refuses these arguments, whatever the shape
            raise ConfigError(f"{class_name(cls)}({_show(config)}) raised {type(exc).__name__}: {exc}") from None
        raise refuse(cls, f"it is not elementwise: it refuses a flat (1-D) parameter ({type(exc).__name__}: {exc}), "
                          "and tierstore.tiered runs it on flat pieces of every parameter") from None  # fmt: skip
    history = []
    for k in range(PROBE_STEPS):
        for p, g in zip(params, grads[k]):
            p.grad = g.clone()
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001
            raise refuse(
                cls,
                f"its step() on a {PROBE_SHAPES[0]} matrix and a {PROBE_SHAPES[1]} vector raised {type(exc).__name__}: "
                f"{exc} (tierstore.tiered runs it on flat pieces of every parameter)",
            ) from None
        history.append(
            (
                [p.detach().clone() for p in params],
                [_copied(opt.state.get(p, {})) for p in params],
                _copied({k2: v for k2, v in opt.param_groups[0].items() if k2 != "params"}),
            )
        )
    return params, history, {k: v for k, v in opt.defaults.items()}


def _copied(value: Any) -> Any:
    return {k: _copied(v) for k, v in value.items()} if isinstance(value, dict) else copy.deepcopy(value)


def _show(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


def _is_count(value: Any, k: int) -> bool:
    if isinstance(value, Tensor):
        return value.dim() == 0 and value.is_floating_point() and float(value) == k
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == k


def _sort_state(cls: type, params: Sequence[Tensor], history: list) -> tuple[list[str], set[str], Any]:
    """Fields (in creation order), those seen negative, and the per-parameter step's kind."""
    fields: list[str] = []
    signed: set[str] = set()
    step: Any = None
    for k, (_, states, _) in enumerate(history, start=1):
        for p, state in zip(params, states):
            odd = []  # (telling first: a tensor of another shape, then anything else) state that is no field
            for key, value in state.items():
                if key == "step" and _is_count(value, k):
                    step = value.dtype if isinstance(value, Tensor) else type(value)
                elif isinstance(value, Tensor) and value.shape == p.shape and value.dtype == torch.float32:
                    if key not in fields:
                        if k > 1:
                            raise refuse(cls, f"it creates the state {key!r} only at a later step than the first")
                        fields.append(key)
                    if bool((value < 0).any()):
                        signed.add(key)
                elif isinstance(value, Tensor) and value.dim() > 0:
                    odd.insert(0, (key, f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}", "factored"))
                else:
                    what = f"a {value.dim()}-d tensor" if isinstance(value, Tensor) else f"a {type(value).__name__}"
                    odd.append((key, what, "scalar"))
            if odd:
                key, what, kind = odd[0]
                why = ("a state of another shape than the parameter's (factored or per-row moments read the "
                       "whole tensor)" if kind == "factored" else
                       "a per-parameter scalar besides step, which tierstore.tiered does not keep")  # fmt: skip
                raise refuse(
                    cls,
                    f"it is not elementwise: it keeps state {key!r} as {what} for a parameter of shape "
                    f"{tuple(p.shape)}: {why} (it stores float32 state of the parameter's shape and a step count)",
                )
            missing = [f for f in fields if f not in state]
            if missing:
                raise refuse(cls, f"it keeps {missing} for some parameters or steps only")
    return fields, signed, step


def probe(cls: type, kwargs: Mapping[str, Any], overrides: Iterable[Mapping[str, Any]]) -> ClassProbe:
    """What ``cls`` keeps under ``kwargs`` and each param group's ``overrides`` (see the module docs).

    Raises
    ------
    ConfigError
        If ``cls`` is not a ``torch.optim.Optimizer`` subclass, refuses the
        arguments, or keeps state ``tierstore.tiered`` cannot store.
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"tierstore.tiered takes a torch.optim.Optimizer subclass, not {cls!r}")
    arguments, var_keyword = constructor_arguments(cls)
    take = ClassProbe(cls, (), arguments=arguments, var_keyword=var_keyword).constructor_kwargs
    fields: list[str] = []
    signed: set[str] = set()
    step = None
    group_keys: set[str] = set()
    for config in _groups(kwargs, overrides):
        params, history, _ = _run_class(cls, config, take)
        found, negative, kind = _sort_state(cls, params, history)
        fields += [f for f in found if f not in fields]
        signed |= negative
        step = kind if kind is not None else step
        before = _copied(dict(_defaults_group(cls, config, take)))
        for _, _, group in history:
            group_keys |= {k for k, v in group.items() if k not in before or not _same(v, before[k])}
            before = group
    return ClassProbe(cls, tuple(fields), frozenset(signed), step, frozenset(group_keys), arguments, var_keyword)


def _defaults_group(cls: type, config: Mapping[str, Any], take: Callable) -> dict[str, Any]:
    opt = cls([torch.nn.Parameter(torch.zeros(1))], **take(config))
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    except Exception:  # noqa: BLE001 -- values that do not compare are different
        return False


def check_elementwise(algorithm: Generic, overrides: Iterable[Mapping[str, Any]]) -> None:
    """Refuse ``algorithm``'s class unless it gives flat pieces the bits it gives whole tensors (module docs).

    Raises
    ------
    ConfigError
        Naming the class, the first difference (or the error a piece raised) and why it matters.
    """
    cls = algorithm.cls
    for config in _groups(algorithm.kwargs, overrides):
        _, history, _ = _run_class(cls, config, algorithm.found.constructor_kwargs)
        try:
            pieces = _run_pieces(algorithm, config)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 -- a class that cannot run on a flat piece is not elementwise
            raise refuse(
                cls,
                f"it is not elementwise: on a flat piece of a parameter its step raised {type(exc).__name__}: {exc} "
                "(it reads the whole tensor: its shape, a norm or a factorisation)",
            ) from None
        for k, ((want_p, want_s, want_g), (got_p, got_s, got_g)) in enumerate(zip(history, pieces), start=1):
            problem = _first_difference(algorithm, want_p, want_s, want_g, got_p, got_s, got_g)
            if problem:
                raise refuse(
                    cls,
                    f"it is not elementwise: run on flat pieces of its parameters (cut at multiples of 64 elements) "
                    f"instead of the whole tensors, {problem} after step {k} (it reads more than one element at a "
                    "time: a norm, the tensor's shape, a factorisation or an orthogonalisation)",
                )


def _run_pieces(algorithm: Generic, config: Mapping[str, Any]) -> list:
    """The adapter's update on the probe's data: each parameter's flat pieces, spread over two calls per step."""
    params, grads = _data(0)
    flats = [p.detach().view(-1) for p in params]
    stores = {name: [torch.zeros(p.numel()) for p in params] for name in algorithm.field_names}
    group = {**algorithm.defaults(config), "params": list(params)}
    history = []
    for k in range(PROBE_STEPS):
        hyper = algorithm.snapshot(group, algorithm.field_names)
        steps = [torch.tensor(float(k + 1)) for _ in params]
        calls: list[tuple[list, list, dict, list]] = [([], [], {n: [] for n in stores}, []), ([], [], {n: [] for n in stores}, [])]
        for i, (flat, grad) in enumerate(zip(flats, grads[k])):
            g = grad.clone().view(-1)
            cuts = [s for s in PIECE_STARTS if s < flat.numel()] + [flat.numel()]
            for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
                targets, grad_pieces, fields, step_list = calls[(i + j) % 2]
                targets.append(flat[a:b])
                grad_pieces.append(g[a:b])
                for name in stores:
                    fields[name].append(stores[name][i][a:b])
                step_list.append(steps[i])
        for targets, grad_pieces, fields, step_list in calls:
            if targets:
                algorithm.update(targets, grad_pieces, fields, step_list, hyper)
        states = [{name: stores[name][i].view(p.shape).clone() for name in stores} for i, p in enumerate(params)]
        history.append(([p.detach().clone() for p in params], states,
                        {k2: v for k2, v in group.items() if k2 != "params"}))  # fmt: skip
    return history


def _first_difference(algorithm: Generic, want_p, want_s, want_g, got_p, got_s, got_g) -> str:
    for i, (a, b) in enumerate(zip(want_p, got_p)):
        if not torch.equal(a, b):
            return f"parameter {i} (shape {tuple(a.shape)}) differs{_by(a, b)}"
    for i, (a, b) in enumerate(zip(want_s, got_s)):
        for name in algorithm.field_names:
            if not torch.equal(a[name], b[name]):
                return f"its state {name!r} of parameter {i} differs{_by(a[name], b[name])}"
    for key in algorithm.found.group_keys:
        if key in want_g and not _same(want_g[key], got_g.get(key)):
            return f"its group key {key!r} is {got_g.get(key)!r} instead of {want_g[key]!r}"
    return ""


def _by(a: Tensor, b: Tensor) -> str:
    diff = (a.double() - b.double()).abs()
    return f" (max abs difference {float(diff.nan_to_num(math.inf).max()):.3g})"


__all__ = ["PIECE_STARTS", "PROBE_SHAPES", "PROBE_STEPS", "check_elementwise", "probe", "refuse"]

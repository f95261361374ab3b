"""``torch.optim.AdamW``'s state-dict format: one home for its shape and its checks.

A torch optimizer state dict is ``{"state": {id: {"step", "exp_avg",
"exp_avg_sq", ["max_exp_avg_sq"]}}, "param_groups": [{..., "params": [id,
...]}]}``: ids count the parameters of every group in order, and a parameter
has an entry only once it took a step. tierstore adds ``master_param`` (the
fp32 master copy) where the state keeps one; torch's AdamW ignores it.

This module builds such dicts (with tensors allocated for every field, for
the caller to fill shard by shard), packs param groups and maps incoming ids
to parameter positions as ``torch.optim.Optimizer`` does, and checks an
incoming dict against a layout. Entries of ``optimizer.state`` that are not
tierstore's (a key of a parameter's state other than ``step`` and the
fields, or a key that is not a parameter: torch lets a user or a scheduler
keep such entries) travel through state dicts as torch carries them
(:func:`extra_state`, :func:`cast_like_param`).

Example
-------
>>> import torch
>>> from tierstore._layout.layout import Layout
>>> w = torch.zeros(3, requires_grad=True)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
>>> sd, flats = empty_state_dict(layout, [1.0], [{"lr": 0.1, "amsgrad": False}])
>>> sorted(sd["state"][0]), sd["param_groups"][0]["params"]
(['exp_avg', 'exp_avg_sq', 'step'], [0])
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._compute.algorithms import ADAMW, Algorithm
from .._compute.algorithms.identify import check_loaded_group, foreign_state, state_owners
from .._platform.dtensor import local_tensor
from ..errors import ConfigError, ParamsChangedError
from .layout import MASTER, MASTER_KEY, STATE_KEY_OF_FIELD, Layout

#: ``torch.optim.AdamW``'s group keys that TieredAdamW does not use, with the
#: values that describe what it does, so state dicts load into either optimizer
#: (their home is the algorithm: :attr:`~tierstore._compute.algorithms.base.Algorithm.group_defaults`).
GROUP_DEFAULTS = dict(ADAMW.group_defaults)


#: The keys of a parameter's state that tierstore keeps itself (in its shards and step counts);
#: any other key of ``optimizer.state[p]`` is the user's, carried as torch carries it.
OWN_STATE_KEYS = frozenset({"step", *STATE_KEY_OF_FIELD.values()})


def own_state_keys(layout: Layout) -> frozenset[str]:
    """The keys of a parameter's torch state that the layout's algorithm keeps (its scalars, its fields' keys)."""
    algorithm = layout.algorithm
    return frozenset({*algorithm.state_scalars, "step", *map(layout.state_key, layout.field_order)})


#: The key of the small dict a trainer integration saves in a checkpoint in place of the optimizer's
#: state (``tierstore.integrations``): the reference to a snapshot beside it, never the state.
REFERENCE_KEY = "tierstore_snapshot"

def step_tensor(step: float) -> Tensor:
    """A parameter's step count as torch's AdamW keeps it (an fp32 scalar tensor)."""
    # Note: always fp32 on the CPU, where the update runs; torch uses float64 when that is the
    # default dtype, and the parameter's device with fused=True.
    return torch.tensor(float(step), dtype=torch.float32)


def param_steps(state: Mapping[Any, Mapping[str, Any]], params: Sequence[Tensor]) -> list[float | None]:
    """Each parameter's AdamW step (``None`` before its first), from an optimizer's ``state``."""
    steps = []
    for p in params:
        st = state.get(p)
        steps.append(float(st["step"]) if st and "step" in st else None)
    return steps


def reset_param_steps(
    state: dict[Any, dict[str, Any]],
    params: Sequence[Tensor],
    steps: Mapping[int, float],
    scalars: Mapping[int, Mapping[str, Tensor]] | None = None,
) -> None:
    """Give each parameter whose position is in ``steps`` that step count; the others have no state.

    ``scalars[i]``: parameter ``i``'s other per-parameter scalars (NAdam's ``mu_product``), kept beside its step.
    """
    for i, p in enumerate(params):
        if i in steps:
            state[p] = {"step": step_tensor(steps[i]), **(scalars or {}).get(i, {})}
        else:
            state.pop(p, None)


def param_scalars(state: Mapping[Any, Mapping[str, Any]], params: Sequence[Tensor], names: Collection[str]) -> list[dict[str, Tensor]]:
    """Each parameter's scalars called ``names`` (an algorithm's :attr:`~tierstore._compute.algorithms.base.Algorithm.scalar_inits`),
    from an optimizer's ``state``; a parameter without them has an empty dict."""
    out = []
    for p in params:
        st = state.get(p) or {}
        out.append({n: st[n] for n in names if isinstance(st.get(n), Tensor)})
    return out


def restore_groups(
    param_groups: Sequence[dict[str, Any]],
    saved: Sequence[Mapping[str, Any]],
    *,
    like_torch: bool = False,
    algorithm: Algorithm = ADAMW,
) -> None:
    """Take the hyperparameters of ``saved`` groups (not their params), torch's defaults where absent.

    ``like_torch``: as ``torch.optim.Optimizer.load_state_dict`` does, each
    group becomes the saved one (keys it lacks are dropped, then get
    the algorithm's defaults, :meth:`~tierstore._compute.algorithms.base.Algorithm.restore_group`; ``param_names`` stay unless the saved group has
    them). Otherwise the saved keys are merged into the group.
    """
    for mine, group in zip(param_groups, saved):
        params, names = mine["params"], mine.get("param_names")
        if like_torch:
            mine.clear()
        mine.update({k: v for k, v in group.items() if k != "params"})
        mine["params"] = params
        if names is not None and "param_names" not in group:
            mine["param_names"] = names
        algorithm.restore_group(mine)


def check_same_params(param_groups: Sequence[Mapping[str, Any]], params: Sequence[Tensor]) -> None:
    """Raise ``ParamsChangedError`` if the groups no longer hold exactly ``params`` (the layout is fixed)."""
    now = [p for g in param_groups for p in g["params"]]
    if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
        raise ParamsChangedError(
            f"the optimizer's parameters changed since construction ({len(params)} then, {len(now)} now); "
            "TieredAdamW's state layout is fixed: build a new optimizer for a new set of parameters"
        )


def packed_groups(
    param_groups: Sequence[Mapping[str, Any]], params: Sequence[Tensor]
) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """``param_groups`` packed as ``torch.optim.Optimizer.state_dict`` packs them, and each parameter's key.

    Ids count the parameters of the groups in order, a parameter listed
    again (a group appended twice) keeping its first id, exactly as torch
    numbers them. ``keys[i]`` is the state-dict key of the layout's
    parameter ``i``.

    Raises
    ------
    ParamsChangedError
        If the groups hold a tensor the optimizer was not built with, or no
        longer hold one it was (the state's layout is fixed).

    Example
    -------
    >>> import torch
    >>> a, b = torch.zeros(1), torch.zeros(1)
    >>> groups = [{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}]
    >>> packed, keys = packed_groups(groups + groups, [a, b])
    >>> [g["params"] for g in packed], keys
    ([[0], [1], [0], [1]], {0: 0, 1: 1})
    """
    position = {id(p): i for i, p in enumerate(params)}
    ids: dict[int, int] = {}  # id(tensor) -> state-dict key
    start, out = 0, []
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            if id(p) not in position:
                raise ParamsChangedError(
                    f"param group {gi} holds a tensor of shape {tuple(p.shape)} that this TieredAdamW was not "
                    "built with (param_groups were edited after construction); its state layout is fixed: "
                    "build a new TieredAdamW with every parameter and load this one's state_dict() into it"
                )
        packed = {k: v for k, v in group.items() if k != "params"}
        for i, p in enumerate(group["params"], start):
            ids.setdefault(id(p), i)
        packed["params"] = [ids[id(p)] for p in group["params"]]
        start += len(packed["params"])
        out.append(packed)
    missing = [i for i, p in enumerate(params) if id(p) not in ids]
    if missing:
        raise ParamsChangedError(
            f"parameters {missing[:5]} were removed from param_groups after construction; TieredAdamW's "
            "state layout is fixed: put them back, or build a new TieredAdamW for the new set of parameters"
        )
    return out, {position[pid]: key for pid, key in ids.items()}


def extra_state(
    state: Mapping[Any, Mapping[str, Any]],
    params: Sequence[Tensor],
    keys: Mapping[int, int],
    own: Collection[str] = OWN_STATE_KEYS,
) -> tuple[dict[int, dict[str, Any]], dict[Any, Any]]:
    """The entries of ``optimizer.state`` tierstore does not keep itself, keyed as a state dict keys them.

    ``own`` are the keys tierstore keeps (:func:`own_state_keys`; AdamW's by default).

    Returns the extra keys of each parameter's state (by state-dict key) and
    the entries whose key is not a parameter, both as torch's ``state_dict``
    carries them (the values themselves, not copies).

    Example
    -------
    >>> import torch
    >>> w = torch.zeros(1)
    >>> extra_state({w: {"step": 1.0, "ema": 0.5}, "note": 1}, [w], {0: 0})
    ({0: {'ema': 0.5}}, {'note': 1})
    """
    position = {id(p): i for i, p in enumerate(params)}
    per_param: dict[int, dict[str, Any]] = {}
    others: dict[Any, Any] = {}
    for key, entry in state.items():
        if not isinstance(key, Tensor):
            others[key] = entry
            continue
        i = position.get(id(key))
        extras = {k: v for k, v in entry.items() if k not in own}
        if i is not None and extras and i in keys:
            per_param[keys[i]] = extras
    return per_param, others


def cast_like_param(param: Tensor, value: Any) -> Any:
    """An extra state value loaded for ``param``, cast as ``torch.optim.Optimizer.load_state_dict`` casts it.

    Tensors move to the parameter's device (and, for a floating-point
    parameter, take its dtype); dicts, lists and tuples are cast element by
    element; anything else is kept as it is.

    Example
    -------
    >>> import torch
    >>> cast_like_param(torch.zeros(1, dtype=torch.float64), {"ema": [torch.ones(1)]})["ema"][0].dtype
    torch.float64
    """
    local = local_tensor(param)
    if isinstance(value, Tensor):
        if local.is_floating_point():
            return value.to(dtype=local.dtype, device=local.device)
        return value.to(device=local.device)
    if isinstance(value, dict):
        return {k: cast_like_param(param, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        # Note: torch rebuilds any Iterable with type(value)(...), which garbles strings; only
        # plain lists and tuples are rebuilt here, other values are kept as they are.
        return type(value)(cast_like_param(param, v) for v in value)
    return value


def load_extra_state(
    state: MutableMapping[Any, dict[str, Any]],
    params: Sequence[Tensor],
    per_param: Mapping[int, Mapping[str, Any]],
    others: Mapping[Any, Any],
) -> None:
    """Put loaded extra entries into ``optimizer.state`` (after the step counts were replaced).

    As torch's ``load_state_dict``, which replaces the whole state: entries
    whose key is not a parameter are those of the loaded dict only.
    """
    for key in [k for k in state if not isinstance(k, Tensor)]:
        del state[key]
    for i, extras in per_param.items():
        p = params[i]
        state.setdefault(p, {}).update({k: cast_like_param(p, v) for k, v in extras.items()})
    for key, value in others.items():
        state[key] = value


def has_state(layout: Layout, index: int, step: float | None) -> bool:
    """Whether parameter ``index`` has an entry in a torch state dict.

    As in torch: once it took a step. Frozen parameters never do; a
    zero-element parameter does (it has no elements, but counts its steps).
    """
    meta = layout.params[index]
    return step is not None and (meta.trainable or meta.numel == 0)


def empty_state_dict(
    layout: Layout,
    steps: Sequence[float | None],
    groups: Sequence[Mapping[str, Any]],
    *,
    has_master: Sequence[bool] | None = None,
    keys: Mapping[int, int] | None = None,
    scalars: Sequence[Mapping[str, Tensor]] | None = None,
) -> tuple[dict[str, Any], dict[int, dict[str, Tensor]]]:
    """A torch AdamW state dict with a tensor allocated for every field, and their flat views.

    ``groups`` are the param groups' hyperparameters (a ``params`` key is
    replaced by the layout's positions), or, with ``keys``, groups packed by
    :func:`packed_groups` (kept as they are) and the state-dict key of each
    layout position (the state is keyed by those). A field an option adds
    (``max_exp_avg_sq``) is given only to parameters whose group uses the
    option (amsgrad), ``step`` only where the algorithm keeps one, ``master_param`` to those for which
    ``has_master`` is true (default: all, when the layout keeps masters).
    The flat views, ``flats[param][field]``, are what
    :meth:`~tierstore._layout.layout.Layout.copy_out` fills. ``scalars[i]``
    holds parameter ``i``'s other per-parameter scalars (:func:`param_scalars`),
    which an algorithm with :attr:`~tierstore._compute.algorithms.base.Algorithm.scalar_inits` needs.

    Raises
    ------
    ConfigError
        If the algorithm keeps per-parameter scalars and ``scalars`` is not given
        (a state directory or checkpoint gives what it recorded:
        :func:`~tierstore._layout.scalar_record.tensors_of`).
    """
    algorithm = layout.algorithm
    if algorithm.scalar_inits and scalars is None:
        raise ConfigError(
            f"{algorithm.front}'s state keeps a per-parameter {' and '.join(algorithm.scalar_inits)} that this source "
            "does not give: pass scalars= (each parameter's, as the state directory or checkpoint recorded them)"
        )
    state: dict[int, dict[str, Tensor]] = {}
    flats: dict[int, dict[str, Tensor]] = {}
    for p in layout.params:
        step = steps[p.index]
        if not has_state(layout, p.index, step):
            continue
        entry = {"step": step_tensor(step)} if "step" in algorithm.state_scalars else {}
        for name in algorithm.scalar_inits:
            entry[name] = scalars[p.index][name].clone()
        flat = {}
        for field in layout.fields:
            option = None if field == MASTER else algorithm.field(field).option
            if option is not None and not algorithm.uses(groups[p.group], option):
                continue  # a field the group does not use (max_exp_avg_sq without amsgrad): torch has none
            if field == "master" and has_master is not None and not has_master[p.index]:
                continue
            tensor = torch.empty(p.shape, dtype=torch.float32)
            entry[layout.state_key(field)] = tensor
            flat[field] = tensor.view(-1)
        if not entry:
            continue  # nothing torch would keep (SGD without momentum keeps no state)
        state[p.index if keys is None else keys[p.index]] = _in_torch_key_order(entry, layout)
        if p.trainable:
            flats[p.index] = flat
    if keys is not None:
        return {"state": state, "param_groups": [dict(g) for g in groups]}, flats
    torch_groups = []
    for gi, group in enumerate(groups):
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [p.index for p in layout.params if p.group == gi]
        torch_groups.append(packed)
    return {"state": state, "param_groups": torch_groups}, flats


def _in_torch_key_order(entry: dict[str, Tensor], layout: Layout) -> dict[str, Tensor]:
    """``entry``'s keys as torch orders a state: ``step``, then the fields (``master_param``, tierstore's, last)."""
    order = ["step", *layout.algorithm.scalar_inits, *(layout.state_key(f) for f in layout.field_order if f != MASTER), MASTER_KEY]
    return {k: entry[k] for k in order if k in entry}


def positions(state_dict: Mapping[str, Any], *, strict: bool = True) -> tuple[list[list[Any]], dict[Any, int]]:
    """The saved groups' id lists, and each saved id's position (ids in group order).

    ``strict=False`` accepts state keys that no group lists (torch keeps
    those as state that belongs to no parameter).

    Raises
    ------
    ConfigError
        If ``state_dict`` is not shaped like an optimizer state dict, or (``strict``)
        its state names ids that no group lists.
    """
    try:
        groups = [list(g["params"]) for g in state_dict["param_groups"]]
        state = state_dict["state"]
    except (KeyError, TypeError) as exc:
        raise ConfigError(
            f"not a torch optimizer state dict ({exc!r}); pass optimizer.state_dict(), which has 'state' "
            "and 'param_groups' with 'params' lists"
        ) from None
    position: dict[Any, int] = {}
    for ids in groups:
        for pid in ids:
            position[pid] = len(position)
    unknown = [pid for pid in state if pid not in position]
    if unknown and strict:
        raise ConfigError(f"loaded state refers to parameter ids {unknown[:5]} that no param group lists")
    return groups, position


def require_option_fields(groups: Sequence[Mapping[str, Any]], layout: Layout, source: str) -> None:
    """Refuse groups that use an option whose field the state lacks (amsgrad without ``max_exp_avg_sq``).

    Raises
    ------
    ConfigError
        Naming the group and the fix (:meth:`~tierstore._compute.algorithms.base.Algorithm.require_fields`).
    """
    layout.algorithm.require_fields(groups, layout.fields, source)


require_amsgrad_field = require_option_fields  # its name while AdamW was the one algorithm


def require_state_dict(state_dict: Any) -> None:
    """Refuse what is not a torch optimizer state dict, naming what it is (before anything reads it).

    Raises
    ------
    ConfigError
        If it is not a mapping with ``state`` and ``param_groups``; a trainer
        integration's reference (:data:`REFERENCE_KEY`) is named as one.

    Example
    -------
    >>> require_state_dict({"state": {}, "param_groups": []})
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        keys = sorted(map(str, state_dict)) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        if isinstance(state_dict, Mapping) and REFERENCE_KEY in state_dict:
            raise ConfigError(
                f"the loaded state dict is a reference ({REFERENCE_KEY!r}) to an optimizer snapshot that a trainer "
                "integration wrote beside the checkpoint, not the state itself: resume through the same integration "
                "(tierstore.integrations.accelerate.checkpoint_by_snapshot before load_state, TieredCheckpoints in "
                "Lightning's callbacks, TieredTrainer for Hugging Face Trainer)"
            )
        raise ConfigError(
            f"the loaded state dict has {keys}; expected a dict with 'state' and 'param_groups', as "
            "torch.optim.AdamW.state_dict() and TieredAdamW.state_dict() return"
        )


def incoming_state(
    state_dict: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]], layout: Layout
) -> tuple[dict[int, dict[str, Any]], dict[Any, Any]]:
    """Check a state dict against this optimizer's groups and layout; its entries by parameter position.

    Returns the parameters' entries by position and, as torch keeps them, the
    entries whose key no group lists (state that belongs to no parameter).
    DTensor values (FSDP2) are replaced by their local parts. The fields of
    frozen parameters are dropped (their extra keys are kept).

    Raises
    ------
    ConfigError
        If the group or parameter counts differ, the state or a group is
        another algorithm's (both named), a hyperparameter is invalid, amsgrad
        is used without the field, an id is unknown, or a tensor has the wrong
        number of elements.
    """
    require_state_dict(state_dict)
    algorithm = layout.algorithm
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ConfigError(
            f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has {len(param_groups)}"
        )
    for gi, (mine, saved) in enumerate(zip(param_groups, saved_groups)):
        if len(mine["params"]) != len(saved["params"]):
            raise ConfigError(
                f"loaded state dict's parameter group {gi} has {len(saved['params'])} parameters, "
                f"this optimizer's has {len(mine['params'])}"
            )
        check_loaded_group(saved, algorithm, f"loaded group {gi}")  # another algorithm's is refused, both named
    require_option_fields(saved_groups, layout, "loaded")
    _, position = positions(state_dict, strict=False)
    incoming: dict[int, dict[str, Any]] = {}
    others: dict[Any, Any] = {}
    for pid, entry in state_dict["state"].items():
        i = position.get(pid)
        if i is None:
            others[pid] = entry
            continue
        meta = layout.params[i]
        if not isinstance(entry, Mapping):
            raise ConfigError(
                f"loaded state of parameter id {pid!r} is a {type(entry).__name__}, expected a dict such as "
                "{'step': ..., 'exp_avg': ..., 'exp_avg_sq': ...}"
            )
        entry = {k: local_tensor(v) if isinstance(v, Tensor) and k != "step" else v for k, v in entry.items()}
        owners = state_owners(entry, algorithm)
        if owners:  # another algorithm's keys (momentum_buffer into AdamW): never carried as the user's own
            raise ConfigError(foreign_state(owners, algorithm, f"the loaded state of parameter {i} ({sorted(map(str, entry))})"))
        if not meta.trainable and meta.numel > 0:
            extras = {k: v for k, v in entry.items() if k not in own_state_keys(layout)}
            if extras:
                incoming[i] = extras
            continue
        for key in map(layout.state_key, layout.field_order):
            if key in entry and not isinstance(entry[key], Tensor):
                raise ConfigError(
                    f"loaded {key} of parameter {i} is {type(entry[key]).__name__}, expected a tensor of "
                    f"{meta.numel} elements (shape {meta.shape}); load a state dict saved by {algorithm.front} or "
                    f"{algorithm.torch_class}"
                )
            if key in entry and entry[key].numel() != meta.numel:
                raise ConfigError(
                    f"loaded {key} of parameter {i} has {entry[key].numel()} elements, the parameter "
                    f"has {meta.numel} (shape {meta.shape})"
                )
        # A parameter that has taken a step has both moments: a missing one is never made up as zeros
        # (torch.optim.AdamW fails at its next step on such a state; this fails before loading anything).
        required = [*algorithm.scalar_inits, *map(layout.state_key, algorithm.required_fields())]
        missing = [key for key in required if "step" in entry and key not in entry]
        if missing:
            raise ConfigError(
                f"loaded state of parameter {i} has a step but no {' and no '.join(missing)}; load a state dict "
                f"saved by {algorithm.front} or {algorithm.torch_class} whole, or drop the parameter's entry to start it fresh"
            )
        incoming[i] = entry
    return incoming, others


def flat_sources(incoming: Mapping[int, Mapping[str, Any]], layout: Layout) -> dict[int, dict[str, Tensor]]:
    """Flat fp32 views of the incoming tensors, by parameter and field (what ``copy_in`` takes)."""
    out = {}
    for i, entry in incoming.items():
        out[i] = {
            field: entry[key].detach().reshape(-1)
            for field in layout.fields
            if isinstance(entry.get(key := layout.state_key(field)), Tensor)
        }
    return out

"""``torch.optim.AdamW``'s state-dict format: one home for its shape and its checks.

A torch optimizer state dict is ``{"state": {id: {"step", "exp_avg",
"exp_avg_sq", ["max_exp_avg_sq"]}}, "param_groups": [{..., "params": [id,
...]}]}``: ids count the parameters of every group in order, and a parameter
has an entry only once it took a step. tierstore adds ``master_param`` (the
fp32 master copy) where the state keeps one; torch's AdamW ignores it.

This module builds such dicts (with tensors allocated for every field, for
the caller to fill shard by shard), maps incoming ids to parameter
positions, and checks an incoming dict against a layout.

Example
-------
>>> import torch
>>> from tierstore.layout import Layout
>>> w = torch.zeros(3, requires_grad=True)
>>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"))
>>> sd, flats = empty_state_dict(layout, [1.0], [{"lr": 0.1, "amsgrad": False}])
>>> sorted(sd["state"][0]), sd["param_groups"][0]["params"]
(['exp_avg', 'exp_avg_sq', 'step'], [0])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .dtensor import local_tensor
from .errors import ConfigError, ParamsChangedError
from .hyper import check_hyper
from .layout import FIELD_ORDER, STATE_KEY_OF_FIELD, Layout

#: ``torch.optim.AdamW``'s group keys that TieredAdamW does not use, with the
#: values that describe what it does, so state dicts load into either optimizer.
GROUP_DEFAULTS = {
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}


def step_tensor(step: float) -> Tensor:
    """A parameter's step count as torch's AdamW keeps it (an fp32 scalar tensor)."""
    return torch.tensor(float(step), dtype=torch.float32)


def param_steps(state: Mapping[Any, Mapping[str, Any]], params: Sequence[Tensor]) -> list[float | None]:
    """Each parameter's AdamW step (``None`` before its first), from an optimizer's ``state``."""
    steps = []
    for p in params:
        st = state.get(p)
        steps.append(float(st["step"]) if st and "step" in st else None)
    return steps


def reset_param_steps(state: dict[Any, dict[str, Any]], params: Sequence[Tensor], steps: Mapping[int, float]) -> None:
    """Give each parameter whose position is in ``steps`` that step count; the others have no state."""
    for i, p in enumerate(params):
        if i in steps:
            state[p] = {"step": step_tensor(steps[i])}
        else:
            state.pop(p, None)


def restore_groups(param_groups: Sequence[dict[str, Any]], saved: Sequence[Mapping[str, Any]]) -> None:
    """Take the hyperparameters of ``saved`` groups (not their params), torch's defaults where absent."""
    for mine, group in zip(param_groups, saved):
        mine.update({k: v for k, v in group.items() if k != "params"})
        for key, value in GROUP_DEFAULTS.items():
            mine.setdefault(key, value)
        mine["betas"] = tuple(float(b) for b in mine["betas"])


def check_same_params(param_groups: Sequence[Mapping[str, Any]], params: Sequence[Tensor]) -> None:
    """Raise ``ParamsChangedError`` if the groups no longer hold exactly ``params`` (the layout is fixed)."""
    now = [p for g in param_groups for p in g["params"]]
    if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
        raise ParamsChangedError(
            f"the optimizer's parameters changed since construction ({len(params)} then, {len(now)} now); "
            "TieredAdamW's state layout is fixed: build a new optimizer for a new set of parameters"
        )


def packed_groups(param_groups: Sequence[Mapping[str, Any]], params: Sequence[Tensor]) -> list[dict[str, Any]]:
    """``param_groups`` with each ``params`` list replaced by parameter positions, as torch saves them."""
    index = {id(p): i for i, p in enumerate(params)}
    out = []
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [index[id(p)] for p in group["params"]]
        out.append(packed)
    return out


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
) -> tuple[dict[str, Any], dict[int, dict[str, Tensor]]]:
    """A torch AdamW state dict with a tensor allocated for every field, and their flat views.

    ``groups`` are the param groups' hyperparameters (a ``params`` key is
    replaced by the layout's positions). ``max_exp_avg_sq`` is given only to
    parameters whose group uses amsgrad, ``master_param`` to those for which
    ``has_master`` is true (default: all, when the layout keeps masters).
    The flat views, ``flats[param][field]``, are what
    :meth:`~tierstore.layout.Layout.copy_out` fills.
    """
    state: dict[int, dict[str, Tensor]] = {}
    flats: dict[int, dict[str, Tensor]] = {}
    for p in layout.params:
        step = steps[p.index]
        if not has_state(layout, p.index, step):
            continue
        amsgrad = bool(groups[p.group].get("amsgrad", False))
        entry = {"step": step_tensor(step)}
        flat = {}
        for field in layout.fields:
            if field == "max_exp_avg_sq" and not amsgrad:
                continue
            if field == "master" and has_master is not None and not has_master[p.index]:
                continue
            tensor = torch.empty(p.shape, dtype=torch.float32)
            entry[STATE_KEY_OF_FIELD[field]] = tensor
            flat[field] = tensor.view(-1)
        state[p.index] = _in_torch_key_order(entry)
        if p.trainable:
            flats[p.index] = flat
    torch_groups = []
    for gi, group in enumerate(groups):
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [p.index for p in layout.params if p.group == gi]
        torch_groups.append(packed)
    return {"state": state, "param_groups": torch_groups}, flats


def _in_torch_key_order(entry: dict[str, Tensor]) -> dict[str, Tensor]:
    order = ["step", *(STATE_KEY_OF_FIELD[f] for f in FIELD_ORDER if f != "master"), STATE_KEY_OF_FIELD["master"]]
    return {k: entry[k] for k in order if k in entry}


def positions(state_dict: Mapping[str, Any]) -> tuple[list[list[Any]], dict[Any, int]]:
    """The saved groups' id lists, and each saved id's position (ids in group order).

    Raises
    ------
    ConfigError
        If ``state_dict`` is not shaped like an optimizer state dict, or its
        state names ids that no group lists.
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
    if unknown:
        raise ConfigError(f"loaded state refers to parameter ids {unknown[:5]} that no param group lists")
    return groups, position


def require_amsgrad_field(groups: Sequence[Mapping[str, Any]], layout: Layout, source: str) -> None:
    """Refuse groups that use amsgrad when the state has no ``max_exp_avg_sq``.

    Raises
    ------
    ConfigError
        Naming the group and the fix.
    """
    if "max_exp_avg_sq" in layout.fields:
        return
    for gi, group in enumerate(groups):
        if group.get("amsgrad", False):
            raise ConfigError(
                f"{source} parameter group {gi} uses amsgrad but this optimizer was built without it; "
                "build TieredAdamW with amsgrad=True"
            )


def incoming_state(
    state_dict: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]], layout: Layout
) -> dict[int, dict[str, Any]]:
    """Check a state dict against this optimizer's groups and layout; its entries by parameter position.

    DTensor values (FSDP2) are replaced by their local parts. Entries of
    frozen parameters are dropped.

    Raises
    ------
    ConfigError
        If the group or parameter counts differ, a hyperparameter is
        invalid, amsgrad is used without the field, an id is unknown, or a
        tensor has the wrong number of elements.
    """
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
        check_hyper(saved["lr"], saved["betas"], saved["eps"], saved["weight_decay"], f" in loaded group {gi}")
    require_amsgrad_field(saved_groups, layout, "loaded")
    _, position = positions(state_dict)
    incoming: dict[int, dict[str, Any]] = {}
    for pid, entry in state_dict["state"].items():
        i = position[pid]
        meta = layout.params[i]
        entry = {k: local_tensor(v) if isinstance(v, Tensor) and k != "step" else v for k, v in entry.items()}
        if not meta.trainable and meta.numel > 0:
            continue
        for key in STATE_KEY_OF_FIELD.values():
            if key in entry and entry[key].numel() != meta.numel:
                raise ConfigError(
                    f"loaded {key} of parameter {i} has {entry[key].numel()} elements, the parameter "
                    f"has {meta.numel} (shape {meta.shape})"
                )
        incoming[i] = entry
    return incoming


def flat_sources(incoming: Mapping[int, Mapping[str, Any]], layout: Layout) -> dict[int, dict[str, Tensor]]:
    """Flat fp32 views of the incoming tensors, by parameter and field (what ``copy_in`` takes)."""
    out = {}
    for i, entry in incoming.items():
        out[i] = {
            field: entry[key].detach().reshape(-1)
            for field in layout.fields
            if isinstance(entry.get(key := STATE_KEY_OF_FIELD[field]), Tensor)
        }
    return out

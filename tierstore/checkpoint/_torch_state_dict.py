"""Conversions between checkpoints or state directories and torch optimizer state dicts (states that fit in RAM).

The state dict is that of the state's algorithm's torch class (``torch.optim.AdamW``,
``torch.optim.SGD``, ...): a checkpoint or state directory names its algorithm; a torch
state dict does not, so :func:`state_dict_to_checkpoint` takes it (``algorithm=``).

A state dict holds every moment as a full CPU tensor, so these are for
models whose state fits in RAM; larger states stream
(:mod:`tierstore.checkpoint._streaming`). A state dict given to
:func:`state_dict_to_checkpoint` is checked entry by entry first: a missing
moment is never written as zeros.

Example
-------
>>> import tempfile, torch
>>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
>>> ref = torch.optim.AdamW([w], lr=0.1); ref.step()
>>> path = tempfile.mkdtemp() + "/ckpt.zarr"
>>> state_dict_to_checkpoint(ref.state_dict(), path)
>>> float(checkpoint_to_state_dict(path)["state"][0]["step"])
1.0
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._compute.algorithms import Algorithm, algorithm_named
from .._compute.algorithms.identify import check_loaded_group, foreign_state, state_owners
from .._layout.layout import DEFAULT_SHARD_NUMEL, MASTER_KEY, Layout, state_fields
from .._layout.scalar_record import RECORD_KEY, record_of, tensors_of, within_float32
from .._layout.torch_format import empty_state_dict, flat_sources, positions
from .._state import manifest as manifest_mod
from ..errors import ConfigError
from ._reader import CheckpointReader
from ._state_dir import check_manifest_header, open_state_reader, require_clean
from ._validate import MAX_STEP
from ._writer import CheckpointWriter
from ._zarr_format import CheckpointHeader

__all__ = ["checkpoint_to_state_dict", "statedir_to_state_dict", "state_dict_to_checkpoint"]

def checkpoint_to_state_dict(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint as a state dict of its algorithm's torch class (every field as a full CPU tensor).

    Parameters that never took a step have no entry in ``state``, as in
    torch. ``master_param`` is included where the checkpoint has master
    weights; torch's optimizers ignore it, the tiered fronts load it.

    Raises
    ------
    CorruptStateError, FormatVersionError
        As :func:`load_checkpoint`.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> from tierstore.checkpoint import save_checkpoint
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> with TieredAdamW([w], lr=0.1) as opt:
    ...     _ = opt.step(); save_checkpoint(opt, path)
    >>> ref = torch.optim.AdamW([w], lr=0.1)
    >>> ref.load_state_dict(checkpoint_to_state_dict(path)); ref.state[w]["exp_avg"].tolist()
    [0.10000000149011612, 0.10000000149011612, 0.10000000149011612]
    """
    ck = CheckpointReader(path)
    layout = ck.layout
    scalars = tensors_of(ck.param_scalars, len(layout.params))  # NAdam's mu_product: what the checkpoint recorded
    result, flats = empty_state_dict(layout, ck.param_steps, ck.param_groups, has_master=ck.has_master, scalars=scalars)
    scratch = torch.empty(len(layout.fields) * layout.shard_numel, dtype=torch.float32)
    for index in layout.shards_of(flats):
        shard = layout.shards[index]
        flat = scratch[: len(layout.fields) * shard.capacity]
        for field, values in layout.field_views(flat, shard).items():
            ck.read_values(field, shard.start, values.numpy())
        layout.copy_out(shard, flat, flats)
    return result


def statedir_to_state_dict(state_dir: str | os.PathLike) -> dict[str, Any]:
    """A state directory's last commit as a state dict of its algorithm's torch class (no optimizer needed).

    Raises
    ------
    CorruptStateError, FormatVersionError
        As :func:`export_statedir`.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> d = tempfile.mkdtemp(); w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> with TieredAdamW([w], state_dir=d) as opt:
    ...     _ = opt.step()
    >>> sorted(statedir_to_state_dict(d)["state"][0])
    ['exp_avg', 'exp_avg_sq', 'step']
    """
    with open_state_reader(state_dir) as reader:
        require_clean(reader)
        layout = reader.layout
        _, param_steps, param_groups = check_manifest_header(reader)
        scalars = tensors_of(reader.manifest.get(RECORD_KEY), len(layout.params))  # checked with the manifest
        result, flats = empty_state_dict(layout, param_steps, param_groups, scalars=scalars)
        for index in layout.shards_of(flats):
            layout.copy_out(layout.shards[index], reader.read_shard(index), flats)
    return result


def state_dict_to_checkpoint(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    *,
    shard_numel: int = DEFAULT_SHARD_NUMEL,
    params: Iterable[torch.Tensor] | None = None,
    overwrite: bool = False,
    checksum: str | None = "xxh3",
    algorithm: str | Algorithm = "adamw",
) -> None:
    """Write a torch optimizer's (or a tiered front's) state dict as a zarr checkpoint.

    A parameter with state (``exp_avg``...) is trainable with the state's
    shape. Without ``params``, a parameter with no state is recorded as
    frozen with an unknown shape: loading then works only into an optimizer
    where that parameter is frozen too. Pass ``params`` (the model's
    parameters, in the state dict's order) to record every shape and which
    are trainable; trainable parameters without state get zeros and no step,
    as after construction.

    Parameters
    ----------
    state_dict
        ``optimizer.state_dict()`` of the torch class of ``algorithm``
        (``torch.optim.AdamW`` by default).
    path, overwrite, checksum
        As :func:`save_checkpoint`.
    shard_numel
        Elements per chunk (rounded up to a multiple of 1024).
    params
        Optional: the parameters the state dict belongs to.
    algorithm
        The optimizer algorithm whose state it is, by its registered name
        (``"adamw"``, ``"sgd"``, ...): a torch state dict does not name its
        optimizer. One whose keys are another registered algorithm's is refused,
        naming both.

    Raises
    ------
    ConfigError
        If the state dict is malformed, another algorithm's, or does not match ``params``.
    CheckpointExistsError
        As :func:`save_checkpoint`.

    Example
    -------
    >>> import tempfile, torch
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> ref = torch.optim.AdamW([w], lr=0.1); ref.step()
    >>> path = tempfile.mkdtemp() + "/ckpt.zarr"
    >>> state_dict_to_checkpoint(ref.state_dict(), path, shard_numel=1024)
    >>> checkpoint_to_state_dict(path)["state"][0]["exp_avg"].tolist()
    [0.10000000149011612, 0.10000000149011612, 0.10000000149011612]
    """
    algorithm = algorithm_named(algorithm)
    groups, position = positions(state_dict)
    n = len(position)
    given = None if params is None else list(params)
    if given is not None and len(given) != n:
        raise ConfigError(f"params has {len(given)} tensors but the state dict's param groups list {n}; pass them all, in order")
    entries: list[dict[str, Any]] = [{} for _ in range(n)]
    for pid, entry in state_dict["state"].items():
        entries[position[pid]] = entry
    group_of = [g for ids, g in zip(groups, state_dict["param_groups"]) for _ in ids]
    keys = [MASTER_KEY, *algorithm.field_names]
    for i, entry in enumerate(entries):
        _check_torch_entry(i, entry, algorithm, group_of[i])
    for gi, group in enumerate(state_dict["param_groups"]):
        # The reader refuses hyperparameters the torch class refuses: so does the writer.
        check_loaded_group(group, algorithm, f"param group {gi}")
    # A field an option adds is kept when a group uses the option or a parameter's state holds it.
    options = set(algorithm.options(state_dict["param_groups"]))
    options |= {f.option for f in algorithm.fields if f.option is not None and any(f.name in e for e in entries)}
    fields = state_fields(algorithm, options, master=any(MASTER_KEY in e for e in entries))
    stand_ins: list[list[torch.Tensor]] = []
    known, steps, has_master = [], [], []
    for ids in groups:
        group_tensors = []
        for pid in ids:
            i = position[pid]
            entry = entries[i]
            ref = next((entry[k] for k in keys if k in entry), None)
            if given is not None:
                p = given[i]
                stand_in = torch.empty(p.shape, dtype=p.dtype, device="meta").requires_grad_(bool(p.requires_grad) and p.is_floating_point())
                if ref is not None and ref.numel() != p.numel():
                    key = next(k for k in keys if k in entry)
                    raise ConfigError(
                        f"the {key} of parameter {i} has {ref.numel()} elements, params[{i}] "
                        f"has {p.numel()} (shape {tuple(p.shape)}); pass the parameters in the state dict's order"
                    )
                known.append(True)
            elif ref is not None:
                stand_in = torch.empty(ref.shape, dtype=ref.dtype, device="meta").requires_grad_(True)
                known.append(True)
            elif entry:
                raise ConfigError(
                    f"the state of parameter {i} holds no tensor ({sorted(map(str, entry))}), so its shape is unknown; "
                    "pass params=model.parameters() (in the state dict's order)"
                )
            else:
                stand_in = torch.empty(0, device="meta")
                known.append(False)
            group_tensors.append(stand_in)
            steps.append(_step_of(algorithm, entry) if entry else None)
            has_master.append(MASTER_KEY in entry)
        stand_ins.append(group_tensors)
    layout = Layout.build(stand_ins, shard_numel=shard_numel, fields=fields, algorithm=algorithm)
    if given is not None:
        for i, entry in enumerate(entries):
            if entry and not layout.params[i].trainable:
                raise ConfigError(f"parameter {i} has optimizer state but params[{i}] does not require grad")
    sources = flat_sources({i: e for i, e in enumerate(entries) if e and layout.params[i].trainable}, layout)
    header = CheckpointHeader(
        layout=layout,
        step_count=int(max((s for s in steps if s is not None), default=0)),
        param_groups=manifest_mod.encode_groups(state_dict["param_groups"]),
        param_steps=steps,
        source="torch",
        param_scalars=record_of(algorithm.scalar_inits, steps, [algorithm.loaded_scalars(e) for e in entries]),
        known_shapes=known,
        has_master=has_master,
    )
    scratch = torch.empty(layout.shard_numel * len(fields), dtype=torch.float32)
    with CheckpointWriter(path, header, overwrite=overwrite, checksum=checksum) as writer:
        for shard in layout.shards:
            flat = scratch[: shard.capacity * len(fields)]
            layout.copy_in(shard, flat, sources)
            for field, t in layout.field_views(flat, shard).items():
                writer.write(shard, field, t)


def _step_of(algorithm: Algorithm, entry: Mapping[str, Any]) -> float:
    """A stepped parameter's step count: the algorithm's reading of its entry (torch's ``step``), else 1."""
    step = algorithm.loaded_step(entry)
    # Note: an algorithm whose torch state keeps no step (SGD) is recorded as stepped once; its state has what
    # it needs (the lazy fields it created) and no update reads the count.
    return 1.0 if step is None else float(step)


def _check_torch_entry(i: int, entry: Any, algorithm: Algorithm, group: Mapping[str, Any]) -> None:
    """Refuse a torch state entry that is not complete, or another algorithm's: a missing field is never written as zeros.

    As in torch, a parameter's entry has the algorithm's scalars (AdamW:
    ``step``; NAdam also ``mu_product``, a finite number) and the fields it always keeps (``exp_avg``, ``exp_avg_sq``),
    and the fields of the options its group uses (``max_exp_avg_sq`` with
    amsgrad; torch's AdamW fails at its next step without it); every tensor
    has the same number of elements.

    Raises
    ------
    ConfigError
        Naming the parameter, the key and the fix (both algorithms for another's state).
    """
    if not isinstance(entry, dict):
        raise ConfigError(f"the state of parameter {i} is {type(entry).__name__}, not a dict; pass optimizer.state_dict()")
    if not entry:
        return
    owners = state_owners(entry, algorithm)
    if owners:
        names = " or ".join(repr(a.name) for a in owners)
        raise ConfigError(foreign_state(owners, algorithm, f"the state of parameter {i} ({sorted(map(str, entry))})",
                                        fix=f"pass algorithm={names} to convert it"))  # fmt: skip
    scalars = [k for k in algorithm.state_scalars if k == "step" or k in algorithm.scalar_inits]
    optional = [f.name for f in algorithm.fields if f.option is not None and not f.lazy and algorithm.uses(group, f.option)]
    required = scalars + list(algorithm.required_fields()) + optional
    missing = [k for k in required if k not in entry]
    if missing:
        options = sorted({f.option for f in algorithm.fields if f.name in missing and f.option is not None})
        raise ConfigError(
            f"the state of parameter {i} lacks {missing}"
            + (f" (its param group uses {' and '.join(options)})" if options else "")
            + f"; a missing tensor is never written as zeros. Pass the complete state dict of a {algorithm.torch_class}"
        )
    if "step" in entry:
        step = entry["step"]
        try:
            value = float(step)
        except (TypeError, ValueError, RuntimeError):
            value = math.nan
        if isinstance(step, bool) or not (math.isfinite(value) and 0 <= value <= MAX_STEP and value.is_integer()):
            raise ConfigError(
                f"the step of parameter {i} is {step!r}; a step is a whole number >= 0 (as {algorithm.torch_class} counts)"
            )
    for name in algorithm.scalar_inits:  # NAdam's mu_product: recorded as a number, read back checked as one
        value = entry[name]
        try:
            number = float(value) if isinstance(value, torch.Tensor) else value
        except (TypeError, ValueError, RuntimeError):
            number = None
        if not within_float32(number):
            raise ConfigError(
                f"the {name} of parameter {i} is {value!r}; it must be a finite number within float32's range "
                f"(a number or a one-element tensor, as {algorithm.torch_class} keeps it)"
            )
    first = None
    for key in (*algorithm.field_names, MASTER_KEY):
        if key not in entry:
            continue
        tensor = entry[key]
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"the {key} of parameter {i} is {type(tensor).__name__}, not a tensor; pass optimizer.state_dict()")
        if first is not None and tensor.numel() != first[1]:
            raise ConfigError(
                f"the {key} of parameter {i} has {tensor.numel()} elements, its {first[0]} {first[1]}; every tensor of a "
                "parameter's state has the parameter's size"
            )
        first = first or (key, tensor.numel())

"""Checks of what a checkpoint or a manifest says, before anything read from it is trusted.

A checkpoint may come from anywhere: its directory tree is scanned before
zarr opens a file (:func:`scan_checkpoint`), and the values saved beside a
layout (step counts, param groups: :func:`check_header`) and a checkpoint's
parameter index (:func:`check_param_index`) are checked against that
layout. Each refusal is a :class:`~tierstore.errors.CorruptStateError`
naming where, the value and what was expected.

Example
-------
>>> same_json([1, {"a": True}], [1, {"a": True}]), same_json(1, 1.0), same_json(True, 1)
(True, False, False)
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

from .._layout.layout import MAX_PARAMS, Layout
from .._layout.scalar_record import check_record
from .._state import manifest as manifest_mod
from ..errors import ConfigError, CorruptStateError
from ._files import file_kind
from ._zarr_format import MAX_METADATA_NBYTES

__all__ = ["MAX_STEP", "scan_checkpoint", "same_json", "check_header", "check_scalars", "check_param_index"]

MAX_STEP = 1 << 53  # the largest step count read back (every whole number up to it is a float)


def scan_checkpoint(path: Path) -> dict[str, int]:
    """Every file of a checkpoint (relative path -> size), checking that each entry is a regular file or a directory.

    Runs before zarr opens anything: zarr follows symlinks and reads whole
    files, so a FIFO would hang it, a device feed it without end and a link
    point it outside the checkpoint.

    Raises
    ------
    CorruptStateError
        If ``path`` is not a directory holding ``zarr.json``, or any entry under
        it is a symlink, FIFO, socket or device, or a ``zarr.json`` is larger than
        :data:`MAX_METADATA_NBYTES`.
    """
    try:
        top = os.stat(path)  # the path the caller named may be a link; nothing inside it may
    except FileNotFoundError:
        raise CorruptStateError(
            f"checkpoint {str(path)!r} does not exist; pass the path that save_checkpoint, export_statedir "
            "or state_dict_to_checkpoint wrote"
        ) from None
    except OSError as exc:
        raise CorruptStateError(f"cannot read checkpoint {str(path)!r} ({exc.strerror}); check the path and its permissions") from exc
    if not stat.S_ISDIR(top.st_mode):
        raise CorruptStateError(
            f"checkpoint {str(path)!r} is {file_kind(top.st_mode)}, not a directory; a zarr checkpoint is a directory "
            "holding zarr.json (a .pt file is read with torch.load)"
        )
    sizes: dict[str, int] = {}
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            with os.scandir(path / rel if rel else path) as it:
                listed = [(entry.name, entry.stat(follow_symlinks=False)) for entry in it]
        except OSError as exc:
            raise CorruptStateError(f"cannot list {path / rel} ({exc.strerror}); check its permissions") from exc
        for name, st in listed:
            child = f"{rel}/{name}" if rel else name
            if stat.S_ISDIR(st.st_mode):
                pending.append(child)
            elif not stat.S_ISREG(st.st_mode):
                raise CorruptStateError(
                    f"{path / child} is {file_kind(st.st_mode)}, not a regular file; a checkpoint holds only regular "
                    "files and directories, so it is not read. Write the checkpoint again"
                )
            elif name == "zarr.json" and st.st_size > MAX_METADATA_NBYTES:
                raise CorruptStateError(
                    f"{path / child} holds {st.st_size} bytes, more than the {MAX_METADATA_NBYTES} a checkpoint's "
                    "metadata may take; it is not read. Write the checkpoint again"
                )
            else:
                sizes[child] = st.st_size
    if "zarr.json" not in sizes:
        raise CorruptStateError(
            f"{str(path)!r} is not a zarr v3 checkpoint (no zarr.json); pass the path that "
            "save_checkpoint, export_statedir or state_dict_to_checkpoint wrote"
        )
    return sizes


def same_json(a: Any, b: Any) -> bool:
    """JSON values equal with their types (``True`` is not ``1``, ``1.0`` is not ``1``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return a == b


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_header(
    where: str, layout: Layout, *, step_count: Any, param_steps: Any, param_groups: Any
) -> tuple[int, list[float | None], list[dict[str, Any]]]:
    """Check the step counts and param groups saved beside a layout (a checkpoint's or a manifest's).

    Step counts are non-negative whole numbers (:data:`MAX_STEP` at most), one per
    parameter or ``None``; every group a parameter names exists, and its
    hyperparameters are of the kinds the layout's algorithm saves and values
    its torch class accepts (:meth:`~tierstore._compute.algorithms.base.Algorithm.check_group`);
    a group using an option needs the field it adds (amsgrad: ``max_exp_avg_sq``).

    Returns
    -------
    (step_count, param_steps, param_groups)
        The checked values, groups decoded (``betas`` as a tuple: the algorithm's pairs).

    Raises
    ------
    CorruptStateError
        Naming ``where``, the value and what was expected.
    """
    fix = "the state is damaged or was not written by tierstore; restore it from a good copy, or write it again"
    if type(step_count) is not int or not 0 <= step_count <= MAX_STEP:
        raise CorruptStateError(f"{where} has step_count={step_count!r}; it must be a whole number in [0, {MAX_STEP}] ({fix})")
    if not isinstance(param_steps, list) or len(param_steps) != len(layout.params):
        count = len(param_steps) if isinstance(param_steps, list) else type(param_steps).__name__
        raise CorruptStateError(f"{where} has {count} param_steps for the {len(layout.params)} parameters of its layout ({fix})")
    steps: list[float | None] = []
    for i, s in enumerate(param_steps):
        if s is not None and not (_is_number(s) and math.isfinite(s) and 0 <= s <= MAX_STEP and float(s).is_integer()):
            raise CorruptStateError(f"{where} has param_steps[{i}]={s!r}; a step is null or a whole number in [0, {MAX_STEP}] ({fix})")
        steps.append(None if s is None else float(s))
    needed = 1 + max((p.group for p in layout.params), default=0)
    if not isinstance(param_groups, list) or not needed <= len(param_groups) <= MAX_PARAMS:
        count = len(param_groups) if isinstance(param_groups, list) else type(param_groups).__name__
        raise CorruptStateError(f"{where} has {count} param_groups; its parameters name {needed} ({fix})")
    algorithm = layout.algorithm
    groups = []
    for gi, group in enumerate(param_groups):
        at = f"{where} param_groups[{gi}]"
        if not isinstance(group, dict):
            raise CorruptStateError(f"{at} is {type(group).__name__}, not an object ({fix})")
        problem = manifest_mod.saved_group_problem(group, algorithm)
        if problem is not None:
            key, value, expected = problem
            value = None if value is manifest_mod.MISSING else value
            raise CorruptStateError(f"{at} has {key}={value!r}; it must be {expected} ({fix})")
        decoded = algorithm.decode_group(group)
        try:
            algorithm.check_group(decoded, f" in {at}")
        except (ConfigError, KeyError, TypeError, ValueError) as exc:  # the torch class would refuse it: so does a load
            raise CorruptStateError(f"{exc} ({fix})") from None
        for spec in algorithm.fields:
            if spec.option is not None and spec.name not in layout.fields and algorithm.uses(decoded, spec.option):
                raise CorruptStateError(f"{at} uses {spec.option} but the state has no {spec.name} ({fix})")
        groups.append(decoded)
    return step_count, steps, groups


def check_scalars(where: str, layout: Layout, value: Any, steps: list[float | None]) -> dict[str, list[float | None]] | None:
    """The record of each parameter's scalars besides its step saved beside a layout (``None``: its algorithm
    keeps none), checked against the layout's algorithm and the checked ``steps``
    (:func:`~tierstore._layout.scalar_record.check_record`).

    Raises
    ------
    CorruptStateError
        Naming ``where``, the key, the value and what was expected.

    Example
    -------
    >>> import torch
    >>> from tierstore._compute.algorithms import algorithm_named
    >>> w = torch.zeros(3, requires_grad=True)
    >>> layout = Layout.build([[w]], shard_numel=1024, fields=("exp_avg", "exp_avg_sq"), algorithm=algorithm_named("nadam"))
    >>> check_scalars("checkpoint /ck", layout, {"mu_product": [0.5]}, [1.0])
    {'mu_product': [0.5]}
    """
    fix = "the state is damaged or was not written by tierstore; restore it from a good copy, or write it again"

    def invalid(key: str, found: Any, expected: str) -> CorruptStateError:
        return CorruptStateError(f"{where} has {key}={manifest_mod.short_repr(found)}; it must be {expected} ({fix})")

    return check_record(value, layout.algorithm.scalar_inits, steps, invalid)


def check_param_index(attrs: dict[str, Any], layout: Layout, where: str) -> list[dict[str, Any]]:
    """The checkpoint's parameter index, checked entry by entry against its layout.

    The index is what plain zarr readers (and :func:`load_checkpoint`'s mapping
    of another flat space) use: an entry that differs from the layout would
    put moments on other parameters.

    Raises
    ------
    CorruptStateError
        Naming the first entry and key that differ.
    """
    index = attrs.get("params")
    if not isinstance(index, list) or len(index) != len(layout.params):
        count = len(index) if isinstance(index, list) else type(index).__name__
        raise CorruptStateError(
            f"the parameter index of checkpoint {where} has {count} entries, its layout {len(layout.params)} "
            "parameters; the checkpoint is damaged, write it again"
        )
    keys = {"index", "group", "shape", "dtype", "start", "numel", "trainable"}
    for p, saved in zip(layout.params, index):
        expected = {
            "index": p.index, "group": p.group, "shape": list(p.shape), "dtype": p.dtype,
            "start": p.start, "numel": p.numel, "trainable": p.trainable,
        }
        at = f"parameter {p.index} in the index of checkpoint {where}"
        if not isinstance(saved, dict) or not keys <= set(saved) <= keys | {"has_master"}:
            raise CorruptStateError(
                f"{at} has keys {sorted(saved) if isinstance(saved, dict) else saved!r}; expected {sorted(keys)}. "
                "The checkpoint is damaged, write it again"
            )
        for key, value in expected.items():
            # Converted torch state dicts do not know the shapes of parameters without state (frozen here).
            if key == "shape" and saved[key] is None and not p.trainable:
                continue
            if not same_json(saved[key], value):
                raise CorruptStateError(
                    f"{at} has {key}={saved[key]!r}, its layout {value!r}; the checkpoint is damaged, write it again"
                )
        if "has_master" in saved and (
            not isinstance(saved["has_master"], bool) or (saved["has_master"] and not (p.trainable and "master" in layout.fields))
        ):
            raise CorruptStateError(
                f"{at} has has_master={saved['has_master']!r} but its layout keeps no master for it; the checkpoint "
                "is damaged, write it again"
            )
    return index

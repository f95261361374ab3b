"""What the manifest records and how a resume checks it (no I/O here).

The manifest is the commit record of a state directory: the layout it
belongs to (and its fingerprint, and so its optimizer algorithm), the
committed ``step_count``, every parameter's step, the param groups'
hyperparameters (checked as the layout's algorithm checks them), and for every
shard which copy is committed and its checksum. :class:`~tierstore._state.statedir.StateDir`
writes it atomically; this module builds its content, checks it on read
(:func:`validate`: every field's type and bounds, before anything uses it)
and reads it back.

Example
-------
>>> groups = [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "name": "decay"}]
>>> encode_groups(groups)
[{'betas': [0.9, 0.999], 'lr': 0.1, 'name': 'decay'}]
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from typing import Any

import torch

from .._compute.algorithms import ADAMW, ALGORITHMS, FLAG_OR_NULL, NUMBER, PAIR, Algorithm
from .._layout.layout import Layout
from .._layout.scalar_record import RECORD_KEY, check_record
from .._version import __version__
from ..errors import (
    ConfigError,
    CorruptStateError,
    FormatVersionError,
    LayoutMismatchError,
    TierstoreError,
)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def encode_groups(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param-group hyperparameters as JSON-able dicts (without ``params``).

    Values JSON cannot hold (custom objects users hang on groups) are left out.
    """
    out = []
    for group in groups:
        entry = {}
        for key in sorted(group):
            if key == "params":
                continue
            value = _jsonable(group[key])
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            entry[key] = value
        out.append(entry)
    return out


def decode_group(saved: dict[str, Any], algorithm: Algorithm = ADAMW) -> dict[str, Any]:
    """Inverse of one :func:`encode_groups` entry (``betas`` back to a tuple: the algorithm's pairs).

    ``algorithm`` is the one whose groups these are (the saved layout's).
    """
    return algorithm.decode_group(saved)


#: A saved group's key that is absent (:func:`saved_group_problem`).
MISSING = object()
_EXPECTED = {NUMBER: "a number", PAIR: "a pair of numbers"}


def _is_number(value: Any) -> bool:
    """A real number (int or float, not bool) that converts to a float (an int past 1e308 does not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def saved_group_problem(group: dict[str, Any], algorithm: Algorithm) -> tuple[str, Any, str] | None:
    """The first hyperparameter of a saved group whose JSON type is not its kind, or ``None``.

    The kinds are the algorithm's (:attr:`~tierstore._compute.algorithms.base.Algorithm.group_kinds`):
    a number and a pair of numbers must be there, a flag is checked where present. Returns
    ``(key, value, expected)``; ``value`` is :data:`MISSING` for an absent key.

    Example
    -------
    >>> saved_group_problem({"lr": 0.1, "eps": 1e-8, "weight_decay": 0, "betas": [0.9]}, ADAMW)
    ('betas', [0.9], 'a pair of numbers')
    """
    for key, kind in algorithm.group_kinds.items():
        value = group.get(key, MISSING)
        if kind == NUMBER:
            ok = _is_number(value)
        elif kind == PAIR:
            ok = isinstance(value, list) and len(value) == 2 and all(map(_is_number, value))
        else:
            if value is MISSING:
                continue
            ok = isinstance(value, bool) or (kind == FLAG_OR_NULL and value is None)
        if not ok:
            return key, value, _EXPECTED.get(kind, "true or false" + (" or null" if kind == FLAG_OR_NULL else ""))
    return None


def build(
    *,
    layout: Layout,
    step_count: int,
    param_steps: Sequence[float | None],
    groups: Sequence[dict[str, Any]],
    shards: list[dict],
    durable: bool,
    clean: bool,
    backend: str | None,
    ram_budget: int | None,
    previous: dict[str, Any] | None = None,
    param_scalars: dict[str, list[float | None]] | None = None,
) -> dict[str, Any]:
    """The manifest's content for one commit.

    ``previous`` is the last commit's manifest: its step, steps, groups and
    shard records are kept under ``"previous"`` so that a durable directory
    can also be rolled back one step (the other copy of every shard still
    holds it). Distributed resumes use that to meet at a common step.
    ``param_scalars``: each parameter's scalars besides its step
    (:mod:`tierstore._layout.scalar_record`), recorded only for an algorithm
    that keeps some (NAdam's ``mu_product``): other manifests have no such key.
    """
    rollback = None
    if previous is not None and durable and previous.get("durable"):
        rollback = {k: previous[k] for k in ROLLBACK_KEYS if k in previous}
    scalars = {} if param_scalars is None else {RECORD_KEY: {k: list(v) for k, v in param_scalars.items()}}
    return {
        "previous": rollback,
        "tierstore_version": __version__,
        "fingerprint": layout.fingerprint,
        "layout": layout.to_dict(),
        "step_count": step_count,
        "param_steps": list(param_steps),
        **scalars,
        "param_groups": encode_groups(groups),
        "shards": shards,
        "durable": durable,
        "clean": clean,
        "backend": backend,
        "ram_budget": ram_budget,
        "committed_at": time.time(),
    }


ROLLBACK_KEYS = ("step_count", "param_steps", RECORD_KEY, "param_groups", "shards")


def committed_steps(manifest: dict[str, Any]) -> list[int]:
    """The steps a directory can resume at: its last commit and, when kept, the one before."""
    steps = [int(manifest["step_count"])]
    previous = manifest.get("previous")
    if previous and int(previous["step_count"]) != steps[0]:
        steps.append(int(previous["step_count"]))
    return steps


def at_step(manifest: dict[str, Any], step: int | None, where: str) -> dict[str, Any]:
    """The manifest as of committed ``step`` (``None``: the last commit).

    Rolling back makes every shard point at the copy the previous commit
    named; the other copies' checksums are forgotten (they hold the newer
    step, about to be overwritten).

    Raises
    ------
    CorruptStateError
        If ``step`` is neither the last commit nor the one before it.
    """
    if step is None or int(step) == int(manifest["step_count"]):
        return manifest
    previous = manifest.get("previous")
    if not previous or int(previous["step_count"]) != int(step):
        raise CorruptStateError(
            f"state_dir={where!r} cannot resume at step {step}: it holds steps "
            f"{committed_steps(manifest)} (a durable directory keeps its last commit and the one "
            "before). Resume at one of those"
        )
    rolled = dict(manifest)
    rolled.update({k: previous[k] for k in ROLLBACK_KEYS if k in previous})  # param_scalars: only some algorithms
    rolled["shards"] = [{**rec, "stale_checksum": None} for rec in previous["shards"]]
    rolled["previous"] = None
    return rolled


#: What :func:`Layout.from_dict` may raise on a layout it refuses (wrapped in a CorruptStateError).
_LAYOUT_ERRORS = (TierstoreError, KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError,
                  ZeroDivisionError, RecursionError)  # fmt: skip


def saved_layout(manifest: dict[str, Any], where: str) -> Layout:
    """The layout a manifest describes.

    Raises
    ------
    CorruptStateError
        If the manifest's layout cannot be read or its fingerprint does not match it.
    FormatVersionError
        If it is the state of an optimizer algorithm this tierstore does not know (a newer one wrote it).
    """
    raw = manifest.get("layout")
    if not isinstance(raw, dict):
        raise _invalid(where, "layout", raw, "the layout object tierstore writes")
    try:
        layout = Layout.from_dict(raw)
    except _LAYOUT_ERRORS as exc:
        name = raw.get("algorithm")
        if isinstance(name, str) and name.isidentifier() and len(name) <= 64 and name not in ALGORITHMS:
            raise FormatVersionError(  # a registered name of a newer tierstore (a generic adapter's has a colon)
                f"the state in {where} belongs to the optimizer algorithm {name!r}, which this tierstore "
                f"({__version__}) does not know (it knows {sorted(ALGORITHMS)}); read it with the tierstore that "
                f"wrote it ({short_repr(manifest.get('tierstore_version'))}) or a newer one"
            ) from None
        raise CorruptStateError(
            f"the manifest in {where} has no readable layout ({type(exc).__name__}: {short_repr(str(exc), 300)}); "
            f"{_FIX}"
        ) from exc
    if layout.fingerprint != manifest.get("fingerprint"):
        raise CorruptStateError(
            f"the manifest in {where} does not match its own layout fingerprint "
            f"(fingerprint={short_repr(manifest.get('fingerprint'))}); {_FIX}"
        )
    return layout


# -- checking a manifest read back ------------------------------------------------------------

_FIX = "it was damaged or crafted: restore the state directory from a checkpoint, or start over with an empty state_dir"
#: Step counts a manifest may hold: whole numbers from 0 to 2**53 (every one exact in a double).
MAX_STEP = 1 << 53
_CHECKSUM = re.compile(r"[0-9a-f]{16}")


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to at most ``limit`` characters for a message (the manifest and the state directory quote values with it)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def _invalid(where: str, key: str, value: Any, expected: str) -> CorruptStateError:
    return CorruptStateError(f"the manifest {where} has {key}={short_repr(value)}, expected {expected}; {_FIX}")


def _missing(where: str, key: str) -> CorruptStateError:
    return CorruptStateError(f"the manifest {where} has no {key!r}, which every tierstore manifest holds; {_FIX}")


def _field(record: dict, name: str, where: str, prefix: str) -> Any:
    if name not in record:
        raise _missing(where, prefix + name)
    return record[name]


def _whole(value: Any, key: str, where: str, *, low: int = 0, high: int = MAX_STEP, integral_float: bool = False) -> int:
    """A whole number in ``[low, high]`` (a float with no fraction too, when ``integral_float``); never a bool."""
    expected = f"a whole number from {low} to {high}"
    if isinstance(value, bool):
        raise _invalid(where, key, value, expected)
    if isinstance(value, float) and integral_float and math.isfinite(value) and value.is_integer():
        number = int(value)
    elif isinstance(value, int):
        number = value
    else:
        raise _invalid(where, key, value, expected)
    if not low <= number <= high:
        raise _invalid(where, key, value, expected)
    return number


def _flag(value: Any, key: str, where: str, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise _invalid(where, key, value, "true or false" + (" or null" if optional else ""))


def _number(value: Any, key: str, where: str) -> float:
    """A real number (int or float, not bool) that converts to a float (an int past 1e308 does not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(where, key, value, "a number")
    try:
        return float(value)
    except OverflowError:
        raise _invalid(where, key, value, "a number within the range of a double") from None


def _text(value: Any, key: str, where: str, *, optional: bool = False, limit: int = 256) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or len(value) > limit:
        raise _invalid(where, key, value, f"a string of at most {limit} characters" + (" or null" if optional else ""))


def _checksum(value: Any, key: str, where: str) -> None:
    if value is not None and not (isinstance(value, str) and _CHECKSUM.fullmatch(value)):
        raise _invalid(where, key, value, "null or 16 lowercase hex digits (an xxh3_64 checksum)")


def _list(value: Any, key: str, where: str, length: int | None = None) -> list:
    if not isinstance(value, list):
        raise _invalid(where, key, value, "a list")
    if length is not None and len(value) != length:
        raise CorruptStateError(
            f"the manifest {where} lists {len(value)} entries in {key}, its layout has {length}; {_FIX}"
        )
    return value


def _group(group: Any, key: str, where: str, algorithm: Algorithm) -> None:
    """A param group's hyperparameters: the types tierstore writes, values the algorithm's torch class accepts."""
    if not isinstance(group, dict):
        raise _invalid(where, key, group, "an object of hyperparameters")
    problem = saved_group_problem(group, algorithm)
    if problem is not None:
        name, value, expected = problem
        if value is MISSING:
            raise _missing(where, f"{key}.{name}")
        if isinstance(value, list) and expected == _EXPECTED[PAIR]:
            for k, b in enumerate(value):  # the element that is not a number, named as before
                _number(b, f"{key}.{name}[{k}]", where)
        if expected == _EXPECTED[NUMBER]:
            _number(value, f"{key}.{name}", where)  # says "within the range of a double" for a huge int
        raise _invalid(where, f"{key}.{name}", value, expected)
    try:  # the construction checks the torch class makes, as the optimizer makes them
        algorithm.check_group(algorithm.decode_group(group), f" in {key}")
    except (ConfigError, KeyError, TypeError, ValueError) as exc:  # an algorithm's check of a crafted group
        raise CorruptStateError(
            f"the manifest {where} holds hyperparameters {algorithm.torch_class} refuses: {exc}. {_FIX}"
        ) from None


def _commit(record: dict, prefix: str, layout: Layout, where: str) -> int:
    """One commit's fields (the manifest's own, or its ``previous``); returns its step_count."""
    step = _whole(_field(record, "step_count", where, prefix), f"{prefix}step_count", where)
    steps = _list(_field(record, "param_steps", where, prefix), f"{prefix}param_steps", where, len(layout.params))
    for i, value in enumerate(steps):
        if value is not None:
            _whole(value, f"{prefix}param_steps[{i}]", where, integral_float=True)
    # Each parameter's scalars besides its step (NAdam's mu_product), exactly where the algorithm keeps them.
    check_record(record.get(RECORD_KEY), layout.algorithm.scalar_inits, steps,
                 lambda key, value, expected: _invalid(where, prefix + key, value, expected))  # fmt: skip
    groups = _list(_field(record, "param_groups", where, prefix), f"{prefix}param_groups", where)
    used = max((p.group for p in layout.params), default=-1) + 1
    if len(groups) < used:
        raise CorruptStateError(
            f"the manifest {where} lists {len(groups)} param groups in {prefix}param_groups, its layout "
            f"places parameters in {used}; {_FIX}"
        )
    for g, group in enumerate(groups):
        _group(group, f"{prefix}param_groups[{g}]", where, layout.algorithm)
    shards = _list(_field(record, "shards", where, prefix), f"{prefix}shards", where, len(layout.shards))
    for i, rec in enumerate(shards):
        key = f"{prefix}shards[{i}]"
        if not isinstance(rec, dict):
            raise _invalid(where, key, rec, "an object with copy, checksum, stale_checksum, written_step")
        _whole(_field(rec, "copy", where, f"{key}."), f"{key}.copy", where, high=1)
        _checksum(_field(rec, "checksum", where, f"{key}."), f"{key}.checksum", where)
        _checksum(rec.get("stale_checksum"), f"{key}.stale_checksum", where)
        if "written_step" in rec:
            _whole(rec["written_step"], f"{key}.written_step", where, low=-1, high=step)
    return step


def validate(manifest: dict[str, Any], where: str) -> Layout:
    """Check every field of a manifest read back, before anything uses it; return its layout.

    Types and bounds of every known field: the layout (:meth:`Layout.from_dict`
    and its fingerprint), step counts (whole numbers from 0 to 2**53: never
    negative, NaN, fractional, a bool or huge), every parameter's step, the
    param groups' hyperparameters (accepted only where ``torch.optim.AdamW``'s
    constructor accepts them), each parameter's scalars besides its step where
    the algorithm keeps some (:func:`~tierstore._layout.scalar_record.check_record`:
    finite, one per parameter, null exactly where its step is), one shard record per shard of the layout (copy
    0 or 1, checksums of 16 hex digits, ``written_step`` within the commit's
    steps), and the same for the previous commit kept for a rollback. Keys it
    does not know (a user's own param-group entries) are left as they are.
    ``where`` names the manifest in messages.

    Raises
    ------
    CorruptStateError
        Naming the manifest, the key, its value, what was expected and the fix.

    Example
    -------
    >>> validate({"layout": []}, "/run/manifest.json")
    Traceback (most recent call last):
    ...
    tierstore.errors.CorruptStateError: the manifest /run/manifest.json has layout=[], expected the layout ...
    """
    layout = saved_layout(manifest, where)
    step = _commit(manifest, "", layout, where)
    previous = manifest.get("previous")
    if previous is not None:
        if not isinstance(previous, dict):
            raise _invalid(where, "previous", previous, "null or the previous commit's record")
        if _commit(previous, "previous.", layout, where) > step:
            raise _invalid(where, "previous.step_count", previous["step_count"], f"at most step_count ({step})")
    for name in ("durable", "clean"):
        if name in manifest:
            _flag(manifest[name], name, where)
    _text(manifest.get("backend"), "backend", where, optional=True, limit=64)
    _text(manifest.get("tierstore_version", ""), "tierstore_version", where, limit=64)
    if manifest.get("ram_budget") is not None:
        _whole(manifest["ram_budget"], "ram_budget", where, high=1 << 63)
    if "committed_at" in manifest:
        when = _number(manifest["committed_at"], "committed_at", where)
        if not math.isfinite(when) or when < 0:
            raise _invalid(where, "committed_at", manifest["committed_at"], "a time in seconds since 1970")
    return layout


def check_same_model(saved: Layout, mine: Layout, where: str) -> None:
    """Refuse to reuse state laid out for another model.

    Raises
    ------
    LayoutMismatchError
        Naming the first difference and the fix; state of another optimizer
        algorithm is named with both algorithms.
    """
    if saved.algorithm is not mine.algorithm:
        raise LayoutMismatchError(other_algorithm(f"state_dir={where!r}", saved.algorithm, mine.algorithm))
    if saved.fingerprint != mine.fingerprint and saved.format != mine.format:
        same_otherwise = Layout.from_dict({**mine.to_dict(), "moment_dtype": saved.format.name})
        if same_otherwise.fingerprint == saved.fingerprint:
            raise LayoutMismatchError(
                f"state_dir={where!r} holds moments in moment_dtype={saved.format.name!r}, this optimizer was "
                f"built with moment_dtype={mine.format.name!r}. Pass moment_dtype={saved.format.name!r} to "
                "resume it as it is, or convert it: resume it with its format, save_checkpoint(path), then "
                f"load_checkpoint(path) into a {mine.algorithm.front} with moment_dtype={mine.format.name!r} and another "
                "state_dir (docs/formats.md, 'Converting a state directory')"
            )
    if saved.fingerprint != mine.fingerprint:
        raise LayoutMismatchError(
            f"state_dir={where!r} holds state for another model or configuration: "
            f"{saved.describe_difference(mine)} (fingerprint {mine.fingerprint} vs saved "
            f"{saved.fingerprint}). Pass the same parameters, dtypes and param groups (and "
            "shard_numel/amsgrad/keep_master) as the run that wrote it, or use another state_dir"
        )


def other_algorithm(what: str, saved: Algorithm, mine: Algorithm, fix: str = "") -> str:
    """The message refusing state of another optimizer algorithm: both named, and the fix.

    ``what`` names the state (``"state_dir='/run'"``, ``"checkpoint /ck.zarr"``); ``fix``
    replaces the resume's (build the other front, or use another ``state_dir``).

    Example
    -------
    >>> from tierstore._compute.algorithms.adamw import AdamW
    >>> class SGD(AdamW): name, front, torch_class = "sgd", "TieredSGD", "torch.optim.SGD"
    >>> print(other_algorithm("state_dir='/run'", SGD(), ADAMW))  # doctest: +NORMALIZE_WHITESPACE
    state_dir='/run' holds TieredSGD (sgd) state; this is TieredAdamW (adamw): resume it with a TieredSGD,
    or give TieredAdamW another state_dir (an optimizer resumes only the state of its own algorithm)
    """
    fix = fix or (
        f"resume it with a {saved.front}, or give {mine.front} another state_dir (an optimizer resumes only "
        "the state of its own algorithm)"
    )
    return f"{what} holds {saved.label} state; this is {mine.label}: {fix}"

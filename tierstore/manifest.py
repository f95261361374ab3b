"""What the manifest records and how a resume checks it (no I/O here).

The manifest is the commit record of a state directory: the layout it
belongs to (and its fingerprint), the committed ``step_count``, every
parameter's AdamW step, the param groups' hyperparameters, and for every
shard which copy is committed and its checksum. :class:`~tierstore.statedir.StateDir`
writes it atomically; this module builds its content and reads it back.

Example
-------
>>> groups = [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "name": "decay"}]
>>> encode_groups(groups)
[{'betas': [0.9, 0.999], 'lr': 0.1, 'name': 'decay'}]
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import torch

from ._version import __version__
from .errors import CorruptStateError, LayoutMismatchError
from .layout import Layout


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


def decode_group(saved: dict[str, Any]) -> dict[str, Any]:
    """Inverse of one :func:`encode_groups` entry (``betas`` back to a tuple)."""
    group = dict(saved)
    if "betas" in group:
        group["betas"] = tuple(float(b) for b in group["betas"])
    return group


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
) -> dict[str, Any]:
    """The manifest's content for one commit.

    ``previous`` is the last commit's manifest: its step, steps, groups and
    shard records are kept under ``"previous"`` so that a durable directory
    can also be rolled back one step (the other copy of every shard still
    holds it). Distributed resumes use that to meet at a common step.
    """
    rollback = None
    if previous is not None and durable and previous.get("durable"):
        rollback = {k: previous[k] for k in ROLLBACK_KEYS if k in previous}
    return {
        "previous": rollback,
        "tierstore_version": __version__,
        "fingerprint": layout.fingerprint,
        "layout": layout.to_dict(),
        "step_count": step_count,
        "param_steps": list(param_steps),
        "param_groups": encode_groups(groups),
        "shards": shards,
        "durable": durable,
        "clean": clean,
        "backend": backend,
        "ram_budget": ram_budget,
        "committed_at": time.time(),
    }


ROLLBACK_KEYS = ("step_count", "param_steps", "param_groups", "shards")


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
    rolled.update({k: previous[k] for k in ROLLBACK_KEYS})
    rolled["shards"] = [{**rec, "stale_checksum": None} for rec in previous["shards"]]
    rolled["previous"] = None
    return rolled


def saved_layout(manifest: dict[str, Any], where: str) -> Layout:
    """The layout a manifest describes.

    Raises
    ------
    CorruptStateError
        If the manifest's layout cannot be read or its fingerprint does not match it.
    """
    try:
        layout = Layout.from_dict(manifest["layout"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptStateError(f"the manifest in {where} has no readable layout ({exc})") from exc
    if layout.fingerprint != manifest.get("fingerprint"):
        raise CorruptStateError(f"the manifest in {where} does not match its own layout fingerprint")
    return layout


def check_same_model(saved: Layout, mine: Layout, where: str) -> None:
    """Refuse to reuse state laid out for another model.

    Raises
    ------
    LayoutMismatchError
        Naming the first difference and the fix.
    """
    if saved.fingerprint != mine.fingerprint and saved.format != mine.format:
        same_otherwise = Layout.from_dict({**mine.to_dict(), "moment_dtype": saved.format.name})
        if same_otherwise.fingerprint == saved.fingerprint:
            raise LayoutMismatchError(
                f"state_dir={where!r} holds moments in moment_dtype={saved.format.name!r}, this optimizer was "
                f"built with moment_dtype={mine.format.name!r}. Pass moment_dtype={saved.format.name!r} to "
                "resume it as it is, or convert it: resume it with its format, save_checkpoint(path), then "
                f"load_checkpoint(path) into a TieredAdamW with moment_dtype={mine.format.name!r} and another "
                "state_dir (docs/formats.md, 'Converting a state directory')"
            )
    if saved.fingerprint != mine.fingerprint:
        raise LayoutMismatchError(
            f"state_dir={where!r} holds state for another model or configuration: "
            f"{saved.describe_difference(mine)} (fingerprint {mine.fingerprint} vs saved "
            f"{saved.fingerprint}). Pass the same parameters, dtypes and param groups (and "
            "shard_numel/amsgrad/keep_master) as the run that wrote it, or use another state_dir"
        )

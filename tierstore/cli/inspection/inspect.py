"""``tierstore inspect DIR``: the committed step, layout, bytes and hyperparameters of a state directory or checkpoint.

It prints the committed step, whether the state is clean and durable, the
optimizer algorithm whose state it is (its front, name and torch class), a
layout summary, bytes per tier and the hyperparameters of every param group
(``--json`` for a machine-readable dict). ``DIR`` may also be a zarr
checkpoint. Only the manifest (or the checkpoint's attributes) is read, never
the shards.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(prog="tierstore inspect")
>>> add_arguments(parser)
>>> parser.parse_args(["/tmp/state", "--json"]).json
True
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ...sizes import format_size
from .. import EXIT_OK
from ..paths import input_kind, usage_error

if TYPE_CHECKING:  # the layout imports torch: only once the command runs (inspect --help stays fast)
    from ..._layout.layout import Layout

__all__ = ["add_arguments", "run", "describe_statedir", "describe_checkpoint"]

CORE_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")  # shown first, in this order, where present


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore inspect``."""
    parser.add_argument(
        "dir", help="a tierstore state directory (or a zarr checkpoint); for a state over several drives, its home "
        "(the directory holding the manifest: the others are found where it last saw them)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _plain(value: Any) -> Any:
    """A saved string as it may be printed: escapes shown, never sent to the terminal."""
    return value if not isinstance(value, str) or value.isprintable() else repr(value)


def _number(value: Any) -> float | int | None:
    """A saved number, or ``None`` when it is not a finite number (a crafted file must not break printing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return value


def _layout_summary(layout: Layout, fingerprint: str) -> dict[str, Any]:
    trainable = [p for p in layout.params if p.trainable]
    return {
        "params": len(layout.params),
        "trainable": len(trainable),
        "frozen": len(layout.params) - len(trainable),
        "trainable_numel": layout.trainable_numel,
        "shards": len(layout.shards),
        "shard_numel": layout.shard_numel,
        "total_numel": layout.total_numel,
        "fields": list(layout.fields),
        "moment_dtype": layout.format.name,
        "bytes_per_param": layout.bytes_per_element,
        "fingerprint": fingerprint,
    }


def _algorithm_summary(layout: Layout) -> dict[str, Any]:
    """The optimizer algorithm whose state it is, and its fields in this state (the master is tierstore's own)."""
    algorithm = layout.algorithm
    return {
        "name": algorithm.name,
        "front": algorithm.front,
        "torch_class": algorithm.torch_class,
        "fields": [f for f in layout.fields if f != "master"],
    }


def _groups_summary(groups: list[dict[str, Any]], layout: Layout) -> list[dict[str, Any]]:
    out = []
    for gi, group in enumerate(groups):
        entry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        entry["params"] = sum(1 for p in layout.params if p.group == gi)
        out.append(entry)
    return out


def _steps_summary(steps: list[float | None]) -> dict[str, Any]:
    known = [s for s in steps if s is not None]
    return {"with_state": len(known), "min": min(known, default=None), "max": max(known, default=None)}


def describe_statedir(path: str | os.PathLike) -> dict[str, Any]:
    """What ``tierstore inspect --json`` prints for a state directory.

    Raises
    ------
    CorruptStateError, FormatVersionError
        If the manifest is missing, corrupt or from a newer tierstore.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore import TieredAdamW
    >>> d = tempfile.mkdtemp(); w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> with TieredAdamW([w], state_dir=d) as opt:
    ...     _ = opt.step()
    >>> info = describe_statedir(d); info["step_count"], info["layout"]["trainable"]
    (1, 1)
    """
    from ..._state.statedir import INFLIGHT
    from ...checkpoint import check_manifest_header, open_state_reader

    with open_state_reader(path) as reader:
        m = reader.manifest
        layout = reader.layout
        step_count, param_steps, param_groups = check_manifest_header(reader)
        ram_budget = _number(m.get("ram_budget"))
        committed_at = _number(m.get("committed_at"))
        return {
            "kind": "state_dir",
            "path": str(reader.path),
            "step_count": step_count,
            "committed_at": committed_at if committed_at is not None and committed_at < 1e11 else None,
            "clean": reader.clean,
            "durable": bool(m.get("durable")),
            "interrupted_after_commit": os.path.lexists(reader.path / INFLIGHT),
            "tierstore_version": _plain(m.get("tierstore_version")),
            "format_version": m.get("format_version"),
            "backend": _plain(m.get("backend")),
            "algorithm": _algorithm_summary(layout),
            "moment_dtype": layout.format.name,
            "layout": _layout_summary(layout, layout.fingerprint),
            "bytes": {
                "state_per_copy": layout.state_nbytes,
                "per_full_shard": layout.slot_nbytes,
                "files": reader.file_sizes(),
                "ram_budget": int(ram_budget) if ram_budget is not None else None,
            },
            "param_steps": _steps_summary(param_steps),
            "param_groups": _groups_summary(param_groups, layout),
            **_drives_summary(reader),
        }


def _drives_summary(reader: Any) -> dict[str, Any]:
    """A state over several directories: what each drive holds (its placement), as ``{"drives": [...]}``;
    ``{}`` for one directory (whose output stays what it always was)."""
    record = reader.manifest.get("drives")
    if record is None:
        return {}
    shares = reader.drive_shares()
    for share in shares:
        k = share["index"]
        share["path"] = _plain(share["path"])
        share["backend"] = _plain(record["backends"][k]) if record.get("backends") else None
        share["bandwidth"] = record["bandwidths"][k] if record.get("bandwidths") else None
    return {"drives": shares}


def describe_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """What ``tierstore inspect --json`` prints for a zarr checkpoint.

    Raises
    ------
    CorruptStateError, FormatVersionError
        If the checkpoint cannot be read or is from a newer tierstore.

    Example
    -------
    >>> import tempfile, torch
    >>> from tierstore.checkpoint import state_dict_to_checkpoint
    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> ref = torch.optim.AdamW([w]); ref.step()
    >>> p = tempfile.mkdtemp() + "/c.zarr"; state_dict_to_checkpoint(ref.state_dict(), p)
    >>> describe_checkpoint(p)["source"]
    'torch'
    """
    from ..._layout.layout import Layout
    from ...checkpoint import read_checkpoint_attributes

    attrs = read_checkpoint_attributes(path)  # checked: layout, steps, groups, arrays, every entry a plain file
    layout = Layout.from_dict(attrs["layout"])
    arrays_bytes = 0
    for dirpath, _dirs, files in os.walk(path):  # never follows links (and the check above refused any)
        arrays_bytes += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files if f != "zarr.json")
    return {
        "kind": "checkpoint",
        "path": str(path),
        "step_count": attrs["step_count"],
        "source": _plain(attrs.get("source")),
        "tierstore_version": _plain(attrs.get("tierstore_version")),
        "format_version": attrs["format_version"],
        "checksum": attrs.get("checksum"),
        "arrays": attrs["arrays"],
        "algorithm": _algorithm_summary(layout),
        "moment_dtype": layout.format.name,
        "layout": _layout_summary(layout, layout.fingerprint),
        "bytes": {"state": layout.state_nbytes, "files": arrays_bytes},
        "param_steps": _steps_summary(attrs["param_steps"]),
        "param_groups": _groups_summary([layout.algorithm.decode_group(g) for g in attrs["param_groups"]], layout),
    }


def _format_group(group: dict[str, Any], defaults: dict[str, Any]) -> str:
    """One group's hyperparameters; ``defaults`` (keys the torch class adds to every group) only where they differ."""
    parts = [f"{k}={tuple(group[k]) if isinstance(group[k], list) else group[k]}" for k in CORE_HYPER if k in group]
    for key, value in group.items():
        if key in CORE_HYPER or key == "params" or defaults.get(key, object()) == value:
            continue
        parts.append(f"{_plain(key)}={_plain(value)}")
    return " ".join(parts)


def _print_text(info: dict[str, Any]) -> None:
    lay = info["layout"]
    b = info["bytes"]
    if info["kind"] == "state_dir":
        when = ""
        if info["committed_at"]:
            stamp = datetime.datetime.fromtimestamp(info["committed_at"], tz=datetime.timezone.utc)
            when = f" (committed {stamp:%Y-%m-%d %H:%M:%S} UTC)"
        print(f"state directory {info['path']}")
        print(f"  committed step: {info['step_count']}{when}")
        state = ("clean" if info["clean"] else "DIRTY (a durable=False run did not close; files mix steps)") + (
            ", durable" if info["durable"] else ", not durable"
        )
        print(f"  state: {state}")
        if info["interrupted_after_commit"]:
            print("  note: a step was interrupted after this commit; the committed state above is intact")
        print(f"  written by: tierstore {info['tierstore_version']} (format {info['format_version']}), backend {info['backend']}")
    else:
        print(f"zarr checkpoint {info['path']} (from {info['source']}, checksum {info['checksum']})")
        print(f"  step: {info['step_count']}")
        print(f"  written by: tierstore {info['tierstore_version']} (format {info['format_version']})")
    algo = info["algorithm"]
    print(f"  optimizer: {algo['front']} ({algo['name']}), the state of {algo['torch_class']}: {', '.join(algo['fields']) or 'no fields'}")
    print("layout:")
    print(
        f"  parameters: {lay['params']} ({lay['trainable']} trainable, {lay['frozen']} frozen), "
        f"{lay['trainable_numel']:,} trainable elements"
    )
    moments = "" if lay["moment_dtype"] == "float32" else f" (moments in {lay['moment_dtype']}, {lay['bytes_per_param']:.3g} B/param)"
    print(f"  shards: {lay['shards']} x {lay['shard_numel']:,} elements; fields: {', '.join(lay['fields'])}{moments}")
    print(f"  fingerprint: {lay['fingerprint']}")
    print("bytes:")
    if info["kind"] == "state_dir":
        print(f"  state: {format_size(b['state_per_copy'])} per copy ({format_size(b['per_full_shard'])} per full shard)")
        files = ", ".join(f"{k} {format_size(v)}" for k, v in b["files"].items()) or "none"
        print(f"  files on disk (allocated): {files}")
        budget = "none (all in RAM)" if b["ram_budget"] is None else format_size(b["ram_budget"])
        print(f"  ram_budget of the last run: {budget} (which shards were resident is not recorded)")
        if info.get("drives"):
            print(f"placement: over {len(info['drives'])} drives (by the bandwidths measured when it was created)")
            for d in info["drives"]:
                speed = f", placed at {d['bandwidth'] / 1e6:,.0f} MB/s" if d["bandwidth"] else ""
                print(f"  drive {d['index']}: {d['path']}: {d['shards']} shards, {format_size(d['bytes'])} per copy "
                      f"(backend {d['backend']}{speed})")
    else:
        print(f"  state: {format_size(b['state'])}; chunk files: {format_size(b['files'])}")
    steps = info["param_steps"]
    if steps["with_state"]:
        span = f"{steps['min']:g}" if steps["min"] == steps["max"] else f"{steps['min']:g}..{steps['max']:g}"
        print(f"param steps: {steps['with_state']} parameters with state, step {span}")
    else:
        print("param steps: no parameter has taken a step")
    print("param groups:")
    from ..._compute.algorithms import ALGORITHMS

    algorithm = ALGORITHMS.get(info["algorithm"]["name"])
    defaults = dict(algorithm.group_defaults) if algorithm is not None else {}
    for gi, group in enumerate(info["param_groups"]):
        print(f"  group {gi} ({group['params']} params): {_format_group(group, defaults)}")


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore inspect``: classify the input, describe it, print text or JSON."""
    path = Path(args.dir)
    try:
        kind = input_kind(path, "inspect")
    except ConfigError as exc:
        return usage_error(str(exc))
    info = describe_checkpoint(path) if kind == "checkpoint" else describe_statedir(path)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        _print_text(info)
    return EXIT_OK

"""``tierstore inspect | verify | export | to-torch``: look into a state directory without the model.

Every command stands on :class:`~tierstore._state.reader.StateReader` (the
manifest and the committed copy of each shard, verified) or on a zarr
checkpoint; none needs the optimizer, the model or a GPU.

- ``inspect DIR`` prints the committed step, whether the state is clean and
  durable, a layout summary, bytes per tier and the hyperparameters of every
  param group (``--json`` for a machine-readable dict). ``DIR`` may also be a
  zarr checkpoint.
- ``verify DIR`` checks every checksum of the committed copies (errors) and of
  the intact stale copies (warnings) and prints each problem with its shard
  and file; given a zarr checkpoint, it reads and checks every chunk. Exit status: 0 clean, 1 the committed state (or the manifest) is
  bad, 2 a usage error or missing input (no such directory, a file where a directory is needed),
  3 only stale copies are damaged (the committed state is intact).
- ``export DIR OUT.zarr`` streams the committed state into a zarr checkpoint.
- ``to-torch DIR OUT.pt`` writes a ``torch.optim.AdamW`` state dict (the whole
  state in RAM); ``--from-zarr`` converts a zarr checkpoint instead.

Every input is classified before it is read (:func:`input_kind`): a path that
does not exist, a file where a directory is needed or a directory that is
neither kind is a usage error (exit 2) that names the path; a damaged or
crafted input ends in one line naming the file and exit 1. Outputs are
written beside their target and renamed over it; ``--overwrite`` replaces
only a regular file (``to-torch``) or a tierstore checkpoint (``export``).

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(prog="tierstore verify")
>>> add_verify_arguments(parser)
>>> parser.parse_args(["/tmp/state"]).dir
'/tmp/state'
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .._layout.layout import Layout
from .._state.manifest import decode_group
from .._state.reader import Problem
from .._state.statedir import INFLIGHT, LOCK, MANIFEST
from .._storage.store import STATE_FILES
from ..checkpoint import (
    check_manifest_header,
    checkpoint_to_state_dict,
    export_statedir,
    open_state_reader,
    read_checkpoint_attributes,
    statedir_to_state_dict,
    verify_checkpoint,
    write_output_file,
)
from ..errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptStateError,
    FormatVersionError,
    LayoutMismatchError,
)
from ..sizes import format_size

EXIT_OK = 0
EXIT_ERROR = 1  # a check failed, or the input is damaged
EXIT_CORRUPT = 1  # the committed state or the manifest is bad
EXIT_USAGE = 2  # a usage error or missing input (argparse uses 2 for its own)
EXIT_STALE_ONLY = 3  # only stale copies (the step before the commit) are damaged
#: Errors that mean "the input is damaged" (exit 1), as opposed to usage errors (exit 2).
DAMAGED = (CorruptStateError, FormatVersionError, LayoutMismatchError)
CORE_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
# Keys torch.optim.AdamW adds to every group; shown in text only when not at these values.
_TORCH_KEYS = {"foreach": None, "capturable": False, "differentiable": False, "fused": True, "decoupled_weight_decay": True}


# -- what the input is ----------------------------------------------------------


def input_kind(path: str | os.PathLike, command: str) -> str:
    """``"state_dir"`` or ``"checkpoint"``: what the directory ``path`` holds, before anything in it is read.

    Only names are looked at (``lstat``), so a damaged or crafted directory
    is classified without being read; reading it is then the command's job.

    Raises
    ------
    ConfigError
        If ``path`` does not exist, is not a directory, or holds neither a
        ``manifest.json`` (a state directory) nor a ``zarr.json`` (a zarr
        checkpoint): a usage error (exit 2) that names the path.
    CorruptStateError
        If ``path`` holds shard files but no ``manifest.json``: damaged
        input (exit 1); the message says what is missing and how to restore.

    Example
    -------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "zarr.json").write_text("{}")
    2
    >>> input_kind(d, "inspect")
    'checkpoint'
    """
    path = Path(path)
    wanted = "a tierstore state directory (the state_dir of a TieredAdamW) or a zarr checkpoint"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{command}: {str(path)!r} does not exist; pass {wanted}") from None
    except OSError as exc:
        raise ConfigError(f"{command}: cannot look at {str(path)!r} ({exc.strerror}); pass {wanted}") from exc
    if not stat.S_ISDIR(st.st_mode):
        hint = "; a .pt state dict is read with torch.load" if path.suffix == ".pt" else ""
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a directory"
        raise ConfigError(f"{command}: {str(path)!r} is {kind}, not a directory; pass {wanted}{hint}")
    if os.path.lexists(path / "zarr.json"):
        return "checkpoint"
    if os.path.lexists(path / MANIFEST):
        return "state_dir"
    found = [name for name in STATE_FILES if os.path.lexists(path / name)]
    if found:
        # An optimizer writes the manifest when it is built (step 0), so shard files without one were
        # copied without it or lost it: the shard files alone cannot be read (which copy is committed?).
        raise CorruptStateError(
            f"{command}: {str(path)!r} holds shard files ({', '.join(found)}) but {MANIFEST} is missing, the record of "
            "the committed step and of which copy of each shard holds it, so the shards cannot be read; copy "
            f"{MANIFEST} back from where the directory came from, or restore the state from a zarr checkpoint "
            "(docs/troubleshooting.md, 'Corrupt state')"
        )
    started = os.path.lexists(path / LOCK)
    raise ConfigError(
        f"{command}: {str(path)!r} holds neither {MANIFEST} (a state directory) nor zarr.json (a zarr checkpoint)"
        + (": an optimizer opened it, but no step was committed there" if started else f"; pass {wanted}")
    )


def _plain(value: Any) -> Any:
    """A saved string as it may be printed: escapes shown, never sent to the terminal."""
    return value if not isinstance(value, str) or value.isprintable() else repr(value)


def _number(value: Any) -> float | int | None:
    """A saved number, or ``None`` when it is not a finite number (a crafted file must not break printing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return value


# -- inspect -----------------------------------------------------------------


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="a tierstore state directory (or a zarr checkpoint)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


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
        }


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
        "moment_dtype": layout.format.name,
        "layout": _layout_summary(layout, layout.fingerprint),
        "bytes": {"state": layout.state_nbytes, "files": arrays_bytes},
        "param_steps": _steps_summary(attrs["param_steps"]),
        "param_groups": _groups_summary([decode_group(g) for g in attrs["param_groups"]], layout),
    }


def _format_group(group: dict[str, Any]) -> str:
    parts = [f"{k}={tuple(group[k]) if k == 'betas' else group[k]}" for k in CORE_HYPER if k in group]
    for key, value in group.items():
        if key in CORE_HYPER or key == "params" or _TORCH_KEYS.get(key, object()) == value:
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
    else:
        print(f"  state: {format_size(b['state'])}; chunk files: {format_size(b['files'])}")
    steps = info["param_steps"]
    if steps["with_state"]:
        span = f"{steps['min']:g}" if steps["min"] == steps["max"] else f"{steps['min']:g}..{steps['max']:g}"
        print(f"param steps: {steps['with_state']} parameters with state, AdamW step {span}")
    else:
        print("param steps: no parameter has taken a step")
    print("param groups:")
    for gi, group in enumerate(info["param_groups"]):
        print(f"  group {gi} ({group['params']} params): {_format_group(group)}")


def run_inspect(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    try:
        kind = input_kind(path, "inspect")
    except ConfigError as exc:
        return _usage(str(exc))
    info = describe_checkpoint(path) if kind == "checkpoint" else describe_statedir(path)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        _print_text(info)
    return EXIT_OK


# -- verify ------------------------------------------------------------------


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="a tierstore state directory (or a zarr checkpoint)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.epilog = (
        "exit status: 0 clean; 1 the committed state or manifest is corrupt; 2 usage error or missing input "
        "(no such directory, a file where a directory is needed); 3 only stale copies are damaged"
    )


def _verify_checkpoint(path: Path, no_progress: bool) -> int:
    try:
        info = read_checkpoint_attributes(path)
    except DAMAGED as exc:
        print(f"error: {exc}")
        return EXIT_CORRUPT
    total = Layout.from_dict(info["layout"]).state_nbytes  # each field's arrays, in its format
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=True if no_progress else None, file=sys.stderr) as bar:
        problems = verify_checkpoint(path, progress=bar.update)
    for problem in problems:
        print(f"error: {problem}")
    if problems:
        print(f"{len(problems)} damaged chunk(s) in {path}; write the checkpoint again")
        return EXIT_CORRUPT
    if info.get("checksum") is None:
        print(f"ok: {path} has every chunk (it was written without checksums, so their bytes cannot be checked)")
    else:
        arrays = len(info["arrays"]) + len(info.get("scale_arrays") or {})  # int8 moments have a scales array each
        print(f"ok: step {info['step_count']}, every chunk of {arrays} arrays matches its {info['checksum']} checksum")
    return EXIT_OK


def run_verify(args: argparse.Namespace) -> int:
    path = Path(args.dir)
    from .verify_trainer import (
        verify_trainer_checkpoints,  # trainer checkpoint folders (tierstore/integrations)
    )

    if (trainer_code := verify_trainer_checkpoints(path)) is not None:
        return trainer_code
    try:
        kind = input_kind(path, "verify")
    except ConfigError as exc:
        return _usage(str(exc))
    except DAMAGED as exc:  # shard files without a manifest: reported as verify reports damage
        print(f"error: {exc}")
        return EXIT_CORRUPT
    if kind == "checkpoint":
        return _verify_checkpoint(path, args.no_progress)
    try:
        reader = open_state_reader(path)
    except DAMAGED as exc:
        print(f"error: {exc}")
        return EXIT_CORRUPT
    with reader:
        if not reader.clean:
            print(
                f"error: {path} was left dirty by a durable=False run that did not close(); its files mix "
                "steps, so no checksum can match. Start over from a checkpoint"
            )
            return EXIT_CORRUPT
        with tqdm(total=reader.verify_nbytes(), unit="B", unit_scale=True, desc="verify", disable=True if args.no_progress else None, file=sys.stderr) as bar:
            reader.progress = bar.update
            problems: list[Problem] = reader.verify()
        for problem in problems:
            print(problem)
        errors = sum(p.severity == "error" for p in problems)
        warnings = len(problems) - errors
        shards = len(reader.layout.shards)
        if errors:
            print(
                f"{errors} error(s), {warnings} warning(s) in {shards} shards: the committed state of step "
                f"{reader.step_count} is corrupt; restore {path} from a checkpoint"
            )
            return EXIT_CORRUPT
        if warnings:
            print(
                f"{warnings} warning(s): stale copies (the step before {reader.step_count}) are damaged; the "
                f"committed state of step {reader.step_count} is intact ({shards} shards verified)"
            )
            return EXIT_STALE_ONLY
        print(f"ok: step {reader.step_count}, {shards} shards, every checksum matches")
        return EXIT_OK


# -- export / to-torch -----------------------------------------------------------


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="a tierstore state directory")
    parser.add_argument("out", help="the zarr v3 checkpoint to create, e.g. step1000.zarr")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at OUT")
    parser.add_argument(
        "--checksum",
        choices=("xxh3", "crc32c", "none"),
        default="xxh3",
        help="per-chunk checksum: xxh3 in the attributes (default, fastest) or zarr's crc32c codec",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _error(message: str) -> int:
    print(f"tierstore: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _usage(message: str) -> int:
    print(f"tierstore: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _flag_text(exc: Exception) -> str:
    """The library speaks of its keyword argument; on the command line the fix is a flag."""
    return str(exc).replace("overwrite=True", "--overwrite")


def run_export(args: argparse.Namespace) -> int:
    try:
        kind = input_kind(args.dir, "export")
    except ConfigError as exc:
        return _usage(str(exc))
    if kind == "checkpoint":
        return _usage(
            f"{args.dir} is already a zarr checkpoint; export reads a state directory (tierstore verify checks a "
            "checkpoint, tierstore to-torch --from-zarr converts one)"
        )
    problem = _check_export_output(Path(args.dir), Path(args.out), args.overwrite)
    if problem:
        return _usage(problem)
    with open_state_reader(args.dir) as reader:
        total = reader.layout.state_nbytes
    checksum = None if args.checksum == "none" else args.checksum
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=True if args.no_progress else None, file=sys.stderr) as bar:
            export_statedir(args.dir, args.out, overwrite=args.overwrite, checksum=checksum, progress=bar.update)
    except CheckpointExistsError as exc:
        return _usage(_flag_text(exc))
    print(f"exported {args.dir} to {args.out}")
    return EXIT_OK


def add_to_torch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a tierstore state directory (or, with --from-zarr, a zarr checkpoint)")
    parser.add_argument("out", help="the .pt file to write (torch.save of a torch.optim.AdamW state dict)")
    parser.add_argument("--from-zarr", action="store_true", help="SRC is a zarr checkpoint, not a state directory")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it is a regular file")


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def _parent_problem(out: Path) -> str | None:
    """Why no file can be created at ``out`` (which does not exist), or ``None``: its directory must be one."""
    parent = out.parent
    if parent.is_dir():
        return None
    for above in (parent, *parent.parents):  # the nearest part of the path that exists says what is wrong
        try:
            st = os.stat(above)
        except (FileNotFoundError, NotADirectoryError):
            continue
        if not stat.S_ISDIR(st.st_mode):
            return (
                f"cannot write {out}: {above} is {_kind_of(st.st_mode)}, not a directory; pass an OUT inside "
                "an existing directory"
            )
        break
    return f"the directory of {out} ({parent}) does not exist; create it (mkdir -p {parent}) or pass another OUT"


def _check_output(out: Path, overwrite: bool, src: Path | None = None) -> str | None:
    """Why ``to-torch`` cannot write the file ``out`` (checked before the state is read), or ``None``.

    The advice names ``--overwrite`` only where it would work: it replaces a
    regular file, never a directory or a special file.

    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> _check_output(d, overwrite=False).endswith(f"pass a file path such as {d / 'state.pt'} or {d}.pt")
    True
    """
    try:
        st = os.lstat(out)
    except (FileNotFoundError, NotADirectoryError):
        return _parent_problem(out)
    if stat.S_ISDIR(st.st_mode):
        if src is not None and os.path.lexists(src) and os.path.samefile(src, out):
            return f"{out} is the directory being converted; pass the .pt file to write, such as {out}.pt"
        return (
            f"{out} is a directory; to-torch writes one .pt file and never replaces a directory (--overwrite "
            f"replaces only a regular file): pass a file path such as {out / 'state.pt'} or {out}.pt"
        )
    if not stat.S_ISREG(st.st_mode):
        return (
            f"{out} exists and is {_kind_of(st.st_mode)}, not a regular file, so --overwrite will not replace it; "
            "remove it yourself or pass another OUT"
        )
    if not overwrite:
        return f"{out} exists; pass --overwrite to replace it, or choose another OUT"
    return None


def _check_export_output(src: Path, out: Path, overwrite: bool) -> str | None:
    """Why ``export`` cannot write the checkpoint ``out`` (before the state is read), or ``None``.

    ``--overwrite`` replaces only a tierstore checkpoint, so the advice names
    it only for a directory that holds a ``zarr.json``; the library checks the
    rest (that it is tierstore's) when it writes.
    """
    try:
        st = os.lstat(out)
    except (FileNotFoundError, NotADirectoryError):
        return _parent_problem(out)
    other = out.with_name(out.stem + "-2.zarr") if out.suffix == ".zarr" else out.with_name(out.name + ".zarr")
    with_name = f"pass a new path for the checkpoint, such as {other}"
    if stat.S_ISDIR(st.st_mode) and os.path.samefile(src, out):
        return f"{out} is the state directory being exported; {with_name}"
    if not stat.S_ISDIR(st.st_mode) or not os.path.lexists(out / "zarr.json"):
        what = "a directory that is not a zarr checkpoint" if stat.S_ISDIR(st.st_mode) else _kind_of(st.st_mode)
        return (
            f"{out} exists and is {what}, so --overwrite will not replace it (it replaces only a tierstore "
            f"checkpoint); remove it yourself or {with_name}"
        )
    if not overwrite:
        return f"checkpoint {out} exists; pass --overwrite to replace it, or choose another OUT"
    return None


def run_to_torch(args: argparse.Namespace) -> int:
    import torch

    out = Path(args.out)
    problem = _check_output(out, args.overwrite, Path(args.src))
    if problem:
        return _usage(problem)
    try:
        kind = input_kind(args.src, "to-torch")
    except ConfigError as exc:
        return _usage(str(exc))
    if not args.from_zarr and kind == "checkpoint":
        return _usage(f"{args.src} is a zarr checkpoint, not a state directory; pass --from-zarr to convert it")
    if args.from_zarr and kind == "state_dir":
        return _usage(f"{args.src} is a state directory, not a zarr checkpoint; drop --from-zarr to convert it")
    state_dict = checkpoint_to_state_dict(args.src) if args.from_zarr else statedir_to_state_dict(args.src)
    try:
        write_output_file(out, lambda f: torch.save(state_dict, f), overwrite=args.overwrite)
    except CheckpointExistsError as exc:
        return _usage(_flag_text(exc))
    print(f"wrote {out}: {len(state_dict['state'])} parameter states, {len(state_dict['param_groups'])} param groups")
    return EXIT_OK

"""``tierstore verify DIR``: check every checksum of a state directory, a zarr checkpoint or trainer checkpoints.

Given a state directory it checks every checksum of the committed copies
(errors) and of the intact stale copies (warnings) and prints each problem
with its shard and file; given a zarr checkpoint, it reads and checks every
chunk (a clean one is reported with the optimizer algorithm whose state it holds); given a trainer's ``checkpoint-N/`` folder (or the folder holding
them), every snapshot (:mod:`tierstore.cli.verify_trainer`). Exit status: 0
clean, 1 the committed state (or the manifest) is bad, 2 a usage error or
missing input (no such directory, a file where a directory is needed), 3
only stale copies are damaged (the committed state is intact).

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(prog="tierstore verify")
>>> add_arguments(parser)
>>> parser.parse_args(["/tmp/state"]).dir
'/tmp/state'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...errors import ConfigError, CorruptStateError, FormatVersionError, LayoutMismatchError
from .. import EXIT_FAILED, EXIT_OK
from ..paths import input_kind, usage_error

__all__ = ["add_arguments", "run", "EXIT_CORRUPT", "EXIT_STALE_ONLY", "DAMAGED"]

EXIT_CORRUPT = EXIT_FAILED  # the committed state or the manifest is bad
EXIT_STALE_ONLY = 3  # only stale copies (the step before the commit) are damaged
#: Errors that mean "the input is damaged" (exit 1), as opposed to usage errors (exit 2).
DAMAGED = (CorruptStateError, FormatVersionError, LayoutMismatchError)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore verify``."""
    parser.add_argument("dir", help="a tierstore state directory (or a zarr checkpoint)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.epilog = (
        "exit status: 0 clean; 1 the committed state or manifest is corrupt; 2 usage error or missing input "
        "(no such directory, a file where a directory is needed); 3 only stale copies are damaged"
    )


def _bar(total: int, no_progress: bool):  # noqa: ANN202 - a tqdm bar
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=True if no_progress else None, file=sys.stderr)


def _verify_checkpoint(path: Path, no_progress: bool) -> int:
    from ..._layout.layout import Layout
    from ...checkpoint import read_checkpoint_attributes, verify_checkpoint

    try:
        info = read_checkpoint_attributes(path)
    except DAMAGED as exc:
        print(f"error: {exc}")
        return EXIT_CORRUPT
    layout = Layout.from_dict(info["layout"])
    total = layout.state_nbytes  # each field's arrays, in its format
    with _bar(total, no_progress) as bar:
        problems = verify_checkpoint(path, progress=bar.update)
    for problem in problems:
        print(f"error: {problem}")
    if problems:
        print(f"{len(problems)} damaged chunk(s) in {path}; write the checkpoint again")
        return EXIT_CORRUPT
    if info.get("checksum") is None:
        print(f"ok: {path} has every chunk of its {layout.algorithm.label} state (it was written without checksums, so "
              "their bytes cannot be checked)")  # fmt: skip
    else:
        arrays = len(info["arrays"]) + len(info.get("scale_arrays") or {})  # int8 moments have a scales array each
        print(f"ok: step {info['step_count']} of {layout.algorithm.label} state ({', '.join(info['arrays'])}), every "
              f"chunk of {arrays} arrays matches its {info['checksum']} checksum")  # fmt: skip
    return EXIT_OK


def _verify_statedir(path: Path, no_progress: bool) -> int:
    from ...checkpoint import open_state_reader

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
        with _bar(reader.verify_nbytes(), no_progress) as bar:
            reader.progress = bar.update
            problems = reader.verify()
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
        print(f"ok: step {reader.step_count} of {reader.layout.algorithm.label} state, {shards} shards, every checksum matches")
        return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore verify``: trainer checkpoints, a zarr checkpoint or a state directory, by what ``DIR`` holds."""
    # Trainer checkpoint folders (tierstore/integrations) first: a checkpoint-N/ folder holds neither kind.
    from ..verify_trainer import verify_trainer_checkpoints

    path = Path(args.dir)
    if (trainer_code := verify_trainer_checkpoints(path)) is not None:
        return trainer_code
    try:
        kind = input_kind(path, "verify")
    except ConfigError as exc:
        return usage_error(str(exc))
    except DAMAGED as exc:  # shard files without a manifest: reported as verify reports damage
        print(f"error: {exc}")
        return EXIT_CORRUPT
    if kind == "checkpoint":
        return _verify_checkpoint(path, args.no_progress)
    return _verify_statedir(path, args.no_progress)

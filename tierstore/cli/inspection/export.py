"""``tierstore export DIR OUT.zarr``: stream the committed state of a state directory into a zarr v3 checkpoint.

The output is checked before the state is read
(:func:`~tierstore.cli.paths.checkpoint_output_problem`); the checkpoint is
written beside ``OUT`` and renamed over it, and ``--overwrite`` replaces only
a tierstore checkpoint.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(prog="tierstore export")
>>> add_arguments(parser)
>>> parser.parse_args(["/tmp/state", "step1000.zarr"]).checksum
'xxh3'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...errors import CheckpointExistsError, ConfigError
from .. import EXIT_OK
from ..paths import checkpoint_output_problem, flag_text, input_kind, usage_error

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore export``."""
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


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore export``: check the input and the output, then stream the state shard by shard."""
    try:
        kind = input_kind(args.dir, "export")
    except ConfigError as exc:
        return usage_error(str(exc))
    if kind == "checkpoint":
        return usage_error(
            f"{args.dir} is already a zarr checkpoint; export reads a state directory (tierstore verify checks a "
            "checkpoint, tierstore to-torch --from-zarr converts one)"
        )
    problem = checkpoint_output_problem(Path(args.dir), Path(args.out), args.overwrite)
    if problem:
        return usage_error(problem)
    from tqdm import tqdm

    from ...checkpoint import export_statedir, open_state_reader

    with open_state_reader(args.dir) as reader:
        total = reader.layout.state_nbytes
    checksum = None if args.checksum == "none" else args.checksum
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=True if args.no_progress else None, file=sys.stderr) as bar:
            export_statedir(args.dir, args.out, overwrite=args.overwrite, checksum=checksum, progress=bar.update)
    except CheckpointExistsError as exc:
        return usage_error(flag_text(exc))
    print(f"exported {args.dir} to {args.out}")
    return EXIT_OK

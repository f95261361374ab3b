"""``tierstore move SRC... --to DST...``: a state onto another set of drives (more, fewer, others).

The state is streamed shard by shard within ``--ram-budget`` (the reader's
buffer and a few arena slots of the largest shard), each shard verified by
its checksum as it is read, written to the drive the destination's placement
gives it (by ``--bandwidths``, else a quick probe of each destination drive),
read back and checked (unless ``--no-verify``), then committed in the
destination by its manifest. The source is locked while it is read, never
written: a move killed at any moment leaves it resumable as it was, and the
destination without a state (a new move into it starts over).

``SRC`` is the state's home directory (its other drives are found where its
manifest recorded them), or all of its directories, home first. Each ``DST``
is missing or empty (or holds what a killed move left); the first becomes
the new home. A one-directory destination is a plain state directory.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser(prog="tierstore move")
>>> add_arguments(parser)
>>> args = parser.parse_args(["/nvme0/run", "--to", "/nvme1/run", "/nvme2/run"])
>>> args.src, args.to
(['/nvme0/run'], ['/nvme1/run', '/nvme2/run'])
"""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from . import EXIT_OK
from .paths import input_kind, usage_error

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``tierstore move``."""
    parser.add_argument("src", nargs="+", help="the state: its home directory, or all of its directories, home first")
    parser.add_argument("--to", nargs="+", required=True, metavar="DST",
                        help="the new directories, one per drive, the new home first: missing or empty")  # fmt: skip
    parser.add_argument("--ram-budget", default="256MiB", help="RAM for the shards in flight (default 256MiB)")
    parser.add_argument("--bandwidths", nargs="+", type=float, metavar="BYTES_PER_S",
                        help="each destination drive's bandwidth (write then read), e.g. 3e9 1.5e9; default: a quick probe")  # fmt: skip
    parser.add_argument("--backend", default="auto", choices=("auto", "direct", "buffered", "mmap"),
                        help="how the destination's files are written (default auto, per drive)")  # fmt: skip
    parser.add_argument("--io-workers", type=int, default=4, help="I/O threads per drive and direction (default 4)")
    parser.add_argument("--no-verify", action="store_true", help="do not read the destination back before committing it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``tierstore move``: check the paths, stream the state, print what each drive holds now."""
    try:
        kind = input_kind(args.src[0], "move")
    except ConfigError as exc:
        return usage_error(str(exc))
    if kind != "state_dir":
        return usage_error(f"move: {args.src[0]!r} is a zarr checkpoint; move takes a state directory (load_checkpoint "
                           "into an optimizer with the new state_dir converts a checkpoint)")  # fmt: skip
    from tqdm import tqdm

    from .._config.registry import check_int
    from .._state.move import move_state
    from .._state.reader import StateReader
    from ..sizes import format_size, parse_size

    budget = parse_size(args.ram_budget)
    check_int("--io-workers", args.io_workers, 1)
    with StateReader(args.src if len(args.src) > 1 else args.src[0]) as reader:
        total = reader.layout.state_nbytes * (1 if args.no_verify else 2)
    with tqdm(total=total, unit="B", unit_scale=True, desc="move", disable=True if args.no_progress else None,
              file=sys.stderr) as bar:  # fmt: skip
        moved = move_state(args.src, args.to, ram_budget=budget, backend=args.backend, bandwidths=args.bandwidths,
                           io_workers=args.io_workers, verify=not args.no_verify, progress=bar.update)  # fmt: skip
    checked = "written, read back and verified" if moved.verified else "written and checksummed"
    print(f"moved step {moved.step_count}: {moved.shards} shards, {format_size(moved.nbytes)} {checked} in "
          f"{moved.seconds:.1f} s ({moved.slots} slots in flight); the source is untouched")  # fmt: skip
    for k, (path, nbytes) in enumerate(zip(args.to, moved.drive_bytes)):
        print(f"  drive {k}{' (home)' if k == 0 else ''}: {path}: {format_size(nbytes)}")
    print(f"resume with state_dir={args.to if len(args.to) > 1 else args.to[0]!r}")
    return EXIT_OK

"""The drives ``tierstore plan`` is given: ``--drive PATH_OR_NAME[:SIZE[:READ[/WRITE]]]``, figures filled in from files.

Each ``--drive`` names one drive of a state over several directories, in
the order ``state_dir`` would list them:

- ``PATH_OR_NAME``: the directory the state would use on it (its free space
  is read there, or at its nearest existing parent), or just a name;
- ``SIZE``: its free space (``3.5TB``, ``800GiB``); empty or ``-``: read at
  the path;
- ``READ[/WRITE]``: its bandwidth in GB/s, read and write (one number: both).

A speed not given is taken from measurements, matched by directory (the
drive's path, or a directory under one measured): a ``tierstore bench io DIR
DIR... --json`` file (``summary.drives``), then a ``tierstore tune`` knobs
file. Nothing here imports torch.

Example
-------
>>> parse_drive("/nvme0/run:3.5TB:7/5")
DriveSpec(name='/nvme0/run', free=3500000000000, read_gbps=7.0, write_gbps=5.0)
>>> parse_drive("slow-sata::0.5")
DriveSpec(name='slow-sata', free=None, read_gbps=0.5, write_gbps=0.5)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from .inputs import disk_free, existing_ancestor, parse_nbytes, parse_rate, read_io_json_drives
from .results import DriveSpec

__all__ = ["parse_drive", "resolve_drives", "SPEC_HELP"]

SPEC_HELP = "PATH_OR_NAME[:SIZE[:READ[/WRITE]]], e.g. /nvme0/run:3.5TB:7/5 (GB/s; SIZE empty: read at PATH)"


def parse_drive(spec: str) -> DriveSpec:
    """One ``--drive`` value as a :class:`~tierstore.planner.results.DriveSpec` (free space and speeds as given).

    Raises
    ------
    ConfigError
        Naming the value and the form it should take.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"--drive {spec!r} is empty; give {SPEC_HELP}")
    parts = spec.split(":")
    if len(parts) > 3:  # a path with colons: the last two fields are size and speed
        parts = [":".join(parts[:-2]), parts[-2], parts[-1]]
    name, size, speed = (parts + [""] * 3)[:3]
    if not name:
        raise ConfigError(f"--drive {spec!r} names no drive; give {SPEC_HELP}")
    free = None if size.strip() in ("", "-") else parse_nbytes(size.strip(), f"--drive {spec!r}: SIZE", allow_zero=True)
    read = write = None
    if speed.strip():
        halves = speed.split("/")
        if len(halves) > 2:
            raise ConfigError(f"--drive {spec!r}: the speed {speed!r} must be READ or READ/WRITE in GB/s, e.g. 7/5")
        read = parse_rate(halves[0].strip(), f"--drive {spec!r}: READ")
        write = parse_rate(halves[-1].strip(), f"--drive {spec!r}: WRITE")
    return DriveSpec(name, free, read, write)


def _inside(directory: str, measured: str) -> bool:
    where, root = os.path.abspath(directory), os.path.abspath(measured).rstrip("/")
    return where == root or where.startswith(root + "/")


def resolve_drives(specs: Sequence[str], *, io_json: str | None = None, knobs: str | None = None) -> list[DriveSpec]:
    """The ``--drive`` values, each with its free space read at its path and its speeds from the files when not given.

    With no ``--drive`` but an ``io_json`` of several drives, those drives.

    Raises
    ------
    ConfigError
        For a malformed value, or a file that cannot be read.

    Example
    -------
    >>> import tempfile
    >>> [d.free > 0 for d in resolve_drives([tempfile.gettempdir() + "::2/1"])]
    [True]
    """
    measured: list[tuple[str, float | None, float | None]] = list(read_io_json_drives(io_json)) if io_json else []
    if not specs and len(measured) > 1:
        specs = [where for where, _, _ in measured]
    tuned = None
    if knobs:
        from .._config.knobs_file import read_knobs_file

        tuned = read_knobs_file(knobs)
    out = []
    for spec in specs:
        drive = parse_drive(spec)
        looks_like_path = "/" in drive.name or Path(drive.name).exists()
        if drive.free is None and looks_like_path:
            drive = dataclasses.replace(drive, free=disk_free(existing_ancestor(drive.name)))
        if drive.read_gbps is None:
            found = next(((r, w) for where, r, w in measured if _inside(drive.name, where)), None)
            if found is None and tuned is not None:
                figure = next((d for d in tuned.drives if _inside(drive.name, d.path)), None)
                if figure is not None:  # read+write bandwidth alone: as equal read and write speeds
                    both = 2 * figure.bandwidth / 1e9
                    found = ((figure.read_bandwidth or 0) / 1e9 or both, (figure.write_bandwidth or 0) / 1e9 or both)
            if found is not None:
                drive = dataclasses.replace(drive, read_gbps=found[0], write_gbps=found[1])
        out.append(drive)
    return out

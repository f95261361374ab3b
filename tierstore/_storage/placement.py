"""Which drive holds each shard of a state spread over several directories (pure arithmetic, no I/O).

A state over several drives streams each step's shards from all of them at
once, so a step takes as long as the slowest drive needs for its share.
:func:`place` gives each drive a share of the bytes proportional to its
bandwidth (bytes per second to read a byte back and write it again: what one
step does with a streamed shard), so every drive finishes its share at about the
same time, and deals the shards out in layout order: a step streams shards in
that order, so consecutive shards sit on different drives and every drive
stays busy. Equal drives get the shards round robin.

Each drive's state files hold its own shards back to back, in layout order
(:func:`drive_offsets`), so a one-drive placement lays the files out exactly
as a single state directory always did.

The placement is decided once, when a state is created, and recorded in its
manifest; it is part of the state's identity (a resume keeps it), while the
bandwidths it was computed from are resources only (they come from
:func:`tierstore._storage.drive_speed.probe_drives`, which gives directories
on one drive equal parts of its figure, or from figures a caller passes).

Example
-------
>>> place([100] * 6, [1.0, 1.0])
[0, 1, 0, 1, 0, 1]
>>> place([100] * 6, [2e9, 1e9])  # twice as fast: twice the bytes
[0, 0, 1, 0, 0, 1]
>>> drive_offsets([100] * 6, [0, 0, 1, 0, 0, 1], drives=2)
([0, 100, 0, 200, 300, 100], [400, 200])
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from fractions import Fraction

from ..errors import ConfigError, ConfigTypeError

__all__ = ["MAX_DRIVES", "place", "check_bandwidths", "drive_offsets", "drive_bytes", "check_placement"]

#: The most directories one state may span (a GPU server carries 4 to 8 drives; 64 leaves room).
MAX_DRIVES = 64


def check_bandwidths(bandwidths: Sequence[float], *, drives: int | None = None, name: str = "bandwidths") -> tuple[float, ...]:
    """``bandwidths`` as a tuple of floats: one positive, finite number of bytes/s per drive.

    Raises
    ------
    ConfigTypeError
        If it is not a sequence of numbers (a bool is no number).
    ConfigError
        If it is empty, has more than :data:`MAX_DRIVES` entries or not ``drives``
        of them, or holds a value that is not positive and finite; the message
        names the value and the fix.

    Example
    -------
    >>> check_bandwidths([2e9, 5e8])
    (2000000000.0, 500000000.0)
    >>> check_bandwidths([1e9, 0])
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigError: bandwidths[1]=0 must be a positive, finite number of bytes per second, e.g. 2e9
    """
    if isinstance(bandwidths, (str, bytes)) or not isinstance(bandwidths, Sequence):
        raise ConfigTypeError(
            f"{name}={bandwidths!r} must be a list of bytes per second, one per drive, e.g. [2e9, 1e9]"
        )
    if not 1 <= len(bandwidths) <= MAX_DRIVES:
        raise ConfigError(f"{name} lists {len(bandwidths)} drives; give one bandwidth per drive, 1 to {MAX_DRIVES}")
    if drives is not None and len(bandwidths) != drives:
        raise ConfigError(
            f"{name} lists {len(bandwidths)} bandwidths for {drives} directories; give one per directory, in the "
            "same order"
        )
    out = []
    for k, value in enumerate(bandwidths):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigTypeError(f"{name}[{k}]={value!r} must be a number of bytes per second, e.g. 2e9")
        number = float(value)
        if not (math.isfinite(number) and number > 0):
            raise ConfigError(f"{name}[{k}]={value!r} must be a positive, finite number of bytes per second, e.g. 2e9")
        out.append(number)
    return tuple(out)


def place(shard_nbytes: Sequence[int], bandwidths: Sequence[float], *, devices: Sequence[Hashable] | None = None) -> list[int]:
    """The directory of each shard: bytes per drive proportional to its bandwidth, shards interleaved in order.

    Each shard, in layout order, goes to the drive that would finish its
    share soonest with it: the drive ``d`` with the least
    ``(bytes_d + nbytes) / bandwidths[d]`` (the lowest index on a tie). Every
    drive's bytes then stay within one shard of its proportional share, and a
    run of shards streamed in order alternates between drives as their
    speeds allow. Deterministic: the same sizes and bandwidths give the same
    placement.

    ``devices``: the drive each directory is on (any hashable, e.g. its
    ``st_dev``; default: each its own). Directories on one drive add their
    bandwidths into that drive's, the shards are dealt to the drives as
    above, and a drive's shards go to its directories in runs, in layout
    order, each directory's run its share of the drive's bytes: a step then
    streams one file at a time from that drive, as from a single directory.
    (Alternating between two files on one drive made a streamed step 1.18x
    slower than one directory on the 2-vCPU VM's virtual disk; runs: 1.01x.)

    Raises
    ------
    ConfigError, ConfigTypeError
        If ``bandwidths`` is not one positive, finite number per directory
        (:func:`check_bandwidths`), ``devices`` does not name one drive per
        directory, or a shard size is negative.

    Example
    -------
    >>> place([4096] * 4, [1e9])
    [0, 0, 0, 0]
    >>> place([4096] * 8, [3e9, 1e9, 1e9])
    [0, 0, 0, 1, 2, 0, 0, 0]
    >>> place([4096] * 8, [1e9, 1e9, 2e9], devices=["disk", "disk", "nvme"])  # the disk's two: a run each
    [0, 2, 0, 2, 1, 2, 1, 2]
    """
    speeds = check_bandwidths(bandwidths)
    for index, nbytes in enumerate(shard_nbytes):
        if nbytes < 0:
            raise ConfigError(f"shard {index} has {nbytes} bytes; a shard's size is never negative")
    if devices is None:
        devices = range(len(speeds))
    elif isinstance(devices, (str, bytes)) or len(devices) != len(speeds):
        raise ConfigError(f"devices={devices!r} must name the drive of each of the {len(speeds)} directories")
    members: dict[Hashable, list[int]] = {}
    for k, device in enumerate(devices):
        members.setdefault(device, []).append(k)
    groups = list(members.values())  # each drive's directories, drives in the order of their first directory
    drive_of = _deal(shard_nbytes, [sum(speeds[k] for k in group) for group in groups])
    out = [0] * len(shard_nbytes)
    for g, group in enumerate(groups):
        mine = [i for i, d in enumerate(drive_of) if d == g]
        total, weight = sum(shard_nbytes[i] for i in mine), sum(Fraction(speeds[k]) for k in group)
        # Where each directory's run ends in the drive's bytes (its share, the ones before it added), doubled and
        # rounded down, in exact arithmetic: a shard whose middle falls on an end goes the same way whatever the
        # figures' scale (two directories at [f, f] place as at [1, 1]; floats rounded total * f / 2f either way).
        limits = [math.floor(2 * total * sum(Fraction(speeds[k]) for k in group[: j + 1]) / weight)
                  for j in range(len(group))]  # fmt: skip
        done, j = 0, 0
        for i in mine:
            # A shard goes where its middle falls: done + size / 2 > end  <=>  2 * done + size > floor(2 * end).
            while j < len(group) - 1 and 2 * done + shard_nbytes[i] > limits[j]:
                j += 1
            out[i] = group[j]
            done += shard_nbytes[i]
    return out


def _deal(shard_nbytes: Sequence[int], speeds: Sequence[float]) -> list[int]:
    """Each shard, in order, to the drive that would finish its share soonest with it (:func:`place`)."""
    if len(speeds) == 1:
        return [0] * len(shard_nbytes)
    drives = range(len(speeds))
    load = [0] * len(speeds)
    out: list[int] = []
    for nbytes in shard_nbytes:
        best = min(drives, key=lambda d: ((load[d] + nbytes) / speeds[d], d))
        load[best] += nbytes
        out.append(best)
    return out


def check_placement(placement: Sequence[int], *, shards: int, drives: int) -> list[int]:
    """``placement`` as a list, if it names a drive in ``[0, drives)`` for each of ``shards`` shards.

    Raises
    ------
    ConfigError
        Naming the first entry that is not a drive index, or the count.

    Example
    -------
    >>> check_placement([0, 1, 1], shards=3, drives=2)
    [0, 1, 1]
    """
    if len(placement) != shards:
        raise ConfigError(f"the placement names a drive for {len(placement)} shards, the layout has {shards}")
    for index, drive in enumerate(placement):
        if isinstance(drive, bool) or not isinstance(drive, int) or not 0 <= drive < drives:
            raise ConfigError(f"the placement puts shard {index} on drive {drive!r}; drives are 0 to {drives - 1}")
    return list(placement)


def drive_offsets(shard_nbytes: Sequence[int], placement: Sequence[int], *, drives: int) -> tuple[list[int], list[int]]:
    """Where each shard's extent starts in its drive's state files, and each drive's file size.

    A drive's files hold its shards back to back in layout order, so one
    drive gives the offsets a single state directory always had.

    Example
    -------
    >>> drive_offsets([10, 20, 30], [0, 0, 0], drives=1)
    ([0, 10, 30], [60])
    """
    sizes = [0] * drives
    offsets = []
    for nbytes, drive in zip(shard_nbytes, placement, strict=True):
        offsets.append(sizes[drive])
        sizes[drive] += nbytes
    return offsets, sizes


def drive_bytes(shard_nbytes: Sequence[int], placement: Sequence[int], *, drives: int) -> list[int]:
    """Bytes of state (one copy) on each drive.

    Example
    -------
    >>> drive_bytes([10, 20, 30], [1, 0, 1], drives=2)
    [20, 40]
    """
    return drive_offsets(shard_nbytes, placement, drives=drives)[1]

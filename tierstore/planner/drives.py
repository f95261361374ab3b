"""A plan over several drives: what each holds and how fast a streamed step can be (``tierstore plan --drive ...``).

A state over several directories places its shards by each drive's
bandwidth (:func:`tierstore._storage.placement.place`, the optimizer's own
placement, over the same layout): bytes per drive in proportion to
``1 / (1/read + 1/write)``, the bytes it writes and reads back per second,
shards dealt out in layout order. From that placement:

- each drive holds its shards: with durability two copies of each, else one
  copy of its streamed shards (:class:`~tierstore.planner.results.DriveShare`);
- a streamed step reads and writes back every streamed shard, each drive its
  own at once: the step's disk time is the slowest drive's share,
  ``max(streamed_d / read_d + streamed_d / write_d)``;
- the **striped floor** is what perfect proportions would give: the step's
  streamed bytes over the drives' combined read+write bandwidth,
  ``streamed / sum(bandwidth_d)`` (:class:`~tierstore.planner.results.StripedStep`),
  beside the fastest drive alone.

A drive whose bandwidth is unknown makes the placement assume equal drives
(the optimizer would probe them at creation) and the step time unknown.

Example
-------
>>> from tierstore.planner import plan_memory
>>> from tierstore.planner.results import DriveSpec
>>> plan = plan_memory(10**8, host_ram=64 << 30, ram_budget="1/4", drives=[
...     DriveSpec("/nvme0", read_gbps=6.0, write_gbps=3.0), DriveSpec("/nvme1", read_gbps=3.0, write_gbps=1.5)])
>>> [round(d.state / plan.state, 2) for d in plan.drives]
[0.67, 0.33]
>>> round(plan.striped.placement_seconds / plan.striped.floor_seconds, 2)
1.01
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .._layout.budget import TierPlan
from .._layout.layout import Layout
from .._storage.placement import MAX_DRIVES, drive_bytes, place
from ..errors import ConfigError, ConfigTypeError
from .report import both_units
from .results import GB, DriveShare, DriveSpec, Shortfall, StripedStep

__all__ = ["check_drives", "plan_drives", "drive_shortfalls"]


def check_drives(drives: Sequence[DriveSpec]) -> tuple[DriveSpec, ...]:
    """``drives`` as a tuple, each a :class:`DriveSpec` with a name, a free space >= 0 and speeds > 0 (or unknown).

    Raises
    ------
    ConfigError
        For no drive, more than the most a state spans, a name given twice, or a bad value; naming it.

    Example
    -------
    >>> check_drives([DriveSpec("a"), DriveSpec("a")])
    Traceback (most recent call last):
    ...
    tierstore.errors.ConfigError: drives name 'a' twice; give each drive once
    """
    if isinstance(drives, (str, bytes, DriveSpec)) or not isinstance(drives, Sequence):
        raise ConfigTypeError(f"drives={drives!r} must be a list of DriveSpec, one per drive")
    if not 1 <= len(drives) <= MAX_DRIVES:
        raise ConfigError(f"drives lists {len(drives)} drives; a state spans 1 to {MAX_DRIVES}")
    seen = set()
    for d in drives:
        if not isinstance(d, DriveSpec):
            raise ConfigTypeError(f"drives holds {d!r}; give a DriveSpec(name, free, read_gbps, write_gbps) per drive")
        if not isinstance(d.name, str) or not d.name:
            raise ConfigError(f"a drive's name {d.name!r} must be a non-empty string (its path, or a name)")
        if d.name in seen:
            raise ConfigError(f"drives name {d.name!r} twice; give each drive once")
        seen.add(d.name)
        if d.free is not None and (isinstance(d.free, bool) or not isinstance(d.free, int) or d.free < 0):
            raise ConfigError(f"drive {d.name!r}: free={d.free!r} must be a byte count >= 0")
        for key in ("read_gbps", "write_gbps"):
            value = getattr(d, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"drive {d.name!r}: {key}={value!r} must be a finite number of GB/s > 0, e.g. 3.5")
    return tuple(drives)


def _bandwidth(d: DriveSpec) -> float | None:
    """Bytes per second the drive writes and reads back (what placement weighs it by), or ``None`` unknown."""
    if d.read_gbps is None or d.write_gbps is None:
        return None
    return GB / (1 / d.read_gbps + 1 / d.write_gbps)


def plan_drives(layout: Layout, tiers: TierPlan, drives: Sequence[DriveSpec], *,
                durable: bool) -> tuple[tuple[DriveShare, ...], StripedStep]:
    """Each drive's share of the state under the optimizer's placement, and the step's striped disk time."""
    speeds = [_bandwidth(d) for d in drives]
    known = all(s is not None for s in speeds)
    sizes = [layout.shard_nbytes(s) for s in layout.shards]
    placement = place(sizes, speeds if known else [1.0] * len(drives))  # type: ignore[arg-type]
    state = drive_bytes(sizes, placement, drives=len(drives))
    streamed_set = set(tiers.disk_shards)
    shares = []
    for k, d in enumerate(drives):
        mine = [i for i, drive in enumerate(placement) if drive == k]
        streamed_ids = [i for i in mine if i in streamed_set]
        streamed = sum(sizes[i] for i in streamed_ids)
        files = 2 * state[k] if durable else streamed
        seconds = None
        if d.read_gbps is not None and d.write_gbps is not None:
            seconds = streamed / (d.read_gbps * GB) + streamed / (d.write_gbps * GB)
        shares.append(DriveShare(
            name=d.name, free=d.free, read_gbps=d.read_gbps, write_gbps=d.write_gbps,
            bandwidth_gbps=None if speeds[k] is None else speeds[k] / GB, shards=len(mine), state=state[k],
            streamed_shards=len(streamed_ids), streamed=streamed, files=files,
            fits=None if d.free is None else files <= d.free, step_seconds=seconds,
        ))
    total = sum(s.streamed for s in shares)
    if known:
        combined = sum(speeds)  # type: ignore[arg-type]
        floor = total / combined
        slowest = max(s.step_seconds for s in shares)  # type: ignore[type-var]
        alone = total / max(speeds)  # type: ignore[type-var]
        striped = StripedStep(floor_seconds=floor, placement_seconds=slowest, fastest_alone_seconds=alone,
                              combined_gbps=combined / GB, streamed=total, placed_by="bandwidth")
    else:
        striped = StripedStep(floor_seconds=None, placement_seconds=None, fastest_alone_seconds=None,
                              combined_gbps=None, streamed=total, placed_by="equal shares (a bandwidth is unknown)")
    return tuple(shares), striped


def drive_shortfalls(shares: Sequence[DriveShare], *, durable: bool) -> list[Shortfall]:
    """One shortfall per drive too small for its share, with what would make it fit."""
    out = []
    for s in shares:
        if s.fits is False and s.free is not None:
            fixes = [f"free {both_units(s.files - s.free)} more on {s.name}", "give a drive with more room in its place"]
            if durable and s.streamed <= s.free:
                fixes.append("durable=False keeps one copy of the streamed shards only (no crash consistency)")
            fixes.append("leave it out: the other drives then take its shards")
            out.append(Shortfall(
                f"drive space on {s.name}", s.files, s.free,
                f"{s.name} holds {s.shards:,} shards ({both_units(s.state)} of state"
                + (", two copies" if durable else "") + f"): its files need {both_units(s.files)}, it has "
                f"{both_units(s.free)} free: " + "; or ".join(fixes),
            ))
    return out

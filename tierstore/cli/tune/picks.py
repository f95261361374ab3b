"""What ``tierstore tune`` picks from its measurements, each value with the measurement behind it (no I/O).

- **I/O workers and request size**: the setting at which the drives, all at
  once (one drive: alone), read and write back fastest: the step bandwidth
  ``1 / (1/read + 1/write)`` of the medians over rounds. Among the settings
  within :data:`TOLERANCE` of the fastest, the one with the fewest bytes in
  flight (then the fewest workers): the measurement cannot tell them apart,
  and fewer threads leave more of the CPU to the update.
- **Prefetch depth**: enough shards in flight that every drive has its queue
  full: a drive needs ``ceil(io_workers * request_bytes / shard extent)``
  shards of its own in flight, and shards are dealt out in proportion to
  bandwidth, so the slowest drive gets one of every ``sum / slowest``
  shards. At least the default (2), at most :data:`MAX_PREFETCH`: each
  level of depth is one more arena slot of budget.
- **Shard size** (a suggestion only: it is part of a state's identity): the
  default 4 Mi elements, or larger when one shard's extent would not fill a
  drive's queue (``io_workers * request_bytes``).
- **Update threads**: the thread count whose AdamW update ran fastest while
  the drives were streaming (the fewest within :data:`TOLERANCE`).

Example
-------
>>> settings = [{"kind": "all", "op": op, "request_bytes": r << 20, "workers": w, "GBps": g}
...             for r, w, g in ((1, 4, 1.0), (1, 8, 1.2), (4, 8, 1.22)) for op in ("read", "write")]
>>> p = pick_io(settings, kind="all")
>>> p.value, p.why.split(":")[0]
({'io_workers': 8, 'request_bytes': 1048576}, 'io_workers=8, request_bytes=1.00 MiB')
>>> pick_threads({1: [0.010, 0.011], 2: [0.0105, 0.0104]}).value
1
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._config.knobs import Knobs
from ..._layout.layout import DEFAULT_SHARD_NUMEL
from ...errors import ConfigError
from ...sizes import format_size

__all__ = ["Pick", "pick_io", "pick_prefetch", "suggest_shard_numel", "pick_threads", "TOLERANCE", "MAX_PREFETCH"]

TOLERANCE = 0.05  # settings within 5% of the fastest are as fast, as far as one run can tell
MAX_PREFETCH = 8  # each level of prefetch is an arena slot: beyond this the budget pays more than it gains
MAX_SUGGESTED_SHARD_NUMEL = 64 << 20  # 64 Mi elements: 512 MiB extents with two fields
BYTES_PER_ELEMENT = 8  # two fp32 moments: the smallest extent per element of a float32 state


@dataclass(frozen=True)
class Pick:
    """One value the tuner chose: ``value``, the sentence that says why, and the figures behind it (for the JSON)."""

    name: str
    value: Any
    why: str
    measured: dict[str, Any] = field(default_factory=dict)


def _step(read: float | None, write: float | None) -> float | None:
    if not read or not write or read != read or write != write:
        return None
    return 1.0 / (1.0 / read + 1.0 / write)


def pick_io(settings: Sequence[Mapping[str, Any]], *, kind: str, tolerance: float = TOLERANCE) -> Pick:
    """``io_workers`` and ``request_bytes``: the setting where ``kind`` (``all``, or ``d0`` alone) streams fastest.

    Raises
    ------
    ConfigError
        When no setting has both a read and a write figure of ``kind``.
    """
    points: dict[tuple[int, int], dict[str, float]] = {}
    for s in settings:
        if s["kind"] == kind:
            points.setdefault((s["request_bytes"], s["workers"]), {})[s["op"]] = s["GBps"]
    scored = [(r, w, ops["read"], ops["write"], _step(ops.get("read"), ops.get("write"))) for (r, w), ops in points.items()]
    scored = [x for x in scored if x[4] is not None]
    if not scored:
        raise ConfigError(f"no setting of {kind!r} has both a read and a write figure: nothing to pick from")
    fastest = max(x[4] for x in scored)
    close = [x for x in scored if x[4] >= fastest * (1 - tolerance)]
    r, w, read, write, step = min(close, key=lambda x: (x[0] * x[1], x[1]))
    best = max(scored, key=lambda x: x[4])
    where = "the drives all at once" if kind == "all" else "the drive"
    why = (f"io_workers={w}, request_bytes={format_size(r)}: {where} read {read:.2f} GB/s and write {write:.2f} GB/s "
           f"there (read+write {step:.2f} GB/s), the best of {len(scored)} settings")
    if (r, w) != (best[0], best[1]):
        why += (f" with the fewest bytes in flight (the fastest, {best[4]:.2f} GB/s at {format_size(best[0])} "
                f"x{best[1]}, is within {tolerance:.0%})")
    measured = {"kind": kind, "read_GBps": read, "write_GBps": write, "step_GBps": step, "fastest_GBps": fastest,
                "fastest_at": {"request_bytes": best[0], "workers": best[1]}, "settings": len(scored),
                "tolerance": tolerance}
    return Pick("io", {"io_workers": w, "request_bytes": r}, why, measured)


def suggest_shard_numel(*, io_workers: int, request_bytes: int) -> Pick:
    """A shard size whose extent fills one drive's queue: the default, or larger for deep queues of large requests.

    Example
    -------
    >>> suggest_shard_numel(io_workers=8, request_bytes=1 << 20).value == DEFAULT_SHARD_NUMEL
    True
    >>> suggest_shard_numel(io_workers=16, request_bytes=16 << 20).value >> 20
    32
    """
    in_flight = io_workers * request_bytes
    need = 1 << max(0, math.ceil(math.log2(max(1, in_flight // BYTES_PER_ELEMENT))))
    value = min(max(DEFAULT_SHARD_NUMEL, need), MAX_SUGGESTED_SHARD_NUMEL)
    if value == DEFAULT_SHARD_NUMEL:
        why = (f"shard_numel={value} (the default, {value >> 20} Mi elements): its extent, at least "
               f"{format_size(value * BYTES_PER_ELEMENT)}, holds the {format_size(in_flight)} a drive has in flight")
    else:
        why = (f"shard_numel={value} ({value >> 20} Mi elements): one shard's extent "
               f"({format_size(value * BYTES_PER_ELEMENT)} or more) holds the {format_size(in_flight)} a drive has in "
               f"flight ({io_workers} x {format_size(request_bytes)}), which the default's does not")
    why += "; a suggestion for a new state only (the shard size is part of a state's identity)"
    return Pick("shard_numel", value, why, {"in_flight_bytes": in_flight, "bytes_per_element": BYTES_PER_ELEMENT})


def pick_prefetch(bandwidths: Sequence[float], *, io_workers: int, request_bytes: int, shard_numel: int) -> Pick:
    """Shards in flight that keep every drive's queue full, from the drives' bandwidths (bytes/s).

    Example
    -------
    >>> pick_prefetch([1e9], io_workers=8, request_bytes=1 << 20, shard_numel=4 << 20).value
    2
    >>> pick_prefetch([3e9, 1e9], io_workers=8, request_bytes=1 << 20, shard_numel=4 << 20).value
    4
    """
    default = Knobs().prefetch_depth
    extent = shard_numel * BYTES_PER_ELEMENT
    per_drive = max(1, math.ceil(io_workers * request_bytes / extent))
    spread = math.ceil(sum(bandwidths) / min(bandwidths)) if len(bandwidths) > 1 else 1
    need = per_drive * spread
    value = min(max(default, need), MAX_PREFETCH)
    why = (f"prefetch_depth={value}: each drive needs {per_drive} shard(s) in flight to keep {io_workers} requests "
           f"of {format_size(request_bytes)} going (a {shard_numel >> 10} Ki-element shard's extent is at least "
           f"{format_size(extent)})")
    if len(bandwidths) > 1:
        why += (f", and the slowest drive holds one shard of every {spread} (its {min(bandwidths) / 1e9:.2f} GB/s of "
                f"{sum(bandwidths) / 1e9:.2f} GB/s in all)")
    if value != need:
        why += f"; {need} bounded to {default}..{MAX_PREFETCH} (each level is one more arena slot of ram_budget)"
    measured = {"per_drive": per_drive, "spread": spread, "need": need, "bandwidths": list(bandwidths),
                "shard_numel": shard_numel}
    return Pick("prefetch_depth", value, why, measured)


def pick_threads(seconds: Mapping[int, Sequence[float]], *, tolerance: float = TOLERANCE, numel: int | None = None,
                 updates: int | None = None) -> Pick:
    """The update thread count whose run beside the drives' I/O ended first (median), the fewest within ``tolerance``.

    ``seconds`` are per thread count the runs of :func:`tierstore.cli.tune.cpu.time_with_io`:
    ``updates`` updates of a ``numel``-element shard while every drive reads and writes back.

    Raises
    ------
    ConfigError
        When nothing was timed.
    """
    medians = {t: statistics.median(v) for t, v in seconds.items() if v}
    if not medians:
        raise ConfigError("no update was timed: nothing to pick update_threads from")
    fastest = min(medians.values())
    value = min(t for t, s in medians.items() if s <= fastest * (1 + tolerance))
    what = (f"{updates} AdamW updates of a {numel >> 20} Mi-element shard" if updates and numel else "the AdamW updates")
    others = ", ".join(f"{t} threads {s:.3f} s" for t, s in sorted(medians.items()) if t != value)
    why = (f"update_threads={value}: {what} beside every drive reading and writing back took {medians[value]:.3f} s"
           + (f" ({others})" if others else ""))
    return Pick("update_threads", value, why, {"median_s": {str(t): s for t, s in sorted(medians.items())},
                                                 "tolerance": tolerance, "updates": updates, "numel": numel})
